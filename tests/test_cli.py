"""``dsa-ref verify`` / ``python -m dsa_ref verify``: runs every check, prints a table or JSON, exit code."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsa_ref import cli

ROOT = Path(__file__).resolve().parents[1]
EXPECTED = [name for name, _ in cli.CPU_CHECKS]


def _run(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "dsa_ref", "verify", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def full_run():
    return _run("--json")


def test_verify_json_passes_every_check(full_run):
    assert full_run.returncode == 0, full_run.stdout[-3000:] + full_run.stderr[-3000:]
    report = json.loads(full_run.stdout)
    assert report["ok"] is True and report["gpu"] is False
    names = [c["name"] for c in report["checks"]]
    assert names == EXPECTED
    for c in report["checks"]:
        assert set(c) == {"name", "shapes", "dtype", "max_error", "tolerance", "passed", "seconds", "detail", "skipped"}
        assert c["passed"], c
        if not c["skipped"]:
            assert isinstance(c["max_error"], (int, float)) and c["max_error"] <= c["tolerance"], c
    assert report["seconds"] < 60, "verify must stay fast (about 10 s on 2 cores)"


def test_a_failing_check_gives_a_non_zero_exit():
    proc = _run("--json", "--only", "injected", "--inject-failure")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is False
    (check,) = report["checks"]
    assert check["name"].startswith("injected") and check["passed"] is False
    assert "relative L2 error" in check["detail"] and check["max_error"] > check["tolerance"]


def test_table_output(capsys):
    rc = cli.main(["verify", "--only", "topk", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0
    header = out.splitlines()[0].split()
    assert header == ["check", "shapes", "dtype", "max", "error", "tolerance", "result", "time"]
    assert "topk: canonical rule on ties" in out and "PASS" in out and "2 passed, 0 failed" in out


def test_table_shows_failures_with_their_reason(capsys):
    rc = cli.main(["verify", "--only", "injected", "--inject-failure", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 1 and "FAIL" in out and "cosine similarity" in out


def test_an_exception_is_a_failed_check():
    def broken():
        raise RuntimeError("boom")

    (r,) = cli.run_checks([("broken", broken)], progress=False)
    assert not r.passed and "RuntimeError: boom" in r.detail


def test_usage_errors_exit_2(capsys):
    assert cli.main(["verify", "--only", "no such check"]) == 2
    assert "no check matches" in capsys.readouterr().err
    assert cli.main(["verify", "--list"]) == 0
    assert "mla: dense == absorbed" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main([])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
def test_gpu_without_cuda_says_why_and_fails(capsys):
    assert cli.main(["verify", "--gpu", "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert "cannot run the TileLang checks: CUDA is not available" in captured.err
    assert captured.out == "", "nothing runs when --gpu cannot"


def test_gpu_checks_are_defined_at_deepseek_shapes():
    names = [name for name, _ in cli.gpu_checks()]
    assert names and all(n.startswith("tilelang: ") for n in names)
    assert any("V3.2 shape" in n and "fwd" in n for n in names) and any("bwd" in n for n in names)


# the script pip installs beside the interpreter (the venv's bin/ need not be on PATH)
_SCRIPT = shutil.which("dsa-ref", path=os.path.dirname(sys.executable)) or shutil.which("dsa-ref")


@pytest.mark.skipif(_SCRIPT is None, reason="the package is not pip-installed here")
def test_console_script():
    proc = subprocess.run([_SCRIPT, "verify", "--only", "fp8", "--json"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["ok"] is True
