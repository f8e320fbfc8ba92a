"""Blocks wherever they live: attribute layers, ModuleList layers, custom containers and mixes are
found by structure (or named with --blocks), and a plan at any feasible budget applies."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from planner.config import TrainConfig
from planner.errors import TraceError
from planner.runtime.apply import apply_plan
from planner.simulation.step import simulate
from planner.solver.baselines import strategy_choices
from planner.solver.planning import solve
from planner.tracing.blocks import find_region_paths
from planner.tracing.recorder import loss_of, run_step_inputs, trace
from planner.tracing.specs import ModelSpec

WIDTH = 16


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Holder(nn.Module):
    """A custom container: layers as attributes `block0`, `block1`, ..."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        for i in range(n):
            setattr(self, f"block{i}", Layer())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.n):
            x = getattr(self, f"block{i}")(x)
        return x


class Stack(nn.Module):
    """Groups of layers in one of three forms, in order: attributes, a ModuleList, a Holder."""

    def __init__(self, groups: list[tuple[str, int]]) -> None:
        super().__init__()
        self.stem = nn.Linear(WIDTH, WIDTH)
        self.parts: list[str] = []
        for g, (kind, n) in enumerate(groups):
            if kind == "attributes":
                for i in range(n):
                    setattr(self, f"layer{g}_{i}", Layer())
                    self.parts.append(f"layer{g}_{i}")
            else:
                setattr(self, f"group{g}", nn.ModuleList(Layer() for _ in range(n)) if kind == "list" else Holder(n))
                self.parts.append(f"group{g}")
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for name in self.parts:
            part = getattr(self, name)
            if isinstance(part, nn.ModuleList):
                for layer in part:
                    x = layer(x)
            else:
                x = part(x)
        return self.head(x).pow(2).mean()


def _expected_blocks(groups: list[tuple[str, int]]) -> list[str]:
    out: list[str] = []
    for g, (kind, n) in enumerate(groups):
        if kind == "attributes":
            out += [f"layer{g}_{i}" for i in range(n)]
        elif kind == "list":
            out += [f"group{g}.{i}" for i in range(n)]
        else:
            out += [f"group{g}.block{i}" for i in range(n)]
    return out


groups_strategy = st.lists(
    st.tuples(st.sampled_from(["attributes", "list", "holder"]), st.integers(2, 3)), min_size=1, max_size=2
)


def _grads(model: nn.Module, inputs) -> list[torch.Tensor]:
    for p in model.parameters():
        p.grad = None
    loss_of(run_step_inputs(model, inputs)).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.slow
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups=groups_strategy, fraction=st.floats(0.0, 1.0))
def test_blocks_are_found_and_a_feasible_plan_applies(groups, fraction):
    def build(batch_size: int, seq_len: int):
        return Stack(groups), (torch.randn(batch_size, seq_len, WIDTH),)

    assert find_region_paths(Stack(groups)) == _expected_blocks(groups)
    config = TrainConfig(batch_size=2, seq_len=16)
    graph = trace(ModelSpec("stack", "random stack", build), batch_size=2, seq_len=16)
    assert [r.path for r in graph.regions] == _expected_blocks(groups)
    peak = simulate(graph, config).peak_bytes
    lowest = simulate(graph, config, choices=strategy_choices(graph, "full")).peak_bytes
    plan = solve(graph, config, int(lowest + fraction * (peak - lowest)))
    torch.manual_seed(0)
    model, inputs = build(2, 16)
    plain = _grads(model, inputs)
    handle = apply_plan(model, plan)
    planned = _grads(model, inputs)
    handle.remove()
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(plain, planned))


def test_blocks_glob_names_the_blocks_and_an_unmatched_glob_says_what_exists():
    model = Stack([("attributes", 2), ("list", 2)])
    assert find_region_paths(model, ["group1.*"]) == ["group1.0", "group1.1"]
    assert find_region_paths(model, ["layer*", "group1"]) == ["layer0_0", "layer0_1", "group1"]
    with pytest.raises(TraceError, match="matches no module.*stem, layer0_0"):
        find_region_paths(model, ["decoder.*"])


def test_repeated_stacks_holding_blocks_give_their_blocks():
    class EncoderDecoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = Holder(2)
            self.decoder = Holder(2)

    assert find_region_paths(EncoderDecoder()) == [
        "encoder.block0",
        "encoder.block1",
        "decoder.block0",
        "decoder.block1",
    ]


class ListStage(nn.Module):
    """A Swin-shaped stage: its layers in a ModuleList that its own forward loops over."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Layer() for _ in range(2))
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.proj(x)


def _list_stages(batch_size: int, seq_len: int):
    model = nn.Sequential(ListStage(), ListStage())
    return model, (torch.randn(batch_size, seq_len, WIDTH),)


def test_a_module_list_is_never_planned_as_one_module():
    """A ModuleList runs no forward of its own, so no plan may recompute it as one (applying such a
    plan did nothing, and the step ran 26% over the budget on a transformers Swin); a plan naming one
    is refused in one line."""
    from planner.errors import PlanFileError
    from planner.plans.format import Decision

    spec = ModelSpec("list-stages", "stages over ModuleLists", _list_stages)
    graph = trace(spec, batch_size=4, seq_len=32)
    assert {"0.blocks", "1.blocks"} <= set(graph.meta["containers"])
    from costmodels.hardware import get_device
    from planner.simulation.costs import op_times
    from planner.simulation.effects import module_span
    from planner.solver.options import block_options

    times = op_times(graph, get_device("cpu"))

    def options(g) -> set[str]:
        return {o.name for o in block_options(g, module_span(g, "0"), times, None)}

    assert "recompute 0.blocks" not in options(graph)
    assert "recompute 0.blocks" in options(dataclasses.replace(graph, meta={**graph.meta, "containers": []}))
    config = TrainConfig(batch_size=4, seq_len=32)
    plan = solve(graph, config, int(0.8 * simulate(graph, config).peak_bytes))
    bad = dataclasses.replace(plan, decisions=(Decision("0.blocks", "recompute"),))
    model, _ = _list_stages(4, 32)
    with pytest.raises(PlanFileError, match="ModuleList with no forward of its own"):
        apply_plan(model, bad)


class LoopedStage(nn.Module):
    """A ResNet-shaped stage: its layers in an nn.Sequential that its forward loops over instead of
    calling (transformers' ResNetStage), so the Sequential's own forward never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(Layer(), Layer())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class LoopedStages(nn.Module):
    """Stages that are themselves looped over: the blocks found by structure are never called."""

    def __init__(self) -> None:
        super().__init__()
        self.stages = nn.Sequential(LoopedStage(), LoopedStage())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            for layer in stage.layers:
                x = layer(x)
        return x.pow(2).mean()


def test_a_sequential_the_model_loops_over_is_never_planned_as_one_module():
    """An nn.Sequential has a forward, but a parent that loops over its children never calls it: a
    plan wrapping it changed nothing (a transformers ResNet planned 'recompute ...stages.0.layers'
    and ran 6.4% over its budget at the no-plan peak). The trace lists what the model never calls
    with the containers; blocks it never calls give way to their children."""
    from costmodels.hardware import get_device
    from planner.simulation.costs import op_times
    from planner.simulation.effects import module_span
    from planner.solver.options import block_options

    spec = ModelSpec(
        "looped-stages",
        "stages over looped Sequentials",
        lambda batch_size, seq_len: (
            nn.Sequential(LoopedStage(), LoopedStage()),
            (torch.randn(batch_size, seq_len, WIDTH),),
        ),
    )
    graph = trace(spec, batch_size=4, seq_len=32)
    assert {"0.layers", "1.layers"} <= set(graph.meta["containers"])
    times = op_times(graph, get_device("cpu"))
    assert "recompute 0.layers" not in {o.name for o in block_options(graph, module_span(graph, "0"), times, None)}

    nested = trace(
        ModelSpec(
            "looped",
            "looped blocks",
            lambda batch_size, seq_len: (LoopedStages(), (torch.randn(batch_size, seq_len, WIDTH),)),
        ),
        batch_size=4,
        seq_len=32,
    )
    assert [r.path for r in nested.regions] == [f"stages.{i}.layers.{j}" for i in range(2) for j in range(2)]
    config = TrainConfig(batch_size=4, seq_len=32)
    base = simulate(nested, config).peak_bytes
    plan = solve(nested, config, int(0.8 * base))
    assert plan.decisions and all(d.module.count(".") == 3 for d in plan.decisions)


def test_a_folded_trace_lists_the_looped_over_modules_of_every_block():
    """A deep run of blocks is traced through a shallow copy (tracing/depth.py): what the shallow
    trace found looped over holds in every block of the run."""
    from planner.tracing.depth import FOLD_MIN_RUN

    depth = FOLD_MIN_RUN + 2
    spec = ModelSpec(
        "deep-looped",
        "deep stack of looped stages",
        lambda batch_size, seq_len: (
            nn.Sequential(*(LoopedStage() for _ in range(depth))),
            (torch.randn(batch_size, seq_len, WIDTH),),
        ),
    )
    graph = trace(spec, batch_size=2, seq_len=8)
    assert graph.meta.get("folded") == depth
    assert {f"{i}.layers" for i in range(depth)} <= set(graph.meta["containers"])


class SharedLayers(nn.Module):
    """Two layers applied three times each (weights shared across depth, as ALBERT does)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer0 = Layer()
        self.layer1 = Layer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = self.layer1(self.layer0(x))
        return x.pow(2).mean()


def test_a_layer_called_several_times_per_step_is_not_a_block():
    """A block is one span of the step; a shared layer's three calls are three. Planned as one, its
    'smallest reachable peak' came out 36% above the no-plan peak. Shared layers are not blocks and
    no plan may wrap them; the infeasible budget says why there are no blocks."""
    from planner.errors import InfeasibleBudget

    spec = ModelSpec(
        "shared",
        "shared layers",
        lambda batch_size, seq_len: (SharedLayers(), (torch.randn(batch_size, seq_len, WIDTH),)),
    )
    graph = trace(spec, batch_size=4, seq_len=32)
    assert graph.regions == []
    assert {"layer0", "layer1", "layer0.up"} <= set(graph.meta["shared_modules"]) <= set(graph.meta["containers"])
    config = TrainConfig(batch_size=4, seq_len=32)
    base = simulate(graph, config).peak_bytes
    with pytest.raises(InfeasibleBudget, match=r"no blocks.*layer0, layer1 run several times per step") as info:
        solve(graph, config, base // 2)
    assert info.value.smallest_peak_bytes == base
