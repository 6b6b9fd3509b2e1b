"""A/B of the persistent indexer kernel: another commit's `indexer_fwd_persistent.py` against this tree's.

``--new DIR`` puts a candidate (``DIR/persistent_new.py``) in place of this tree's kernel.

    git show c8b6d8d:dsa_ref/kernels/indexer_fwd_persistent.py | sed -e 's/from \\._target/from dsa_ref.kernels._target/' \\
        -e 's/from \\.indexer_fwd_ws/from dsa_ref.kernels.indexer_fwd_ws/' > .gpu/old/persistent_old.py
    python tools/probes/ab_indexer_persistent.py --old .gpu/old --out ab.json

Both kernels run in one process on the same inputs (bench_indexer_fp8's causal 4096 x 8192), in GPU time
(work queued ahead, median of 30), alternating old, new, old, new; the rows record the times, the
speed-up of the faster new run over the faster old one, how far the two kernels' scores differ, and
whether they are the same bits. Both take the same operands (the key scales of `quantize_indexer_operands`
are 16-byte aligned, as the loader warp's bulk copy of them needs).
"""
import argparse
import json
import os
import sys

import torch

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path[:0] = [os.path.join(ROOT, "benchmarks"), ROOT]

from bench_indexer_fp8 import inputs, rel_l2  # noqa: E402
from bench_kernels import cuda_time_ms, run_meta  # noqa: E402

SCHEDULES = ((True, dict(consumers=3, stages=4)), (True, dict(consumers=2, stages=4, pingpong=True)),
             (False, dict(consumers=2, stages=4, pingpong=True)), (False, dict(consumers=3, stages=2)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="folder holding the other commit's kernel as persistent_old.py")
    parser.add_argument("--new", default=None, help="folder holding a candidate as persistent_new.py (default: this tree's)")
    parser.add_argument("--shape", default="4096x8192")
    parser.add_argument("--out", default="ab_indexer_persistent.json")
    args = parser.parse_args()
    sys.path.insert(0, args.old)
    import persistent_old

    if args.new:
        sys.path.insert(0, args.new)
        import persistent_new as new
    else:
        from dsa_ref.kernels import indexer_fwd_persistent as new
    from dsa_ref.kernels.indexer_fwd_fp8 import quantize_indexer_operands

    num_q, num_kv = (int(v) for v in args.shape.split("x"))
    q, k, w, st, en = inputs(num_q, num_kv)
    flop = 2 * int((en - st).sum()) * 64 * 128
    q8, qs, k8, ks = quantize_indexer_operands(q, k)
    wf = w.float().contiguous()
    out = {"meta": run_meta(queue_ahead=True), "rows": []}
    for fp8, kw in SCHEDULES:
        operands = (q8, qs, k8, ks, wf, st, en) if fp8 else (q, k, wf, st, en)
        times, scores = {}, {}
        for name, mod in (("old", persistent_old), ("new", new), ("old2", persistent_old), ("new2", new)):
            kernel = mod.indexer_persistent_kernel(64, 128, True, fp8=fp8, **kw)
            s = torch.empty(num_q, num_kv, device="cuda")
            times[name] = cuda_time_ms(lambda: kernel(*operands, s), reps=30, queue_ahead=True)
            kernel(*operands, s)
            scores[name[:3]] = s
        row = {"shape": args.shape, "fp8": fp8, **kw, **{f"{n}_gpu_ms": v for n, v in times.items()},
               "new_vs_old": min(times["old"], times["old2"]) / min(times["new"], times["new2"]),
               "tflops_new": flop / min(times["new"], times["new2"]) / 1e9,
               "rel_l2_new_vs_old": rel_l2(scores["new"], scores["old"]),
               "same_inf": bool(torch.equal(torch.isinf(scores["new"]), torch.isinf(scores["old"]))),
               "bit_identical": bool(torch.equal(scores["new"], scores["old"]))}
        print(row, flush=True)
        out["rows"].append(row)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
