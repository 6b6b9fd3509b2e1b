r"""Chapter 4.2: allgather context parallelism (CP) over `torch.distributed`.

With CP, the tokens of a long packed batch are spread over ``cp_size`` ranks. Each rank keeps its
**queries** local but needs **all keys** of the sequences it serves. DSA makes this cheap: a key is
one latent row (576 numbers) plus one indexer key (128 numbers) per token, so every rank simply
all-gathers them -- instead of passing 128 heads of K and V around a ring.

Per layer and rank:

1. hold the tokens `dsa_ref.layout.cp_shard_index` gives this rank (zigzag: chunks ``r`` and
   ``2 * cp_size - 1 - r`` of every sequence, which balances causal work);
2. compute the latent KV rows and indexer keys of the local tokens, with the RoPE positions of
   their *global* place in their sequence;
3. all-gather both (autograd-aware: the backward is a reduce-scatter, so every rank receives the
   gradient that all ranks' queries sent to its keys) and reorder them into global packed order;
4. run the local queries through their key windows ``key_windows(cu_seqlens, query_index)``,
   exactly as the single-process layer does for those rows.

**The indexer loss.** The single-process loss is ``sum_rows KL / n_rows``. Each rank computes the sum
over its own rows divided by the *global* ``n_rows`` (one all-reduce of a count), so the per-rank
losses add up to the single-process loss, and per-rank parameter gradients **summed** over the CP
group equal the single-process gradients. If your data-parallel reduction *averages* over CP ranks
(Megatron does, over DP x CP), multiply the losses -- the LM loss and, through
`dsa_ref.set_indexer_loss_scale`, the indexer loss -- by ``cp_size``. For logging, add the per-rank
values with `reduce_loss_for_logging`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .dsa import DSAOutput, DSAttention
from .layout import check_cu_seqlens, cp_shard_index, key_windows
from .mla import check_tokens

__all__ = ["all_gather_with_grad", "cp_dsa_forward", "gather_keys_to_global", "global_order",
           "reduce_loss_for_logging", "shard_tokens", "unshard_tokens", "check_same_cu_seqlens"]


# --8<-- [start:all_gather]
class _AllGather(torch.autograd.Function):
    """Concatenate every rank's tensor along dim 0; backward: sum the gradients, keep this rank's slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)  # [world * n, ...]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group = ctx.group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        n = grad.shape[0] // world
        if dist.get_backend(group) == dist.Backend.NCCL:
            out = torch.empty((n, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
            dist.reduce_scatter_tensor(out, grad.contiguous(), group=group)
            return out, None
        # gloo has no reduce-scatter: an all-reduce followed by taking our slice is the same sum
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total[rank * n:(rank + 1) * n], None
# --8<-- [end:all_gather]


def all_gather_with_grad(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-gather along dim 0 in rank order, differentiable (backward = reduce-scatter).

    Args:
        x: ``[n, ...]``, the same shape on every rank.
        group: the CP process group (default: the world).

    Returns:
        ``[world * n, ...]``.
    """
    return _AllGather.apply(x, group)


def global_order(cu_seqlens: torch.Tensor, cp_size: int) -> torch.Tensor:
    """For rows gathered in rank order, their global packed index: ``[T]``."""
    return torch.cat([cp_shard_index(cu_seqlens, cp_size, r) for r in range(cp_size)])


# --8<-- [start:gather_keys_to_global]
def gather_keys_to_global(x_local: torch.Tensor, cu_seqlens: torch.Tensor,
                          group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-gather per-token key rows of every rank and put them into global packed order.

    Args:
        x_local: ``[T / cp, ...]`` rows of this rank's tokens, in `cp_shard_index` order.
        cu_seqlens: int ``[num_seqs + 1]`` of the whole packed batch.
        group: the CP process group.

    Returns:
        ``[T, ...]`` where row ``i`` belongs to global token ``i``.
    """
    cp_size = dist.get_world_size(group)
    gathered = all_gather_with_grad(x_local, group)  # [T, ...] in rank order
    order = global_order(cu_seqlens.cpu(), cp_size).to(x_local.device)  # [T]: global index of each gathered row
    # gathered[j] is token order[j]; inverting the permutation puts token i at row i
    return gathered[torch.argsort(order)]  # [T, ...]
# --8<-- [end:gather_keys_to_global]


def shard_tokens(x: torch.Tensor, cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This rank's rows of a full ``[T, ...]`` tensor: ``x[cp_shard_index(...)]``."""
    return x[cp_shard_index(cu_seqlens, cp_size, cp_rank).to(x.device)]


def unshard_tokens(x_local: torch.Tensor, cu_seqlens: torch.Tensor,
                   group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The full ``[T, ...]`` tensor from every rank's rows (an all-gather in global order, no grad)."""
    with torch.no_grad():
        return gather_keys_to_global(x_local.detach(), cu_seqlens, group)


def check_same_cu_seqlens(cu_seqlens: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Raise ValueError on every rank if the ranks were given different ``cu_seqlens``.

    Cheap: one all-reduce (MAX) of a 5-number fingerprint and of its negation.
    """
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    i = torch.arange(cu.numel(), dtype=torch.int64)
    fingerprint = torch.stack([torch.tensor(cu.numel()), cu.sum(), (cu * (i + 1)).sum(),
                               (cu * cu).sum(), cu[-1]])  # [5]
    both = torch.cat([fingerprint, -fingerprint])  # max of both halves = (max, -min)
    device = _group_device(group, cu_seqlens)
    both = both.to(device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    hi, lo = both[:5].cpu(), -both[5:].cpu()
    if not torch.equal(hi, lo):
        raise ValueError(
            f"the CP ranks were given different cu_seqlens (rank {dist.get_rank(group)} has "
            f"{cu.tolist()[:8]}{'...' if cu.numel() > 8 else ''}); every rank must pass the same global cu_seqlens"
        )


# --8<-- [start:cp_dsa_forward]
def cp_dsa_forward(layer: DSAttention, x_local: torch.Tensor, cu_seqlens: torch.Tensor, *,
                   group: dist.ProcessGroup | None = None, cp_size: int | None = None,
                   stage: str | None = None, check_inputs: bool = True,
                   loss_row_mask: torch.Tensor | None = None,
                   topk_indices: torch.Tensor | None = None) -> DSAOutput:
    """Run a `DSAttention` layer under allgather context parallelism.

    Args:
        layer: the layer (replicated: the same weights on every rank).
        x_local: ``[T / cp, dim]`` this rank's tokens, in `cp_shard_index` order (see `shard_tokens`).
        cu_seqlens: int ``[num_seqs + 1]`` of the whole packed batch (the same on every rank);
            every sequence length must be divisible by ``2 * cp_size``.
        group: the CP process group (default: the world).
        cp_size: optional; if given it must equal the group's size (a guard against mis-built groups).
        stage: overrides ``layer.stage``.
        check_inputs: verify that all ranks pass the same ``cu_seqlens`` (one small all-reduce).
        loss_row_mask: optional bool ``[T / cp]`` for this rank's tokens (e.g. ``shard_tokens`` of a
            global mask); ``False`` rows (padding) are left out of the indexer loss and its global mean.
        topk_indices: for a layer without an indexer (index sharing): ``[T / cp, K]`` the
            ``topk_indices`` an earlier layer returned on this rank (global key indices).

    Returns:
        `DSAOutput` for this rank's tokens: ``output [T / cp, dim]``, this rank's share of the indexer
        loss (the shares add up to the single-process loss), ``topk_indices [T / cp, topk]`` in global
        key indices.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("cp_dsa_forward needs an initialised torch.distributed process group")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if cp_size is not None and cp_size != world:
        raise ValueError(f"cp_size={cp_size} does not match the CP group's size {world}")
    check_tokens(x_local, layer.config.mla.dim, name="x_local")
    cu = check_cu_seqlens(cu_seqlens)
    if check_inputs:
        check_same_cu_seqlens(cu, group)
    query_index = cp_shard_index(cu.cpu(), world, rank).to(x_local.device)  # [T / cp]
    if x_local.shape[0] != query_index.numel():
        raise ValueError(
            f"x_local has {x_local.shape[0]} tokens, but rank {rank} of {world} owns "
            f"{query_index.numel()} tokens of cu_seqlens (T={int(cu[-1])}); pass shard_tokens(x, cu_seqlens, ...)"
        )
    cu = cu.to(x_local.device)
    if loss_row_mask is not None and (loss_row_mask.dtype != torch.bool or loss_row_mask.shape != (x_local.shape[0],)):
        raise ValueError(f"loss_row_mask must be a bool tensor of shape [{x_local.shape[0]}], got "
                         f"{loss_row_mask.dtype} {tuple(loss_row_mask.shape)}")
    num_loss_rows = (_global_valid_rows(cu, query_index, group, loss_row_mask)
                     if layer.loss_reduction == "mean" else None)
    shared = {} if topk_indices is None else {"topk_indices": topk_indices}
    return layer.attend(x_local, cu, query_index, gather=lambda t: gather_keys_to_global(t, cu, group),
                        stage=stage, num_loss_rows=num_loss_rows, loss_row_mask=loss_row_mask, **shared)
# --8<-- [end:cp_dsa_forward]


def reduce_loss_for_logging(loss: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The single-process value of a loss split over CP ranks: the (detached) sum of the shares."""
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    return total


# --8<-- [start:global_valid_rows]
def _global_valid_rows(cu: torch.Tensor, query_index: torch.Tensor, group,
                       row_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Number of loss rows (non-empty key window, not masked out) over the whole CP group (one all-reduce)."""
    starts, ends = key_windows(cu, query_index)
    rows = ends > starts  # [T / cp]
    if row_mask is not None:
        rows = rows & row_mask.to(rows.device)
    count = rows.sum().to(torch.int64).reshape(1).to(_group_device(group, query_index))
    dist.all_reduce(count, group=group)
    return count[0].to(query_index.device)
# --8<-- [end:global_valid_rows]


def _group_device(group, like: torch.Tensor) -> torch.device:
    """NCCL collectives need CUDA tensors; gloo takes CPU tensors."""
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
