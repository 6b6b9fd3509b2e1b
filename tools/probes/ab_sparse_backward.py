"""A/B of the sparse MLA backward's schedules (knobs of `sparse_mla_bwd.backward_kernel`), rounds alternating.

    python tools/probes/ab_sparse_backward.py --schedules "split=4,buffers=2;split=8,buffers=2" --rounds 4

Every schedule runs in one process on the same inputs (bench_kernels' causal top-2048 at each shape),
the kernel alone on the wrapper's prepared operands (int32 indices padded to 128 slots, the zero row
appended, base-2 LSE, ``Delta``, the block counts), in GPU time (work queued ahead, median of 20; the
``dKV`` buffer is zeroed inside each timed call, as the wrapper does), in rounds that alternate the
schedules, so clock drift hits all of them alike. ``default`` is the kernel's own default. Each row
records every round's time, the TFLOP/s of the best round, each schedule's speed against the
default in each round, and whether its ``dQ`` equals the default's bit for bit (it should: only
``dKV``'s atomic additions may differ in order) and its ``dKV``'s largest difference.
"""
import argparse
import ast
import json
import os
import sys

import torch

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path[:0] = [os.path.join(ROOT, "benchmarks"), ROOT]

from bench_kernels import BENCH_TOPK, H, cuda_time_ms, run_meta, shape_inputs  # noqa: E402
from dsa_ref.kernels.shapes import DIM, DIM_V, SM_SCALE  # noqa: E402


def parse_schedules(text: str) -> dict[str, dict]:
    """``"split=4,buffers=2;batch_waits=True,dkv_policy=Square"`` ->
    ``{"default": {}, "split=4,buffers=2": {"split": 4, "buffers": 2}, ...}`` (Python literals; other
    values stay strings)."""
    def value(text):
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return text

    out = {"default": {}}
    for item in filter(None, (s.strip() for s in text.split(";"))):
        out[item] = {key: value(v) for key, v in (pair.split("=", 1) for pair in item.split(","))}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", default="split=4,buffers=2", help="';'-separated knob lists")
    parser.add_argument("--shapes", default="4096x8192")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="ab_sparse_backward.json")
    args = parser.parse_args()

    from dsa_ref.kernels import sparse_mla_bwd as bwd
    from dsa_ref.kernels.autograd import _base2_lse, _block_counts, _pad_indices, sparse_mla_tilelang, with_zero_row

    schedules = parse_schedules(args.schedules)
    kernels = {name: bwd.backward_kernel(H, DIM, DIM_V, SM_SCALE, **kw) for name, kw in schedules.items()}
    out = {"meta": run_meta(queue_ahead=True), "topk": BENCH_TOPK, "schedules": schedules, "rows": []}
    for shape in args.shapes.split(","):
        num_q, num_kv = (int(v) for v in shape.split("x"))
        x = shape_inputs(num_q, num_kv)
        q, kv, indices = x["q"], x["kv"], x["idx"]
        with torch.no_grad():
            o, lse = sparse_mla_tilelang(q, kv, indices, sm_scale=SM_SCALE, d_v=DIM_V, validate=False)
        d_out = torch.randn_like(o)
        delta = (o.float() * d_out.float()).sum(-1).contiguous()  # [T, H]
        lse2 = _base2_lse(lse)
        kv0 = with_zero_row(kv)  # [S + 1, D]
        idx = _pad_indices(indices, 128)  # [T, K'] int32
        counts = _block_counts(idx, bwd.BLOCK_S)
        flop = 2 * int((indices >= 0).sum()) * H * (3 * DIM + 2 * DIM_V)
        dkvs = {name: torch.zeros(kv0.shape, dtype=torch.float32, device="cuda") for name in kernels}

        def runner(name):
            kernel, dkv = kernels[name], dkvs[name]

            def run():
                dkv.zero_()
                return kernel(q, kv0, d_out, idx, counts, lse2, delta, dkv)
            return run

        runs = {name: runner(name) for name in kernels}
        times = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, fn in runs.items():
                times[name].append(cuda_time_ms(fn, reps=20, queue_ahead=True))
        results = {name: (fn(), dkvs[name].clone()) for name, fn in runs.items()}
        ref_dq, ref_dkv = results["default"]
        row = {"shape": shape}
        for name, t in times.items():
            dq, dkv = results[name]
            row[name] = {
                "gpu_ms": t,
                "tflops": flop / min(t) / 1e9,
                "vs_default_by_round": [d / s for d, s in zip(times["default"], t)],
                "dq_same_as_default": bool(torch.equal(dq, ref_dq)),
                "dkv_max_abs_diff": float((dkv - ref_dkv).abs().max()),
            }
        print(json.dumps(row), flush=True)
        out["rows"].append(row)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
