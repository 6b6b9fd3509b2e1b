"""How far the fp8 indexer's scores move if the sum over heads ran on the tensor cores.

The fp8 kernel's epilogue spends two CUDA-core instructions per (key, query, head) on
``w * relu(s)`` (a maximum and a fused multiply-add): as many instructions as its products take
tensor cycles (chapter 5). A second warpgroup MMA could take the sum over heads, ``relu(S) @ W``,
with ``relu(S)`` in registers as its A operand, but that operand is rounded first: to bf16 or fp16
(after ``cvt.rn.relu``) or to tf32 (after the maximum). This probe emulates each rounding on the CPU
in float64 and prints, against the exact scores of the same e4m3 operands (`dsa_ref.fp8`'s
simulation), the worst error over the per-entry bound of `tests/test_kernels_indexer_fp8.py`
(``2^-10`` times the magnitude ``M = sum_h |w q_scale| |s| k_scale``) and the relative L2 error
(that test's bound: 5e-3; the current kernel: about 1.25e-4).

    python tools/probes/fp8_head_sum_precision.py [--queries 256 --keys 512 --seed 0]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dsa_ref.fp8 import act_quant_pow2  # noqa: E402

HEADS, DIM = 64, 128
ENTRY = 2.0**-10  # the per-entry bound of the kernel test, relative to the magnitude


def tf32(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to tf32 (10 stored mantissa bits, to nearest even), as float64."""
    bits = x.float().contiguous().view(torch.int32)
    bits = (bits + 0xFFF + ((bits >> 13) & 1)) & ~0x1FFF
    return bits.view(torch.float32).double()


def roundings() -> dict:
    """name -> (ReLU'd logits, weights) -> what the second MMA would see of each."""
    def bf16(x):
        return x.to(torch.bfloat16).double()

    def fp16_scaled(x):  # fp16 overflows past 65504; |y_q . y_k| <= 128 * 448^2 < 2^25, so scale by 2^-10 first
        return (x * 2.0**-10).to(torch.float16).double() * 2.0**10

    return {
        "bf16 logits (cvt.rn.relu.bf16x2), fp32 weights": lambda r, w: (bf16(r), w),
        "fp16 logits scaled by 2^-10, fp32 weights": lambda r, w: (fp16_scaled(r), w),
        "tf32 logits, fp32 weights": lambda r, w: (tf32(r), w),
        "tf32 logits, tf32 weights": lambda r, w: (tf32(r), tf32(w)),
        "tf32 logits, tf32 weights split hi + lo": lambda r, w: (tf32(r), tf32(w) + tf32(w - tf32(w))),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=256)
    parser.add_argument("--keys", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    g = torch.Generator().manual_seed(args.seed)
    for q_scale in (1.0, 4.0):  # the queries' spread against the keys'
        q = torch.randn(args.queries, HEADS, DIM, generator=g) * q_scale
        k = torch.randn(args.keys, DIM, generator=g)
        w = torch.randn(args.queries, HEADS, generator=g) * HEADS**-0.5 * DIM**-0.5
        q8, qs = act_quant_pow2(q, block_size=DIM)  # e4m3 values, power-of-two scales
        k8, ks = act_quant_pow2(k, block_size=DIM)
        s = torch.einsum("thd,sd->tsh", q8.double(), k8.double())  # [T, S, H] exact: e4m3 products are exact
        wq = w.double() * qs[..., 0].double()  # [T, H]: the weights times the query scales
        kscale = ks[:, 0].double()[None, :]  # [1, S]
        exact = (torch.relu(s) * wq[:, None, :]).sum(-1) * kscale  # [T, S]
        magnitude = (s.abs() * wq.abs()[:, None, :]).sum(-1) * kscale
        print(f"queries x {q_scale}: max |y_q . y_k| = {s.abs().max().item():.3g}")
        for name, rounding in roundings().items():
            r, wr = rounding(torch.relu(s), wq)
            got = (r * wr[:, None, :]).sum(-1) * kscale
            worst = ((got - exact).abs() / (ENTRY * magnitude)).max().item()
            rel = ((got - exact).norm() / exact.norm()).item()
            print(f"  {name:50s} worst error {worst:.3f} of the bound, relative L2 {rel:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
