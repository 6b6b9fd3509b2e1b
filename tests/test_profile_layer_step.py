"""benchmarks/profile_layer_step.py on the CPU: the tiny layer's step is profiled and its tables written."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import profile_layer_step as pls  # noqa: E402


def test_tiny_step_writes_the_per_op_tables(tmp_path):
    assert pls.main(["--device", "cpu", "--backend", "reference", "--tiny", "--tokens", "24",
                     "--out", str(tmp_path), "--top", "5"]) == 0
    results = json.loads((tmp_path / "profile_layer_step.json").read_text())
    assert [(p["tokens"], p["stage"]) for p in results["points"]] == [(24, "dense_warmup"), (24, "sparse")]
    for p in results["points"]:
        ops = p["ops"]
        assert p["step_ms"] > 0 and ops and p["time"] == "CPU"
        assert abs(sum(r["pct_of_step"] for r in ops) - 100.0) < 1e-6
        assert any(r["op"] == "aten::mm" for r in ops), "the projections' matrix products are profiled"
        assert all(r["total_ms"] >= r["self_ms"] - 1e-9 for r in ops)
    text = (tmp_path / "profile_layer_step.md").read_text()
    assert "## 24 tokens, sparse" in text and "| op | calls | CPU total ms | CPU self ms | % of step |" in text
    rows = [ln for ln in text.split("## 24 tokens, sparse")[1].splitlines() if ln.startswith("| `")]
    assert len(rows) == 5, "--top rows per table"


def test_kernels_are_attributed_to_the_op_that_launched_them():
    kernel = SimpleNamespace
    events = [SimpleNamespace(name="SparseMLAFunction", kernels=[kernel(name="main_kernel", device=0, duration=300.0)]),
              SimpleNamespace(name="SelectedIndexScoresBackward",
                              kernels=[kernel(name="main_kernel", device=0, duration=100.0)] * 2),
              SimpleNamespace(name="aten::mm", kernels=[])]
    rows = pls.kernel_table(SimpleNamespace(events=lambda: events), steps=2)
    assert [(r["kernel"], r["launched_by"], r["calls"], r["ms"]) for r in rows] == [
        ("main_kernel", "SparseMLAFunction", 0.5, 0.15), ("main_kernel", "SelectedIndexScoresBackward", 1.0, 0.1)]
    assert abs(rows[0]["pct_of_kernels"] - 60.0) < 1e-9
