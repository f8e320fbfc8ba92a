"""The solver's per-block option set holds the known recompute policies: for every block signature of
GPT-, Llama- and ResNet-shaped models, each of full, none (so every-N), torch's op-SAC, torchtitan's
alternating op-SAC and Megatron's selective recompute is an option, or an option beats it at
equal-or-less memory at every op and equal-or-less time."""

from __future__ import annotations

import numpy as np
import pytest
from models_for_tests import PATH

from costmodels.hardware import get_device
from planner.config import TrainConfig
from planner.simulation.costs import op_times, storage_bytes
from planner.simulation.effects import SpanChoice
from planner.solver.baselines import block_spans
from planner.solver.options import OptionEffect, block_options, option_effect
from planner.solver.policies import attention_core_choice, op_sac_alt_choice, op_sac_choice

MODELS = {"gpt_small": 64, "llama_small": 64, "resnet_small": 16}  # spec -> seq_len (image side for ResNet)


def _dominates(a: OptionEffect | None, b: OptionEffect | None) -> bool:
    """a uses no more memory than b at every op sample and at the replay, and costs no more time."""
    if a is None or b is None:
        return a is b
    lo, hi = min(a.lo, b.lo), max(a.hi, b.hi)
    da, db = np.zeros(hi - lo, dtype=np.int64), np.zeros(hi - lo, dtype=np.int64)
    da[a.lo - lo : a.hi - lo] = a.delta
    db[b.lo - lo : b.hi - lo] = b.delta
    replay_a, replay_b = (-(2**62) if e.replay_peak is None else e.replay_peak for e in (a, b))  # None: no replay
    return (
        bool(np.all(da <= db))
        and a.replay_at == b.replay_at
        and replay_a <= replay_b
        and a.cost_s <= b.cost_s * (1 + 1e-9)
        and a.offload_bytes <= b.offload_bytes
    )


def _known_policies(graph, span) -> dict[str, SpanChoice | None]:
    out = {
        "none": None,
        "full": SpanChoice(span, "recompute"),
        "op-sac": op_sac_choice(graph, span),
        "op-sac-alt": op_sac_alt_choice(graph, span),
    }
    megatron = attention_core_choice(graph, span)
    if megatron is not None:
        out["megatron-selective"] = megatron
    return out


@pytest.mark.parametrize("model", list(MODELS))
def test_options_hold_the_known_policies(model, traced):
    config = TrainConfig(batch_size=2, seq_len=MODELS[model])
    graph = traced(f"{PATH}:{model}", 2, MODELS[model])
    device, sizes = get_device(config.gpu), storage_bytes(graph, config)
    times = op_times(graph, device)
    signatures = {}
    for region, span in zip(graph.regions, block_spans(graph)):
        signatures.setdefault(region.signature, span)
    assert signatures
    missing = []
    for span in signatures.values():
        options = block_options(graph, span, times, None)
        effects = [None if o.choice is None else option_effect(graph, o.choice, times, device, sizes) for o in options]
        for name, policy in _known_policies(graph, span).items():
            effect = None if policy is None else option_effect(graph, policy, times, device, sizes)
            held = any(o.choice == policy or _dominates(e, effect) for o, e in zip(options, effects))
            if not held:
                missing.append(f"{span.path}: {name}")
    assert not missing, f"{model}: no option holds " + ", ".join(missing)
