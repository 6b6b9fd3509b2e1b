"""The kernel instances the GPU tests and benchmarks use, in one place.

TileLang specialises a kernel on its compile-time sizes (heads, widths, top-k, softmax scale), so
every distinct combination is a separate compilation (seconds each). Tests and benchmarks stick
to the combinations below, and `benchmarks/precompile_kernels.py` builds them all in parallel
before a GPU session.
"""

from ..config import deepseek_v32

SM_SCALE = deepseek_v32().mla.softmax_scale  # 192 ** -0.5 * mscale ** 2 = 0.13523...
DIM, DIM_V = 576, 512  # absorbed MLA: latent 512 + rope 64; values = the latent
INDEXER_DIM = 128
TEST_TOPK = 128  # tests pad any K <= 128 to this
BENCH_TOPK = 2048
TEST_HEADS = (16, 32, 64, 128)
INDEXER_HEADS = (16, 32, 64)


def kernel_set():
    """``(builder_name, args)`` pairs for every kernel the tests and benchmarks compile."""
    jobs = []
    for h in TEST_HEADS:
        jobs.append(("simple", (h, DIM, DIM_V, TEST_TOPK, SM_SCALE)))
        jobs.append(("backward", (h, DIM, DIM_V, TEST_TOPK, SM_SCALE)))
        if h % 64 == 0:
            jobs.append(("warp_specialized", (h, DIM, DIM_V, TEST_TOPK, SM_SCALE)))
    jobs.append(("simple", (128, DIM, DIM_V, BENCH_TOPK, SM_SCALE)))
    jobs.append(("warp_specialized", (128, DIM, DIM_V, BENCH_TOPK, SM_SCALE)))
    jobs.append(("backward", (128, DIM, DIM_V, BENCH_TOPK, SM_SCALE)))
    for h in INDEXER_HEADS:
        jobs.append(("indexer", (h, INDEXER_DIM, True)))
    return jobs


def build(name, args):
    """Compile one kernel of `kernel_set` (TileLang caches it on disk)."""
    from . import indexer_fwd, sparse_mla_bwd, sparse_mla_fwd

    builders = {
        "simple": sparse_mla_fwd.simple_kernel,
        "warp_specialized": sparse_mla_fwd.warp_specialized_kernel,
        "backward": sparse_mla_bwd.backward_kernel,
        "indexer": indexer_fwd.indexer_kernel,
    }
    return builders[name](*args)
