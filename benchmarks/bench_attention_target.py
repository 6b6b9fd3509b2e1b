"""Benchmark the head-summed attention probabilities kernel (the indexer loss's target) on one GPU.

    python benchmarks/bench_attention_target.py [--shapes 4096x4096,8192x8192,4096x8192] [--reps 30]
                                                [--stages 2] [--out results.json]

DeepSeek-V3.2 sizes: H = 128 heads, latent rows of 576, top-k 2048; the queries are the last
``num_q`` positions of one causal sequence of ``num_kv`` tokens, each selecting random keys of its
window (early queries have fewer than 2048 keys, so their rows end in ``-1`` slots). Times are
medians over CUDA events after warm-up; the LSE comes from the sparse MLA kernel on the same
inputs.

TFLOP/s count every slot, ``2 T H K 576`` (``tflops``), and only the blocks of 64 slots the kernel
visits, up to each row's last valid slot (``tflops_visited``).
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

H = 128


def bench_rows(shapes, reps: int = 30, stages=(2,)) -> list[dict]:
    """One row per ``(num_q, num_kv)`` shape: ms and TFLOP/s of the kernel (per pipeline depth)."""
    from bench_kernels import cuda_time_ms, shape_inputs

    from dsa_ref.kernels.attention_target import BLOCK_KEYS, attention_head_sum_tilelang, head_sum_probs_kernel
    from dsa_ref.kernels.autograd import _block_counts, sparse_mla_tilelang
    from dsa_ref.kernels.shapes import BENCH_TOPK, DIM, DIM_V, SM_SCALE

    rows = []
    for num_q, num_kv in shapes:
        x = shape_inputs(num_q, num_kv)
        q, kv, idx = x["q"], x["kv"], x["idx"]
        with torch.no_grad():
            _, lse = sparse_mla_tilelang(q, kv, idx, sm_scale=SM_SCALE, d_v=DIM_V)
        idx32 = idx.to(torch.int32).contiguous()
        counts = _block_counts(idx32, BLOCK_KEYS)
        lse2 = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse.double() * 1.4426950408889634)
        lse2 = lse2.float().contiguous()
        flop = 2 * num_q * H * BENCH_TOPK * DIM
        visited = 2 * int(counts.sum()) * BLOCK_KEYS * H * DIM
        row = {"num_q": num_q, "num_kv": num_kv, "heads": H, "topk": BENCH_TOPK,
               "valid_slot_fraction": float((idx >= 0).float().mean())}
        ms = cuda_time_ms(lambda: attention_head_sum_tilelang(q, kv, idx, lse, sm_scale=SM_SCALE), reps=reps)
        row.update(wrapper_ms=ms, wrapper_tflops=flop / ms / 1e9)
        for n in stages:  # the kernel alone, without the wrapper's conversions
            kernel = head_sum_probs_kernel(H, DIM, float(SM_SCALE), num_stages=n)
            out = torch.zeros(num_q, BENCH_TOPK, device="cuda")
            ms = cuda_time_ms(lambda: kernel(q, kv, idx32, counts, lse2, out), reps=reps)
            row.update({f"stages{n}_ms": ms, f"stages{n}_tflops": flop / ms / 1e9,
                        f"stages{n}_tflops_visited": visited / ms / 1e9})
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4096x4096,8192x8192,4096x8192")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--stages", default="2", help="comma list of pipeline depths to time (1 or 2)")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_attention_target needs a CUDA GPU; nothing to do")
        return 0
    shapes = [tuple(int(v) for v in spec.split("x")) for spec in args.shapes.split(",")]
    rows = bench_rows(shapes, args.reps, tuple(int(s) for s in args.stages.split(",")))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
