r"""Chapter 4.4: tensor parallelism (TP) of the DSA layer, alone and beside context parallelism.

Tensor parallelism splits one layer's **attention heads** over the ``tp`` ranks of a process group;
every rank sees every token of its batch (``x`` is replicated over TP). Rank ``r`` owns heads
``[r * H / tp, (r + 1) * H / tp)`` (DeepSeek-V3.2 at tp = 8: 16 of the 128 heads):

* **split by head**: the rows of ``wq_b`` (column-parallel), the rows of ``wkv_b`` (whose per-head
  blocks are ``W_UK`` and ``W_UV``) and the columns of ``wo`` (row-parallel: each rank's partial
  output is all-reduced);
* **replicated**: ``wq_a``, ``q_norm``, ``wkv_a``, ``kv_norm``. The query latent ``qr`` and the
  latent KV row ``[c_kv ; k_pe]`` (576 numbers) belong to a token, not to a head, so every rank
  computes them itself -- cheaper than sending them;
* **replicated**: the whole lightning indexer. Its inputs (``x`` and ``qr``, detached) and its
  weights are the same on every TP rank, so its scores and its top-k are the same too; the KL
  target is the main attention summed over *all* heads, so each rank's per-head sum is all-reduced
  over TP before the L1 normalisation.

Collectives (``f`` and ``g`` as in the Megatron-LM paper): ``f`` is the identity in forward and an
all-reduce of the gradient in backward, ``g`` the reverse. This module puts ``g`` after ``wo`` and
``f`` where the replicated latents enter the head-split part (``latent_grads="activations"``), so
every replicated parameter and ``x`` receive their complete gradient, identical on every rank. The
alternative, ``latent_grads="parameters"``, puts ``f`` on ``x`` and sums the replicated parameters'
gradients after backward (`sync_tensor_parallel_grads`), as Megatron does with sequence parallelism.

TP composes with allgather CP unchanged: a `TensorParallelDSA` is a `DSAttention`, so
`dsa_ref.context_parallel.cp_dsa_forward` runs it over the CP group while the TP collectives use
the TP group (`make_tp_cp_groups` builds both from one world).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .config import DSAConfig, MLAConfig
from .dsa import DSAOutput, DSAttention
from .mla import MLA, MLAProjections

__all__ = ["TensorParallelDSA", "HeadParallelMLA", "ColumnParallelLinear", "RowParallelLinear", "TPCPGroups",
           "LATENT_GRADS", "KL_TARGETS", "SPLIT_DIMS", "check_replicated", "copy_to_tp", "reduce_from_tp",
           "make_tp_cp_groups", "parameter_kind", "sync_tensor_parallel_grads", "tp_collective_bytes",
           "check_heads_divisible"]

LATENT_GRADS = ("activations", "parameters")
KL_TARGETS = ("all_reduce", "local")

#: Parameters split by head, and the dim they are split along (all others are replicated over TP).
SPLIT_DIMS = {"mla.wq_b.weight": 0, "mla.wkv_b.weight": 0, "mla.wo.weight": 1}


# --8<-- [start:f_and_g]
class _CopyToTP(torch.autograd.Function):
    """``f``: identity in forward; backward all-reduces (sums) the gradient over the TP group."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)  # each rank's heads sent only their part
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """``g``: all-reduces (sums) the partial results in forward; identity in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None  # every rank's partial result entered the sum with weight 1
# --8<-- [end:f_and_g]


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``f``: a replicated tensor entering a head-split computation (backward: all-reduce of its gradient)."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``g``: the sum of every rank's partial ``x`` (forward: all-reduce; backward: identity)."""
    return _ReduceFromTP.apply(x, group)


class ColumnParallelLinear(nn.Module):
    """This rank's rows of a ``[out_features, in_features]`` linear map: ``y_r = x W_r^T`` (no bias).

    Args:
        in_features, out_features: the *full* layer's sizes; ``out_features`` must divide by ``tp_size``.
        group: the TP group; tp_size: its size.
        copy_input: pass ``x`` through `copy_to_tp` (``x`` is replicated and its other consumers see
            the complete gradient); ``False`` when the caller handles the input's gradient.

    ``weight`` is ``[out_features / tp, in_features]``, initialised like the full ``nn.Linear``.
    """

    def __init__(self, in_features: int, out_features: int, *, group, tp_size: int, copy_input: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        if out_features % tp_size:
            raise ValueError(f"out_features={out_features} is not divisible by tp_size={tp_size}")
        self.group, self.copy_input = group, copy_input
        self.weight = nn.Parameter(torch.empty(out_features // tp_size, in_features, device=device, dtype=dtype))
        bound = in_features ** -0.5  # nn.Linear's default bound, from the full fan-in
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = copy_to_tp(x, self.group)
        return F.linear(x, self.weight)  # [..., out / tp]


class RowParallelLinear(nn.Module):
    """This rank's columns of a ``[out_features, in_features]`` linear map, outputs summed over TP.

    ``y = sum_r x_r W_r^T`` where ``x_r`` is this rank's slice of the input features (its heads) and
    ``W_r`` the matching columns: ``weight`` is ``[out_features, in_features / tp]``. The sum is `reduce_from_tp`.
    """

    def __init__(self, in_features: int, out_features: int, *, group, tp_size: int,
                 device=None, dtype=None) -> None:
        super().__init__()
        if in_features % tp_size:
            raise ValueError(f"in_features={in_features} is not divisible by tp_size={tp_size}")
        self.group = group
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp_size, device=device, dtype=dtype))
        bound = in_features ** -0.5  # the full layer's fan-in, not this shard's
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp(F.linear(x, self.weight), self.group)  # [..., out]: complete on every rank


# --8<-- [start:head_parallel_mla]
class HeadParallelMLA(MLA):
    """The MLA of one TP rank: its heads' rows of ``wq_b`` and ``wkv_b``, its heads' columns of ``wo``.

    Args:
        config: the *full* layer's MLA config (``n_heads`` = all heads).
        group, tp_size: the TP group and its size (``config.n_heads`` must divide by it).
        latent_grads: where the gradients of the replicated latents are summed over TP:
            ``"activations"`` -- on ``qr``, ``c_kv`` and ``k_pe`` in backward (`copy_to_tp`), so the
            replicated parameters and ``x`` get complete gradients; ``"parameters"`` -- on ``x`` only,
            and the replicated parameters' gradients are summed by `sync_tensor_parallel_grads`.

    ``self.config`` is the local config (``n_heads = H / tp``), ``self.full_config`` the full one.
    Every method of `MLA` works unchanged on the local heads; ``forward`` is a TP dense MLA.
    """

    def __init__(self, config: MLAConfig, *, group, tp_size: int, latent_grads: str = "activations",
                 device=None, dtype=None) -> None:
        if not isinstance(config, MLAConfig):
            raise TypeError(f"config must be an MLAConfig, got {type(config).__name__}")
        check_heads_divisible(config.n_heads, tp_size)
        if latent_grads not in LATENT_GRADS:
            raise ValueError(f"latent_grads must be one of {LATENT_GRADS}, got {latent_grads!r}")
        super().__init__(dataclasses.replace(config, n_heads=config.n_heads // tp_size), device=device, dtype=dtype)
        self.full_config, self.group, self.tp_size, self.latent_grads = config, group, tp_size, latent_grads
        c, kw = config, dict(group=group, tp_size=tp_size, device=device, dtype=dtype)
        # column-parallel: qr is replicated; f sums its gradient over the ranks' heads in backward
        self.wq_b = ColumnParallelLinear(c.q_lora_rank, c.n_heads * c.qk_head_dim,
                                         copy_input=latent_grads == "activations", **kw)
        # row-parallel: each rank's heads give a partial [T, dim]; g sums them in forward
        self.wo = RowParallelLinear(c.n_heads * c.v_head_dim, c.dim, **kw)
        # wkv_b keeps nn.Linear's type with this rank's rows [H/tp * (nope + v), r]: the absorbed
        # form uses it only as weights (W_UK, W_UV), never as a layer applied to a replicated input

    def project(self, x: torch.Tensor, pos: torch.Tensor) -> MLAProjections:
        """`MLA.project` for this rank's heads; the replicated latents pass through ``f``."""
        if self.latent_grads == "parameters":
            x = copy_to_tp(x, self.group)  # dx is summed here; replicated weights keep partial grads
        p = super().project(x, pos)  # qr [T, q_lora], q [T, H/tp, ...], c_kv [T, r], k_pe [T, rope]
        if self.latent_grads == "activations":
            # the latent row is shared by all heads; this rank's heads send back only their share
            p = dataclasses.replace(p, c_kv=copy_to_tp(p.c_kv, self.group), k_pe=copy_to_tp(p.k_pe, self.group))
        return p
# --8<-- [end:head_parallel_mla]


class TensorParallelDSA(DSAttention):
    """One TP rank's share of a `DSAttention` layer: its heads of the MLA, the whole indexer.

    Args:
        config: the *full* layer's config; ``config.mla.n_heads`` must divide by the TP size.
        tp_group: the TP process group (default: the world).
        tp_size: optional; if given it must equal the group's size (guards against mis-built groups).
        latent_grads: ``"activations"`` (default) or ``"parameters"``; see `HeadParallelMLA`.
        kl_target: ``"all_reduce"`` (default; Megatron's semantics): the per-rank sums over heads of
            the KL target are all-reduced before the L1 normalisation, so every rank has the target
            of all heads, the same loss and the same indexer gradients. ``"local"``: each rank uses
            its own heads' target and nothing is sent; the KL gradient is linear in the target, so
            the indexer gradients *averaged* over TP (`sync_tensor_parallel_grads`) are still exact,
            but the logged loss is then an upper bound (see the chapter).
        check_replicas: verify cheaply in every forward (two all-reduces of a few int64 fingerprints)
            that the TP ranks got identical inputs and computed identical top-k (and, with
            ``kl_target="all_reduce"``, identical losses); raises ValueError on every rank otherwise.
        stage, backend, loss_coeff, loss_reduction, device, dtype: as for `DSAttention`.

    The weights are initialised like a `DSAttention`'s, independently per rank: load real ones with
    `from_dense` / `load_from_dense` (replicated weights must be identical on every TP rank;
    `check_replicated_parameters` verifies it). ``self.config`` is the local config
    (``n_heads = H / tp``), ``self.full_config`` the full one. Parameter names are those of `DSAttention`.

    After backward call `sync_tensor_parallel_grads`; the data-parallel/CP gradient reduction comes
    on top, as for a `DSAttention`.
    """

    def __init__(self, config: DSAConfig, *, tp_group: dist.ProcessGroup | None = None, tp_size: int | None = None,
                 latent_grads: str = "activations", kl_target: str = "all_reduce", check_replicas: bool = True,
                 stage: str = "sparse", backend: str = "reference", loss_coeff: float = 1.0,
                 loss_reduction: str = "mean", device=None, dtype=None) -> None:
        if not isinstance(config, DSAConfig):
            raise TypeError(f"config must be a DSAConfig, got {type(config).__name__}")
        world, rank = _tp_world(tp_group, tp_size)
        check_heads_divisible(config.mla.n_heads, world)
        if latent_grads not in LATENT_GRADS:
            raise ValueError(f"latent_grads must be one of {LATENT_GRADS}, got {latent_grads!r}")
        if kl_target not in KL_TARGETS:
            raise ValueError(f"kl_target must be one of {KL_TARGETS}, got {kl_target!r}")
        local = dataclasses.replace(config, mla=dataclasses.replace(config.mla, n_heads=config.mla.n_heads // world))
        super().__init__(local, stage=stage, backend=backend, loss_coeff=loss_coeff, loss_reduction=loss_reduction,
                         device=device, dtype=dtype)
        self.full_config = config
        self.tp_group, self.tp_size, self.tp_rank = tp_group, world, rank
        self.latent_grads, self.kl_target, self.check_replicas = latent_grads, kl_target, bool(check_replicas)
        self.mla = HeadParallelMLA(config.mla, group=tp_group, tp_size=world, latent_grads=latent_grads,
                                   device=device, dtype=dtype)

    @classmethod
    def from_dense(cls, layer: DSAttention, *, tp_group: dist.ProcessGroup | None = None,
                   tp_size: int | None = None, **kwargs) -> "TensorParallelDSA":
        """This rank's shard of a full `DSAttention` (same weights, stage, backend, loss settings and scale).

        ``kwargs`` go to the constructor (``latent_grads``, ``kl_target``, ``check_replicas``).
        """
        if not isinstance(layer, DSAttention) or isinstance(layer, TensorParallelDSA):
            raise TypeError(f"layer must be a full dsa_ref.DSAttention, got {type(layer).__name__}")
        w = layer.mla.wq_a.weight
        tp = cls(layer.config, tp_group=tp_group, tp_size=tp_size, stage=layer.stage, backend=layer.backend,
                 loss_coeff=layer.loss_coeff, loss_reduction=layer.loss_reduction, device=w.device, dtype=w.dtype,
                 **kwargs)
        tp.load_from_dense(layer)
        tp.loss_scale = layer.loss_scale
        return tp

    def load_from_dense(self, layer: DSAttention) -> None:
        """Copy a full layer's weights: this rank's heads of the split ones, all of the replicated ones."""
        if layer.config != self.full_config:
            raise ValueError("load_from_dense: the layer's config differs from this module's full_config")
        full = dict(layer.named_parameters())
        with torch.no_grad():
            for name, p in self.named_parameters():
                src = full[name]
                if name in SPLIT_DIMS:
                    src = src.chunk(self.tp_size, dim=SPLIT_DIMS[name])[self.tp_rank]  # heads are contiguous blocks
                p.copy_(src)

    # --8<-- [start:tp_attend]
    def attend(self, x: torch.Tensor, cu_seqlens: torch.Tensor, query_index: torch.Tensor, *,
               gather, stage: str | None = None, num_loss_rows: torch.Tensor | int | None = None,
               head_sum_reduce=None, loss_row_mask: torch.Tensor | None = None) -> DSAOutput:
        """`DSAttention.attend` for this rank's heads (``x`` and the windows are the same on every TP rank)."""
        if head_sum_reduce is not None:
            raise ValueError("TensorParallelDSA brings its own head_sum_reduce (the all-reduce over TP)")
        if self.check_replicas:
            inputs = dict(x=x, cu_seqlens=cu_seqlens, query_index=query_index)
            if loss_row_mask is not None:
                inputs["loss_row_mask"] = loss_row_mask
            check_replicated(self.tp_group, what="the layer inputs", **inputs,
                             hint="every TP rank must get the same tokens: with CP, the ranks of a TP group "
                                  "must share one CP rank (see make_tp_cp_groups)")
        reduce = self._sum_over_tp if self.kl_target == "all_reduce" else None
        res = super().attend(x, cu_seqlens, query_index, gather=gather, stage=stage,
                             num_loss_rows=num_loss_rows, head_sum_reduce=reduce, loss_row_mask=loss_row_mask)
        if self.check_replicas:
            same = dict(topk_indices=res.topk_indices)
            if self.kl_target == "all_reduce":
                same["indexer_loss"] = res.indexer_loss
            check_replicated(self.tp_group, what="the indexer's results", **same,
                             hint="the indexer is replicated: its weights, its kernels or the KL target's "
                                  "all-reduce differ across ranks")
        return res
    # --8<-- [end:tp_attend]

    def _sum_over_tp(self, summed: torch.Tensor) -> torch.Tensor:
        """The KL target's sum over this rank's heads (``[R, S]``, or ``[R, K]`` slots in the sparse
        stage) -> the sum over all heads (no grad)."""
        dist.all_reduce(summed, group=self.tp_group)
        return summed

    def full_tensors(self, *, grads: bool = False) -> dict[str, torch.Tensor]:
        """Every parameter (or its gradient) of the full layer: split ones all-gathered over TP (no grad).

        Replicated ones are returned as this rank holds them. A collective: call it on every TP rank.
        """
        out = {}
        for name, p in self.named_parameters():
            t = p.grad if grads else p
            if t is None:
                raise ValueError(f"full_tensors: {name} has no gradient")
            t = t.detach()
            if name in SPLIT_DIMS:
                parts = [torch.empty_like(t) for _ in range(self.tp_size)]
                dist.all_gather(parts, t.contiguous(), group=self.tp_group)
                t = torch.cat(parts, dim=SPLIT_DIMS[name])
            out[name] = t.clone()
        return out

    def check_replicated_parameters(self, *, grads: bool = False) -> None:
        """Raise ValueError on every rank unless the replicated parameters (or grads) are bitwise equal over TP."""
        tensors = {}
        for name, p in self.named_parameters():
            if parameter_kind(name) != "split":
                t = p.grad if grads else p
                if t is not None:
                    tensors[name] = t
        check_replicated(self.tp_group, what="the replicated " + ("gradients" if grads else "parameters"), **tensors)


# --8<-- [start:sync_grads]
def sync_tensor_parallel_grads(layer: nn.Module) -> None:
    """Reduce over TP the gradients that need it; call after backward, before the optimizer step.

    For every `TensorParallelDSA` inside ``layer``:

    * ``indexer.*``: **averaged** over TP. With ``kl_target="all_reduce"`` they are identical already
      (every rank computed the same loss); the average keeps them bitwise identical even where kernels
      are not deterministic. With ``kl_target="local"`` the average is what makes them exact.
    * replicated MLA weights (``wq_a``, ``q_norm``, ``wkv_a``, ``kv_norm``): **summed** over TP with
      ``latent_grads="parameters"`` (each rank holds its heads' share); nothing with
      ``"activations"`` (complete and identical already).
    * split weights: nothing; each rank owns its heads' shard.

    Data-parallel or CP reductions come on top and commute with this one.
    """
    for m in layer.modules():
        if not isinstance(m, TensorParallelDSA):
            continue
        for name, p in m.named_parameters():
            if p.grad is None:
                continue
            kind = parameter_kind(name)
            if kind == "indexer":
                dist.all_reduce(p.grad, group=m.tp_group)
                p.grad.div_(m.tp_size)
            elif kind == "latent" and m.latent_grads == "parameters":
                dist.all_reduce(p.grad, group=m.tp_group)
# --8<-- [end:sync_grads]


def parameter_kind(name: str) -> str:
    """How a `DSAttention` parameter lives under TP.

    Returns ``"split"`` (by head), ``"latent"`` (replicated MLA weights) or ``"indexer"`` (replicated).
    """
    if name in SPLIT_DIMS:
        return "split"
    if name.startswith("indexer."):
        return "indexer"
    if name.startswith("mla."):
        return "latent"
    raise ValueError(f"parameter_kind: {name!r} is not a DSAttention parameter")


def check_heads_divisible(n_heads: int, tp_size: int) -> None:
    """Raise ValueError unless the attention heads split evenly over the TP ranks."""
    if tp_size < 1 or n_heads % tp_size:
        raise ValueError(f"tensor parallelism splits heads: n_heads={n_heads} is not divisible by tp={tp_size}")


class TPCPGroups(NamedTuple):
    """This rank's groups of a ``tp x cp`` grid (`make_tp_cp_groups`)."""

    tp_group: dist.ProcessGroup
    cp_group: dist.ProcessGroup
    tp_rank: int
    cp_rank: int


# --8<-- [start:groups]
def make_tp_cp_groups(tp_size: int, cp_size: int) -> TPCPGroups:
    """Split the world into a ``cp_size x tp_size`` grid: ``rank = cp_rank * tp_size + tp_rank``.

    TP is the fastest-varying dim (as in Megatron-LM), so a TP group is ``tp_size`` consecutive ranks,
    on one node's fast links. A TP group's ranks share one CP rank and so hold the same tokens; a CP
    group's ranks hold the same heads. Every rank must call this (``new_group`` is collective).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("make_tp_cp_groups needs an initialised torch.distributed process group")
    world, rank = dist.get_world_size(), dist.get_rank()
    for name, v in (("tp_size", tp_size), ("cp_size", cp_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if tp_size * cp_size != world:
        raise ValueError(f"tp_size x cp_size = {tp_size} x {cp_size} = {tp_size * cp_size} ranks, "
                         f"but the world has {world}")
    tp_group = cp_group = None
    for c in range(cp_size):  # every rank creates every group, in the same order
        g = dist.new_group([c * tp_size + t for t in range(tp_size)])
        if rank // tp_size == c:
            tp_group = g
    for t in range(tp_size):
        g = dist.new_group([c * tp_size + t for c in range(cp_size)])
        if rank % tp_size == t:
            cp_group = g
    return TPCPGroups(tp_group, cp_group, rank % tp_size, rank // tp_size)
# --8<-- [end:groups]


# --8<-- [start:bytes]
def tp_collective_bytes(config: DSAConfig, tokens: int, *, keys: int | None = None, act_bytes: int = 2,
                        target_bytes: int = 4, grad_bytes: int = 4) -> dict[str, int]:
    """Payload of each TP collective of one layer, in bytes (what one rank puts into the sum).

    Args:
        config: the full layer's config.
        tokens: query tokens per rank ``T`` (all TP ranks of a group hold the same ones).
        keys: keys ``S`` the queries see (default ``tokens``; with CP the gathered length).
        act_bytes: bytes per activation or activation gradient (bf16: 2).
        target_bytes: bytes per KL-target entry (fp32: 4).
        grad_bytes: bytes per parameter gradient (fp32 main grads: 4).

    Returns:
        Per layer and micro-batch: ``"output"`` (forward ``g`` after ``wo``, ``[T, dim]``),
        ``"target_dense"`` (forward, the KL target's head sum ``[T, S]``), ``"target_sparse"`` (the
        same on the selected slots, ``[T, topk]``, as `dsa_ref.indexer_loss` reduces it), ``"latent_grads"``
        (backward ``f`` on ``qr``, ``c_kv``, ``k_pe``), ``"input_grad"`` (backward ``f`` on ``x``, with
        ``latent_grads="parameters"``). Per optimizer step: ``"latent_param_grads"`` (the sum of the
        replicated MLA weights' gradients, with ``latent_grads="parameters"``) and
        ``"indexer_param_grads"`` (their average). A ring all-reduce over ``tp`` ranks sends and
        receives ``2 (tp - 1) / tp`` times the payload on every rank.
    """
    m, i = config.mla, config.indexer
    keys = tokens if keys is None else keys
    latent_params = (m.dim * m.q_lora_rank + m.q_lora_rank  # wq_a, q_norm
                     + m.dim * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank)  # wkv_a, kv_norm
    indexer_params = (m.q_lora_rank * i.n_heads * i.head_dim + m.dim * i.head_dim  # wq_b, wk
                      + 2 * i.head_dim + m.dim * i.n_heads)  # k_norm, weights_proj
    return {
        "output": tokens * m.dim * act_bytes,
        "target_dense": tokens * keys * target_bytes,
        "target_sparse": tokens * i.topk * target_bytes,
        "latent_grads": tokens * (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim) * act_bytes,
        "input_grad": tokens * m.dim * act_bytes,
        "latent_param_grads": latent_params * grad_bytes,
        "indexer_param_grads": indexer_params * grad_bytes,
    }
# --8<-- [end:bytes]


def check_replicated(group: dist.ProcessGroup | None = None, *, what: str = "tensors", hint: str = "",
                     **tensors: torch.Tensor) -> None:
    """Raise ValueError on every rank of ``group`` unless each named tensor is bitwise equal on all of them.

    Cheap: each tensor is reduced to six int64 numbers (shape and weighted sums of its bits), and
    one all-reduce (MAX) of the fingerprints and their negations compares them all.
    """
    names = list(tensors)
    if not names:
        return
    fingerprints = torch.stack([_fingerprint(tensors[n]) for n in names])  # [N, 6]
    both = torch.cat([fingerprints, -fingerprints]).to(_collective_device(group))  # max of both = (max, -min)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    hi, lo = both[: len(names)].cpu(), -both[len(names):].cpu()
    differ = [n for n, h, l_ in zip(names, hi, lo) if not torch.equal(h, l_)]
    if differ:
        raise ValueError(f"{what} differ across the {dist.get_world_size(group)} TP ranks: {', '.join(differ)} "
                         f"(seen on rank {dist.get_rank(group)})" + (f"; {hint}" if hint else ""))


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Six int64 numbers that change when any bit or the shape of ``t`` changes (with overwhelming odds)."""
    t = t.detach()
    shape = torch.tensor([t.dim(), *t.shape], dtype=torch.int64)
    shape_code = (shape * torch.arange(1, shape.numel() + 1, dtype=torch.int64) * 1000003).sum()
    t = t.contiguous().flatten()
    if t.is_floating_point():
        t = t.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()])
    bits = t.to(torch.int64)  # on t's device: only the six numbers move
    w = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device)
    sums = torch.stack([bits.sum(), (bits * w).sum(), (bits * w * w).sum(), (bits ^ w).sum()]).cpu()
    return torch.cat([torch.tensor([bits.numel()]), shape_code.reshape(1), sums])  # int64 wraps: fine for a hash


def _tp_world(group, tp_size) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("TensorParallelDSA needs an initialised torch.distributed process group")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if tp_size is not None and tp_size != world:
        raise ValueError(f"tp_size={tp_size} does not match the TP group's size {world}")
    return world, rank


def _collective_device(group) -> torch.device:
    """NCCL collectives need CUDA tensors; gloo takes CPU tensors."""
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
