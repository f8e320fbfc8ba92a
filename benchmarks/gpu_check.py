"""Predicted peak against torch.cuda.max_memory_allocated / memory_reserved over a real GPU step.

python -m benchmarks.gpu_check [--out DIR]: appends rows under `gpu` in DIR/results.json.
Without a GPU it prints "no GPU: skipped" and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks.models import spec

# name, spec, seq_len, precision
MODELS = [("llama-1024-L8", spec("llama_1024_L8"), 2048, "bf16-mixed"),
          ("gpt2", "gpt2", 1024, "fp32"),
          ("mistral-small", spec("mistral_small"), 2048, "bf16-mixed")]


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
    inputs = ({k: v.cuda() for k, v in inputs.items()} if isinstance(inputs, dict)
              else tuple(v.cuda() for v in inputs))
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
    del model, opt, inputs
    torch.cuda.empty_cache()
    return {"model": name, "spec": model_spec, "seq_len": seq, "precision": precision, "gpu": config.gpu,
            "device_name": torch.cuda.get_device_name(0), "predicted_bytes": predicted,
            "max_allocated_bytes": allocated, "reserved_bytes": reserved,
            "error_vs_allocated": (predicted - allocated) / allocated,
            "error_vs_reserved": (predicted - reserved) / reserved}


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
    path = Path(args.out) / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    results = json.loads(path.read_text()) if path.exists() else {}
    results.setdefault("gpu", []).extend(rows)
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
