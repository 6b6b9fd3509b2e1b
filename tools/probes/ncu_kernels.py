"""Launch one dsa_ref kernel once (or a few times) on the benchmark's inputs, for Nsight Compute.

    ncu --clock-control none --nvtx --nvtx-include "probe/" --section ... \
        python tools/probes/ncu_kernels.py indexer_fp8 [--shape 4096x8192] [--kw '{"block_q": 4}']

Kernels: ``indexer`` (bf16 lightning indexer), ``indexer_fp8`` (on operands quantised beforehand),
``backward`` (sparse MLA backward, main kernel), ``forward`` (sparse MLA forward, default schedule),
``flashmla`` (FlashMLA's sparse prefill forward on the same inputs, loaded from ``--peers``).
The inputs are those of benchmarks/bench_kernels.py; nothing is timed here (ncu measures).
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from bench_kernels import D_I, H, H_I, shape_inputs  # noqa: E402
from dsa_ref.kernels.shapes import DIM, DIM_V, SM_SCALE  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", choices=["indexer", "indexer_fp8", "backward", "forward", "flashmla"])
    parser.add_argument("--shape", default="4096x8192")
    parser.add_argument("--kw", default="{}", help="schedule knobs as JSON")
    parser.add_argument("--launches", type=int, default=1)
    parser.add_argument("--peers", default=".gpu/peers", help="folder with flashmla/ (see benchmarks/bench_peers.py)")
    args = parser.parse_args()
    num_q, num_kv = (int(v) for v in args.shape.split("x"))
    kw = json.loads(args.kw)
    x = shape_inputs(num_q, num_kv)
    st, en = x["starts"].to(torch.int32).contiguous(), x["ends"].to(torch.int32).contiguous()
    torch.cuda.synchronize()
    with torch.no_grad():
        if args.kernel in ("indexer", "indexer_fp8"):
            w = x["iw"].float().contiguous()
            scores = torch.empty(num_q, num_kv, device="cuda")
            if args.kernel == "indexer":
                from dsa_ref.kernels.indexer_fwd import indexer_kernel
                kernel = indexer_kernel(H_I, D_I, True, **kw)
                run = lambda: kernel(x["iq"], x["ik"], w, st, en, scores)  # noqa: E731
            else:
                from dsa_ref.kernels.indexer_fwd_fp8 import indexer_fp8_kernel, quantize_indexer_operands
                q8, qs, k8, ks = quantize_indexer_operands(x["iq"], x["ik"])
                kernel = indexer_fp8_kernel(H_I, D_I, True, **kw)
                run = lambda: kernel(q8, qs, k8, ks, w, st, en, scores)  # noqa: E731
        elif args.kernel == "backward":
            from dsa_ref.kernels import sparse_mla_bwd as bwd
            from dsa_ref.kernels.autograd import _base2_lse, _block_counts, _pad_indices, sparse_mla_tilelang
            idx = _pad_indices(x["idx"], 128)
            out, lse = sparse_mla_tilelang(x["q"], x["kv"], idx, sm_scale=SM_SCALE, d_v=DIM_V)
            d_out = torch.randn_like(out)
            delta = (out.float() * d_out.float()).sum(-1).contiguous()
            lse2, counts = _base2_lse(lse), _block_counts(idx, bwd.BLOCK_S)
            kernel = bwd.backward_kernel(H, DIM, DIM_V, SM_SCALE, **kw)
            dkv = torch.zeros(x["kv"].shape, dtype=torch.float32, device="cuda")
            run = lambda: kernel(x["q"], x["kv"], d_out, idx, counts, lse2, delta, dkv)  # noqa: E731
        elif args.kernel == "flashmla":
            from bench_peers import load_family

            mod = load_family("flashmla", Path(args.peers), torch.device("cuda")).module("flashmla")
            kv, idx = x["kv"][:, None, :].contiguous(), x["idx"].to(torch.int32)[:, None, :].contiguous()  # -1 unused
            run = lambda: mod.sparse_prefill_fwd(x["q"], kv, idx, SM_SCALE, DIM_V, None, None)  # noqa: E731
        else:
            from dsa_ref.kernels.autograd import sparse_mla_tilelang
            run = lambda: sparse_mla_tilelang(x["q"], x["kv"], x["idx"], sm_scale=SM_SCALE, d_v=DIM_V, **kw)  # noqa: E731
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("probe")  # ncu --nvtx --nvtx-include "probe/" profiles these launches only
        for _ in range(args.launches):
            run()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    print(f"{args.kernel} {args.shape} {kw}: launched {args.launches}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
