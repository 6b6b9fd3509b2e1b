r"""Chapter 3.2, part 3: the DSA attention layer and its two training stages.

`DSAttention` puts the pieces together for one layer, on packed tokens:

1. MLA projections (chapter 1), absorbed into MQA over the latent (chapter 2);
2. the lightning indexer scores every (query, key) pair of the window, from *detached* inputs;
3. each query keeps its top-k keys;
4. main attention: dense over the window (``stage="dense_warmup"``) or sparse over the selection
   (``stage="sparse"``);
5. the indexer KL loss against the main attention (detached), over the window or the selection.

**Index sharing** (GLM-5's IndexShare, Megatron-LM's ``dsa_indexer_topk_freq``): a layer built with
``has_indexer=False`` owns no indexer. It takes the top-k of an earlier layer that does --
``layer(x, topk_indices=earlier.topk_indices)`` -- and skips steps 2, 3 and 5: it attends over those
keys (sparse stage) or densely (warm-up), and its indexer loss is 0 with no gradient. Only layers
owning an indexer have an indexer loss.

**Training stages** (DeepSeek-V3.2, section 2.1):

* ``"dense_warmup"`` -- the main attention stays dense and the indexer learns to imitate it.
  The KL gradient reaches only the indexer; freeze everything else by optimising only
  `trainable_parameters` (the paper trains only the indexer here).
* ``"sparse"`` -- the main attention uses the top-k keys, all parameters train: the main model
  from the language-model loss, the indexer only from the sparse KL (its inputs are detached).

**One backward for both losses.** The layer output passes through `IndexerLossAutoScaler`, an
identity in forward whose backward also sends ``loss_scale`` as the gradient of the indexer loss.
So ``lm_loss.backward()`` trains the indexer too, and ``loss_scale`` is where micro-batching
(``1 / num_microbatches``) and gradient-averaging conventions enter.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import nn

from . import dispatch
from ._checks import check_dim, check_int, check_rank, check_tensor
from .absorbed_mla import AbsorbedMLA
from .attention import dense_mla_attention
from .config import DSAConfig
from .fp8 import fp8_selection_operands
from .indexer import LightningIndexer
from .layout import positions_and_windows
from .mla import MLA, check_tokens, tokens_cu_seqlens
from .slot_path import SlotOps, attention_and_loss_on_slots
from .streaming import streamed_topk_indices
from .streaming_slots import chunked_attention_head_sum, chunked_index_scores_at, chunked_sparse_mla
from .streaming_loss import streamed_indexer_loss, windowed_attention_on_slots

__all__ = ["DSAttention", "DSAOutput", "IndexerLossAutoScaler", "STAGES", "check_shared_topk",
           "set_indexer_loss_scale"]

STAGES = ("dense_warmup", "sparse")


# --8<-- [start:autoscaler]
class IndexerLossAutoScaler(torch.autograd.Function):
    """Identity on the layer output that injects the indexer loss into the backward pass.

    ``apply(output, loss, scale)`` returns ``output`` unchanged. In backward it passes the output
    gradient through and gives ``loss`` the gradient ``scale`` -- as if ``scale * loss`` had been
    added to the final loss -- so a training loop calls ``backward()`` once.
    """

    @staticmethod
    def forward(ctx, output: torch.Tensor, loss: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (loss,) = ctx.saved_tensors
        if isinstance(ctx.scale, torch.Tensor):
            return grad_output, torch.ones_like(loss) * ctx.scale.to(dtype=loss.dtype, device=loss.device), None
        return grad_output, torch.full_like(loss, ctx.scale), None  # a number: no copy to the device
# --8<-- [end:autoscaler]


class DSAOutput(NamedTuple):
    """What `DSAttention` returns.

    Attributes:
        output: ``[T, dim]`` the layer output (carries the indexer-loss gradient, see the auto-scaler).
        indexer_loss: the scalar KL loss of this call (for logging: ``.detach()`` it; do not add it
            to the training loss again, the output already carries its gradient).
        topk_indices: int64 ``[T, topk]`` the selection (``-1`` = unused slot).
    """

    output: torch.Tensor
    indexer_loss: torch.Tensor
    topk_indices: torch.Tensor


class DSAttention(nn.Module):
    """DeepSeek Sparse Attention: absorbed MLA + lightning indexer + top-k + sparse attention + KL loss.

    Args:
        config: the layer's hyper-parameters.
        stage: ``"dense_warmup"`` or ``"sparse"`` (see the module docs); a forward call can override it.
        backend: ``"reference"``, ``"tilelang"`` or ``"auto"`` (see `dsa_ref.dispatch`).
        loss_coeff: coefficient of the indexer loss.
        loss_reduction: ``"mean"`` over valid query rows or ``"sum"``.
        has_indexer: ``False`` builds a layer without an indexer that attends over the top-k indices
            of an earlier layer (index sharing; pass them as ``topk_indices`` to `forward`).
        device, dtype: for the weights (``indexer.weights_proj`` stays float32).

    Attributes:
        loss_scale: gradient the indexer loss receives in backward (default 1.0); set it with
            `set_indexer_loss_scale` (micro-batching and context parallelism do).
        indexer: the `LightningIndexer`, or ``None`` for a layer built with ``has_indexer=False``.

    ``state_dict()`` holds every weight once, under ``mla.*`` and ``indexer.*``: `absorbed` is a
    view of ``mla`` built on access, not a submodule (state dicts saved with the older duplicate
    ``absorbed.mla.*`` keys still load).
    """

    def __init__(self, config: DSAConfig, *, stage: str = "sparse", backend: str = "reference",
                 loss_coeff: float = 1.0, loss_reduction: str = "mean", has_indexer: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        if not isinstance(config, DSAConfig):
            raise TypeError(f"config must be a DSAConfig, got {type(config).__name__}")
        self.config = config
        self.stage = _check_stage(stage)
        self.backend = dispatch.check_backend(backend)
        self.loss_coeff = float(loss_coeff)
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        self.loss_reduction = loss_reduction
        self.loss_scale: float | torch.Tensor = 1.0
        if not isinstance(has_indexer, bool):
            raise TypeError(f"has_indexer must be a bool, got {type(has_indexer).__name__}")
        self.mla = MLA(config.mla, device=device, dtype=dtype)
        self.indexer = LightningIndexer(config, device=device, dtype=dtype) if has_indexer else None
        self._register_load_state_dict_pre_hook(_drop_absorbed_duplicates)

    @property
    def has_indexer(self) -> bool:
        """Whether this layer owns an indexer (``False``: it attends over another layer's top-k)."""
        return self.indexer is not None

    @property
    def absorbed(self) -> AbsorbedMLA:
        """The absorbed form of ``self.mla``: a view sharing its weights, built on access (not a submodule)."""
        return AbsorbedMLA(self.mla)

    # --8<-- [start:trainable_parameters]
    def trainable_parameters(self, stage: str | None = None) -> list[nn.Parameter]:
        """The parameters to optimise in a stage: only the indexer's in the dense warm-up, all in sparse.

        A layer without an indexer has nothing to train in the warm-up (an empty list).
        """
        stage = _check_stage(self.stage if stage is None else stage)
        if stage == "dense_warmup":
            return [] if self.indexer is None else list(self.indexer.parameters())
        return list(self.parameters())
    # --8<-- [end:trainable_parameters]

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, *,
                stage: str | None = None, loss_row_mask: torch.Tensor | None = None,
                topk_indices: torch.Tensor | None = None) -> DSAOutput:
        """One DSA layer over packed causal sequences.

        Args:
            x: ``[T, dim]`` hidden states (after the input norm).
            cu_seqlens: int ``[num_seqs + 1]``; default one sequence of ``T`` tokens.
            stage: overrides ``self.stage`` for this call.
            loss_row_mask: optional bool ``[T]``; ``False`` rows (padding tokens) are left out of the
                indexer loss and its mean. Pack padding as sequences of its own in ``cu_seqlens`` so
                that no real query attends to it.
            topk_indices: int ``[T, K]``, only for a layer without an indexer (``has_indexer=False``):
                the selection of an earlier layer (its `DSAOutput.topk_indices`), ``-1`` = unused slot;
                every other index must lie in its query's key window.

        Returns:
            `DSAOutput` ``(output [T, dim], indexer_loss [], topk_indices [T, topk])``; a layer without
            an indexer returns a zero loss (no gradient) and the ``topk_indices`` it was given.
        """
        check_tokens(x, self.config.mla.dim)
        cu = tokens_cu_seqlens(x, cu_seqlens)
        query_index = torch.arange(x.shape[0], device=x.device)  # [T]
        shared = {} if topk_indices is None else {"topk_indices": topk_indices}
        return self.attend(x, cu, query_index, gather=lambda t: t, stage=stage, loss_row_mask=loss_row_mask,
                           **shared)

    # --8<-- [start:attend]
    def attend(self, x: torch.Tensor, cu_seqlens: torch.Tensor, query_index: torch.Tensor, *,
               gather, stage: str | None = None, num_loss_rows: torch.Tensor | int | None = None,
               head_sum_reduce=None, loss_row_mask: torch.Tensor | None = None,
               topk_indices: torch.Tensor | None = None) -> DSAOutput:
        """The layer for the queries ``query_index`` of the packed sequences ``cu_seqlens``.

        ``x`` holds the tokens ``query_index`` (all tokens without context parallelism, a rank's
        shard with it); ``gather`` turns per-token key tensors of these tokens into all keys in
        global packed order (identity without CP, an all-gather with it); ``num_loss_rows`` is the
        divisor of the mean loss (the global number of valid rows under CP); ``head_sum_reduce``
        combines the KL target's sum over this module's heads with the other ranks' heads (an
        all-reduce under tensor parallelism, see `dsa_ref.tensor_parallel`; ``None``: all heads are here);
        ``loss_row_mask`` (bool, one per query) leaves padding rows out of the indexer loss;
        ``topk_indices`` (``[T_q, K]``, global key indices) is the shared selection of a layer
        without an indexer (see `forward`).
        """
        stage = _check_stage(self.stage if stage is None else stage)
        if self.indexer is None:
            return self._attend_shared(x, cu_seqlens, query_index, gather=gather, stage=stage,
                                       topk_indices=topk_indices)
        if topk_indices is not None:
            raise ValueError("topk_indices is only for a layer built with has_indexer=False; this layer owns an "
                             "indexer and selects its own keys")
        cfg = self.config
        # [T_q] each: RoPE positions, key windows in global key order (the layout is read back once)
        pos, starts, ends = positions_and_windows(cu_seqlens, query_index)

        # 1. MLA projections, absorbed: queries [T_q, H, 576], this shard's latent rows [T_q, 576]
        p = self.mla.project(x, pos)
        q, kv_local = self.absorbed.absorbed_qkv(p)
        kv = gather(kv_local)  # [S, 576]

        # 2. indexer on detached inputs: it learns from its KL loss only
        q_i, k_i_local, w_i = self.indexer.project(x.detach(), p.qr.detach(), pos)
        k_i = gather(k_i_local)  # [S, D_I]

        # 3. top-k selection (no gradient), streamed: the [T_q, S] index scores never exist (chapter 7);
        #    with indexer.fp8 by fp8 scores (the kernel, or the simulation on dequantised operands)
        fp8 = cfg.indexer.fp8
        select = dispatch.chunk_selector(self.backend, q_i=q_i, k_i=k_i, w_i=w_i, fp8=fp8)
        sel_q, sel_k, sel_w = q_i.detach(), k_i.detach(), w_i.detach()
        if fp8 and select is None:
            sel_q, sel_k, sel_w = fp8_selection_operands(sel_q, sel_k, sel_w)
        topk = streamed_topk_indices(sel_q, sel_k, sel_w, cfg.indexer.topk, starts=starts, ends=ends,
                                     relu=cfg.indexer.use_relu, chunk_selector=select)  # [T_q, topk]

        # 4-5. main attention and the indexer KL loss against it (detached); kernels where they run.
        #      Their slots are the layer's own selection or window slots, in range by construction:
        #      the attention kernel skips its index check and the device sync it costs
        ops = dispatch.slot_ops(self.backend, q=q, kv=kv, q_i=q_i, k_i=k_i, w_i=w_i, validate=False)
        loss_args = dict(reduction=self.loss_reduction, coeff=self.loss_coeff, num_rows=num_loss_rows,
                         head_sum_reduce=head_sum_reduce)
        if stage == "sparse":  # attention over the selection; the loss on its [T_q, K] slots (`slot_path`)
            readable = SlotOps(sparse_mla=functools.partial(dispatch.sparse_mla, backend=self.backend,
                                                            reference=chunked_sparse_mla),
                               attention_head_sum=chunked_attention_head_sum, index_scores_at=chunked_index_scores_at)
            o_latent, loss = attention_and_loss_on_slots(
                q, kv, q_i, k_i, w_i, topk, stage=stage, sm_scale=self.mla.softmax_scale, d_v=cfg.mla.kv_lora_rank,
                relu=cfg.indexer.use_relu, starts=starts, ends=ends, row_mask=loss_row_mask,
                ops=readable if ops is None else ops, **loss_args)
            return self._finish(o_latent, loss, topk)

        # dense warm-up: attention over the window; the loss streamed over key tiles (`streaming_loss`)
        if ops is None:
            o_latent, lse = dense_mla_attention(q, kv, sm_scale=self.mla.softmax_scale, d_v=cfg.mla.kv_lora_rank,
                                                starts=starts, ends=ends)  # [T_q, H, r], [T_q, H]
        else:
            o_latent, lse = windowed_attention_on_slots(q, kv, sm_scale=self.mla.softmax_scale,
                                                        d_v=cfg.mla.kv_lora_rank, starts=starts, ends=ends, ops=ops)
        loss = streamed_indexer_loss(q_i, k_i, w_i, q.detach(), kv.detach(), lse.detach(),
                                     sm_scale=self.mla.softmax_scale, relu=cfg.indexer.use_relu, starts=starts,
                                     ends=ends, row_mask=loss_row_mask, ops=ops, **loss_args)
        return self._finish(o_latent, loss, topk)
    # --8<-- [end:attend]

    # --8<-- [start:attend_shared]
    def _attend_shared(self, x: torch.Tensor, cu_seqlens: torch.Tensor, query_index: torch.Tensor, *,
                       gather, stage: str, topk_indices: torch.Tensor | None) -> DSAOutput:
        """`attend` for a layer without an indexer: attention over another layer's top-k, no indexer loss."""
        cfg = self.config
        # [T_q] each: RoPE positions, key windows in global key order (the layout is read back once)
        pos, starts, ends = positions_and_windows(cu_seqlens, query_index)
        topk = check_shared_topk(topk_indices, starts, ends)  # [T_q, K]
        p = self.mla.project(x, pos)
        q, kv_local = self.absorbed.absorbed_qkv(p)  # [T_q, H, 576], [T_q, 576]
        kv = gather(kv_local)  # [S, 576]
        if stage == "dense_warmup":
            o_latent, _ = dense_mla_attention(q, kv, sm_scale=self.mla.softmax_scale,
                                              d_v=cfg.mla.kv_lora_rank, starts=starts, ends=ends)  # [T_q, H, r]
        else:
            o_latent, _ = dispatch.sparse_mla(q, kv, topk, sm_scale=self.mla.softmax_scale, d_v=cfg.mla.kv_lora_rank,
                                              backend=self.backend, reference=chunked_sparse_mla)  # [T_q, H, r]
        loss = torch.zeros((), dtype=torch.float64 if q.dtype == torch.float64 else torch.float32,
                           device=x.device)  # no indexer, no loss
        return self._finish(o_latent, loss, topk)
    # --8<-- [end:attend_shared]

    def _finish(self, o_latent: torch.Tensor, loss: torch.Tensor, topk: torch.Tensor) -> DSAOutput:
        """Output projection, and the indexer loss's gradient attached to the output (auto-scaler)."""
        out = self.absorbed.output(o_latent)  # [T_q, dim]
        if torch.is_grad_enabled() and loss.requires_grad:
            out = IndexerLossAutoScaler.apply(out, loss, self.loss_scale)
        return DSAOutput(out, loss, topk)


def set_indexer_loss_scale(module: nn.Module, scale: float | torch.Tensor) -> None:
    """Set ``loss_scale`` on every `DSAttention` inside ``module`` (e.g. ``1 / num_microbatches``)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float, torch.Tensor)):
        raise TypeError(f"scale must be a float or a scalar tensor, got {type(scale).__name__}")
    if isinstance(scale, torch.Tensor) and scale.numel() != 1:
        raise ValueError(f"scale must be a scalar, got shape {tuple(scale.shape)}")
    for m in module.modules():
        if isinstance(m, DSAttention):
            m.loss_scale = scale


def check_shared_topk(topk_indices: torch.Tensor | None, starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Check the top-k a layer without an indexer was given: int ``[T_q, K]``, ``-1`` or inside each key window.

    Returns the indices as int64. Raises ValueError naming the first bad entry (an index outside its
    query's window would let a query read a future token or another sequence).
    """
    if topk_indices is None:
        raise ValueError("this layer has no indexer (has_indexer=False): pass topk_indices, the selection of an "
                         "earlier layer that owns one (its DSAOutput.topk_indices)")
    check_tensor("topk_indices", topk_indices)
    check_int("topk_indices", topk_indices)
    check_rank("topk_indices", topk_indices, 2, "[T, K]")
    check_dim("topk_indices", topk_indices, 0, starts.shape[0], "one row per query token")
    if topk_indices.shape[1] < 1:
        raise ValueError(f"topk_indices must have at least one slot per row, got shape {tuple(topk_indices.shape)}")
    idx = topk_indices.to(device=starts.device, dtype=torch.int64)  # [T_q, K]
    inside = (idx >= starts[:, None]) & (idx < ends[:, None])  # [T_q, K]
    bad = ~(inside | (idx == -1))
    if bool(bad.any()):
        t, j = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"topk_indices[{t}, {j}] = {int(idx[t, j])} lies outside query {t}'s key window "
                         f"[{int(starts[t])}, {int(ends[t])}) (use -1 for an unused slot)")
    return idx


def _drop_absorbed_duplicates(state_dict, prefix, *args) -> None:
    """Load-state-dict pre-hook: drop the ``absorbed.mla.*`` copies older versions saved beside ``mla.*``."""
    for key in [k for k in state_dict if k.startswith(prefix + "absorbed.mla.")]:
        del state_dict[key]


def _check_stage(stage: str) -> str:
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    return stage
