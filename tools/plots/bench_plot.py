"""Plot the measured TileLang kernel benchmark for docs/benchmarks.md.

    python tools/plots/bench_plot.py                      # reads benchmarks/results/2026-12-03_s4_h200_kernels.json
                                                          # and writes docs/assets/bench_kernels.png
    python tools/plots/bench_plot.py --json OTHER.json --out OTHER.png

One group of bars per shape (queries x keys, top-k 2048, 128 heads): the achieved TFLOP/s of the
sparse MLA forward (warp-specialised and simple schedules, and the warp-specialised kernel alone
when the JSON has it), its backward, the indexer and the
readable reference's forward, under the FLOP conventions of benchmarks/bench_kernels.py (every
top-k slot counted). The dashed line is the bf16 matrix-product rate measured on the same H200
(790 TFLOP/s); the dotted lines are the project's targets for the forward (500) and the backward
(200). Nothing is measured here: the numbers are the JSON's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "2026-12-03_s4_h200_kernels.json"
DEFAULT_OUT = ROOT / "docs" / "assets" / "bench_kernels.png"
PEAK = 790  # TFLOP/s, bf16 dense matrix product measured on the H200
TARGETS = ((500, "forward target 500", "tab:blue"), (200, "backward target 200", "tab:green"))
KERNELS = (
    ("fwd_ws", "sparse MLA forward, warp-specialised"),
    ("fwd_ws_kernel", "its kernel alone"),
    ("fwd_simple", "sparse MLA forward, simple"),
    ("bwd", "sparse MLA backward"),
    ("indexer", "indexer scores"),
    ("fwd_reference", "forward, readable reference"),
)


def plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta, rows = results["meta"], results["rows"]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    kernels = [(key, label) for key, label in KERNELS if key + "_tflops" in rows[0]]  # older JSON lack some
    width = 0.8 / len(kernels)
    for i, (key, label) in enumerate(kernels):
        xs = [n + (i - (len(kernels) - 1) / 2) * width for n in range(len(rows))]
        values = [r[key + "_tflops"] for r in rows]
        reference = key.endswith("reference")
        bars = ax.bar(xs, values, width, label=label, color="#cccccc" if reference else None,
                      hatch="//" if reference else None, edgecolor="black" if reference else None, lw=0.4)
        for bar, v in zip(bars, values):
            ax.text(bar.get_x() + bar.get_width() / 2, v + 8, f"{v:.0f}", ha="center", va="bottom", fontsize=6.5)
    ax.axhline(PEAK, color="black", lw=1, ls="--")
    ax.text(len(rows) - 0.5, PEAK + 8, f"measured bf16 matmul peak, {PEAK} TFLOP/s", ha="right", va="bottom", fontsize=8)
    for level, text, color in TARGETS:
        ax.axhline(level, color=color, lw=1.0, ls=":", label=text)
    ax.set_xticks(range(len(rows)), [f"{r['num_q']} x {r['num_kv']}" for r in rows])
    ax.set_xlim(-0.5, len(rows) - 0.5)
    ax.set_ylim(0, 880)
    ax.set_xlabel(f"queries x keys (top-k {rows[0]['topk']}, {rows[0]['heads']} heads)")
    ax.set_ylabel("TFLOP/s (all top-k slots counted)")
    ax.set_title(f"TileLang kernels, {meta['gpu']}, {meta['date']} "
                 f"(torch {meta['torch']}, CUDA {meta['cuda']}, tilelang {meta['tilelang']})", fontsize=9)
    ax.legend(fontsize=7, ncol=3, loc="upper left", bbox_to_anchor=(0, 0.9), framealpha=0.9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    # no timestamps in the PNG, so regenerating it from the same JSON gives the same bytes
    fig.savefig(out, dpi=130, metadata={"Software": None})
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    results = json.loads(args.json.read_text())
    plot(results, args.out)
    try:
        shown = args.out.resolve().relative_to(ROOT)
    except ValueError:
        shown = args.out
    print(f"wrote {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
