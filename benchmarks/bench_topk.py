"""Benchmark the radix-select top-k kernel against torch.topk and the reference on one GPU.

    python benchmarks/bench_topk.py [--quick] [--shapes 4096x4096,...] [--topk 2048] [--out file.json]

Inputs as in ``bench_kernels.py``: the queries are the last ``num_q`` positions of one causal
sequence of ``num_kv`` keys, so query ``t`` sees keys ``< num_kv - num_q + t + 1`` and the rest of
its row is ``-inf``; the scores inside the windows are uniform random fp32. For each shape it
times, with CUDA events (median of many runs after warm-up):

* ``kernel``: `topk_indices_tilelang(sorted=False, check_nan=False)`, the kernel alone (the set in
  ascending index order);
* ``kernel_sorted``: the same with ``sorted=True``, identical to the reference;
* ``kernel_sorted_checked``: ``sorted=True`` with the default NaN check (one more read of the
  scores and a host synchronisation), the call `dsa_ref.dispatch` makes;
* ``torch_topk_unsorted`` / ``torch_topk``: ``torch.topk(sorted=False / True)`` (no canonical ties);
* ``reference``: `dsa_ref.topk_indices` (a full stable sort of every row).

It prints one JSON line per shape and writes them all to ``--out``; ``exact`` says whether the
kernel's sorted output equals the reference's on that input.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_kernels import cuda_time_ms, run_meta  # noqa: E402

from dsa_ref import key_windows, topk_indices  # noqa: E402

TOPK = 2048
SHAPES = "4096x4096,8192x8192,16384x16384,4096x8192"


def causal_scores(num_q: int, num_kv: int, seed: int = 0) -> torch.Tensor:
    """fp32 CUDA ``[num_q, num_kv]``: random scores, ``-inf`` past each query's causal window."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    _, ends = key_windows(torch.tensor([0, num_kv]), torch.arange(num_kv - num_q, num_kv))
    scores = torch.rand(num_q, num_kv, device="cuda", generator=g)
    key = torch.arange(num_kv, device="cuda")
    return scores.masked_fill(key[None] >= ends.cuda()[:, None], float("-inf"))


def bench_rows(shapes, reps: int, *, topk: int = TOPK, ref_reps: int | None = None) -> list[dict]:
    """One timing row (a dict of ``*_ms`` entries) per ``(num_q, num_kv)`` in ``shapes``.

    ``reps`` timed runs per kernel (after warm-up), ``ref_reps`` for the slow reference
    (default ``max(2, reps // 10)``). Needs CUDA and tilelang.
    """
    from dsa_ref.kernels.topk import topk_indices_tilelang

    ref_reps = ref_reps or max(2, reps // 10)
    rows = []
    for num_q, num_kv in shapes:
        scores = causal_scores(num_q, num_kv)
        row = {"num_q": num_q, "num_kv": num_kv, "topk": topk}
        runs = {
            "kernel": (lambda: topk_indices_tilelang(scores, topk, sorted=False, check_nan=False), reps),
            "kernel_sorted": (lambda: topk_indices_tilelang(scores, topk, check_nan=False), reps),
            "kernel_sorted_checked": (lambda: topk_indices_tilelang(scores, topk), reps),
            "torch_topk_unsorted": (lambda: torch.topk(scores, topk, dim=1, sorted=False), reps),
            "torch_topk": (lambda: torch.topk(scores, topk, dim=1, sorted=True), reps),
            "reference": (lambda: topk_indices(scores, topk), ref_reps),
        }
        with torch.no_grad():
            for name, (fn, n) in runs.items():
                row[name + "_ms"] = cuda_time_ms(fn, warmup=min(3, n), reps=n)
            row["exact"] = bool(torch.equal(topk_indices_tilelang(scores, topk), topk_indices(scores, topk)))
        row["speedup_vs_torch_topk_unsorted"] = row["torch_topk_unsorted_ms"] / row["kernel_ms"]
        row["speedup_vs_reference"] = row["reference_ms"] / row["kernel_sorted_ms"]
        rows.append(row)
        del scores
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--shapes", default=SHAPES, help="comma list of NUM_QxNUM_KV")
    parser.add_argument("--topk", type=int, default=TOPK)
    parser.add_argument("--out", default="bench_topk.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_topk needs a CUDA GPU; nothing to do")
        return 1
    shapes = [tuple(int(v) for v in spec.split("x")) for spec in args.shapes.split(",")]
    meta = run_meta()
    if meta["tilelang"] == "unavailable":
        print("bench_topk needs tilelang; nothing to do")
        return 1
    rows = []
    for shape in shapes:
        rows += bench_rows([shape], reps=10 if args.quick else 50, topk=args.topk)
        print(json.dumps(rows[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
