"""benchmarks/bench_layer_ab.py: its summary, and one real round on the CPU with this tree on both sides."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import bench_layer_ab  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_summary_takes_the_median_over_rounds_and_the_ratio():
    rows = [dict(tree="this", tokens=8, stage="sparse", median_ms=m) for m in (10.0, 30.0, 11.0)]
    rows += [dict(tree="other", tokens=8, stage="sparse", median_ms=m) for m in (5.0, 5.5)]
    rows += [dict(tree="other", tokens=8, stage="dense_warmup", error="timed out")]
    (sparse, dense) = bench_layer_ab.summarise(rows)
    assert sparse["this_ms"] == 11.0 and sparse["other_ms"] == 5.25
    assert sparse["this_over_other"] == pytest.approx(11.0 / 5.25)
    assert "this_over_other" not in dense and "other_ms" not in dense


def test_one_round_on_the_cpu(tmp_path):
    out = tmp_path / "ab.json"
    rc = bench_layer_ab.main(["--other", ROOT, "--device", "cpu", "--scale", "tiny", "--backend", "reference",
                              "--tokens", "64", "--stages", "sparse", "--rounds", "1", "--reps", "1",
                              "--out", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert [r["tree"] for r in result["records"]] == ["this", "other"]
    assert all(r["median_ms"] > 0 for r in result["records"])
    assert result["summary"][0]["this_over_other"] > 0


def test_refuses_a_folder_without_the_package(tmp_path):
    with pytest.raises(SystemExit, match="dsa_ref/__init__.py"):
        bench_layer_ab.main(["--other", str(tmp_path), "--out", str(tmp_path / "x.json")])
