"""The benchmark harness runs end to end on a reduced set and writes results.json (keeps it from rotting)."""

import json

from benchmarks.__main__ import main
from planner.solver.planning import BASELINES


def test_benchmarks_quick_subset(tmp_path):
    rc = main(["--quick", "--out", str(tmp_path), "--only", "accuracy,quality,solver", "--models", "mlp,llama-L2"])
    results = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0, results["failures"]
    assert {"accuracy", "quality", "solver"} <= set(results)
    acc = results["accuracy"]
    assert len(acc) == 4 and all(r.get("budget_fraction", 0) < 1.0 for r in acc) and {r["size"] for r in acc} == {"tiny", "small"} and {r["plan"] for r in acc} == {"none", "optimal"}
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
