"""The two-pass sparse MLA backward against the one-pass kernel, in one process, rounds alternating.

    python tools/probes/ab_two_pass_backward.py --rounds 3 --out two_pass.json

1. Pass A and pass B (`dsa_ref.kernels.sparse_mla_bwd_two_pass`) against the float64 reference at
   H = 128 (messy indices, duplicates, an empty row).
2. At each shape (bench_kernels' causal top-2048), on the wrapper's prepared operands: the one-pass
   kernel, pass A alone, pass B alone, A + B on whole-size ``P`` / ``dS`` buffers,
   `two_pass_backward` as the autograd wrapper calls it (chunks of 1 GiB of buffers, block counts
   included), the same in one chunk, the whole backward through `sparse_mla_tilelang` with each
   ``backward`` and the variants in ``A_VARIANTS`` / ``B_VARIANTS``; GPU time (work queued ahead, median of
   20) in rounds that alternate them; TFLOP/s counted on the backward's FLOPs; ``dQ`` and ``dKV``
   against the one-pass kernel's; the fastest pass A with the fastest pass B.
"""
import argparse
import functools
import json
import os
import sys

import torch

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path[:0] = [os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "tests"), ROOT]

from bench_kernels import H, cuda_time_ms, run_meta, shape_inputs  # noqa: E402
from dsa_ref import sparse_mla  # noqa: E402
from dsa_ref.kernels.autograd import _base2_lse, _block_counts, _pad_indices, sparse_mla_tilelang, with_zero_row  # noqa: E402
from dsa_ref.kernels import sparse_mla_bwd as bwd  # noqa: E402
from dsa_ref.kernels.shapes import DIM, DIM_V, SM_SCALE, TEST_TOPK  # noqa: E402

from dsa_ref.kernels import sparse_mla_bwd_two_pass as tp  # noqa: E402


A_VARIANTS = {"one_wait_per_product": dict(batch_waits=False)}  # pass A's default: policy "Square", batched waits
# (2026-12-07_h100_ab_two_pass_pass_a_batch_waits.json: batched 12.95 against 13.27 ms at 4096x8192)
B_VARIANTS = {}  # the default: 3 parts of 192 channels, 64 rows staged at once (2026-12-07_h100_ab_two_pass_backward*.json
# measured parts=2/rows=8, rows=32, parts=6 and overlap=True; none won)


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def two_pass(q, kv0, d_out, idx, lse2, delta, heads):
    """(dq, dkv [S + 1, D] fp32) from the two passes; ``kv0`` has the zero row, ``idx`` int32 padded to 64."""
    T_, K = idx.shape
    P = torch.empty(T_, heads, K, dtype=torch.bfloat16, device=q.device)
    dS = torch.empty_like(P)
    dq = torch.empty_like(q)
    tp.dq_kernel(heads, DIM, DIM_V, SM_SCALE)(q, kv0, d_out, idx, _block_counts(idx, tp.BLOCK_S), lse2, delta,
                                              P, dS, dq)
    dkv = torch.zeros(kv0.shape, dtype=torch.float32, device=q.device)
    tp.dkv_kernel(heads, DIM, DIM_V)(q, d_out, P, dS, idx, _block_counts(idx, tp.BLOCK_B), dkv)
    return dq, dkv


def check_reference():
    from gpu_helpers import messy_indices

    T_, S = 97, 260
    g = torch.Generator(device="cpu").manual_seed(31)
    q = torch.randn(T_, H, DIM, generator=g).to("cuda", torch.bfloat16)
    kv = torch.randn(S, DIM, generator=g).to("cuda", torch.bfloat16)
    idx = messy_indices(T_, S, TEST_TOPK, seed=4)
    idx[:, 3:9] = 11
    idx[5] = -1
    d_out = torch.randn(T_, H, DIM_V, generator=g).to("cuda", torch.bfloat16)
    qr, kvr = q.double().requires_grad_(True), kv.double().requires_grad_(True)
    ref_out, ref_lse = sparse_mla(qr, kvr, idx, sm_scale=SM_SCALE, d_v=DIM_V)
    (ref_out * d_out.double()).sum().backward()
    idx32 = _pad_indices(idx, 64)
    delta = (ref_out.to(torch.bfloat16).float() * d_out.float()).sum(-1).contiguous()
    lse2 = _base2_lse(ref_lse).float().contiguous()
    dq, dkv = two_pass(q, with_zero_row(kv), d_out, idx32, lse2, delta, H)
    res = {"dq_rel_l2": rel_l2(dq, qr.grad), "dkv_rel_l2": rel_l2(dkv[:-1], kvr.grad),
           "finite": bool(torch.isfinite(dq).all() and torch.isfinite(dkv[:-1]).all()),
           "empty_row_zero": bool((dq[5] == 0).all())}
    res["ok"] = res["finite"] and res["empty_row_zero"] and res["dq_rel_l2"] < 1.5e-2 and res["dkv_rel_l2"] < 1.5e-2
    return res


def time_shape(num_q, num_kv, rounds):
    x = shape_inputs(num_q, num_kv)
    q, kv, indices = x["q"], x["kv"], x["idx"]
    with torch.no_grad():
        o, lse = sparse_mla_tilelang(q, kv, indices, sm_scale=SM_SCALE, d_v=DIM_V, validate=False)
    d_out = torch.randn_like(o)
    delta = (o.float() * d_out.float()).sum(-1).contiguous()
    lse2 = _base2_lse(lse)
    kv0 = with_zero_row(kv)
    idx = _pad_indices(indices, 128)
    flop = 2 * int((indices >= 0).sum()) * H * (3 * DIM + 2 * DIM_V)
    one = bwd.backward_kernel(H, DIM, DIM_V, SM_SCALE)
    counts32 = _block_counts(idx, 32)
    counts64 = _block_counts(idx, 64)
    dkv1 = torch.zeros(kv0.shape, dtype=torch.float32, device="cuda")
    P = torch.empty(num_q, H, idx.shape[1], dtype=torch.bfloat16, device="cuda")
    dS = torch.empty_like(P)
    dkv2 = torch.zeros_like(dkv1)
    ka, kb = tp.dq_kernel(H, DIM, DIM_V, SM_SCALE), tp.dkv_kernel(H, DIM, DIM_V)
    extra_a = {f"pass_a_{name}": tp.dq_kernel(H, DIM, DIM_V, SM_SCALE, **kw) for name, kw in A_VARIANTS.items()}
    extra_b = {f"pass_b_{name}": tp.dkv_kernel(H, DIM, DIM_V, **kw) for name, kw in B_VARIANTS.items()}

    def run_one():
        dkv1.zero_()
        return one(q, kv0, d_out, idx, counts32, lse2, delta, dkv1)

    dq_buf = torch.empty_like(q)

    def run_a():
        ka(q, kv0, d_out, idx, counts32, lse2, delta, P, dS, dq_buf)
        return dq_buf

    def run_package(buffer_bytes=tp.BUFFER_BYTES):  # as the wrapper runs it, block counts included
        return tp.two_pass_backward(q, kv0, d_out, idx, lse2, delta, sm_scale=SM_SCALE, d_v=DIM_V,
                                    buffer_bytes=buffer_bytes)[0]

    # the whole backward through the public call (delta kernel, zero row, block counts, dkv cast included)
    qg, kvg = q.detach().requires_grad_(True), kv.detach().requires_grad_(True)
    public = {mode: sparse_mla_tilelang(qg, kvg, indices, sm_scale=SM_SCALE, d_v=DIM_V, validate=False,
                                        backward=mode)[0] for mode in ("one_pass", "two_pass")}

    def run_public(mode):
        qg.grad = kvg.grad = None
        torch.autograd.backward(public[mode], d_out, retain_graph=True)

    def run_b():
        dkv2.zero_()
        kb(q, d_out, P, dS, idx, counts64, dkv2)

    def run_ab():
        dq = run_a()
        run_b()
        return dq

    runs = {"one_pass": run_one, "pass_a": run_a, "pass_b": run_b, "two_pass": run_ab,
            "two_pass_backward": run_package,
            "two_pass_backward_one_chunk": functools.partial(run_package, buffer_bytes=1 << 34),
            "public_one_pass": functools.partial(run_public, "one_pass"),
            "public_two_pass": functools.partial(run_public, "two_pass")}

    def variant_a(k):
        k(q, kv0, d_out, idx, counts32, lse2, delta, P, dS, dq_buf)
        return dq_buf

    for name, k in extra_a.items():
        runs[name] = functools.partial(variant_a, k)

    def variant_b(k):
        dkv2.zero_()
        k(q, d_out, P, dS, idx, counts64, dkv2)

    for name, k in extra_b.items():
        runs[name] = functools.partial(variant_b, k)
    times = {k: [] for k in runs}
    for _ in range(rounds):
        for k, fn in runs.items():
            times[k].append(cuda_time_ms(fn, reps=20, queue_ahead=True))
    dq1 = run_one().clone()
    dq2 = run_ab().clone()
    row = {"shape": f"{num_q}x{num_kv}", "flop": flop}
    for k, t in times.items():
        row[k] = {"gpu_ms": t, "tflops_of_backward": flop / min(t) / 1e9}
    row["dq_equal"] = bool(torch.equal(dq1, dq2))
    row["dq_rel_l2"] = rel_l2(dq2, dq1)
    row["dkv_rel_l2"] = rel_l2(dkv2, dkv1)
    dq3, dkv3 = tp.two_pass_backward(q, kv0, d_out, idx, lse2, delta, sm_scale=SM_SCALE, d_v=DIM_V)
    row["two_pass_backward"]["dq_equal"] = bool(torch.equal(dq3, dq2))
    row["two_pass_backward"]["dkv_rel_l2"] = rel_l2(dkv3, dkv1)
    for name in extra_a:
        row[name]["dq_equal"] = bool(torch.equal(runs[name](), dq2))
    for name in extra_b:
        runs[name]()
        row[name]["dkv_rel_l2"] = rel_l2(dkv2, dkv1)
    run_public("one_pass")
    g1 = (qg.grad.clone(), kvg.grad.clone())
    run_public("two_pass")
    row["public_two_pass"]["dq_rel_l2"] = rel_l2(qg.grad, g1[0])
    row["public_two_pass"]["dkv_rel_l2"] = rel_l2(kvg.grad, g1[1])
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    row["public_two_pass"]["vs_one_pass"] = med["public_one_pass"] / med["public_two_pass"]
    del dq3, dkv3, g1
    best_a = min([k for k in med if k.startswith("pass_a")], key=med.get)
    best_b = min([k for k in med if k.startswith("pass_b")], key=med.get)
    row["best_pair"] = {"a": best_a, "b": best_b, "gpu_ms_sum_of_medians": med[best_a] + med[best_b],
                        "vs_one_pass": med["one_pass"] / (med[best_a] + med[best_b])}
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="two_pass.json")
    parser.add_argument("--shapes", default="4096x8192")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    out = {"meta": {**run_meta(), "timing": "GPU time: work queued ahead, median of 20 (bench_kernels.cuda_time_ms)"},
           "reference": check_reference(), "rows": []}
    print(json.dumps(out["reference"]), flush=True)
    for shape in args.shapes.split(","):
        row = time_shape(*(int(v) for v in shape.split("x")), args.rounds)
        print(json.dumps(row), flush=True)
        out["rows"].append(row)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
