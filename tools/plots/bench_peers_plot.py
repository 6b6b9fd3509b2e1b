"""Plot a benchmarks/bench_peers.py results JSON: dsa_ref's kernels beside the peers', for docs/known_kernels.md.

    python tools/plots/bench_peers_plot.py --json benchmarks/results/DATE_h200_peers.json [MORE.json ...]
                                           [--out docs/assets/bench_peers.png]

With several files, an operation measured in a later one takes its rows from there
(`known_kernels_page.merge_runs`, as the page does).

One panel per operation, one group of bars per shape, one bar per implementation: TFLOP/s per call
(after an L2 flush) under the JSON's FLOP formulas; for the KL loss, which has no FLOP count, ms per
call (lower is better). A hatched bar did not pass its oracle check; an implementation that failed or
was skipped has no bar (the conformance table on the page says why). Nothing is measured here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "docs" / "assets" / "bench_peers.png"
OP_ORDER = ("sparse_fwd", "sparse_bwd", "indexer_fwd", "indexer_bwd", "attention_target", "kl_loss")
TITLES = {"sparse_fwd": "sparse MLA forward", "sparse_bwd": "sparse MLA backward", "indexer_fwd": "indexer forward",
          "indexer_bwd": "indexer backward", "attention_target": "attention target", "kl_loss": "KL loss + gradient"}
#: one colour per implementation across the panels (others take the next colours of the cycle)
COLOURS = {"dsa_ref": "#1f4e9c", "flashmla": "#ff7f0e", "megatron": "#2ca02c", "tilelang": "#d62728",
           "tilelang_simple": "#d62728", "tilelang_pipelined": "#9467bd", "tilelang_fp8": "#8c564b",
           # dsa_ref's other calls of one op: lighter blues, never a peer's colour
           "dsa_ref_staggered": "#6f9fd8", "dsa_ref_kernel": "#6f9fd8", "dsa_ref_one_pass": "#6f9fd8",
           "dsa_ref_torch": "#b8cce8", "megatron_autograd": "#98df8a"}


def _impls(results: dict, op: str) -> list[str]:
    names = list(results.get("impls", {}).get(op, {}))
    for r in results["results"]:
        if r["op"] == op and r["impl"] not in names:
            names.append(r["impl"])
    return names


def plot(results: dict, out: Path) -> None:
    """Draw ``results`` (a bench_peers JSON, already loaded) into ``out``; rows that merged files kept from
    an earlier run (``earlier_run``) are left out, so every panel holds one run."""
    results = dict(results, results=[r for r in results["results"] if "earlier_run" not in r])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [op for op in OP_ORDER if any(r["op"] == op for r in results["results"])]
    shapes = [s["name"] for s in results["shapes"]]
    by = {(r["op"], r["shape"], r["impl"]): r for r in results["results"]}
    cols = min(3, max(1, len(ops)))
    rows = (len(ops) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows), squeeze=False)
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colours = dict(COLOURS)
    for ax, op in zip(axes.flat, ops):
        names = _impls(results, op)
        timed = any(by.get((op, s, n), {}).get("tflops") is not None for s in shapes for n in names)
        width = 0.8 / max(1, len(names))
        for i, name in enumerate(names):
            colour = colours.setdefault(name, palette[(len(colours) + 5) % len(palette)])
            xs, values, hatches = [], [], []
            for n, s in enumerate(shapes):
                r = by.get((op, s, name))
                if r is None or r["status"] != "ok" or r.get("ms_per_call") is None:
                    continue
                value = r.get("tflops") if timed else r["ms_per_call"]
                if value is None:
                    continue
                xs.append(n + (i - (len(names) - 1) / 2) * width)
                values.append(value)
                hatches.append("//" if (r.get("check") or {}).get("status", "ok") != "ok" else None)
            if not values:
                continue
            bars = ax.bar(xs, values, width, label=name, color=colour, edgecolor="black", lw=0.4)
            for bar, hatch, v in zip(bars, hatches, values):
                if hatch:
                    bar.set_hatch(hatch)
                label = f"{v:.0f}" if timed else f"{v:.2f}"
                ax.text(bar.get_x() + bar.get_width() / 2, v, label, ha="center", va="bottom", fontsize=5.5)
        run = results.get("meta", {}).get("op_runs", {}).get(op)  # an op measured in a later run of its own
        ax.set_title(TITLES.get(op, op) + (f" ({run['date']})" if run else ""), fontsize=9)
        ax.set_xticks(range(len(shapes)), [s.replace(" ", "\n") for s in shapes], fontsize=7)
        ax.set_ylabel("TFLOP/s per call" if timed else "ms per call (lower is better)", fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
        ax.set_ylim(top=ax.get_ylim()[1] * 1.3)  # headroom: the legend sits above the bars
        ax.legend(fontsize=6, loc="upper center", ncol=3)
        ax.grid(axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(ops):]:
        ax.set_visible(False)
    m = results.get("meta", {})
    later = " (panels with a date: from a later run)" if m.get("op_runs") else ""
    fig.suptitle(f"dsa_ref and peer kernels, {m.get('gpu', m.get('device', ''))}, {m.get('date', '')}{later} "
                 f"(hatched: output did not pass the oracle check)", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130, metadata={"Software": None})  # no timestamp: same JSON, same bytes
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, nargs="+", required=True)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tools"))
    from known_kernels_page import merge_runs

    plot(merge_runs([json.loads(p.read_text()) for p in args.json], [p.name for p in args.json]), args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
