"""A/B of the staggered sparse MLA forward: other versions of `sparse_mla_fwd.py` against this tree's, beside FlashMLA.

    git show 1a2b3c4:dsa_ref/kernels/sparse_mla_fwd.py | sed -e 's/from \\._target/from dsa_ref.kernels._target/' \\
        > .gpu/ab/fwd_old.py
    python tools/probes/ab_sparse_forward.py --variants old=.gpu/ab/fwd_old.py --peers .gpu/peers --out ab.json

Every kernel runs in one process on the same inputs (bench_kernels' causal top-2048 at each shape), the
kernel alone on the wrapper's prepared operands (int32 indices padded to 128 slots, the zero row
appended, and the block counts for versions that take them; ``NAME_counted`` times such a version with
the count pass included, as a kernel that counts inside is timed), in GPU time (work queued ahead, median of 30), in two alternating rounds;
FlashMLA's sparse prefill (``--peers``, as `benchmarks/bench_peers.py` loads it) runs on the same
inputs in its own layout, and ``public`` is this tree's public call on the benchmark's int64
indices (`sparse_mla_tilelang(..., validate=False)`: the padding, the zero row and the block counts
included), ``public_int32`` the same call on those indices made int32 beforehand. Every round also times each entry back to back (30 calls queued one after another, the
mean; `bench_peers.back_to_back_ms`). Each row records the times, the TFLOP/s of the faster round,
each entry's speed against this tree's kernel, whether a variant's ``out`` and ``lse`` equal
this tree's bit for bit, and (with ``--peers``) FlashMLA's time over the public call's in each round,
in GPU time and back to back (above 1: the public call is faster; compare within a round, since
clocks drift between rounds).
"""
import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path[:0] = [os.path.join(ROOT, "benchmarks"), ROOT]

from bench_kernels import BENCH_TOPK, H, cuda_time_ms, run_meta, shape_inputs  # noqa: E402
from bench_peers import back_to_back_ms, load_family  # noqa: E402
from dsa_ref.kernels.shapes import DIM, DIM_V, SM_SCALE  # noqa: E402


def load_file(name: str, path: str):
    spec = importlib.util.spec_from_file_location(f"ab_fwd_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="", help="comma list of name=path to other sparse_mla_fwd.py files")
    parser.add_argument("--shapes", default="4096x8192,16384x16384")
    parser.add_argument("--peers", default="", help="folder with flashmla/ (empty: no FlashMLA)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="ab_sparse_forward.json")
    args = parser.parse_args()

    from dsa_ref.kernels import sparse_mla_fwd as tree
    from dsa_ref.kernels.autograd import _block_counts, _pad_indices, sparse_mla_tilelang, with_zero_row

    modules = {"tree": tree}
    for item in filter(None, args.variants.split(",")):
        name, path = item.split("=", 1)
        modules[name] = load_file(name, path)
    flashmla = None
    if args.peers:
        flashmla = load_family("flashmla", Path(args.peers), torch.device("cuda")).module("flashmla")

    out = {"meta": run_meta(queue_ahead=True), "topk": BENCH_TOPK, "rows": []}
    for shape in args.shapes.split(","):
        num_q, num_kv = (int(v) for v in shape.split("x"))
        x = shape_inputs(num_q, num_kv)
        q, kv, indices = x["q"], x["kv"], x["idx"]
        flop = 2 * int((indices >= 0).sum()) * H * (DIM + DIM_V)
        kv0 = with_zero_row(kv)  # [S + 1, D]
        idx = _pad_indices(indices, 2 * tree.BLOCK_I)  # [T, K'] int32
        counts = _block_counts(idx, 2 * tree.BLOCK_I)
        runs, counted = {}, {}
        for name, mod in modules.items():
            kernel = mod.staggered_kernel(H, DIM, DIM_V, SM_SCALE)
            if hasattr(mod, "COUNT_CHUNK"):  # a version that counts each row's pairs itself
                runs[name] = lambda k=kernel: k(q, kv0, idx)
            else:  # an older one takes the block counts: made beforehand, and with the count pass timed
                runs[name] = lambda k=kernel: k(q, kv0, idx, counts)
                counted[f"{name}_counted"] = lambda k=kernel: k(q, kv0, idx, _block_counts(idx, 2 * tree.BLOCK_I))
        runs.update(counted)
        runs["public"] = lambda: sparse_mla_tilelang(q, kv, indices, sm_scale=SM_SCALE, d_v=DIM_V, validate=False)
        indices32 = indices.to(torch.int32)  # [T, K]: the public call on int32 indices, as FlashMLA takes them
        runs["public_int32"] = lambda: sparse_mla_tilelang(q, kv, indices32, sm_scale=SM_SCALE, d_v=DIM_V,
                                                           validate=False)
        if flashmla is not None:
            kv3, idx3 = kv[:, None, :].contiguous(), indices.to(torch.int32)[:, None, :].contiguous()
            runs["flashmla"] = lambda: flashmla.sparse_prefill_fwd(q, kv3, idx3, SM_SCALE, DIM_V, None, None)
        times = {name: [] for name in runs}
        b2b = {name: [] for name in runs}
        with torch.no_grad():
            for _ in range(args.rounds):
                for name, fn in runs.items():
                    times[name].append(cuda_time_ms(fn, reps=30, queue_ahead=True))
                    b2b[name].append(back_to_back_ms(fn, reps=30))
        ref_out, ref_lse = runs["tree"]()
        row = {"shape": shape}
        best = {name: min(t) for name, t in times.items()}
        for name, t in times.items():
            row[f"{name}_gpu_ms"] = t
            row[f"{name}_tflops"] = flop / best[name] / 1e9
            row[f"{name}_vs_tree"] = best["tree"] / best[name]
            row[f"{name}_b2b_ms"] = b2b[name]
            row[f"{name}_b2b_tflops"] = flop / min(b2b[name]) / 1e9
            if name in modules and name != "tree":
                o, lse = runs[name]()
                row[f"{name}_same_as_tree"] = bool(torch.equal(o, ref_out) and torch.equal(lse, ref_lse))
        if "flashmla" in runs:  # issue 21's ratio: FlashMLA's time over the public call's, round by round
            row["public_vs_flashmla_by_round"] = [f / p for f, p in zip(times["flashmla"], times["public"])]
            row["public_b2b_vs_flashmla_by_round"] = [f / p for f, p in zip(b2b["flashmla"], b2b["public"])]
        print(json.dumps(row), flush=True)
        out["rows"].append(row)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
