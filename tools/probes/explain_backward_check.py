"""Explain a failed elementwise check of a sparse-MLA backward: which gradient elements are over
their bound, and which term of the error model they stand against.

Rebuilds `bench_peers`' inputs for one shape (the same seeds), runs dsa_ref's public backward
(`sparse_mla_tilelang`, ``backward`` as given) per check block as `bench_peers` does (``d_out`` zero
outside the block), checks it with `dsa_ref.oracle.check_sparse_mla_backward`, and for every
``dkv`` / ``dq`` element over its bound prints: actual, expected (float64), the magnitude ``m``, the
bound's terms (``atol * rms``, ``rtol * m`` and the delta allowance), how many slots of the block
read the key row, and the delta terms (`dsa_ref.oracle.sparse_mla_backward_delta_terms`: what a
kernel's ``delta = rowsum(O * dO)`` from its bf16 output can move the element by, per ``lambda u``).
The 2026-12-07 run (`benchmarks/results/2026-12-07_h100_explain_backward_check_4096x32768.json`)
was made before the check had the delta allowance, with the sum ``sum_v |O dO|`` in its place.

    python tools/probes/explain_backward_check.py --shape 4096x32768:uniform --out explain.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_peers as bp  # noqa: E402

from dsa_ref import sparse_mla  # noqa: E402
from dsa_ref.oracle import (  # noqa: E402
    CONVENTIONS,
    check_sparse_mla_backward,
    delta_allowance_scale,
    sparse_mla_backward_delta_terms,
    sparse_mla_backward_magnitudes,
)


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
    result = {"block": [lo, hi], "ok": report.ok, "failures": [f for c in report.comparisons for f in c.failures],
              "worst_ratio": {c.name: c.worst_ratio for c in report.comparisons}}
    if report.ok:
        return result
    # the reference again, to name the elements over their bound
    q64, kv64, d64 = qb.double().requires_grad_(True), x.kv.double().requires_grad_(True), db.double()
    with torch.enable_grad():
        o64, _ = sparse_mla(q64, kv64, ib, sm_scale=x.sm_scale, d_v=x.dims.dim_v)  # [C, H, d_v]
        e_dq, e_dkv = torch.autograd.grad(o64, (q64, kv64), d64)
    m_dq, m_dkv = sparse_mla_backward_magnitudes(qb, x.kv, ib, db, sm_scale=x.sm_scale, d_v=x.dims.dim_v)
    t_dq, t_dkv = sparse_mla_backward_delta_terms(qb, x.kv, ib, db, sm_scale=x.sm_scale, d_v=x.dims.dim_v)
    valid = ib >= 0  # [C, K]
    reads = torch.zeros(x.kv.shape[0], dtype=torch.long, device=ib.device)
    reads.index_add_(0, ib[valid], torch.ones_like(ib[valid]))
    for c, name, a, e, m, md in ((report.comparisons[0], "dq", dq[lo:hi], e_dq, m_dq, t_dq),
                                 (report.comparisons[1], "dkv", dkv, e_dkv, m_dkv, t_dkv)):
        a64 = a.double()
        rms = float(e.square().mean().sqrt())
        atol_term = c.tol.atol * (rms if c.tol.atol_scaled else 1.0)
        allowance = delta_allowance_scale(a.dtype) * md
        bound = atol_term + c.tol.rtol * m + allowance
        over = ((a64 - e).abs() > bound).nonzero().tolist()
        rows = []
        for pos in over[:limit]:
            p = tuple(pos)
            rows.append({"at": list(p), "actual": float(a64[p]), "expected": float(e[p]), "err": float((a64 - e)[p].abs()),
                         "magnitude": float(m[p]), "atol_term": atol_term, "rtol_term": float(c.tol.rtol * m[p]),
                         "delta_terms": float(md[p]), "delta_allowance": float(allowance[p]),
                         "reads_of_key": int(reads[p[0]]) if name == "dkv" else None})
        result[name] = {"over": len(over), "rms": rms, "atol": c.tol.atol, "rtol": c.tol.rtol, "elements": rows,
                        "max_delta_terms_over_m": float((md / m.clamp_min(1e-300)).max())}
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
