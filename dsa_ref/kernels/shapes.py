"""The kernel instances the GPU tests and benchmarks use, in one place.

TileLang specialises a kernel on its compile-time sizes (heads, widths, softmax scale; the numbers
of queries, keys and top-k slots are runtime sizes), so every distinct combination is a separate
compilation (seconds each). Tests and benchmarks stick
to the combinations below, and `benchmarks/precompile_kernels.py` builds them all in parallel
before a GPU session.
"""

from ..config import deepseek_v32

SM_SCALE = deepseek_v32().mla.softmax_scale  # 192 ** -0.5 * mscale ** 2 = 0.13523...
DIM, DIM_V = 576, 512  # absorbed MLA: latent 512 + rope 64; values = the latent
INDEXER_DIM = 128
TEST_TOPK = 128  # the tests' top-k (kernels take any K at run time)
BENCH_TOPK = 2048
TEST_HEADS = (16, 32, 64, 128)
INDEXER_HEADS = (16, 32, 64)


def _schedule(dkv_layout="rows", tma_reduce=False, prefetch=False, dkv_policy="Square", batch_waits=False, split=2,
              buffers=1) -> dict:
    return dict(dkv_layout=dkv_layout, tma_reduce=tma_reduce, prefetch=prefetch, dkv_policy=dkv_policy,
                batch_waits=batch_waits, split=split, buffers=buffers)


# The schedules of `sparse_mla_bwd.backward_kernel` (its knobs) that are tested on the GPU against
# the reference (tests/test_kernels_sparse_mla.py) and timed against each other
# (benchmarks/tune_kernels.py), at H = 128. The first one is the plain schedule (warp MMAs for
# dKV, 4-float atomics, synchronous gathers); the last one is the kernel's default.
BACKWARD_SCHEDULES = [
    _schedule(),
    _schedule(dkv_layout="channels"),
    _schedule(prefetch=True),
    _schedule(tma_reduce=True),
    _schedule(dkv_layout="channels", tma_reduce=True),
    _schedule(tma_reduce=True, prefetch=True),
    _schedule(dkv_layout="channels", tma_reduce=True, prefetch=True),
    _schedule(dkv_layout="channels", tma_reduce=True, prefetch=True, dkv_policy="FullRow"),
    _schedule(dkv_layout="channels", tma_reduce=True, prefetch=True, dkv_policy="FullRow", batch_waits=True),
    _schedule(dkv_layout="channels", tma_reduce=True, prefetch=True, dkv_policy="FullRow", split=4, buffers=2),
    _schedule(dkv_layout="channels", tma_reduce=True, prefetch=True, dkv_policy="FullRow", batch_waits=True, split=4,
              buffers=2),
]

# The other schedules of the indexer (`indexer_fwd.indexer_kernel`, knobs besides its defaults),
# tested against the reference and timed against the default the same way: the single-warpgroup
# kernel (``consumers=0``) with two queries per GEMM, one (with and without the ping-pong of two
# accumulators), four queries per block, or four blocks per SM; the warp-specialised kernel
# (`indexer_fwd_ws`, the builder's own default) with one, two or three consumers; the persistent kernel.
INDEXER_SCHEDULES = [dict(consumers=1), dict(consumers=0), dict(consumers=0, merge=1, pingpong=True), dict(consumers=0, merge=1),
                     dict(consumers=0, block_q=4, pingpong=True), dict(consumers=0, min_blocks=4),
                     dict(consumers=2), dict(consumers=3), dict(persistent=True, consumers=3, stages=2),
                     dict(persistent=True, consumers=2, stages=3, pingpong=True)]

# The fp8 indexer's (`indexer_fwd_fp8.indexer_fp8_kernel`, the same knobs) tested schedules besides its
# default; with fp8 operands the queries of a block take half the shared memory, so more of them fit.
# `INDEXER_FP8_TUNE` adds what benchmarks/bench_indexer_fp8.py and tune_kernels.py time besides.
INDEXER_FP8_SCHEDULES = [dict(merge=1, pingpong=True), dict(block_q=4), dict(block_q=4, pingpong=True),
                         dict(min_blocks=0), dict(consumers=1), dict(consumers=2), dict(consumers=3),
                         dict(persistent=True, consumers=3, stages=4),
                         dict(persistent=True, consumers=2, stages=4, pingpong=True)]
INDEXER_FP8_TUNE = [dict(min_blocks=5), dict(consumers=1, stages=3), dict(consumers=1, stages=4),
                    dict(consumers=3, stages=3), dict(persistent=True, consumers=3, stages=2),
                    dict(persistent=True, consumers=3, stages=3), dict(persistent=True, consumers=2, stages=4),
                    dict(persistent=True, consumers=4, stages=4), dict(persistent=True, consumers=4, stages=3),
                    dict(persistent=True, consumers=2, stages=3, pingpong=True)]
INDEXER_TUNE = [dict(stages=3), dict(stages=4),  # the default (one consumer) with more key tiles in flight
                dict(persistent=True, consumers=3, stages=3), dict(persistent=True, consumers=2, stages=3),
                dict(persistent=True, consumers=4, stages=2), dict(persistent=True, consumers=2, stages=4, pingpong=True)]
# The schedules the wrappers run (`autograd.lightning_indexer_tilelang`,
# `indexer_fwd_fp8.fp8_indexer_scores_tilelang`), and the benchmarks' "default": the persistent
# kernel (`indexer_fwd_persistent`), the fastest measured (docs, chapter 5). The builders' own keyword
# defaults stay those of the earlier kernels: the warp-specialised one (bf16) and one warpgroup (fp8).
INDEXER_DEFAULT = dict(persistent=True, consumers=2, stages=4, pingpong=True)
INDEXER_FP8_DEFAULT = dict(persistent=True, consumers=2, stages=4, pingpong=True)
# The bf16 schedules benchmarks/bench_indexer_fp8.py times besides the bf16 default, so that the fp8
# kernel's speed-up is also stated against the fastest bf16 kernel of the run.
INDEXER_BF16_RIVALS = [dict(), dict(persistent=True, consumers=2, stages=3, pingpong=True),
                       dict(persistent=True, consumers=3, stages=2)]
# The persistent schedules (`indexer_fwd_persistent`) the tests also run at 16 and 32 heads.
PERSISTENT_BF16 = dict(persistent=True, consumers=3, stages=2)
PERSISTENT_FP8 = dict(persistent=True, consumers=3, stages=4)
PERSISTENT_FP8_PINGPONG = dict(persistent=True, consumers=2, stages=4, pingpong=True)  # = INDEXER_FP8_DEFAULT


# The fused KL kernel's (`indexer_loss_slots.slot_kl_kernel`) tile and thread count besides its default
# (2048 slots, 256 threads), timed against it by benchmarks/bench_slot_kl.py.
SLOT_KL_SCHEDULES = [dict(block=1024, threads=256), dict(block=2048, threads=512), dict(block=1024, threads=128)]


def kernel_set():
    """``(builder_name, args[, kwargs])`` for every kernel the tests and benchmarks compile."""
    jobs = []
    for h in TEST_HEADS:
        jobs.append(("simple", (h, DIM, DIM_V, SM_SCALE)))
        jobs.append(("backward", (h, DIM, DIM_V, SM_SCALE)))
        jobs.append(("delta", (h, DIM_V)))
        if h % 64 == 0:
            jobs.append(("warp_specialized", (h, DIM, DIM_V, SM_SCALE)))
            jobs += [("staggered", (h, DIM, DIM_V, SM_SCALE, dtype)) for dtype in ("int32", "int64")]
    jobs += [("backward", (128, DIM, DIM_V, SM_SCALE), kw) for kw in BACKWARD_SCHEDULES]
    jobs += [("indexer", (64, INDEXER_DIM, True), kw) for kw in INDEXER_SCHEDULES]
    for h in INDEXER_HEADS:
        jobs.append(("indexer", (h, INDEXER_DIM, True), INDEXER_DEFAULT))
        jobs.append(("scores_at", (h, INDEXER_DIM, True)))
        jobs.append(("scores_at_backward", (h, INDEXER_DIM, True)))
    for h in INDEXER_HEADS:
        jobs.append(("indexer_fp8", (h, INDEXER_DIM, True), INDEXER_FP8_DEFAULT))
    jobs.append(("indexer", (64, INDEXER_DIM, True)))  # the builders' own defaults
    jobs.append(("indexer_fp8", (64, INDEXER_DIM, True)))
    jobs.append(("indexer", (64, INDEXER_DIM, False), INDEXER_DEFAULT))  # the wrappers' relu=False
    jobs.append(("indexer_fp8", (64, INDEXER_DIM, False)))
    jobs.append(("indexer_fp8", (64, INDEXER_DIM, False), INDEXER_FP8_DEFAULT))  # the wrappers' relu=False
    jobs += [("indexer_fp8", (64, INDEXER_DIM, True), kw) for kw in INDEXER_FP8_SCHEDULES]
    jobs += [(name, (h, INDEXER_DIM, True), dict(consumers=2)) for h in (16, 32) for name in ("indexer", "indexer_fp8")]
    jobs += [(name, (h, INDEXER_DIM, True), kw) for h in (16, 32)
             for name, kw in (("indexer", PERSISTENT_BF16), ("indexer_fp8", PERSISTENT_FP8),
                              ("indexer_fp8", PERSISTENT_FP8_PINGPONG))]
    jobs.append(("scores_at", (64, INDEXER_DIM, False)))
    jobs.append(("scores_at_backward", (64, INDEXER_DIM, False)))
    jobs.append(("scores_at", (16, 64, True)))
    jobs.append(("scores_at_backward", (16, 64, True)))
    jobs.append(("topk", ()))
    for h in TEST_HEADS:
        jobs.append(("head_sum", (h, DIM, SM_SCALE)))
    jobs.append(("slot_kl", ()))
    jobs += [("slot_kl", (), kw) for kw in SLOT_KL_SCHEDULES]
    return jobs


def build(name, args, kwargs=None):
    """Compile one kernel of `kernel_set` (TileLang caches it on disk)."""
    from . import (attention_target, indexer_bwd, indexer_fwd, indexer_fwd_fp8, indexer_loss_slots, sparse_mla_bwd,
                   sparse_mla_fwd, topk)

    builders = {
        "simple": sparse_mla_fwd.simple_kernel,
        "warp_specialized": sparse_mla_fwd.warp_specialized_kernel,
        "staggered": sparse_mla_fwd.staggered_kernel,
        "backward": sparse_mla_bwd.backward_kernel,
        "delta": sparse_mla_bwd.delta_kernel,
        "indexer": indexer_fwd.indexer_kernel,
        "indexer_fp8": indexer_fwd_fp8.indexer_fp8_kernel,
        "scores_at": indexer_bwd.selected_scores_kernel,
        "scores_at_backward": indexer_bwd.indexer_backward_kernel,
        "topk": topk.topk_kernel,
        "head_sum": attention_target.head_sum_probs_kernel,
        "slot_kl": indexer_loss_slots.slot_kl_kernel,
    }
    return builders[name](*args, **(kwargs or {}))
