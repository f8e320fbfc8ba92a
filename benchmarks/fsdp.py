"""FSDP2 per-rank peak: memplan's `--zero 3 --dp 2` prediction, PyTorch's FSDPMemTracker on fake
tensors, and a real run on 2 gloo CPU ranks, side by side.

Each model is sharded as memplan predicts it (``fully_shard`` per block, then the root), fp32
AdamW, steady-state step (after a warm-up, gradients set to None). The real run counts live
tensor bytes per rank (planner.runtime.shard.ShardedBytesTracker); FSDPMemTracker runs the
same steps on fake tensors over a fake process group of 2 ranks.
"""

from __future__ import annotations

import os
import queue as queue_module
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import Options, pct, print_table
from planner.api import trace_for
from planner.config import TrainConfig
from planner.runtime.shard import measure_sharded_step, shard_model
from planner.runtime.verify import make_optimizer
from planner.simulation.fsdp import fsdp_units
from planner.simulation.step import simulate
from planner.tracing.recorder import loss_of, run_step_inputs
from planner.tracing.specs import resolve_spec

WORLD_SIZE = 2
MODELS = [  # (name, spec, batch, seq or image side)
    ("gpt2-tiny", "gpt2-tiny", 2, 64),
    ("llama-70b-tiny", "llama-70b-tiny", 2, 64),
    ("resnet-tiny", "resnet-tiny", 2, 32),
]
QUICK = ("gpt2-tiny", "llama-70b-tiny", "resnet-tiny")


def _cases(opts: Options) -> list[tuple]:
    cases = []
    for name, spec, batch_size, seq_len in opts.select(MODELS, QUICK):
        for reshard in (True, False):
            config = TrainConfig(
                batch_size=batch_size, seq_len=seq_len, zero_stage=3, dp=WORLD_SIZE, reshard_after_forward=reshard
            )
            cases.append((f"{name}/{reshard}", name, spec, config))
    return cases


def _measure_worker(rank: int, init_file: str, cases: list, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        for key, spec, config, units in cases:
            torch.manual_seed(0)
            model, inputs = resolve_spec(spec).build(config.batch_size, config.seq_len)
            shard_model(model, units, config)
            out.put(("measured", key, rank, measure_sharded_step(model, inputs, config).peak_bytes))
    finally:
        dist.destroy_process_group()


def _tracker_worker(cases: list, out) -> None:
    """FSDPMemTracker's peak for each case, on fake tensors over a fake 2-rank process group."""
    from torch.distributed.device_mesh import init_device_mesh

    from memplan_compat import FakeStore, FakeTensorMode, FSDPMemTracker

    dist.init_process_group("fake", rank=0, world_size=WORLD_SIZE, store=FakeStore())
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    try:
        for key, spec, config, units in cases:
            with FakeTensorMode():
                model, inputs = resolve_spec(spec).build(config.batch_size, config.seq_len)
                shard_model(model, units, config, mesh=mesh)
                optimizer = make_optimizer(model.parameters(), config.optimizer)
                tracker = FSDPMemTracker(model, optimizer)
                tracker.track_inputs(inputs)
                with tracker:
                    for step in range(2):
                        if step:
                            tracker.reset_mod_stats()
                        loss_of(run_step_inputs(model, inputs)).backward()
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                peak = max(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())
            out.put(("tracker", key, 0, peak))
    finally:
        dist.destroy_process_group()


def _collect(procs: list, out, expected: int) -> list[tuple]:
    got = []
    while len(got) < expected:
        try:
            got.append(out.get(timeout=2))
        except queue_module.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed:
                raise RuntimeError(f"a spawned process failed with exit code {failed[0]}") from None
    for p in procs:
        p.join(timeout=60)
    return got


def run(opts: Options) -> list[dict]:
    cases = _cases(opts)
    rows, work = {}, []
    for key, name, spec, config in cases:
        graph = trace_for(spec, config)
        rows[key] = {
            "model": name,
            "reshard_after_forward": config.reshard_after_forward,
            "batch_size": config.batch_size,
            "seq_len": config.seq_len,
            "predicted_bytes": simulate(graph, config).peak_bytes,
            "measured_bytes": [0] * WORLD_SIZE,
        }
        work.append((key, spec, config, [u.path for u in fsdp_units(graph, WORLD_SIZE)[:-1]]))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_measure_worker, args=(r, os.path.join(tmp, "init"), work, out))
            for r in range(WORLD_SIZE)
        ]
        procs.append(ctx.Process(target=_tracker_worker, args=(work, out)))
        for p in procs:
            p.start()
        results = _collect(procs, out, len(work) * (WORLD_SIZE + 1))
    for kind, key, rank, peak in results:
        if kind == "measured":
            rows[key]["measured_bytes"][rank] = peak
        else:
            rows[key]["fsdp_mem_tracker_bytes"] = peak
    for r in rows.values():
        measured = max(r["measured_bytes"])
        r["memplan_error"] = (r["predicted_bytes"] - measured) / measured
        r["tracker_error"] = (r["fsdp_mem_tracker_bytes"] - measured) / measured
    return list(rows.values())


def show(rows: list[dict]) -> None:
    print_table(
        "FSDP2 per-rank peak bytes on 2 gloo CPU ranks: memplan vs FSDPMemTracker (fake tensors) vs measured",
        [
            "model",
            "reshard",
            "batch x seq",
            "memplan",
            "FSDPMemTracker",
            "measured (rank 0 / 1)",
            "memplan error",
            "tracker error",
        ],
        [
            [
                r["model"],
                str(r["reshard_after_forward"]).lower(),
                f"{r['batch_size']} x {r['seq_len']}",
                f"{r['predicted_bytes']:,}",
                f"{r['fsdp_mem_tracker_bytes']:,}",
                " / ".join(f"{m:,}" for m in r["measured_bytes"]),
                pct(r["memplan_error"], 3),
                pct(r["tracker_error"], 3),
            ]
            for r in rows
        ],
    )
