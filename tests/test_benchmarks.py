"""The benchmark harness runs end to end on a reduced set and writes results.json (keeps it from rotting)."""

import json

import pytest

from benchmarks.__main__ import main
from planner.solver.planning import BASELINES


@pytest.mark.bench
def test_benchmarks_quick_subset(tmp_path):
    rc = main(["--quick", "--out", str(tmp_path), "--only", "accuracy,quality,solver", "--models", "mlp,llama-L2"])
    results = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0, results["failures"]
    assert {"accuracy", "quality", "solver"} <= set(results)
    acc = results["accuracy"]
    assert (
        len(acc) == 4
        and all(r.get("budget_fraction", 0) < 1.0 for r in acc)
        and {r["size"] for r in acc} == {"tiny", "small"}
        and {r["plan"] for r in acc} == {"none", "optimal"}
    )
    for r in acc:
        assert {"model", "predicted_bytes", "measured_bytes", "error"} <= set(r)
        assert r["model"] == "mlp" and r["measured_bytes"] > 0
        assert r["error"] == (r["predicted_bytes"] - r["measured_bytes"]) / r["measured_bytes"]
    q = results["quality"]
    assert [r["budget_fraction"] for r in q] == [0.4, 0.6, 0.8]
    for r in q:
        assert set(r["strategies"]) == set(BASELINES)
        # dominates is judged only where some baseline fits (None elsewhere)
        assert r["dominates"] is None if not r["baseline_fits"] else isinstance(r["dominates"], bool)
        assert r["mincut"]["recompute_flops"] >= 0 and 0.0 <= r["mincut"]["activation_memory_budget"] <= 1.0
    (s,) = results["solver"]
    assert s["model"] == "llama-L2" and s["num_variables"] > 0 and s["status"] in ("OPTIMAL", "FEASIBLE")


@pytest.mark.bench
def test_measured_time_quick(tmp_path):
    rc = main(["--measured-time", "--quick", "--out", str(tmp_path), "--models", "gpt"])
    results = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0, results["failures"]
    rows = {r["strategy"]: r for r in results["measured"] if r["run"] == "eager" or r["strategy"] != "none"}
    assert {r["run"] for r in results["measured"]} == {"eager", "compiled"}
    assert set(rows) == {
        "none",
        "full",
        "every-2",
        "op-sac",
        "op-sac-alt",
        "megatron-selective",
        "memplan 30%",
        "memplan 50%",
        "memplan 70%",
        "compile-budget 0.5",
        "memplan compiled @0.5",
    }
    measured = [r for r in rows.values() if "failure" not in r]
    assert {"none", "full", "op-sac", "memplan 70%", "compile-budget 0.5"} <= {r["strategy"] for r in measured}
    for r in measured:
        assert r["grads_equal"] and len(r["steps"]) >= 1
        assert all(s["wall_s"] > 0 and s["other_cpu_s"] >= 0 and s["attempts"] >= 1 for s in r["steps"])
        if "compile" not in r["strategy"]:  # eager: the simulator's prediction
            assert abs(r["measured_peak_bytes"] - r["predicted_peak_bytes"]) <= 0.01 * r["predicted_peak_bytes"]
    assert 0 < rows["compile-budget 0.5"]["measured_peak_bytes"] and rows["compile-budget 0.5"]["budget_bytes"] is None
    compiled_none = next(r for r in results["measured"] if r["run"] == "compiled" and r["strategy"] == "none")
    assert compiled_none["measured_peak_bytes"] == rows["none"]["measured_peak_bytes"]  # same plan, same step
    assert rows["none"]["measured_overhead"] == 0.0 and rows["none"]["predicted_overhead"] == 0.0
    assert rows["full"]["measured_peak_bytes"] < rows["none"]["measured_peak_bytes"]
    assert rows["memplan 70%"]["measured_peak_bytes"] <= rows["memplan 70%"]["budget_bytes"]
