"""Chapter 5: the optional TileLang fast path.

The kernels in this package compute exactly what the readable functions of chapters 2-3 compute
(same conventions: ``-1`` slots, natural-log LSE, ``out = 0`` / ``lse = -inf`` for empty rows), in bf16
on NVIDIA Hopper GPUs. They are reached only through `dsa_ref.dispatch`; every function here
returns ``None`` to decline inputs it does not support, and the reference runs instead.

Importing this package never fails: without tilelang or CUDA, `available` says why.
"""

import functools

import torch

__all__ = ["available", "sparse_mla", "lightning_indexer", "lightning_indexer_fp8", "topk_indices", "slot_ops",
           "chunk_selector"]


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


def lightning_indexer_fp8(q, k, weights, *, starts=None, ends=None, relu=True):
    """`dsa_ref.fp8.fp8_indexer_scores` (``hadamard=False``) on the fp8 TileLang kernel, or ``None`` for
    unsupported inputs. No gradient."""
    from .indexer_fwd_fp8 import indexer_fp8_supported, lightning_indexer_fp8_tilelang

    if indexer_fp8_supported(q, k, weights) is not None:
        return None
    return lightning_indexer_fp8_tilelang(q, k, weights, starts=starts, ends=ends, relu=relu)


def topk_indices(scores, topk):
    """`dsa_ref.topk_indices` on the TileLang radix-select kernel, or ``None`` for unsupported inputs."""
    from .topk import topk_indices_tilelang, topk_supported

    if topk_supported(scores, topk) is not None:
        return None
    return topk_indices_tilelang(scores, topk, sorted=True)


def slot_ops(q, kv, q_i, k_i, w_i, d_v=512, *, validate=True):
    """The kernels of `dsa_ref.slot_path` as a `SlotOps`, or ``None`` if one of them declines.

    ``validate=False``: the attention, the attention target and the index scores at the slots skip
    their checks that every slot is ``-1`` or in ``[0, S)`` (and the device sync each check costs),
    for slots in range by construction, such as the layer's own selection and window slots
    (`sparse_mla_tilelang`'s ``validate``).
    """
    from ..slot_path import SlotOps
    from .attention_target import attention_head_sum_supported, attention_head_sum_tilelang
    from .autograd import sparse_mla_supported, sparse_mla_tilelang
    from .indexer_bwd import index_scores_at_supported, index_scores_at_tilelang
    from .indexer_loss_slots import indexer_loss_on_slots_tilelang

    probe_idx = torch.zeros(q.shape[0], 1, dtype=torch.int32, device=q.device)  # shapes only
    probe_lse = torch.zeros(q.shape[:2], dtype=torch.float32, device=q.device)
    reasons = (sparse_mla_supported(q, kv, probe_idx, d_v),
               attention_head_sum_supported(q, kv, probe_idx, probe_lse),
               index_scores_at_supported(q_i, k_i, w_i, probe_idx))
    if any(r is not None for r in reasons):
        return None
    return SlotOps(sparse_mla=functools.partial(sparse_mla_tilelang, validate=validate),
                   attention_head_sum=functools.partial(attention_head_sum_tilelang, validate=validate),
                   index_scores_at=functools.partial(index_scores_at_tilelang, validate=validate),
                   indexer_loss_on_slots=indexer_loss_on_slots_tilelang)
# --8<-- [end:decline]


# --8<-- [start:chunk_selector]
def chunk_selector(q, k, weights, *, fp8=False):
    """The per-chunk selector of `dsa_ref.streaming.streamed_topk_indices` on the kernels, or ``None``.

    For a chunk of queries and a range of keys: the TileLang indexer writes the chunk's
    ``[C, n]`` scores and the radix-select kernel keeps the top-k of each row, in the reference
    order. ``None`` when the indexer kernel declines these operands. With ``fp8`` the scores
    come from the fp8 kernel (each chunk's queries and key range quantised by
    `dsa_ref.fp8.act_quant_block128`: one scale per vector, so chunking changes nothing).
    """
    from ..indexer import topk_indices as reference_topk
    from .autograd import indexer_supported, lightning_indexer_tilelang

    if fp8:
        from .indexer_fwd_fp8 import indexer_fp8_supported, lightning_indexer_fp8_tilelang

        supported, score = indexer_fp8_supported, lightning_indexer_fp8_tilelang
    else:
        supported, score = indexer_supported, lightning_indexer_tilelang
    if supported(q, k, weights) is not None:
        return None

    def select(q_c, k_c, w_c, topk, *, starts, ends, relu):
        with torch.no_grad():
            scores = score(q_c, k_c, w_c, starts=starts, ends=ends, relu=relu)  # [C, n]
            picked = topk_indices(scores, topk)  # [C, topk], the radix-select kernel
            return reference_topk(scores, topk) if picked is None else picked  # a declined shape

    return select
# --8<-- [end:chunk_selector]
