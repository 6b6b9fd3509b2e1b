"""Chapter 5: the optional TileLang fast path.

The kernels in this package compute exactly what the readable functions of chapters 2-3 compute
(same conventions: ``-1`` slots, natural-log LSE, ``out = 0`` / ``lse = -inf`` for empty rows), in bf16
on NVIDIA Hopper GPUs. They are reached only through `dsa_ref.dispatch`; every function here
returns ``None`` to decline inputs it does not support, and the reference runs instead.

Importing this package never fails: without tilelang or CUDA, `available` says why.
"""

import functools

import torch

__all__ = ["available", "sparse_mla", "lightning_indexer"]


@functools.lru_cache(maxsize=None)
def _probe() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return False, f"the kernels are built for Hopper (sm_90), this GPU is sm_{major}{minor}"
    try:
        import tilelang  # noqa: F401
    except Exception as err:  # ImportError, or a broken install
        return False, f"tilelang cannot be imported: {err}"
    return True, "ok"


def available() -> tuple[bool, str]:
    """``(True, "ok")`` when the TileLang kernels can run here, else ``(False, reason)``."""
    return _probe()


# --8<-- [start:decline]
def sparse_mla(q, kv, indices, *, sm_scale, d_v=512):
    """`dsa_ref.sparse_mla` on the TileLang kernels, or ``None`` for unsupported inputs."""
    from .autograd import sparse_mla_supported, sparse_mla_tilelang

    if sparse_mla_supported(q, kv, indices, d_v) is not None:
        return None
    return sparse_mla_tilelang(q, kv, indices, sm_scale=sm_scale, d_v=d_v)


def lightning_indexer(q, k, weights, *, starts=None, ends=None, relu=True):
    """`dsa_ref.lightning_indexer` on the TileLang kernel, or ``None`` for unsupported inputs."""
    from .autograd import indexer_supported, lightning_indexer_tilelang

    if indexer_supported(q, k, weights) is not None:
        return None
    return lightning_indexer_tilelang(q, k, weights, starts=starts, ends=ends, relu=relu)
# --8<-- [end:decline]
