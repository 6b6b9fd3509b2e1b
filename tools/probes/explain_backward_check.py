"""Explain a failed elementwise check of a sparse-MLA backward: which gradient elements are over
their bound, and which term of the error model they stand against.

Rebuilds `bench_peers`' inputs for one shape (the same seeds), runs dsa_ref's public backward
(`sparse_mla_tilelang`, ``backward`` as given) per check block as `bench_peers` does (``d_out`` zero
outside the block), checks it with `dsa_ref.oracle.check_sparse_mla_backward`, and for every
``dkv`` / ``dq`` element over its bound prints: actual, expected (float64), the magnitude ``m``, the
bound's two terms (``atol * rms`` and ``rtol * m``), how many slots of the block read the key row,
and ``m_delta``: the sum over those reads of ``sigma * P * |q| * sum_v |O dO|``, the size of the
error a kernel makes through ``delta = rowsum(O * dO)`` computed from its bf16 output ``O`` (the
one term of `dsa_ref.oracle.accumulation_rtol` that is not relative to ``m``).

    python tools/probes/explain_backward_check.py --shape 4096x32768:uniform --out explain.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
spec = importlib.util.spec_from_file_location("bench_peers", ROOT / "benchmarks" / "bench_peers.py")
bp = importlib.util.module_from_spec(spec)
sys.modules["bench_peers"] = bp
spec.loader.exec_module(bp)

from dsa_ref import sparse_mla  # noqa: E402
from dsa_ref.oracle import CONVENTIONS, check_sparse_mla_backward, sparse_mla_backward_magnitudes  # noqa: E402


def explain_block(x, lo: int, hi: int, backward: str, limit: int = 8) -> dict:
    from dsa_ref.kernels.autograd import sparse_mla_tilelang

    q, kv = x.q.detach().requires_grad_(True), x.kv.detach().requires_grad_(True)
    out, _ = sparse_mla_tilelang(q, kv, x.idx, sm_scale=x.sm_scale, d_v=x.dims.dim_v, validate=False,
                                 backward=backward)
    d = x.only_rows(x.d_out, lo, hi)  # [T, H, d_v]
    dq, dkv = torch.autograd.grad(out, (q, kv), d)
    qb, ib, db = x.q[lo:hi], x.idx[lo:hi], d[lo:hi]  # [C, H, D], [C, K], [C, H, d_v]
    report = check_sparse_mla_backward(dq[lo:hi], dkv, db, qb, x.kv, ib, convention=CONVENTIONS["dsa_ref"],
                                       sm_scale=x.sm_scale, d_v=x.dims.dim_v, q_start=lo)
    result = {"block": [lo, hi], "ok": report.ok, "failures": [f for c in report.comparisons for f in c.failures]}
    if report.ok:
        return result
    # the reference again, to name the elements over their bound
    q64, kv64, d64 = qb.double().requires_grad_(True), x.kv.double().requires_grad_(True), db.double()
    with torch.enable_grad():
        o64, _ = sparse_mla(q64, kv64, ib, sm_scale=x.sm_scale, d_v=x.dims.dim_v)  # [C, H, d_v]
        e_dq, e_dkv = torch.autograd.grad(o64, (q64, kv64), d64)
    m_dq, m_dkv = sparse_mla_backward_magnitudes(qb, x.kv, ib, db, sm_scale=x.sm_scale, d_v=x.dims.dim_v)
    o_bf16 = o64.detach().to(torch.bfloat16).double()  # [C, H, d_v]: what a kernel's delta reads
    abs_delta = (o_bf16.abs() * d64.abs()).sum(-1)  # [C, H]
    valid = ib >= 0  # [C, K]
    kv_sel = torch.where(valid[..., None], x.kv.double()[ib.clamp_min(0)], 0.0)  # [C, K, D]
    scores = torch.einsum("thd,tkd->thk", qb.double(), kv_sel) * x.sm_scale  # [C, H, K]
    P = torch.softmax(scores.masked_fill(~valid[:, None, :], float("-inf")), dim=-1).nan_to_num(0.0)  # [C, H, K]
    w = P * abs_delta[..., None] * x.sm_scale  # [C, H, K]
    m_delta_dkv = torch.zeros_like(m_dkv)  # [N, D]
    m_delta_dkv.index_add_(0, ib[valid], torch.einsum("thk,thd->tkd", w, qb.double().abs())[valid])
    m_delta_dq = torch.einsum("thk,tkd->thd", w, kv_sel.abs())  # [C, H, D]
    reads = torch.zeros(x.kv.shape[0], dtype=torch.long, device=ib.device)
    reads.index_add_(0, ib[valid], torch.ones_like(ib[valid]))
    for c, name, a, e, m, md in ((report.comparisons[0], "dq", dq[lo:hi], e_dq, m_dq, m_delta_dq),
                                 (report.comparisons[1], "dkv", dkv, e_dkv, m_dkv, m_delta_dkv)):
        a64 = a.double()
        rms = float(e.square().mean().sqrt())
        atol_term = c.tol.atol * (rms if c.tol.atol_scaled else 1.0)
        bound = atol_term + c.tol.rtol * m
        over = ((a64 - e).abs() > bound).nonzero().tolist()
        rows = []
        for pos in over[:limit]:
            p = tuple(pos)
            rows.append({"at": list(p), "actual": float(a64[p]), "expected": float(e[p]), "err": float((a64 - e)[p].abs()),
                         "magnitude": float(m[p]), "atol_term": atol_term, "rtol_term": float(c.tol.rtol * m[p]),
                         "m_delta": float(md[p]), "u_bf16_times_m_delta": float(md[p]) * 2.0 ** -8,
                         "reads_of_key": int(reads[p[0]]) if name == "dkv" else None})
        result[name] = {"over": len(over), "rms": rms, "atol": c.tol.atol, "rtol": c.tol.rtol, "elements": rows,
                        "max_m_delta_over_m": float((md / m.clamp_min(1e-300)).max())}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="4096x32768:uniform")
    parser.add_argument("--backward", default="auto")
    parser.add_argument("--out", default="explain_backward_check.json")
    args = parser.parse_args()
    (shape,) = bp.parse_shapes(args.shape)
    x = bp.Inputs(shape, device="cuda")
    results = [explain_block(x, lo, hi, args.backward) for lo, hi in x.check_blocks]
    Path(args.out).write_text(json.dumps({"shape": shape.name, "backward": args.backward, "blocks": results}, indent=1))
    for r in results:
        print(json.dumps(r)[:3000])


if __name__ == "__main__":
    main()
