"""Autograd wrappers around the TileLang kernels, with the readable API's semantics.

Each wrapper converts at the boundary (indices padded with ``-1`` to the kernel's block size, int32
except for the staggered forward, which reads int64 ones as they are; ``[S, D]`` contiguous latent
rows; base-2 vs natural LSE) and checks shapes the kernels support; ``*_supported`` returns ``None``
when a call is fine and a reason string when it is not.
"""

import functools
import math

import torch

from ..sparse_attention import check_index_range, check_index_shape, index_bounds

LOG2E = 1.4426950408889634


# --8<-- [start:pad_indices]
def _pad_indices(indices: torch.Tensor, multiple: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """``dtype`` ``[T, K']`` with ``K'`` the next multiple of ``multiple``, padded with -1 (unused slots).

    No copy when ``indices`` is contiguous, of ``dtype`` and ``K`` a multiple already."""
    K = indices.shape[1]
    padded = math.ceil(K / multiple) * multiple
    indices = indices.to(dtype)  # no copy when it has that dtype already
    if padded == K:
        return indices.contiguous()
    return torch.nn.functional.pad(indices, (0, padded - K), value=-1)  # [T, K'], contiguous
# --8<-- [end:pad_indices]


# --8<-- [start:block_counts]
def _block_counts(indices: torch.Tensor, block: int) -> torch.Tensor:
    """int32 ``[T]``: how many ``block``-slot blocks of each row reach its last valid slot.

    The kernels visit only these blocks, so trailing ``-1`` slots (a short causal window, or the
    padding to the kernel's block) are never gathered or computed. A row with no valid slot gets 0.
    One pass over the indices: a block holds a valid slot exactly when its largest index is ``>= 0``
    (unused slots are negative), and the rest works on ``[T, K / block]``.
    """
    T, K = indices.shape
    if K % block:
        indices = torch.nn.functional.pad(indices, (0, block - K % block), value=-1)  # [T, K']
    if indices.numel() == 0:
        return torch.zeros(T, dtype=torch.int32, device=indices.device)
    block_max = indices.reshape(T, -1, block).amax(dim=2)  # [T, K' / block]: each block's largest index
    numbers = _block_numbers(block_max.shape[1], indices.device)  # [K' / block]: 1, 2, ...
    return torch.where(block_max >= 0, numbers, 0).amax(dim=1)  # [T] int32


@functools.lru_cache(maxsize=64)
def _block_numbers(num_blocks: int, device: torch.device) -> torch.Tensor:
    """int32 ``[num_blocks]``: ``1, 2, ..., num_blocks``, so a row whose last valid slot lies in
    block ``b`` needs ``b + 1`` blocks. Cached: the calls of a training run share a few widths."""
    return torch.arange(1, num_blocks + 1, device=device, dtype=torch.int32)
# --8<-- [end:block_counts]


# --8<-- [start:with_zero_row]
def with_zero_row(x: torch.Tensor) -> torch.Tensor:
    """``[S, D] -> [S + 1, D]`` contiguous: ``x`` and one row of zeros after it.

    The simple and warp-specialised forwards and the backward gather row ``S`` for a ``-1`` slot,
    so an unused slot multiplies zeros into every product instead of whatever row 0 holds: garbage
    in rows no slot selects never reaches an output, an LSE or a gradient (a masked probability
    times a NaN row would still be NaN). One copy of ``x``, small beside the attention it feeds.
    (The staggered forward needs none: its copies write zeros for a ``-1`` slot.)
    """
    return torch.cat([x, x.new_zeros((1, *x.shape[1:]))]).contiguous()
# --8<-- [end:with_zero_row]


def _base2_lse(lse: torch.Tensor) -> torch.Tensor:
    """The LSE as the backward kernel takes it: base 2, ``+inf`` for empty rows (``-inf`` LSE), so
    that every probability the kernel recomputes for such a row is ``exp2(s - inf) = 0``."""
    return torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse * LOG2E).contiguous()


# ----------------------------------------------------------------------------- sparse MLA


# --8<-- [start:sparse_mla_supported]
def sparse_mla_supported(q, kv, indices, d_v) -> str | None:
    """Why the kernels cannot take this call, or ``None`` if they can."""
    if not (q.is_cuda and kv.is_cuda and indices.is_cuda):
        return "inputs are not on CUDA"
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        return f"the kernels take bfloat16, got q {q.dtype} and kv {kv.dtype}"
    if q.dim() != 3:
        return f"q must be [T, H, D], got {tuple(q.shape)}"
    T, H, D = q.shape
    if H not in (16, 32, 64) and (H < 64 or H % 64):
        return f"H must be 16, 32, 64 or a multiple of 64, got {H}"
    if d_v % 64 or D <= d_v or (D - d_v) % 16 or D % 64:
        return f"unsupported widths D={D}, d_v={d_v} (need d_v % 64 == 0, D % 64 == 0, tail % 16 == 0)"
    return None
# --8<-- [end:sparse_mla_supported]


# --8<-- [start:sparse_mla_function]
class SparseMLAFunction(torch.autograd.Function):
    """``(out, lse) = sparse_mla(q, kv, indices)`` on TileLang; backward gives ``dq`` and ``dkv``."""

    @staticmethod
    def forward(ctx, q, kv, indices, sm_scale, d_v, schedule, backward="one_pass"):
        from . import sparse_mla_fwd as fwd

        q, kv = q.contiguous(), kv.contiguous()
        T, H, D = q.shape
        index_dtype = torch.int32
        if schedule == "staggered" and H % 64 == 0:
            step = 2 * fwd.BLOCK_I  # one 64-row block per stage, two stages per loop step
            if indices.dtype == torch.int64:  # read as they are: no int32 copy of [T, K]
                index_dtype = torch.int64
            kernel = fwd.staggered_kernel(H, D, d_v, float(sm_scale), str(index_dtype).removeprefix("torch."))
            kv_rows = kv if kv.shape[0] else with_zero_row(kv)  # [S, D]: a -1 slot's copies zero-fill its row
            counts_inside = True  # it counts each row's pairs itself
        else:
            counts_inside = False
            if schedule == "warp_specialized" and H % 64 == 0:
                step = 2 * fwd.BLOCK_I
                kernel = fwd.warp_specialized_kernel(H, D, d_v, float(sm_scale))
            else:
                step = fwd.BLOCK_I
                kernel = fwd.simple_kernel(H, D, d_v, float(sm_scale))
            kv_rows = with_zero_row(kv)  # [S + 1, D]: -1 slots read the zero row
        idx = _pad_indices(indices, step, index_dtype)  # [T, K'] int32 or int64
        counts = () if counts_inside else (_block_counts(idx, step),)  # [T] int32
        out, lse = kernel(q, kv_rows, idx, *counts)
        ctx.save_for_backward(q, kv, idx, out, lse)
        ctx.sm_scale, ctx.d_v, ctx.backward = float(sm_scale), d_v, backward
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        from . import sparse_mla_bwd as bwd

        q, kv, idx, out, lse = ctx.saved_tensors
        idx = idx.to(torch.int32)  # [T, K'] as the backward kernel takes them
        kv = with_zero_row(kv)  # [S + 1, D]: -1 slots read the zero row
        T, H, D = q.shape
        if d_out is None:
            d_out = torch.zeros_like(out)
        d_out = d_out.contiguous()
        delta = bwd.delta_kernel(H, ctx.d_v)(out, d_out)  # [T, H] fp32: sum_d out * d_out
        if d_lse is not None:
            # d lse / d s_j = p_j, so a gradient on lse folds into Delta: dS = P * (dP - (Delta - d_lse))
            delta = delta - d_lse.float()
        lse2 = _base2_lse(lse)  # [T, H]
        if ctx.backward == "two_pass":
            from .sparse_mla_bwd_two_pass import two_pass_backward

            dq, dkv = two_pass_backward(q, kv, d_out, idx, lse2, delta.contiguous(), sm_scale=ctx.sm_scale,
                                        d_v=ctx.d_v)  # [T, H, D] bf16, [S + 1, D] fp32
            return dq, dkv[:-1].to(kv.dtype), None, None, None, None, None
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # [S + 1, D]; the zero row's is dropped
        # the forward padded the slots to a multiple of 64, hence of the backward's 32-row blocks
        kernel = bwd.backward_kernel(H, D, ctx.d_v, ctx.sm_scale)
        counts = _block_counts(idx, bwd.BLOCK_S)  # [T]
        dq = kernel(q, kv, d_out, idx, counts, lse2, delta.contiguous(), dkv)
        return dq, dkv[:-1].to(kv.dtype), None, None, None, None, None
# --8<-- [end:sparse_mla_function]


# Where backward="auto" takes the two-pass backward (at 128 heads). Measured through the public call on
# an H100 (2026-12-07, benchmarks/results/2026-12-07_h100_peers_sparse_kl.json, ..._peers_bwd_long_kv.json),
# two-pass against one-pass: 1.07x / 1.06x / 1.045x at 4096x8192, 8192x8192, 16384x16384 causal, 0.98x at
# 4096x16384 uniform, 0.92x at 4096x24576 uniform, 0.90x at 4096x32768 (causal and uniform). Pass B is one
# scatter-add into the fp32 dkv [S, 576] after another; past ~16K keys dkv (2.3 KB a key) outgrows the
# 50 MB L2, where the one-pass kernel hides its additions behind its own products.
TWO_PASS_MAX_KEYS = 16384
BACKWARDS = ("auto", "one_pass", "two_pass")


def _check_backward(backward) -> None:
    if backward not in BACKWARDS:
        raise ValueError(f"sparse_mla_tilelang: backward must be 'auto', 'one_pass' or 'two_pass', got {backward!r}")


def backward_choice(backward: str, heads: int, num_kv: int) -> str:
    """``"one_pass"`` or ``"two_pass"``: what ``backward`` means for ``heads`` query heads and ``num_kv`` keys
    (``"auto"``: two passes at a multiple of 128 heads and at most `TWO_PASS_MAX_KEYS` keys)."""
    _check_backward(backward)
    if backward == "auto":
        return "two_pass" if heads % 128 == 0 and num_kv <= TWO_PASS_MAX_KEYS else "one_pass"
    return backward


# --8<-- [start:sparse_mla_tilelang]
def sparse_mla_tilelang(q, kv, indices, *, sm_scale, d_v=512, schedule="auto", validate=True,
                        backward="auto"):
    """Sparse MLA on TileLang with the readable API's contract (see `dsa_ref.sparse_mla`).

    Args:
        q: ``[T, H, D]`` bf16 CUDA; kv: ``[S, D]`` or ``[S, 1, D]`` bf16; indices: int ``[T, K]``
            (``[T, 1, K]`` accepted), ``-1`` = unused slot.
        schedule: ``"warp_specialized"`` (64-head blocks), ``"staggered"`` (64-head blocks,
            FlashMLA's scheme; `dsa_ref.kernels.sparse_mla_fwd.staggered_kernel`), ``"simple"``,
            or ``"auto"``: the staggered one whenever ``H`` is a multiple of 64 and the rope
            columns ``D - d_v`` are exactly 64 wide and ``d_v`` a multiple of 128 (it is the fastest: 579 against 535 TFLOP/s
            at 4096 x 8192 on an H100, `benchmarks/bench_peers.py`), else the warp-specialised one
            for 64-head blocks, else the simple one.
        validate: check that every index is ``-1`` or in ``[0, S)``, and raise ``ValueError`` if
            not. The minimum and maximum are computed on the GPU next to the kernel and read back
            after the launch: one device sync per call, which waits for the kernel, so the host
            queues nothing further meanwhile. Until the error, no gather reads outside ``kv``
            (the simple and staggered kernels clamp their rows, TileLang guards the
            warp-specialised one's copies).
            ``False`` skips the check and its sync, for indices that are in range by construction,
            such as those of `dsa_ref.topk_indices`. Out-of-range values are then undefined
            behaviour, in the backward too.
        backward: ``"one_pass"`` (`dsa_ref.kernels.sparse_mla_bwd.backward_kernel`: ``dQ`` and
            ``dKV`` in one kernel), ``"two_pass"``
            (`dsa_ref.kernels.sparse_mla_bwd_two_pass.two_pass_backward`: ``dQ`` with ``P`` and
            ``dS`` written out, then ``dKV`` over all heads of a query; 1 GiB of extra memory at
            most), or ``"auto"``: the two-pass one when ``H`` is a multiple of 128 and there are at
            most `TWO_PASS_MAX_KEYS` keys, else the one-pass one (see `TWO_PASS_MAX_KEYS`).
    """
    _check_backward(backward)  # before anything else: a misspelt choice is reported as such
    if kv.dim() == 3:
        kv = kv[:, 0]
    indices = check_index_shape(indices, q.shape[0])
    reason = sparse_mla_supported(q, kv, indices, d_v)
    if reason is not None:
        raise ValueError(f"sparse_mla_tilelang: {reason}")
    backward = backward_choice(backward, q.shape[1], kv.shape[0])
    if schedule == "auto":
        if q.shape[1] % 64:
            schedule = "simple"
        else:
            schedule = "staggered" if q.shape[2] - d_v == 64 and d_v % 128 == 0 else "warp_specialized"
    bounds = index_bounds(indices) if validate and indices.numel() else None  # [2] on the GPU, not read yet
    out, lse = SparseMLAFunction.apply(q, kv, indices, sm_scale, d_v, schedule, backward)
    if bounds is not None:
        check_index_range(bounds, kv.shape[0])  # the sync, after the kernel is queued
    return out, lse
# --8<-- [end:sparse_mla_tilelang]


# ----------------------------------------------------------------------------- indexer


# --8<-- [start:indexer_supported]
def indexer_supported(q, k, weights) -> str | None:
    """Why the indexer kernel cannot take this call, or ``None`` if it can."""
    if not (q.is_cuda and k.is_cuda and weights.is_cuda):
        return "inputs are not on CUDA"
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16:
        return f"the kernel takes bfloat16 q and k, got {q.dtype} and {k.dtype}"
    if q.dim() != 3 or q.shape[1] not in (16, 32, 64) or q.shape[2] % 16:
        return f"q must be [T, H_I in (16, 32, 64), D_I % 16 == 0], got {tuple(q.shape)}"
    return None
# --8<-- [end:indexer_supported]


# --8<-- [start:indexer_function]
class LightningIndexerFunction(torch.autograd.Function):
    """Index scores from the TileLang kernel; the backward recomputes through the reference.

    The backward is the readable `dsa_ref.lightning_indexer` under autograd, chunked over queries,
    so gradients are exactly those of the reference (no fused backward kernel yet).
    """

    @staticmethod
    def forward(ctx, q, k, weights, starts, ends, relu):
        from .indexer_fwd import indexer_kernel
        from .shapes import INDEXER_DEFAULT

        T, H, D = q.shape
        S = k.shape[0]
        if starts is None:
            starts_i = torch.zeros(T, dtype=torch.int32, device=q.device)
            ends_i = torch.full((T,), S, dtype=torch.int32, device=q.device)
        else:
            starts_i, ends_i = starts.to(torch.int32).contiguous(), ends.to(torch.int32).contiguous()
        scores = torch.empty((T, S), dtype=torch.float32, device=q.device)  # the kernel writes every entry
        kernel = indexer_kernel(H, D, bool(relu), **INDEXER_DEFAULT)  # the fastest schedule measured
        kernel(q.contiguous(), k.contiguous(), weights.float().contiguous(), starts_i, ends_i, scores)
        ctx.save_for_backward(q, k, weights, starts_i, ends_i)
        ctx.has_windows = starts is not None
        ctx.relu = bool(relu)
        return scores

    @staticmethod
    def backward(ctx, d_scores):
        from ..indexer import lightning_indexer

        q, k, weights, starts, ends = ctx.saved_tensors
        with torch.enable_grad():
            q_, k_, w_ = (t.detach().requires_grad_(True) for t in (q, k, weights))
            scores = lightning_indexer(q_, k_, w_, starts=starts.long() if ctx.has_windows else None,
                                       ends=ends.long() if ctx.has_windows else None, relu=ctx.relu)
            # -inf entries carry no gradient; mask them so 0 * inf never appears
            d = torch.where(torch.isfinite(scores), d_scores, torch.zeros_like(d_scores))
            dq, dk, dw = torch.autograd.grad(scores, (q_, k_, w_), d)
        return dq, dk, dw, None, None, None
# --8<-- [end:indexer_function]


def lightning_indexer_tilelang(q, k, weights, *, starts=None, ends=None, relu=True):
    """Index scores on TileLang with the readable API's contract (see `dsa_ref.lightning_indexer`)."""
    reason = indexer_supported(q, k, weights)
    if reason is not None:
        raise ValueError(f"lightning_indexer_tilelang: {reason}")
    return LightningIndexerFunction.apply(q, k, weights, starts, ends, relu)
