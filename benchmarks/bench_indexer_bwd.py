"""Benchmark the indexer scores at selected keys (forward) and their fused backward on one GPU.

    python benchmarks/bench_indexer_bwd.py [--quick] [--shapes 4096x4096,...] [--out results.json]

Each shape ``T x S`` is the last ``T`` queries of one causal sequence of ``S`` tokens, each
selecting its top ``K = 2048`` keys (fewer, ``-1``-padded, for early queries), with the
DeepSeek-V3.2 indexer (``H_I = 64`` heads of ``D = 128``). Times are medians over CUDA events
(`bench_kernels.cuda_time_ms`). TFLOP/s count every slot, ``-1`` ones included: forward
``2 T K H_I D``, backward three times that (logits recomputed, ``dq``, ``dk``). The backward time
includes zeroing the ``dk`` buffer; it does not include the forward.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_kernels, when imported from elsewhere

from dsa_ref.kernels.shapes import BENCH_TOPK, INDEXER_DIM  # noqa: E402

H_I = 64
DEFAULT_SHAPES = ((4096, 4096), (8192, 8192), (16384, 16384), (4096, 8192))


def causal_topk_indices(num_q: int, num_kv: int, topk: int, seed: int = 0) -> torch.Tensor:
    """int32 ``[T, K]``: ``topk`` random distinct keys of each query's causal window, ``-1``-padded."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pos = torch.arange(num_kv - num_q, num_kv, device="cuda")  # [T] global positions of the queries
    out = torch.full((num_q, topk), -1, dtype=torch.int32, device="cuda")
    for lo in range(0, num_q, 1024):  # a random score per (query, key), chunked to bound memory
        p = pos[lo:lo + 1024]
        scores = torch.rand(p.numel(), num_kv, device="cuda", generator=g)
        scores.masked_fill_(torch.arange(num_kv, device="cuda")[None, :] > p[:, None], -1.0)  # future keys
        vals, idx = scores.topk(min(topk, num_kv), dim=1)
        out[lo:lo + 1024, :idx.shape[1]] = torch.where(vals >= 0, idx, -1).int()
    return out


def bench_rows(shapes=DEFAULT_SHAPES, reps: int = 20, topk: int = BENCH_TOPK) -> list[dict]:
    """One dict per ``(T, S)`` shape: forward and backward ms and TFLOP/s."""
    from bench_kernels import cuda_time_ms
    from dsa_ref.kernels.indexer_bwd import (
        _num_blocks,
        indexer_backward_kernel,
        selected_scores_kernel,
    )

    fwd_kernel = selected_scores_kernel(H_I, INDEXER_DIM, True)
    bwd_kernel = indexer_backward_kernel(H_I, INDEXER_DIM, True)
    rows = []
    for num_q, num_kv in shapes:
        g = torch.Generator(device="cuda").manual_seed(num_q + num_kv)
        q = torch.randn(num_q, H_I, INDEXER_DIM, device="cuda", generator=g).bfloat16()
        k = torch.randn(num_kv, INDEXER_DIM, device="cuda", generator=g).bfloat16()
        w = torch.randn(num_q, H_I, device="cuda", generator=g) * H_I**-0.5 * INDEXER_DIM**-0.5
        idx = causal_topk_indices(num_q, num_kv, topk)
        n_blocks = _num_blocks(idx)
        d_scores = torch.randn(num_q, topk, device="cuda", generator=g)
        dk = torch.zeros(num_kv, INDEXER_DIM, dtype=torch.float32, device="cuda")

        def backward():
            dk.zero_()
            bwd_kernel(q, k, w, idx, n_blocks, d_scores, dk)

        fwd_ms = cuda_time_ms(lambda: fwd_kernel(q, k, w, idx, n_blocks), reps=reps)
        bwd_ms = cuda_time_ms(backward, reps=reps)
        flop = 2 * num_q * topk * H_I * INDEXER_DIM
        rows.append({
            "num_q": num_q, "num_kv": num_kv, "topk": topk,
            "valid_slot_fraction": float((idx >= 0).float().mean()),
            "fwd_ms": fwd_ms, "fwd_tflops": flop / fwd_ms / 1e9,
            "bwd_ms": bwd_ms, "bwd_tflops": 3 * flop / bwd_ms / 1e9,
        })
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--shapes", default=",".join(f"{t}x{s}" for t, s in DEFAULT_SHAPES))
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_indexer_bwd needs a CUDA GPU; skipping")
        return 0
    shapes = [tuple(int(v) for v in spec.split("x")) for spec in args.shapes.split(",")]
    rows = bench_rows(shapes, reps=5 if args.quick else 20)
    print("| T x S | K | valid slots | fwd ms (TFLOP/s) | bwd ms (TFLOP/s) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['num_q']} x {r['num_kv']} | {r['topk']} | {r['valid_slot_fraction']:.2f} | "
              f"{r['fwd_ms']:.3f} ({r['fwd_tflops']:.0f}) | {r['bwd_ms']:.3f} ({r['bwd_tflops']:.0f}) |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
