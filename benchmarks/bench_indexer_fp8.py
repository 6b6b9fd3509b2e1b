"""The fp8 lightning indexer against the bf16 one on one GPU: speed, agreement, top-k overlap.

    python benchmarks/bench_indexer_fp8.py [--shapes 4096x8192,16384x16384] [--out FILE.json]
        [--variants "persistent=1:consumers=3:stages=4;consumers=3"] [--bf16-variants ...]

For each shape (the queries are the last ``num_q`` positions of one causal sequence of ``num_kv``
tokens, as in bench_kernels.py; indexer 64 heads x 128, random bf16 ``q`` and ``k``), with CUDA
events, median of ``--reps`` runs after warm-up, both per call (one call on an idle GPU, host
time included) and in GPU time (work queued ahead, see bench_kernels.cuda_time_ms):

* the bf16 kernel alone (`indexer_fwd.indexer_kernel`), in its default (``shapes.INDEXER_DEFAULT``,
  the wrapper's schedule) and its other schedules (``--bf16-variants``, by default
  ``shapes.INDEXER_BF16_RIVALS``), and its wrapper;
* the fp8 kernel alone (`indexer_fwd_fp8.indexer_fp8_kernel`) on operands quantised beforehand
  (DeepSeek quantises in the projections' epilogue), in its default (``shapes.INDEXER_FP8_DEFAULT``)
  and in the builder's own defaults and every schedule of ``shapes.INDEXER_FP8_SCHEDULES +
  INDEXER_FP8_TUNE`` (or ``--variants``); the speed-up is
  ``bf16 ms / fp8 ms``, against the bf16 default (``speedup_gpu``) and against the fastest bf16
  schedule of the run (``speedup_gpu_vs_best_bf16``, the honest one);
* the quantisation alone (`quantize_indexer_operands`: `dsa_ref.fp8.act_quant_pow2` of q and k,
  `act_quant_block128`'s bytes in three PyTorch passes) and the fp8 wrapper that includes it;
* agreement: the fp8 kernel against the float64 simulation on the same quantised operands
  (relative L2, on a sample of rows), and against the bf16 kernel;
* the top-k overlap: the share of the bf16 kernel's top-``--topk`` (radix-select kernel) that the
  fp8 kernel's top-k also selects, averaged over all rows.

TFLOP/s count the (query, key) pairs inside the causal windows, ``2 * pairs * 64 * 128``.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_kernels import D_I, H_I, cuda_time_ms, run_meta  # noqa: E402
from dsa_ref import key_windows, lightning_indexer  # noqa: E402
from dsa_ref.kernels.shapes import (  # noqa: E402
    BENCH_TOPK, INDEXER_BF16_RIVALS, INDEXER_DEFAULT, INDEXER_FP8_DEFAULT, INDEXER_FP8_SCHEDULES, INDEXER_FP8_TUNE)

SAMPLE_ROWS = 512  # rows of the float64 simulation check
SCHEDULE_KEYS = ("block_q", "merge", "pingpong", "block_n", "min_blocks", "consumers", "stages", "persistent")


def inputs(num_q: int, num_kv: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    query_index = torch.arange(num_kv - num_q, num_kv)
    starts, ends = key_windows(torch.tensor([0, num_kv]), query_index)
    q = torch.randn(num_q, H_I, D_I, device="cuda", generator=g).bfloat16()
    k = torch.randn(num_kv, D_I, device="cuda", generator=g).bfloat16()
    w = torch.randn(num_q, H_I, device="cuda", generator=g) * H_I**-0.5 * D_I**-0.5
    return q, k, w, starts.cuda().to(torch.int32), ends.cuda().to(torch.int32)


def overlap(a: torch.Tensor, b: torch.Tensor, num_keys: int) -> float:
    """``|a ∩ b| / |b|`` summed over rows (``-1`` slots ignored)."""
    def mask(idx):
        m = torch.zeros(idx.shape[0], num_keys + 1, dtype=torch.bool, device=idx.device)
        m.scatter_(1, torch.where(idx >= 0, idx, num_keys).long(), True)
        return m[:, :num_keys]

    ma, mb = mask(a), mask(b)
    return float((ma & mb).sum()) / max(float(mb.sum()), 1.0)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    finite = torch.isfinite(b)
    a, b = a[finite].double(), b[finite].double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def parse_variants(text: str) -> list[dict]:
    """``"persistent=1:consumers=3:stages=4;consumers=3"`` -> ``[{persistent: True, ...}, {consumers: 3}]``."""
    out = []
    for spec in filter(None, text.split(";")):
        kw = {}
        for item in spec.split(":"):
            key, value = item.split("=")
            kw[key] = bool(int(value)) if key in ("persistent", "pingpong") else int(value)
        out.append(kw)
    return out


def variant_name(prefix: str, kw: dict) -> str:
    """``bf16_kernel_consumers0``...; ``{}`` (the builder's own keyword defaults) is ``..._builder_default``."""
    return prefix + ("".join(f"_{a}{b}" for a, b in kw.items()) or "_builder_default")


def bench_shape(num_q: int, num_kv: int, *, reps: int, topk: int, variants: list[dict],
                bf16_variants: list[dict]) -> dict:
    from dsa_ref.fp8 import act_quant_block128, fp8_dequant
    from dsa_ref.kernels.autograd import lightning_indexer_tilelang
    from dsa_ref.kernels.indexer_fwd import indexer_kernel
    from dsa_ref.kernels.indexer_fwd_fp8 import (
        indexer_fp8_kernel, lightning_indexer_fp8_tilelang, quantize_indexer_operands)
    from dsa_ref.kernels.topk import topk_indices_tilelang

    q, k, w, st, en = inputs(num_q, num_kv)
    flop = 2 * int((en - st).sum()) * H_I * D_I
    row = {"num_q": num_q, "num_kv": num_kv, "heads": H_I, "dim": D_I, "topk": topk}

    def timed(name, fn, scores=True):
        for mode, queue_ahead in (("call", False), ("gpu", True)):
            ms = cuda_time_ms(fn, reps=reps, queue_ahead=queue_ahead)
            row[f"{name}_{mode}_ms"] = ms
            if scores:
                row[f"{name}_{mode}_tflops"] = flop / ms / 1e9
        rate = f" ({row[name + '_gpu_tflops']:.0f} TFLOP/s)" if scores else ""
        print(f"  {name:28s} per call {row[name + '_call_ms']:.3f} ms, GPU time {row[name + '_gpu_ms']:.3f} ms{rate}",
              flush=True)

    with torch.no_grad():
        scores_bf16 = torch.empty(num_q, num_kv, device="cuda")
        bf16 = indexer_kernel(H_I, D_I, True, **INDEXER_DEFAULT)
        wf = w.float().contiguous()
        timed("bf16_kernel", lambda: bf16(q, k, wf, st, en, scores_bf16))
        row["bf16_variants"] = [{**INDEXER_DEFAULT, "gpu_ms": row["bf16_kernel_gpu_ms"],
                                 "call_ms": row["bf16_kernel_call_ms"]}]
        for kw in bf16_variants:  # the bf16 kernel's faster schedules: the fp8 one is measured against the best
            name = variant_name("bf16_kernel", kw)
            kernel_b = indexer_kernel(H_I, D_I, True, **kw)
            timed(name, lambda: kernel_b(q, k, wf, st, en, scores_bf16))
            row["bf16_variants"].append({**kw, "gpu_ms": row[name + "_gpu_ms"], "call_ms": row[name + "_call_ms"]})
        row["bf16_best"] = min(row["bf16_variants"], key=lambda v: v["gpu_ms"])
        timed("bf16_wrapper", lambda: lightning_indexer_tilelang(q, k, w, starts=st, ends=en))

        q8, qs, k8, ks = quantize_indexer_operands(q, k)
        timed("fp8_quantize", lambda: quantize_indexer_operands(q, k), scores=False)
        # the readable quantiser it replaces (the same bytes, tests/test_fp8.py), for the record
        timed("fp8_quantize_readable", lambda: (act_quant_block128(q, emulate=False),
                                                act_quant_block128(k, emulate=False)), scores=False)
        timed("fp8_wrapper", lambda: lightning_indexer_fp8_tilelang(q, k, w, starts=st, ends=en))
        scores_fp8 = torch.empty(num_q, num_kv, device="cuda")
        row["fp8_variants"] = []
        for kw in variants:  # the first is the default, INDEXER_FP8_DEFAULT
            name = "fp8_kernel" if kw == INDEXER_FP8_DEFAULT else variant_name("fp8_kernel", kw)
            try:
                kernel = indexer_fp8_kernel(H_I, D_I, True, **kw)
            except Exception as err:  # noqa: BLE001 - a variant that does not compile is recorded
                row["fp8_variants"].append({**kw, "error": f"{type(err).__name__}: {str(err)[:300]}"})
                continue
            timed(name, lambda: kernel(q8, qs, k8, ks, wf, st, en, scores_fp8))
            variant = {**kw, "call_ms": row[name + "_call_ms"], "gpu_ms": row[name + "_gpu_ms"],
                       "speedup_call": row["bf16_kernel_call_ms"] / row[name + "_call_ms"],
                       "speedup_gpu": row["bf16_kernel_gpu_ms"] / row[name + "_gpu_ms"],
                       "speedup_gpu_vs_best_bf16": row["bf16_best"]["gpu_ms"] / row[name + "_gpu_ms"]}
            if kw != INDEXER_FP8_DEFAULT:  # every schedule computes the default's numbers (up to its accumulation order)
                ref = lightning_indexer_fp8_tilelang(q, k, w, starts=st, ends=en)
                variant["rel_l2_to_default"] = rel_l2(scores_fp8, ref)
            row["fp8_variants"].append(variant)
        best = min((v for v in row["fp8_variants"] if "gpu_ms" in v), key=lambda v: v["gpu_ms"])
        row["fp8_best"] = best
        row["speedup_default_gpu"] = row["bf16_kernel_gpu_ms"] / row["fp8_kernel_gpu_ms"]
        row["speedup_default_call"] = row["bf16_kernel_call_ms"] / row["fp8_kernel_call_ms"]
        row["speedup_wrapper_gpu"] = row["bf16_wrapper_gpu_ms"] / row["fp8_wrapper_gpu_ms"]

        # agreement: the default fp8 kernel against the float64 simulation, on a sample of rows
        bf16(q, k, wf, st, en, scores_bf16)
        scores_fp8 = lightning_indexer_fp8_tilelang(q, k, w, starts=st, ends=en)
        rows = torch.linspace(0, num_q - 1, min(SAMPLE_ROWS, num_q), device="cuda").long().unique()
        # dequantise, then take the rows (fp8 tensors are only converted, never indexed)
        qf, kf = fp8_dequant(q8, qs[..., None])[rows].double(), fp8_dequant(k8, ks[:, None]).double()
        sim = lightning_indexer(qf, kf, w[rows].double(), starts=st[rows], ends=en[rows])
        exact = lightning_indexer(q[rows].double(), k.double(), w[rows].double(), starts=st[rows], ends=en[rows])
        row["fp8_rel_l2_to_simulation"] = rel_l2(scores_fp8[rows], sim)
        row["fp8_rel_l2_to_exact"] = rel_l2(scores_fp8[rows], exact)
        row["bf16_rel_l2_to_exact"] = rel_l2(scores_bf16[rows], exact)
        del sim, exact, qf, kf

        sel_bf16 = topk_indices_tilelang(scores_bf16, topk, sorted=False)
        sel_fp8 = topk_indices_tilelang(scores_fp8, topk, sorted=False)
        row["topk_overlap_fp8_vs_bf16"] = overlap(sel_fp8, sel_bf16, num_kv)
    row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4096x8192,16384x16384", help="queries x keys, comma separated")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--topk", type=int, default=BENCH_TOPK)
    parser.add_argument("--default-only", action="store_true", help="time only the fp8 kernel's default schedule")
    parser.add_argument("--variants", default=None, help='fp8 schedules besides the default, "k=v:k=v;k=v"')
    parser.add_argument("--bf16-variants", default=None, help="bf16 schedules besides its default, same format")
    parser.add_argument("--out", default="bench_indexer_fp8.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_indexer_fp8 needs a CUDA GPU")
        return 1
    if args.variants is not None:
        others = parse_variants(args.variants)
    else:
        others = [] if args.default_only else [dict()] + INDEXER_FP8_SCHEDULES + INDEXER_FP8_TUNE
    variants = [INDEXER_FP8_DEFAULT] + [kw for kw in others if kw != INDEXER_FP8_DEFAULT]
    bf16_variants = parse_variants(args.bf16_variants) if args.bf16_variants is not None else INDEXER_BF16_RIVALS
    bf16_variants = [kw for kw in bf16_variants if kw != INDEXER_DEFAULT]
    results = []
    for spec in args.shapes.split(","):
        num_q, num_kv = (int(v) for v in spec.split("x"))
        print(f"# {num_q} queries x {num_kv} keys, indexer {H_I} x {D_I}", flush=True)
        row = bench_shape(num_q, num_kv, reps=args.reps, topk=args.topk, variants=variants,
                          bf16_variants=bf16_variants)
        results.append(row)
        best = row["fp8_best"]
        print(f"  speed-up fp8 / bf16 kernel: default {row['speedup_default_gpu']:.2f}x in GPU time "
              f"({row['speedup_default_call']:.2f}x per call); best schedule "
              f"{ {k: v for k, v in best.items() if k in SCHEDULE_KEYS} } "
              f"{best['speedup_gpu']:.2f}x, against the fastest bf16 schedule "
              f"{ {k: v for k, v in row['bf16_best'].items() if k in SCHEDULE_KEYS} } "
              f"{best['speedup_gpu_vs_best_bf16']:.2f}x; wrappers (quantisation included) "
              f"{row['speedup_wrapper_gpu']:.2f}x", flush=True)
        print(f"  fp8 vs simulation rel L2 {row['fp8_rel_l2_to_simulation']:.2e}; to exact: fp8 "
              f"{row['fp8_rel_l2_to_exact']:.2e}, bf16 {row['bf16_rel_l2_to_exact']:.2e}; top-{args.topk} overlap "
              f"fp8 vs bf16 {row['topk_overlap_fp8_vs_bf16']:.4f}", flush=True)
    with open(args.out, "w") as f:
        json.dump({"meta": run_meta(), "rows": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
