"""Real values for small integer/bool tensors on the fake trace (tracing/shadow.py), weight init
skipped while building (tracing/hf.py), and one-line errors for other data-dependent control flow."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from planner.errors import TraceError
from planner.tracing.recorder import trace
from planner.tracing.specs import ModelSpec


class MaskBranch(nn.Module):
    """Runs an extra masking op only when the mask has padding, and reads a position as a Python int."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        nn.init.trunc_normal_(self.proj.weight)  # loops on data values: cannot run on fake tensors

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if not torch.all(mask == 1):
            h = h.masked_fill(mask[..., None] == 0, 0.0)
        last = int(mask.sum(dim=1).max().item())
        return h[:, :last].pow(2).mean()


def _spec(padded: bool) -> ModelSpec:
    def build(batch_size: int, seq_len: int):
        mask = torch.ones(batch_size, seq_len, dtype=torch.long)
        if padded:
            mask[:, seq_len // 2 :] = 0
        return MaskBranch(), (torch.randn(batch_size, seq_len, 8), mask)

    return ModelSpec("mask-branch", "branches on its mask", build)


def test_checks_on_masks_are_answered_from_real_values():
    full = trace(_spec(padded=False), batch_size=2, seq_len=8)
    padded = trace(_spec(padded=True), batch_size=2, seq_len=8)
    assert not any(op.name == "aten.masked_fill.Scalar" for op in full.ops)
    assert any(op.name == "aten.masked_fill.Scalar" for op in padded.ops)
    sliced = [t for t in padded.tensors.values() if t.shape[:2] == (2, 4)]  # h[:, :4]: half the positions
    assert sliced


def test_weight_init_is_skipped_only_while_tracing():
    original = nn.init.trunc_normal_
    trace(_spec(padded=False), batch_size=1, seq_len=4)
    assert nn.init.trunc_normal_ is original
    assert MaskBranch().proj.weight.abs().sum() > 0


class DataBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if h.sum() > 0:  # depends on float activations: no real value exists on the trace
            h = h * 2
        return h.mean()


def test_control_flow_on_activations_is_one_line_naming_op_module_and_line():
    spec = ModelSpec(
        "data-branch", "branches on data", lambda batch_size, seq_len: (DataBranch(), (torch.randn(2, 8),))
    )
    with pytest.raises(TraceError) as info:
        trace(spec, batch_size=1, seq_len=4)
    message = str(info.value)
    assert "\n" not in message
    assert "test_shadow.py:" in message and "if h.sum() > 0" in message
    assert "aten." in message


def test_constant_float_factories_get_shadows_random_ones_do_not():
    from memplan_compat import FakeTensorMode as _Fake
    from planner.tracing.shadow import ShadowMode

    fake = _Fake()
    with fake, ShadowMode(fake) as shadow:
        ones = torch.ones(2, 8)
        mask = ones.bool()
        assert bool((mask.sum() == mask.numel()).item())  # answered from the shadow
        noise = torch.randn(2, 8)
        assert shadow.real(noise) is None and shadow.real(ones) is not None


@pytest.mark.parametrize("rank", [0, 1])
def test_collectives_on_shadowed_counts_are_answered_as_if_every_rank_held_the_same(rank):
    """An expert-parallel dispatch exchanges token counts, then reads them (.tolist()): on fake
    tensors under a fake process group the answer is this rank's chunk from every peer."""
    import torch.distributed as dist
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from memplan_compat import FakeTensorMode, all_to_all_single
    from planner.tracing.parallel.rank_trace import fake_process_group
    from planner.tracing.shadow import ShadowMode

    with fake_process_group(rank, 2):
        group = dist.group.WORLD
        fake_mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
        with fake_mode, ShadowMode(fake_mode):
            counts = torch.arange(4) * 2 + 1  # [1, 3, 5, 7]: rank 0 sends [1, 3], rank 1 [5, 7]
            received = torch.ops._c10d_functional.wait_tensor(all_to_all_single(counts, None, None, group=group))
            in_place = torch.empty_like(counts)
            dist.all_to_all_single(in_place, counts, group=group)
            gathered = torch.ops._c10d_functional.all_gather_into_tensor(counts, 2, group.group_name)
            mine = [1, 3] if rank == 0 else [5, 7]
            assert received.tolist() == mine * 2
            assert in_place.tolist() == mine * 2
            assert gathered.tolist() == [1, 3, 5, 7] * 2
