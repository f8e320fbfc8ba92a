"""Predicted peak against torch.cuda.max_memory_allocated / memory_reserved over a real GPU step,
and the live paths that only run on CUDA: auto_checkpoint + MemoryMonitor (allocated, reserved,
inactive-split bytes, allocation retries, empty_cache between steps, adapt=True), a plan that
offloads to host memory (pinned copies on a side stream), and the out-of-memory observer writing a
snapshot and a report.

python -m benchmarks.gpu_check [--out DIR]: appends rows under `gpu` and `gpu_live` in DIR/results.json.
Without a GPU it prints "no GPU: skipped" and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

from benchmarks.models import spec

# name, spec, seq_len, precision
MODELS = [
    ("llama-1024-L8", spec("llama_1024_L8"), 2048, "bf16-mixed"),
    ("gpt2", "gpt2", 1024, "fp32"),
    ("mistral-small", spec("mistral_small"), 2048, "bf16-mixed"),
]


def _gpu_name() -> str:
    return "h200" if "H200" in torch.cuda.get_device_name(0) else "h100-80gb"


def check(name: str, model_spec: str, seq: int, precision: str) -> dict:
    from costmodels.memory import get_precision
    from planner.api import simulate_model
    from planner.config import TrainConfig
    from planner.tracing.recorder import loss_of, run_step_inputs
    from planner.tracing.specs import resolve_spec

    config = TrainConfig(batch_size=1, seq_len=seq, precision=precision, gpu=_gpu_name())
    predicted = simulate_model(model_spec, config).peak_bytes
    prec = get_precision(precision)
    torch.manual_seed(0)
    model, inputs = resolve_spec(model_spec).build(batch_size=1, seq_len=seq)
    model = model.to("cuda", prec.param_dtype)
    inputs = {k: v.cuda() for k, v in inputs.items()} if isinstance(inputs, dict) else tuple(v.cuda() for v in inputs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)  # the CUDA default (foreach), as simulated

    def step():
        for p in model.parameters():
            p.grad = None
        with torch.autocast("cuda", dtype=prec.autocast_dtype, enabled=prec.autocast_dtype is not None):
            loss = loss_of(run_step_inputs(model, inputs))
        loss.backward()
        opt.step()
        torch.cuda.synchronize()

    step()  # warm-up: optimizer states exist from here on
    torch.cuda.reset_peak_memory_stats()
    step()
    allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.memory_reserved()
    model = opt = inputs = None  # drop the step closure's references before emptying the cache
    torch.cuda.empty_cache()
    return {
        "model": name,
        "spec": model_spec,
        "seq_len": seq,
        "precision": precision,
        "gpu": config.gpu,
        "device_name": torch.cuda.get_device_name(0),
        "predicted_bytes": predicted,
        "max_allocated_bytes": allocated,
        "reserved_bytes": reserved,
        "error_vs_allocated": (predicted - allocated) / allocated,
        "error_vs_reserved": (predicted - reserved) / reserved,
    }


def _cuda_batch(model_spec: str, seq: int, precision: str):
    from costmodels.memory import get_precision
    from planner.tracing.specs import resolve_spec

    torch.manual_seed(0)
    model, inputs = resolve_spec(model_spec).build(batch_size=1, seq_len=seq)
    model = model.to("cuda", get_precision(precision).param_dtype)
    inputs = {k: v.cuda() for k, v in inputs.items()} if isinstance(inputs, dict) else tuple(v.cuda() for v in inputs)
    return model, inputs


def _train(model, inputs, optimizer, monitor, steps: int, precision: str) -> None:
    from costmodels.memory import get_precision
    from planner.tracing.recorder import loss_of, run_step_inputs

    dtype = get_precision(precision).autocast_dtype
    for _ in range(steps):
        with monitor.step(inputs):
            with torch.autocast("cuda", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = loss_of(run_step_inputs(model, inputs))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del loss


def check_live(name: str, model_spec: str, seq: int, precision: str, out: Path, offload: str | None = None) -> dict:
    """auto_checkpoint at 60% of the no-plan peak, four monitored steps (adapt=True, empty_cache
    when inactive split blocks exceed 64 MiB); optionally offloading to host memory."""
    from planner.runtime.auto import auto_checkpoint
    from planner.runtime.monitor import MemoryMonitor

    model, inputs = _cuda_batch(model_spec, seq, precision)
    handle = auto_checkpoint(model, inputs, "60%", precision=precision, offload=offload)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)  # CUDA default: foreach
    log = out / f"gpu-live-{name}{'-offload' if offload else ''}.jsonl"
    with MemoryMonitor(
        log, handle, adapt=True, empty_cache_above=64 * 2**20, record_history=True, report_dir=out
    ) as monitor:
        _train(model, inputs, optimizer, monitor, 4, precision)
    last = monitor.records[-1]
    row = {
        "model": name,
        "offload": offload,
        "gpu": handle.config.gpu,
        "budget_bytes": handle.budget_bytes,
        "plan_decisions": len(handle.plan.decisions),
        "offload_bytes": handle.plan.predicted.offload_bytes,
        "predicted_bytes": last.predicted_peak_bytes,
        "max_allocated_bytes": last.measured_peak_bytes,
        "drift": last.drift,
        "reserved_bytes": last.reserved_bytes,
        "inactive_split_bytes": last.inactive_split_bytes,
        "alloc_retries": last.alloc_retries,
        "ooms": last.ooms,
        "empty_cache_count": monitor.empty_cache_count,
        "steps_over_budget": [r.step for r in monitor.records if r.measured_peak_bytes > handle.budget_bytes],
        "switches": [s["reason"] for r in monitor.records for s in r.switches],
        "log": str(log),
    }
    handle.remove()
    del model, optimizer, inputs
    torch.cuda.empty_cache()
    return row


def check_oom(out: Path) -> dict:
    """Cap this process at 30% of the GPU, allocate past it inside a monitored step: the observer
    dumps a snapshot, the monitor writes a report, and the error reaches the caller."""
    from planner.runtime.monitor import MemoryMonitor

    model, inputs = _cuda_batch("gpt2-tiny", 128, "fp32")
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(0.3)
    raised = False
    try:
        with MemoryMonitor(out / "gpu-oom.jsonl", model=model, record_history=True, report_dir=out) as monitor:
            with monitor.step(inputs):
                pass
            try:
                with monitor.step(inputs):
                    model(*inputs) if isinstance(inputs, tuple) else model(**inputs)
                    torch.empty(int(0.5 * total), dtype=torch.uint8, device="cuda")
            except torch.OutOfMemoryError:
                raised = True
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    report = out / "memplan-oom-step1.json"
    return {
        "model": "oom-observer",
        "raised": raised,
        "report": json.loads(report.read_text()) if report.exists() else None,
        "snapshot_written": (out / "memplan-oom-step1.pickle").exists(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no GPU: skipped")
        return 0
    rows = []
    for m in MODELS:
        try:
            rows.append(check(*m))
        except Exception as e:
            rows.append({"model": m[0], "failure": f"{type(e).__name__}: {e}"})
        print(rows[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    live = []
    jobs = [partial(check_live, *m, out) for m in MODELS[:2]]
    jobs += [partial(check_live, *MODELS[0], out, offload="cpu"), partial(check_oom, out)]
    for job in jobs:
        try:
            live.append(job())
        except Exception as e:
            live.append({"failure": f"{type(e).__name__}: {e}"})
        print(live[-1], flush=True)
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results.setdefault("gpu", []).extend(rows)
    results.setdefault("gpu_live", []).extend(live)
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
