"""Benchmark the TileLang kernels against the readable reference on one GPU.

    python benchmarks/bench_kernels.py [--quick] [--out results.json]

For each shape (DeepSeek-V3.2 attention: H = 128 heads, latent 576 / value 512, top-k 2048,
indexer 64 x 128) it times, with CUDA events (median of many runs after warm-up):

* sparse MLA forward (warp-specialised and simple schedules) and backward; the warp-specialised
  forward also without the index-range check (``validate=False``) and as its kernel alone, on
  prepared int32 indices and block counts, so that the wrapper's share is in the record;
* the indexer scores; the fp8 indexer (with its quantisation, and its kernel alone on quantised
  operands against the bf16 kernel alone: ``indexer_fp8_kernel_speedup``);
* top-k over the indexer scores: the radix-select kernel (set only, and in the reference order),
  the reference (stable sort, canonical ties) and ``torch.topk`` (sorted and unsorted);
* the slot path's kernels (chapter 5): the head-summed attention mass at the selected slots and
  the index scores at the slots, forward and backward;
* the readable reference of each, in the same run, for the ratio.

TFLOP/s count every top-k slot (``-1`` slots included), as the kernels process them all:
forward ``2 T H K (576 + 512)``, backward ``2 T H K (3 * 576 + 2 * 512)``; the indexer counts the
(query, key) pairs inside the windows, ``2 * pairs * 64 * 128``. Inputs are random (not zeros).
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dsa_ref import key_windows, lightning_indexer, sparse_mla, topk_indices  # noqa: E402
from dsa_ref.kernels.shapes import BENCH_TOPK, DIM, DIM_V, SM_SCALE  # noqa: E402

H, H_I, D_I = 128, 64, 128


def _queue_ahead_from_env() -> bool:
    return os.environ.get("DSA_REF_BENCH_QUEUE_AHEAD") == "1"


def run_meta(queue_ahead: bool | None = None) -> dict:
    """Date, GPU, versions and timing mode of this run, for the ``meta`` of a results JSON.

    ``queue_ahead``: how the run times its calls (``cuda_time_ms``'s argument); ``None`` takes the
    mode ``DSA_REF_BENCH_QUEUE_AHEAD`` selects, as the benchmarks do."""
    if queue_ahead is None:
        queue_ahead = _queue_ahead_from_env()
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "timing": "GPU time, work queued ahead" if queue_ahead else "one call on an idle GPU, host overhead included",
    }
    try:
        import tilelang

        meta["tilelang"] = tilelang.__version__
    except Exception:  # pragma: no cover
        meta["tilelang"] = "unavailable"
    return meta


def cuda_time_ms(fn, *, warmup=3, reps=20, before_each=None, queue_ahead=None) -> float:
    """Median time of ``fn()`` in ms, measured with CUDA events.

    ``before_each`` runs untimed before every timed call (the CP benchmark puts a barrier there).
    By default the events bracket one call on an idle GPU, so the time includes the host's Python
    and launch overhead whenever the GPU has to wait for it. With ``queue_ahead`` (or
    ``DSA_REF_BENCH_QUEUE_AHEAD=1``) the GPU first spins for about 5 ms (``torch.cuda._sleep``),
    the host queues all of ``fn``'s work meanwhile, and the events measure the GPU's time alone.
    """
    if queue_ahead is None:
        queue_ahead = _queue_ahead_from_env()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if before_each is not None:
            before_each()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if queue_ahead:
            torch.cuda._sleep(10_000_000)  # GPU clock cycles, about 5 ms
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def shape_inputs(num_q: int, num_kv: int, seed: int = 0):
    """Queries are the last ``num_q`` positions of one causal sequence of ``num_kv`` tokens."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(num_q, H, DIM, device="cuda", generator=g).bfloat16()
    kv = torch.randn(num_kv, DIM, device="cuda", generator=g).bfloat16()
    query_index = torch.arange(num_kv - num_q, num_kv)
    starts, ends = key_windows(torch.tensor([0, num_kv]), query_index)
    starts, ends = starts.cuda(), ends.cuda()
    # random selection inside each causal window: top-k of random scores
    scores = torch.rand(num_q, num_kv, device="cuda", generator=g)
    key = torch.arange(num_kv, device="cuda")
    scores = scores.masked_fill(key[None] >= ends[:, None], float("-inf"))
    vals, idx = torch.topk(scores, BENCH_TOPK, dim=1)
    idx = torch.where(torch.isfinite(vals), idx, torch.full_like(idx, -1))
    iq = torch.randn(num_q, H_I, D_I, device="cuda", generator=g).bfloat16()
    ik = torch.randn(num_kv, D_I, device="cuda", generator=g).bfloat16()
    iw = torch.randn(num_q, H_I, device="cuda", generator=g) * H_I**-0.5 * D_I**-0.5
    return dict(q=q, kv=kv, idx=idx, starts=starts, ends=ends, iq=iq, ik=ik, iw=iw)


def bench_shape(num_q: int, num_kv: int, *, reps: int, ref_reps: int) -> dict:
    from dsa_ref.kernels.autograd import lightning_indexer_tilelang, sparse_mla_tilelang

    x = shape_inputs(num_q, num_kv)
    q, kv, idx = x["q"], x["kv"], x["idx"]
    fwd_flop = 2 * num_q * H * BENCH_TOPK * (DIM + DIM_V)
    bwd_flop = 2 * num_q * H * BENCH_TOPK * (3 * DIM + 2 * DIM_V)
    pairs = int((x["ends"] - x["starts"]).sum())
    idx_flop = 2 * pairs * H_I * D_I
    row = {"num_q": num_q, "num_kv": num_kv, "heads": H, "topk": BENCH_TOPK}

    def timed(name, fn, flop, n):
        ms = cuda_time_ms(fn, reps=n)
        row[name + "_ms"] = ms
        if flop:
            row[name + "_tflops"] = flop / ms / 1e9
        return ms

    with torch.no_grad():
        timed("fwd_ws", lambda: sparse_mla_tilelang(q, kv, idx, sm_scale=SM_SCALE, d_v=DIM_V,
                                                     schedule="warp_specialized"), fwd_flop, reps)
        # the same call without the index-range check (indices from topk_indices), and the kernel
        # alone on prepared int32 indices and block counts: what the wrapper's steps cost
        timed("fwd_ws_unchecked", lambda: sparse_mla_tilelang(q, kv, idx, sm_scale=SM_SCALE, d_v=DIM_V,
                                                               schedule="warp_specialized", validate=False),
              fwd_flop, reps)
        from dsa_ref.kernels import sparse_mla_fwd
        from dsa_ref.kernels.autograd import _block_counts, _pad_indices

        ws_kernel = sparse_mla_fwd.warp_specialized_kernel(H, DIM, DIM_V, SM_SCALE)
        idx_ws = _pad_indices(idx, 2 * sparse_mla_fwd.BLOCK_I)  # [T, K] int32
        pairs_ws = _block_counts(idx_ws, 2 * sparse_mla_fwd.BLOCK_I)  # [T]
        timed("fwd_ws_kernel", lambda: ws_kernel(q, kv, idx_ws, pairs_ws), fwd_flop, reps)
        timed("fwd_simple", lambda: sparse_mla_tilelang(q, kv, idx, sm_scale=SM_SCALE, d_v=DIM_V,
                                                         schedule="simple"), fwd_flop, reps)
        timed("fwd_reference", lambda: sparse_mla(q, kv, idx, sm_scale=SM_SCALE, d_v=DIM_V), fwd_flop, ref_reps)

    # backward only: the forward graph is kept and differentiated repeatedly
    d_out = torch.randn(num_q, H, DIM_V, device="cuda").bfloat16()
    qg, kvg = q.clone().requires_grad_(True), kv.clone().requires_grad_(True)
    out, _ = sparse_mla_tilelang(qg, kvg, idx, sm_scale=SM_SCALE, d_v=DIM_V)
    timed("bwd", lambda: torch.autograd.grad(out, (qg, kvg), d_out, retain_graph=True), bwd_flop, reps)
    del out
    torch.cuda.empty_cache()
    out_ref, _ = sparse_mla(qg, kvg, idx, sm_scale=SM_SCALE, d_v=DIM_V)
    timed("bwd_reference", lambda: torch.autograd.grad(out_ref, (qg, kvg), d_out, retain_graph=True),
          bwd_flop, ref_reps)
    del out_ref
    torch.cuda.empty_cache()

    with torch.no_grad():
        iq, ik, iw, st, en = x["iq"], x["ik"], x["iw"], x["starts"], x["ends"]
        timed("indexer", lambda: lightning_indexer_tilelang(iq, ik, iw, starts=st, ends=en), idx_flop, reps)
        timed("indexer_reference", lambda: lightning_indexer(iq, ik, iw, starts=st, ends=en), idx_flop, ref_reps)
        # the fp8 indexer (benchmarks/bench_indexer_fp8.py has its schedules, accuracy and top-k overlap):
        # the wrapper (quantisation included) and the kernel alone on operands quantised beforehand
        from dsa_ref.kernels.indexer_fwd import indexer_kernel
        from dsa_ref.kernels.shapes import INDEXER_DEFAULT, INDEXER_FP8_DEFAULT
        from dsa_ref.kernels.indexer_fwd_fp8 import (
            indexer_fp8_kernel, lightning_indexer_fp8_tilelang, quantize_indexer_operands)

        timed("indexer_fp8", lambda: lightning_indexer_fp8_tilelang(iq, ik, iw, starts=st, ends=en), idx_flop, reps)
        q8, qs, k8, ks = quantize_indexer_operands(iq, ik)
        st32, en32, iwf = st.to(torch.int32), en.to(torch.int32), iw.float().contiguous()
        idx_out = torch.empty(num_q, num_kv, device="cuda")
        bf16_kernel = indexer_kernel(H_I, D_I, True, **INDEXER_DEFAULT)  # the wrappers' schedules
        fp8_kernel = indexer_fp8_kernel(H_I, D_I, True, **INDEXER_FP8_DEFAULT)
        bf16_ms = timed("indexer_kernel", lambda: bf16_kernel(iq, ik, iwf, st32, en32, idx_out), idx_flop, reps)
        fp8_ms = timed("indexer_fp8_kernel", lambda: fp8_kernel(q8, qs, k8, ks, iwf, st32, en32, idx_out), idx_flop, reps)
        row["indexer_fp8_kernel_speedup"] = bf16_ms / fp8_ms
        del idx_out, q8, k8
        scores = lightning_indexer_tilelang(iq, ik, iw, starts=st, ends=en)
        timed("topk_reference", lambda: topk_indices(scores, BENCH_TOPK), 0, ref_reps)
        timed("torch_topk", lambda: torch.topk(scores, BENCH_TOPK, dim=1), 0, reps)
        timed("torch_topk_unsorted", lambda: torch.topk(scores, BENCH_TOPK, dim=1, sorted=False), 0, reps)
        from dsa_ref.kernels.topk import topk_indices_tilelang

        timed("topk_kernel", lambda: topk_indices_tilelang(scores, BENCH_TOPK, sorted=False), 0, reps)
        timed("topk_kernel_sorted", lambda: topk_indices_tilelang(scores, BENCH_TOPK, sorted=True), 0, reps)
        sel = topk_indices(scores, BENCH_TOPK)
        row["topk_kernel_exact"] = bool(torch.equal(topk_indices_tilelang(scores, BENCH_TOPK), sel))

    # the slot path's kernels: the attention mass for the KL target, the index scores at the slots
    from dsa_ref.kernels.attention_target import attention_head_sum_tilelang
    from dsa_ref.kernels.indexer_bwd import index_scores_at_tilelang

    slot_flop = 2 * num_q * BENCH_TOPK * H_I * D_I
    with torch.no_grad():
        _, lse = sparse_mla_tilelang(q, kv, idx, sm_scale=SM_SCALE, d_v=DIM_V)
        timed("head_sum", lambda: attention_head_sum_tilelang(q, kv, idx, lse, sm_scale=SM_SCALE),
              2 * num_q * H * BENCH_TOPK * DIM, reps)
        timed("scores_at", lambda: index_scores_at_tilelang(iq, ik, iw, idx), slot_flop, reps)
    iqg, ikg, iwg = (t.clone().requires_grad_(True) for t in (iq, ik, iw))
    s_at = index_scores_at_tilelang(iqg, ikg, iwg, idx)
    d_s = torch.randn_like(s_at).masked_fill(idx < 0, 0)
    timed("scores_at_bwd", lambda: torch.autograd.grad(s_at, (iqg, ikg, iwg), d_s, retain_graph=True),
          3 * slot_flop, reps)
    del s_at
    row["indexer_roofline_ms"] = idx_flop / 790e12 * 1e3  # measured bf16 matmul peak on this H200
    row["fwd_roofline_ms"] = fwd_flop / 790e12 * 1e3
    row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    return row


def bench_layer(num_tokens: int, *, reps: int) -> dict:
    """One DSAttention training step (forward + backward), both stages, reference vs TileLang.

    DeepSeek-V3.2's layer (``deepseek_v32()``: hidden 7168, 128 heads, indexer 64 x 128, top-k
    2048) in bf16 on one causal sequence of ``num_tokens`` tokens.
    """
    from dsa_ref import DSAttention, deepseek_v32

    cfg = deepseek_v32()
    torch.manual_seed(0)
    row = {"tokens": num_tokens}
    layer = DSAttention(cfg, backend="reference", device="cuda", dtype=torch.bfloat16)
    x = torch.randn(num_tokens, cfg.mla.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for stage in ("dense_warmup", "sparse"):
        for backend in ("reference", "tilelang"):
            layer.backend = backend

            def step():
                res = layer(x, stage=stage)
                res.output.float().square().mean().backward()

            torch.cuda.reset_peak_memory_stats()
            row[f"{stage}_{backend}_ms"] = cuda_time_ms(step, warmup=1, reps=reps)
            row[f"{stage}_{backend}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            with torch.no_grad():
                row[f"{stage}_{backend}_loss"] = float(layer(x, stage=stage).indexer_loss)  # same on both paths
        row[f"{stage}_speedup"] = row[f"{stage}_reference_ms"] / row[f"{stage}_tilelang_ms"]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--out", default="bench_kernels.json")
    parser.add_argument("--shapes", default="4096x4096,8192x8192,16384x16384,4096x8192")
    parser.add_argument("--layer-tokens", default="4096", help="comma list; empty to skip the layer step")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_kernels needs a CUDA GPU")
        return 1
    reps, ref_reps = (10, 2) if args.quick else (30, 3)
    rows = []
    meta = run_meta()
    for spec in args.shapes.split(","):
        num_q, num_kv = (int(v) for v in spec.split("x"))
        row = bench_shape(num_q, num_kv, reps=reps, ref_reps=ref_reps)
        rows.append(row)
        print(json.dumps(row), flush=True)
    layers = []
    for n in filter(None, args.layer_tokens.split(",")):
        layers.append(bench_layer(int(n), reps=3 if args.quick else 5))
        print(json.dumps(layers[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows, "layers": layers}, f, indent=1)
    print(markdown_table(meta, rows))
    return 0


def markdown_table(meta: dict, rows: list[dict]) -> str:
    lines = [f"{meta['date']}, {meta['gpu']}, torch {meta['torch']}, CUDA {meta['cuda']}, tilelang {meta['tilelang']}",
             "",
             "| queries x keys | fwd WS ms (TFLOP/s) | unchecked, kernel alone ms | fwd simple ms (TFLOP/s) | "
             "fwd ref ms | bwd ms (TFLOP/s) | "
             "bwd ref ms | indexer ms (TFLOP/s, roofline ms) | indexer ref ms | top-k ref ms | torch.topk ms "
             "(unsorted) | top-k kernel ms (sorted) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['num_q']} x {r['num_kv']} | {r['fwd_ws_ms']:.2f} ({r['fwd_ws_tflops']:.0f}) | "
            f"{r['fwd_ws_unchecked_ms']:.2f}, {r['fwd_ws_kernel_ms']:.2f} | "
            f"{r['fwd_simple_ms']:.2f} ({r['fwd_simple_tflops']:.0f}) | {r['fwd_reference_ms']:.1f} | "
            f"{r['bwd_ms']:.2f} ({r['bwd_tflops']:.0f}) | {r['bwd_reference_ms']:.1f} | "
            f"{r['indexer_ms']:.3f} ({r['indexer_tflops']:.0f}, {r['indexer_roofline_ms']:.3f}) | "
            f"{r['indexer_reference_ms']:.2f} | {r['topk_reference_ms']:.2f} | {r['torch_topk_ms']:.2f} "
            f"({r['torch_topk_unsorted_ms']:.2f}) | {r['topk_kernel_ms']:.2f} ({r['topk_kernel_sorted_ms']:.2f}) |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
