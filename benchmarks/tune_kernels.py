"""Time the tuning variants of the TileLang kernels against each other on one GPU.

    python benchmarks/tune_kernels.py [--shapes 4096x8192,4096x4096] [--out tune.json]

Each kernel builder takes a few schedule knobs; this script times every variant listed in
`VARIANTS` on the same random inputs (CUDA events, median of 20 runs after warm-up), checks that
every variant computes the same result as the default one, and prints a table. The defaults in
the kernel files are the winners of the last run (see docs/benchmarks.md).
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_kernels import H_I, D_I, cuda_time_ms, run_meta, shape_inputs  # noqa: E402
from dsa_ref.kernels.shapes import (  # noqa: E402
    BACKWARD_SCHEDULES, DIM, DIM_V, INDEXER_FP8_SCHEDULES, INDEXER_FP8_TUNE, INDEXER_SCHEDULES, INDEXER_TUNE,
    SM_SCALE)


H = 128
# keyword arguments of every variant, on top of the kernel's defaults; the first one of each kernel
# (the defaults) is the one the others are checked against
VARIANTS = {
    # the default first, then every tested schedule (shapes.*_SCHEDULES)
    "indexer": [dict()] + INDEXER_SCHEDULES + INDEXER_TUNE,
    "indexer_fp8": [dict()] + INDEXER_FP8_SCHEDULES + INDEXER_FP8_TUNE,  # on prepared e4m3 operands
    "forward": [dict(), dict(schedule="staggered")],  # the warp-specialised kernel, then FlashMLA's scheme
    "backward": [dict()] + BACKWARD_SCHEDULES,
    "topk": [dict(), dict(threads=512), dict(threads=1024)],
}


def variant_builds():
    """``(name, args, kwargs)`` of every variant, for precompiling."""
    jobs = []
    for kw in VARIANTS["indexer"]:
        jobs.append(("indexer", (H_I, D_I, True), kw))
    for kw in VARIANTS["indexer_fp8"]:
        jobs.append(("indexer_fp8", (H_I, D_I, True), kw))
    for kw in VARIANTS["forward"]:
        kw = dict(kw)
        jobs.append((kw.pop("schedule", "warp_specialized"), (H, DIM, DIM_V, SM_SCALE), kw))
    for kw in VARIANTS["backward"]:
        jobs.append(("backward", (H, DIM, DIM_V, SM_SCALE), kw))
    for kw in VARIANTS["topk"]:
        jobs.append(("topk", (), kw))
    return jobs


class Rows(list):
    """The result rows; each one is printed as it comes, so a crash keeps what was measured."""

    def append(self, row):
        super().append(row)
        print(json.dumps(row), flush=True)


def _build_or_none(builder, args, kw, rows, name):
    """Compile one variant; a variant TileLang cannot compile is recorded as such, not fatal."""
    try:
        return builder(*args, **kw)
    except Exception as err:  # noqa: BLE001 - any compiler error just disqualifies the variant
        rows.append({"kernel": name, **kw, "error": f"{type(err).__name__}: {str(err)[:300]}"})
        return None


def tune_indexer(x, reps):
    from dsa_ref.kernels.indexer_fwd import indexer_kernel

    q, k, w = x["iq"], x["ik"], x["iw"].float().contiguous()
    st, en = x["starts"].to(torch.int32).contiguous(), x["ends"].to(torch.int32).contiguous()
    pairs = int((en - st).sum())
    flop = 2 * pairs * H_I * D_I
    rows, first = Rows(), None
    for kw in VARIANTS["indexer"]:
        kernel = _build_or_none(indexer_kernel, (H_I, D_I, True), kw, rows, "indexer")
        if kernel is None:
            continue
        scores = torch.full((q.shape[0], k.shape[0]), float("nan"), device="cuda")  # all overwritten
        ms = cuda_time_ms(lambda: kernel(q, k, w, st, en, scores), reps=reps)
        if first is None:
            first = scores.clone()
        same = not bool(torch.isnan(scores).any()) and bool(torch.equal(torch.isinf(scores), torch.isinf(first))) and float(
            (scores - first).nan_to_num().abs().max()) < 1e-3 * float(first[torch.isfinite(first)].abs().max())
        rows.append({"kernel": "indexer", **kw, "ms": ms, "tflops": flop / ms / 1e9, "matches_first": same})
    return rows


def tune_indexer_fp8(x, reps):
    """The fp8 indexer's schedules on the benchmark's indexer inputs, quantised once beforehand."""
    from dsa_ref.kernels.indexer_fwd_fp8 import indexer_fp8_kernel, quantize_indexer_operands

    q8, qs, k8, ks = quantize_indexer_operands(x["iq"], x["ik"])
    w = x["iw"].float().contiguous()
    st, en = x["starts"].to(torch.int32).contiguous(), x["ends"].to(torch.int32).contiguous()
    flop = 2 * int((en - st).sum()) * H_I * D_I
    rows, first = Rows(), None
    for kw in VARIANTS["indexer_fp8"]:
        kernel = _build_or_none(indexer_fp8_kernel, (H_I, D_I, True), kw, rows, "indexer_fp8")
        if kernel is None:
            continue
        scores = torch.full((q8.shape[0], k8.shape[0]), float("nan"), device="cuda")  # all overwritten
        ms = cuda_time_ms(lambda: kernel(q8, qs, k8, ks, w, st, en, scores), reps=reps)
        if first is None:
            first = scores.clone()
        same = not bool(torch.isnan(scores).any()) and bool(torch.equal(torch.isinf(scores), torch.isinf(first))) and float(
            (scores - first).nan_to_num().abs().max()) < 1e-3 * float(first[torch.isfinite(first)].abs().max())
        rows.append({"kernel": "indexer_fp8", **kw, "ms": ms, "tflops": flop / ms / 1e9, "matches_first": same})
    return rows


def tune_forward(x, reps):
    from dsa_ref.kernels import sparse_mla_fwd as fwd
    from dsa_ref.kernels.autograd import _block_counts, _pad_indices, with_zero_row

    q, kv = x["q"], x["kv"]
    kv_zero = with_zero_row(kv)  # [S + 1, D]
    idx = _pad_indices(x["idx"], 2 * fwd.BLOCK_I)
    counts = _block_counts(idx, 2 * fwd.BLOCK_I)  # pairs of 64-slot blocks
    flop = 2 * q.shape[0] * H * x["idx"].shape[1] * (DIM + DIM_V)
    rows, first = Rows(), None
    for kw in VARIANTS["forward"]:
        build = fwd.staggered_kernel if kw.get("schedule") == "staggered" else fwd.warp_specialized_kernel
        kernel = _build_or_none(build, (H, DIM, DIM_V, SM_SCALE), {k: v for k, v in kw.items() if k != "schedule"},
                                rows, "forward")
        if kernel is None:
            continue
        # the staggered kernel counts its pairs itself and zero-fills -1 slots; the warp-specialised one
        # reads the zero row the wrapper appends (`with_zero_row`) for them
        args = (q, kv, idx) if kw.get("schedule") == "staggered" else (q, kv_zero, idx, counts)
        ms = cuda_time_ms(lambda: kernel(*args), reps=reps)
        out, lse = kernel(*args)
        if first is None:
            first = (out.float(), lse)
        same = all(float((a - b).norm() / b.norm()) < 1e-2 for a, b in zip((out.float(), lse), first))
        rows.append({"kernel": "forward", **kw, "ms": ms, "tflops": flop / ms / 1e9, "matches_first": same})
    return rows


def tune_backward(x, reps):
    from dsa_ref.kernels import sparse_mla_bwd as bwd
    from dsa_ref.kernels.autograd import _base2_lse, _block_counts, _pad_indices, sparse_mla_tilelang

    q, kv = x["q"], x["kv"]
    idx = _pad_indices(x["idx"], 128)
    with torch.no_grad():
        out, lse = sparse_mla_tilelang(q, kv, idx, sm_scale=SM_SCALE, d_v=DIM_V)
    d_out = torch.randn_like(out)
    delta = (out.float() * d_out.float()).sum(-1).contiguous()
    lse2 = _base2_lse(lse)
    counts = _block_counts(idx, bwd.BLOCK_S)
    flop = 2 * q.shape[0] * H * x["idx"].shape[1] * (3 * DIM + 2 * DIM_V)
    rows, first = Rows(), None
    for kw in VARIANTS["backward"]:
        kernel = _build_or_none(bwd.backward_kernel, (H, DIM, DIM_V, SM_SCALE), kw, rows, "backward")
        if kernel is None:
            continue
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device="cuda")

        def run():
            dkv.zero_()
            return kernel(q, kv, d_out, idx, counts, lse2, delta, dkv)

        ms = cuda_time_ms(run, reps=reps)
        dq = run()
        if first is None:
            first = (dq.float(), dkv.clone())
        same = all(float((a - b).norm() / b.norm()) < 1e-2 for a, b in zip((dq.float(), dkv), first))
        rows.append({"kernel": "backward", **kw, "ms": ms, "tflops": flop / ms / 1e9, "matches_first": same})
    return rows


def tune_topk(x, reps):
    """The radix select alone (set output, no NaN check) on the benchmark's indexer scores."""
    from dsa_ref.kernels.autograd import lightning_indexer_tilelang
    from dsa_ref.kernels.topk import topk_kernel
    from dsa_ref.kernels.shapes import BENCH_TOPK

    scores = lightning_indexer_tilelang(x["iq"], x["ik"], x["iw"], starts=x["starts"], ends=x["ends"])
    rows, first = Rows(), None
    for kw in VARIANTS["topk"]:
        kernel = _build_or_none(topk_kernel, (), kw, rows, "topk")
        if kernel is None:
            continue
        out = torch.empty(scores.shape[0], BENCH_TOPK, dtype=torch.int64, device="cuda")
        ms = cuda_time_ms(lambda: kernel(scores, out), reps=reps)
        if first is None:
            first = out.clone()
        rows.append({"kernel": "topk", **kw, "ms": ms, "matches_first": bool(torch.equal(out, first))})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4096x8192,4096x4096")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default="tune_kernels.json")
    parser.add_argument("--kernels", default="indexer,indexer_fp8,forward,backward,topk",
                        help="which of VARIANTS to time")
    parser.add_argument("--skip-knob", action="append", default=[],
                        help="leave out every variant that sets this knob (e.g. one whose tests failed)")
    args = parser.parse_args()
    for name in VARIANTS:
        VARIANTS[name] = [kw for kw in VARIANTS[name] if not set(kw) & set(args.skip_knob)]
    if not torch.cuda.is_available():
        print("tune_kernels needs a CUDA GPU")
        return 1
    results = []
    for spec in args.shapes.split(","):
        num_q, num_kv = (int(v) for v in spec.split("x"))
        x = shape_inputs(num_q, num_kv)
        tuners = {"indexer": tune_indexer, "indexer_fp8": tune_indexer_fp8, "forward": tune_forward,
                  "backward": tune_backward, "topk": tune_topk}
        print(f"# {num_q} queries x {num_kv} keys", flush=True)
        for name in args.kernels.split(","):
            results += [dict(row, num_q=num_q, num_kv=num_kv) for row in tuners[name](x, args.reps)]
    meta = run_meta()
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
