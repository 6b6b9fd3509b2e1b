r"""TileLang kernel: the indexer's KL loss over the slots, value and gradient in one pass over memory.

The last step of the slot path (`dsa_ref.slot_path`) is `dsa_ref.indexer_loss.indexer_loss_on_slots`:
for each query row ``t`` with valid slots ``V_t`` (the selection in the sparse stage),

$$
p_i = \frac{m_i}{\sum_{j \in V} m_j},\qquad
\log q_i = s_i - \log \sum_{j \in V} e^{s_j},\qquad
\mathrm{KL}_t = \sum_{i \in V,\ p_i > 0} p_i\,(\log p_i - \log q_i),\qquad
\frac{\partial\, \mathrm{KL}_t}{\partial s_i} = q_i \textstyle\sum_{j \in V} p_j - p_i
$$

with ``m`` the head-summed attention mass (`attention_head_sum`, not yet normalised) and ``s``
the index scores at the slots. In PyTorch that is a dozen passes over ``[T, K]`` float32 tensors
(mask, normalise, log-softmax, xlogy, their backward). The kernel reads each row twice and writes
the gradient once, **in the forward**: the loss is linear in its upstream gradient, so the backward
only scales the saved ``dKL/ds`` (`SlotKL`).

**Tiling.** One block per row. The row is walked in tiles of ``BLOCK`` slots (any ``K``; the last
tile is masked). Pass 1 keeps a running maximum of the valid scores with the sum of
``exp(s - max)`` rescaled whenever the maximum grows (online softmax), and the sum of the mass.
Pass 2 reads the tile again, forms ``log q``, ``p``, the KL terms and the gradient, and stores the
gradient (0 off the valid set). With DeepSeek-V3.2's ``K = 2048`` and ``BLOCK = 2048`` a pass is
one tile, so each row is two loads, two block reductions and one store.

**Masking.** Every read of an invalid slot is replaced by a *selection* (``-inf`` score, 0 mass)
before it reaches arithmetic: a NaN or ``inf`` in an unread slot never reaches the loss. A row
with no valid slot has ``KL = 0`` and a zero gradient; a row whose mass is all 0 has ``p = 0``,
``KL = 0`` and gradient ``q * 0 - 0 = 0``, as in the reference.
"""

import functools

import tilelang
import tilelang.language as T
import torch

from ..indexer_loss import _reduce, check_slot_loss_inputs
from ._target import compile_target
from .sparse_mla_fwd import LN2, LOG2E

BLOCK = 2048  # slots per tile: DeepSeek-V3.2's top-k, so a sparse-stage row is one tile
THREADS = 256  # 8 slots per thread

_PASS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: False}


# --8<-- [start:slot_kl_kernel]
@functools.lru_cache(maxsize=None)
def slot_kl_kernel(block: int = BLOCK, threads: int = THREADS):
    """Compile the fused KL kernel (any number of rows ``T`` and slots ``K``).

    Kernel arguments: ``Scores [T, K]`` fp32 index scores at the slots, ``Mass [T, K]`` fp32 head-summed
    attention mass (not normalised), ``Valid [T, K]`` bool; outputs ``DScores [T, K]`` fp32
    (``dKL_t / ds``, 0 off the valid set) and ``KLRows [T]`` fp32.
    """
    num_rows, width = T.dynamic("num_rows"), T.dynamic("width")
    f32 = "float32"
    neg_inf = -T.infinity(f32)

    @T.prim_func
    def main(Scores: T.Tensor((num_rows, width), f32), Mass: T.Tensor((num_rows, width), f32),
             Valid: T.Tensor((num_rows, width), "bool"), DScores: T.Tensor((num_rows, width), f32),
             KLRows: T.Tensor((num_rows,), f32)):
        with T.Kernel(num_rows, threads=threads) as t:
            s = T.alloc_fragment((1, block), f32)  # one tile's scores, -inf off the valid set
            m = T.alloc_fragment((1, block), f32)  # one tile's mass, 0 off the valid set
            e = T.alloc_fragment((1, block), f32)  # exp(s - max) in pass 1, KL terms in pass 2
            tile_max = T.alloc_fragment((1,), f32)
            tile_sum = T.alloc_fragment((1,), f32)
            tile_mass = T.alloc_fragment((1,), f32)
            row_max = T.alloc_fragment((1,), f32)  # running max of the valid scores
            prev_max = T.alloc_fragment((1,), f32)
            shift = T.alloc_fragment((1,), f32)  # row_max, or 0 while it is -inf (no valid slot yet)
            row_sum = T.alloc_fragment((1,), f32)  # sum of exp(s - shift) over the valid slots
            mass_sum = T.alloc_fragment((1,), f32)
            kl = T.alloc_fragment((1,), f32)
            T.fill(row_max, neg_inf)
            T.fill(row_sum, 0)
            T.fill(mass_sum, 0)
            T.fill(kl, 0)
            num_tiles = T.ceildiv(width, block)

            # pass 1: the log-partition of the scores (online max and sum) and the total mass
            for tile in T.serial(num_tiles):
                for _, j in T.Parallel(1, block):
                    i = T.min(tile * block + j, width - 1)  # past the row's end: re-read the last slot, dropped
                    ok = (tile * block + j < width) and Valid[t, i]
                    s[0, j] = T.if_then_else(ok, Scores[t, i], neg_inf)
                    m[0, j] = T.if_then_else(ok, Mass[t, i], 0)
                T.copy(row_max, prev_max)
                T.reduce_max(s, tile_max, dim=1, clear=True)
                row_max[0] = T.max(prev_max[0], tile_max[0])
                shift[0] = T.if_then_else(row_max[0] == neg_inf, 0, row_max[0])
                for _, j in T.Parallel(1, block):
                    e[0, j] = T.if_then_else(s[0, j] == neg_inf, 0, T.exp2((s[0, j] - shift[0]) * LOG2E))
                T.reduce_sum(e, tile_sum, dim=1, clear=True)
                T.reduce_sum(m, tile_mass, dim=1, clear=True)
                # the previous sum was taken against prev_max; exp2(-inf) = 0 rescales an empty sum
                row_sum[0] = row_sum[0] * T.exp2((prev_max[0] - shift[0]) * LOG2E) + tile_sum[0]
                mass_sum[0] = mass_sum[0] + tile_mass[0]

            # log Z; sum(p) (1, or 0 for a row whose mass is all 0); log sum(m)
            log_z = shift[0] + T.log2(T.max(row_sum[0], 1e-38)) * LN2
            has_mass = mass_sum[0] > 0
            log_mass = T.log2(T.max(mass_sum[0], 1e-38)) * LN2
            p_total = T.if_then_else(has_mass, 1.0, 0)

            # pass 2: KL terms and the gradient q * sum(p) - p
            for tile in T.serial(num_tiles):
                for _, j in T.Parallel(1, block):
                    i = T.min(tile * block + j, width - 1)
                    inside = tile * block + j < width
                    ok = inside and Valid[t, i]
                    log_q = Scores[t, i] - log_z
                    p = T.if_then_else(has_mass, Mass[t, i] / T.max(mass_sum[0], 1e-38), 0)  # m / M, as the reference
                    e[0, j] = T.if_then_else(ok and Mass[t, i] > 0,
                                             p * (T.log2(T.max(Mass[t, i], 1e-38)) * LN2 - log_mass - log_q), 0)
                    if inside:
                        DScores[t, i] = T.if_then_else(ok, T.exp2(log_q * LOG2E) * p_total - p, 0)
                T.reduce_sum(e, tile_sum, dim=1, clear=True)
                kl[0] = kl[0] + tile_sum[0]
            KLRows[t] = kl[0]

    return tilelang.compile(main, pass_configs=_PASS, target=compile_target())
# --8<-- [end:slot_kl_kernel]


# --8<-- [start:slot_kl_tilelang]
def slot_kl_tilelang(slot_scores: torch.Tensor, attention_mass: torch.Tensor,
                     valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel itself: ``(sum_t KL_t, dKL/ds)`` in one call, without autograd.

    For callers that apply the upstream gradient themselves (as Megatron-LM's
    ``sparse_indexer_kl_interface`` does); `indexer_loss_on_slots_tilelang` is the autograd path.

    Args:
        slot_scores: ``[T, K]`` float32 CUDA, contiguous: index scores at the slots.
        attention_mass: ``[T, K]`` float32 CUDA, contiguous: head-summed attention mass.
        valid: ``[T, K]`` bool CUDA, contiguous.

    Returns:
        ``kl_sum`` (float32 scalar, the KL summed over rows) and ``d_scores`` ``[T, K]`` float32,
        its gradient with respect to ``slot_scores`` (0 off the valid set).
    """
    check_slot_loss_inputs(slot_scores, attention_mass, valid, "sum")
    for name, x, dtype in (("slot_scores", slot_scores, torch.float32), ("attention_mass", attention_mass, torch.float32),
                           ("valid", valid, torch.bool)):
        if not x.is_cuda or x.dtype != dtype or not x.is_contiguous():
            raise ValueError(f"slot_kl_tilelang: {name} must be a contiguous {dtype} CUDA tensor, got "
                             f"{x.dtype} on {x.device}{'' if x.is_contiguous() else ', not contiguous'}")
    return _slot_kl(slot_scores, attention_mass, valid)


def _slot_kl(slot_scores: torch.Tensor, attention_mass: torch.Tensor,
             valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`slot_kl_tilelang` on arguments already checked (the autograd path checks them once)."""
    num_rows, width = slot_scores.shape
    d_scores = torch.empty((num_rows, width), dtype=torch.float32, device=slot_scores.device)  # [T, K]
    kl_rows = torch.empty((num_rows,), dtype=torch.float32, device=slot_scores.device)  # [T]
    if num_rows and width:
        slot_kl_kernel()(slot_scores, attention_mass, valid, d_scores, kl_rows)  # writes every row of both
    else:
        d_scores.zero_()
        kl_rows.zero_()
    return kl_rows.sum(), d_scores
# --8<-- [end:slot_kl_tilelang]


class SlotKL(torch.autograd.Function):
    """``sum_t KL_t`` with the gradient the kernel stored in the forward (the backward scales it)."""

    @staticmethod
    def forward(ctx, slot_scores: torch.Tensor, mass: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        total, d_scores = _slot_kl(slot_scores, mass, valid)  # [], [T, K]; checked by the caller
        ctx.save_for_backward(d_scores)
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        (d_scores,) = ctx.saved_tensors
        return d_scores * grad_total, None, None  # [T, K]


# --8<-- [start:indexer_loss_on_slots_supported]
def indexer_loss_on_slots_supported(slot_scores, attention_mass, valid) -> str | None:
    """Why the kernel cannot take this call, or ``None`` if it can (shapes are checked by the wrapper)."""
    if not all(x.is_cuda for x in (slot_scores, attention_mass, valid)):
        return "inputs are not on CUDA"
    if slot_scores.dtype == torch.float64 or attention_mass.dtype == torch.float64:
        return "float64 inputs: the kernel computes in float32 (the reference computes in float64)"
    if slot_scores.numel() >= 2 ** 31:
        return f"[T, K] = {tuple(slot_scores.shape)} has 2^31 or more elements (32-bit indexing)"
    return None
# --8<-- [end:indexer_loss_on_slots_supported]


# --8<-- [start:indexer_loss_on_slots_tilelang]
def indexer_loss_on_slots_tilelang(slot_scores: torch.Tensor, attention_mass: torch.Tensor, valid: torch.Tensor,
                                   *, reduction: str = "mean", coeff: float = 1.0, num_rows=None,
                                   head_sum_reduce=None) -> torch.Tensor:
    """`dsa_ref.indexer_loss.indexer_loss_on_slots` on the fused TileLang kernel.

    Same arguments and result (a float32 scalar); gradients reach ``slot_scores`` only. The
    reference computes in float32 too (float64 inputs are declined: the reference takes them);
    the kernel differs from it by the order of its sums (relative ``~1e-6``).

    Args:
        slot_scores: ``[T, K]`` float (float32 from the kernels) index scores at the slots.
        attention_mass: ``[T, K]`` float head-summed attention mass; detached here.
        valid: bool ``[T, K]``: the valid set of each row (each key at most once).
        reduction, coeff, num_rows, head_sum_reduce: as in `indexer_loss_on_slots`.
    """
    check_slot_loss_inputs(slot_scores, attention_mass, valid, reduction)
    reason = indexer_loss_on_slots_supported(slot_scores, attention_mass, valid)
    if reason is not None:
        raise ValueError(f"indexer_loss_on_slots_tilelang: {reason}")
    mass = attention_mass.detach().float()  # [T, K]
    if head_sum_reduce is not None:
        # the reduction (e.g. TP's all-reduce) sums what it is given: zero the invalid slots first
        mass = head_sum_reduce(torch.where(valid, mass, torch.zeros((), dtype=mass.dtype, device=mass.device)))
    total = SlotKL.apply(slot_scores.float().contiguous(), mass.contiguous(), valid.contiguous())
    counted = valid.any(dim=-1).sum() if reduction == "mean" and num_rows is None else None  # rows with a slot
    return _reduce(total, counted, reduction, num_rows, coeff)
# --8<-- [end:indexer_loss_on_slots_tilelang]
