"""`memplan calibrate`: measure this machine and write a device profile for --device-profile."""

from __future__ import annotations

from costmodels.hardware import profile_dict
from planner.cli import report
from planner.cli.guard import guarded_imports
from planner.cli.options import write_json
from planner.units import format_bytes

__all__ = ["register", "run"]

EXAMPLE = "memplan calibrate --out cpu.json\n  memplan plan --model gpt2 --device-profile cpu.json --budget 2GiB"


def register(add) -> None:
    p = add(
        "calibrate",
        "measure matmul, attention, pointwise, host-link and disk rates on this machine "
        "(under about 20 s) and write a device profile",
        run,
        EXAMPLE,
    )
    p.add_argument("--out", default="device-profile.json", help="the device profile to write")
    p.add_argument("--device", choices=("cuda", "cpu"), help="what to measure (default: cuda when available)")
    p.add_argument("--disk-dir", help="folder on the disk that offload would use (default: the temp folder)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test; the rates are not reliable)")


def run(args) -> None:
    with guarded_imports():
        from costmodels.calibration import FULL, QUICK, calibrate
    result = calibrate(QUICK if args.quick else FULL, device=args.device, disk_folder=args.disk_dir)
    m = result.measured()
    rows = [
        ["fp32 matmul", f"{m['fp32_matmul_flops_per_s'] / 1e9:.1f} GFLOP/s"],
        ["bf16 matmul", f"{m['bf16_matmul_flops_per_s'] / 1e9:.1f} GFLOP/s"],
        ["attention", f"{m['attention_flops_per_s'] / 1e9:.1f} GFLOP/s"],
        ["pointwise", f"{format_bytes(int(m['pointwise_bytes_per_s']))}/s"],
        ["host link", f"{format_bytes(int(m['host_link_bytes_per_s']))}/s"],
        ["disk write", f"{format_bytes(int(m['disk_write_bytes_per_s']))}/s"],
        ["disk read", f"{format_bytes(int(m['disk_read_bytes_per_s']))}/s"],
        ["selective checkpoint", f"{m['selective_op_overhead_s'] * 1e6:.1f} us per op and pass"],
        ["checkpoint replay", f"{m['replay_op_overhead_s'] * 1e6:.1f} us per replayed op"],
        *([name, f"{rate / 1e9:.1f} GFLOP/s"] for name, rate in m["op_flops_per_s"].items()),
        *([name, f"{s_per * 1e9:.2f} ns per element"] for name, s_per in m["op_s_per_element"].items()),
    ]
    print(f"{result.device.name}: measured in {result.wall_s:.1f}s")
    print(report.table(["rate", "measured"], rows))
    write_json(args.out, profile_dict(result.device, m))
