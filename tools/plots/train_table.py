"""Markdown tables of a `dsa-ref train` result for the docs (chapter 6).

    python tools/plots/train_table.py benchmarks/results/2026-12-04_cpu_train_mqar_k32_summary.json

Prints the final metrics of the four runs (mean ± standard deviation over seeds) and, from the
log beside the summary (``..._log.jsonl``), the mean answer accuracy at each evaluation after
phase (a) for the runs that branch from it.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def fmt(run: dict, key: str, digits: int = 3) -> str:
    if run[key] is None:
        return "–"
    return f"{run[key]:.{digits}f} ± {run['std'][key]:.{digits}f}"


def main(path: str) -> None:
    summary = json.loads(Path(path).read_text())
    print("| run | answer accuracy | answer loss | gold-key recall | top-k mass | accuracy at the switch | steps | train seconds |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in summary["runs"].items():
        print(f"| `{name}` | {fmt(r, 'accuracy')} | {fmt(r, 'lm_loss')} | {fmt(r, 'gold_key_recall')} | "
              f"{fmt(r, 'topk_mass')} | {fmt(r, 'switch_accuracy')} | {r['steps']:.0f} | {fmt(r, 'seconds', 0)} |")
    log = Path(path.replace("_summary.json", "_log.jsonl"))
    if not log.exists():
        return
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    phases = {"dsa": ("b_warmup", "c_sparse"), "dsa_no_warmup": ("no_warmup_sparse",),
              "dense_continued": ("continued_dense",)}
    table: dict[int, dict[str, float]] = {}
    for run, names in phases.items():
        latest: dict[tuple[int, int], float] = {}  # (seed, step) -> accuracy; a later phase wins
        for name in names:  # at a phase boundary, the next phase's step-0 evaluation (after the switch)
            for r in rows:
                if r["phase"] == name:
                    latest[(r["seed"], r["step"])] = r["accuracy"]
        by_step: dict[int, list[float]] = {}
        for (_, step), value in latest.items():
            by_step.setdefault(step, []).append(value)
        for step, values in by_step.items():
            table.setdefault(step, {})[run] = statistics.fmean(values)
    print()
    print("| step | " + " | ".join(f"`{run}`" for run in phases) + " |")
    print("|---|" + "---|" * len(phases))
    for step in sorted(table):
        cells = [f"{table[step][run]:.3f}" if run in table[step] else "" for run in phases]
        print(f"| {step} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
