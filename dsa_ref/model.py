r"""Chapter 6, part 1: a small language model whose attention is `DSAttention`.

The model is nanoGPT's decoder with the attention of chapters 1-5 in every block:

    tokens ──embed──► x ─┬─ RMSNorm ─► attention ─► + ─┬─ RMSNorm ─► SwiGLU ─► + ─► ... ─► RMSNorm ─► lm_head
                         └───────────────────────────┘ └─────────────────────────┘

Tokens are packed (THD, chapter 4.1): ``tokens [T]`` with ``cu_seqlens``. The attention runs in
one of three **modes**:

* ``"dense"`` -- the dense MLA baseline: ``DSAttention``'s MLA weights in their dense form
  (chapter 1); the indexer does no work and receives no gradient. With a kernel backend
  (``"tilelang"``, ``"auto"``) the same attention runs in its absorbed form on the sparse-MLA
  kernel over every key of the window (`dense_attention_on_kernels`), as the warm-up's does: the
  readable dense form is far too slow at long context on a GPU.
* ``"dense_warmup"`` -- `DSAttention` in its dense warm-up stage: the same dense attention over
  the absorbed latent (chapter 2), plus the indexer's scores, its top-k and its KL loss against the
  dense attention.
* ``"sparse"`` -- `DSAttention` in its sparse stage: the main attention reads only each query's
  top-k keys; the indexer learns from the sparse KL.

So one set of weights moves through the recipe of chapter 6 (dense, warm-up, sparse) by changing
the mode. Sequences never attend to each other, so the attention may run on groups of whole
sequences (``seqs_per_call``) instead of the whole packed batch: the same numbers, but the
reference's score blocks are ``[L, H, L]`` per sequence instead of ``[T, H, T]`` over the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import functools

import torch
import torch.nn.functional as F
from torch import nn

from . import dispatch
from ._checks import check_int, check_rank
from .config import DSAConfig
from .dsa import DSAttention, set_indexer_loss_scale
from .layout import check_cu_seqlens, key_windows, one_sequence, positions
from .slot_path import SlotOps
from .streaming_loss import windowed_attention_on_slots
from .mla import RMSNorm

__all__ = ["ModelConfig", "SwiGLU", "Block", "DSALanguageModel", "ModelOutput", "MODES", "count_parameters",
           "dense_attention_on_kernels"]

MODES = ("dense", "dense_warmup", "sparse")


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of `DSALanguageModel`.

    Attributes:
        vocab_size: number of token ids.
        n_layers: number of blocks.
        attention: the `DSAConfig` of every block's attention (``attention.mla.dim`` is the model width).
        mlp_hidden: hidden width of the SwiGLU MLP.
        norm_eps: epsilon of the block and final RMSNorms.
        token_shift: add a learned embedding of the *previous* token of the same sequence to each
            token's embedding (RWKV's token shift, a width-2 version of the short convolutions of
            H3 and Based). It hands every position its predecessor, so associative recall needs one
            attention hop (find the earlier position whose predecessor is the asked key) instead of
            first learning a previous-token head; small models then learn the tasks of chapter 6
            in hundreds of steps instead of thousands. ``False`` gives the plain nanoGPT embedding.
    """

    vocab_size: int
    n_layers: int
    attention: DSAConfig
    mlp_hidden: int
    norm_eps: float = 1e-6
    token_shift: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layers", "mlp_hidden"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"invalid model config: {name}={value!r}, expected an int >= 1")
        if not isinstance(self.attention, DSAConfig):
            raise TypeError(f"attention must be a DSAConfig, got {type(self.attention).__name__}")

    @property
    def dim(self) -> int:
        """The model width (= ``attention.mla.dim``)."""
        return self.attention.mla.dim


# --8<-- [start:swiglu]
class SwiGLU(nn.Module):
    """The MLP of LLaMA and DeepSeek: ``w2(silu(w1 x) * w3 x)``, ``[T, dim] -> [T, dim]``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # [T, hidden] inside, [T, dim] out
# --8<-- [end:swiglu]


class BlockOutput(NamedTuple):
    """What a `Block` returns: the new residual stream and its attention's indexer results."""

    x: torch.Tensor  # [T, dim]
    indexer_loss: torch.Tensor | None  # scalar, mean over the attention calls; None in mode "dense"
    topk_indices: torch.Tensor | None  # int64 [T, topk] in the keys' packed index space; None in "dense"


class Block(nn.Module):
    """One pre-norm decoder block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    Args:
        config: the model's hyper-parameters.
        backend: `DSAttention`'s backend (``"reference"``, ``"tilelang"``, ``"auto"``).
        attn_dtype: dtype of the attention weights (the TileLang kernels take bfloat16); the
            residual stream, norms and MLP stay in the default dtype.
    """

    def __init__(self, config: ModelConfig, *, backend: str = "reference", attn_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attn = DSAttention(config.attention, backend=backend, dtype=attn_dtype)
        self.mlp_norm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = SwiGLU(config.dim, config.mlp_hidden)

    # --8<-- [start:block_forward]
    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, *, mode: str,
                seqs_per_call: int | None = None) -> BlockOutput:
        h = self.attn_norm(x)  # [T, dim]
        attn_out, loss, topk = self.attention(h, cu_seqlens, mode=mode, seqs_per_call=seqs_per_call)
        x = x + attn_out  # [T, dim]
        x = x + self.mlp(self.mlp_norm(x))  # [T, dim]
        return BlockOutput(x, loss, topk)
    # --8<-- [end:block_forward]

    # --8<-- [start:attention]
    def attention(self, h: torch.Tensor, cu_seqlens: torch.Tensor, *, mode: str,
                  seqs_per_call: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The attention of this block on groups of whole sequences.

        Returns ``(out [T, dim], indexer_loss or None, topk_indices [T, topk] or None)``; the indices
        are shifted into the packed index space of all ``T`` tokens (``-1`` stays ``-1``).
        """
        dtype = next(self.attn.parameters()).dtype
        outs, losses, topks = [], [], []
        for lo, hi, cu in sequence_groups(cu_seqlens, seqs_per_call):
            h_g = h[lo:hi].to(dtype)  # [T_g, dim]
            if mode == "dense":  # dense MLA, no indexer
                if self.attn.backend == "reference":
                    o = self.attn.mla(h_g, cu)  # [T_g, dim]: the dense form of chapter 1
                else:
                    o = dense_attention_on_kernels(self.attn, h_g, cu)  # [T_g, dim]: the same, on the kernels
                outs.append(o.to(h.dtype))
                continue
            res = self.attn(h_g, cu, stage=mode)
            outs.append(res.output.to(h.dtype))  # [T_g, dim]
            losses.append(res.indexer_loss)
            topks.append(torch.where(res.topk_indices >= 0, res.topk_indices + lo, res.topk_indices))  # [T_g, topk]
        out = torch.cat(outs, dim=0)  # [T, dim]
        if mode == "dense":
            return out, None, None
        return out, torch.stack(losses).mean(), torch.cat(topks, dim=0)
    # --8<-- [end:attention]


def dense_attention_on_kernels(attn: DSAttention, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``attn``'s dense causal MLA without its indexer, through its backend's sparse-MLA kernel.

    The absorbed queries attend to every key of their window as sparse attention over the window's
    slots (`dsa_ref.streaming_loss.windowed_attention_on_slots`), in query chunks; where the kernel
    declines (or ``backend="auto"`` without CUDA) `dsa_ref.dispatch.sparse_mla` runs the readable
    `dsa_ref.sparse_mla` instead. Equal to ``attn.mla(x, cu_seqlens)`` up to rounding.

    Args:
        attn: the block's `DSAttention`; x: ``[T, dim]``; cu_seqlens: int ``[num_seqs + 1]``.

    Returns:
        ``[T, dim]``.
    """
    cfg = attn.config.mla
    pos = positions(cu_seqlens)  # [T]
    starts, ends = key_windows(cu_seqlens)  # [T] each
    q, kv = attn.absorbed.absorbed_qkv(attn.mla.project(x, pos))  # [T, H, 576], [T, 576]
    ops = SlotOps(sparse_mla=functools.partial(dispatch.sparse_mla, backend=attn.backend),
                  attention_head_sum=None, index_scores_at=None)  # only the attention is needed
    o_latent, _ = windowed_attention_on_slots(q, kv, sm_scale=attn.mla.softmax_scale, d_v=cfg.kv_lora_rank,
                                              starts=starts, ends=ends, ops=ops)  # [T, H, r]
    return attn.absorbed.output(o_latent)  # [T, dim]


class ModelOutput(NamedTuple):
    """What `DSALanguageModel` returns.

    Attributes:
        logits: ``[T, vocab_size]`` next-token logits (float32).
        indexer_losses: one scalar KL loss per layer (empty in mode ``"dense"``). For logging and for
            the warm-up's optimiser; in mode ``"sparse"`` the layer outputs already carry their gradient.
        topk_indices: one int64 ``[T, topk]`` selection per layer, in packed index space (empty in ``"dense"``).
        hidden: the normalised input of each block's attention, ``[T, dim]`` per layer (only with
            ``return_hidden=True``; for measurements such as `attention_probs`).
    """

    logits: torch.Tensor
    indexer_losses: list[torch.Tensor]
    topk_indices: list[torch.Tensor]
    hidden: list[torch.Tensor]


class DSALanguageModel(nn.Module):
    """A decoder-only language model with DSA attention (nanoGPT-style, pre-norm, SwiGLU, RMSNorm).

    Args:
        config: the hyper-parameters.
        backend: the attention backend of every block.
        attn_dtype: dtype of the attention weights (``None``: the default dtype).

    The indexer's KL gradient reaches the model through `DSAttention`'s auto-scaler; its scale is set
    to ``1 / number of attention calls`` of a forward so that it is the mean over the groups.
    """

    def __init__(self, config: ModelConfig, *, backend: str = "reference", attn_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.embed_prev = nn.Embedding(config.vocab_size, config.dim) if config.token_shift else None
        self.blocks = nn.ModuleList(Block(config, backend=backend, attn_dtype=attn_dtype)
                                    for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.apply(_init_weights)

    def indexer_parameters(self) -> list[nn.Parameter]:
        """The parameters of every block's lightning indexer (what the dense warm-up trains)."""
        return [p for b in self.blocks for p in b.attn.indexer.parameters()]

    def main_parameters(self) -> list[nn.Parameter]:
        """Every parameter except the indexers' (what dense training trains)."""
        index_ids = {id(p) for p in self.indexer_parameters()}
        return [p for p in self.parameters() if id(p) not in index_ids]

    # --8<-- [start:model_forward]
    def forward(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor | None = None, *, mode: str = "sparse",
                seqs_per_call: int | None = None, return_hidden: bool = False) -> ModelOutput:
        """Next-token logits for packed causal sequences.

        Args:
            tokens: int ``[T]`` token ids of the packed sequences.
            cu_seqlens: int ``[num_seqs + 1]``; default one sequence of ``T`` tokens.
            mode: ``"dense"``, ``"dense_warmup"`` or ``"sparse"`` (see the module docs).
            seqs_per_call: sequences per attention call (``None``: all in one call); the result
                does not depend on it beyond float rounding.
            return_hidden: also return each block's attention input (`ModelOutput.hidden`).
        """
        tokens, cu = self._check(tokens, cu_seqlens, mode)
        groups = len(sequence_groups(cu, seqs_per_call))
        set_indexer_loss_scale(self, 1.0 / groups)  # the KL gradient is the mean over the attention calls
        x = self.embed(tokens)  # [T, dim]
        if self.embed_prev is not None:
            x = x + self.previous_token_embedding(tokens, cu)  # [T, dim]
        losses, topks, hidden = [], [], []
        for block in self.blocks:
            if return_hidden:
                hidden.append(block.attn_norm(x).detach())  # [T, dim]
            x, loss, topk = block(x, cu, mode=mode, seqs_per_call=seqs_per_call)  # [T, dim]
            if loss is not None:
                losses.append(loss)
                topks.append(topk)
        logits = self.lm_head(self.norm(x)).float()  # [T, vocab]
        return ModelOutput(logits, losses, topks, hidden)
    # --8<-- [end:model_forward]

    def previous_token_embedding(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """``embed_prev(tokens[t - 1])`` for every token, 0 at the first token of each sequence: ``[T, dim]``."""
        prev = torch.roll(tokens, 1)  # [T]; position 0 wraps, masked below
        first = torch.zeros_like(tokens, dtype=torch.bool)  # [T]
        first[cu_seqlens[:-1].clamp_max(max(tokens.shape[0] - 1, 0))] = tokens.shape[0] > 0
        e = self.embed_prev(prev)  # [T, dim]
        return torch.where(first[:, None], torch.zeros_like(e), e)

    def _check(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor | None, mode: str):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        check_int("tokens", tokens)
        check_rank("tokens", tokens, 1, "[T] packed token ids")
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size):
            raise ValueError(f"tokens must lie in [0, vocab_size={self.config.vocab_size}), "
                             f"got values in [{int(tokens.min())}, {int(tokens.max())}]")
        if cu_seqlens is None:
            return tokens, one_sequence(tokens.shape[0], device=tokens.device)
        cu = check_cu_seqlens(cu_seqlens).to(tokens.device)
        if int(cu[-1]) != tokens.shape[0]:
            raise ValueError(f"cu_seqlens must end at T={tokens.shape[0]} (the number of tokens), got {cu.tolist()[-4:]}")
        return tokens, cu


def sequence_groups(cu_seqlens: torch.Tensor, seqs_per_call: int | None) -> list[tuple[int, int, torch.Tensor]]:
    """Split packed sequences into groups of ``seqs_per_call`` whole sequences.

    Returns:
        ``[(lo, hi, cu_local)]``: token range ``[lo, hi)`` of each group and its own ``cu_seqlens``
        (starting at 0). ``None`` gives one group of everything.
    """
    n = cu_seqlens.numel() - 1
    if seqs_per_call is None or seqs_per_call >= n:
        return [(0, int(cu_seqlens[-1]), cu_seqlens)]
    if isinstance(seqs_per_call, bool) or not isinstance(seqs_per_call, int) or seqs_per_call < 1:
        raise ValueError(f"seqs_per_call must be an int >= 1 or None, got {seqs_per_call!r}")
    groups = []
    for first in range(0, n, seqs_per_call):
        cu = cu_seqlens[first: min(first + seqs_per_call, n) + 1]  # [g + 1]
        lo, hi = int(cu[0]), int(cu[-1])
        groups.append((lo, hi, cu - lo))
    return groups


def count_parameters(model: nn.Module, *, exclude_embeddings: bool = False) -> int:
    """Number of parameters (each tensor once); optionally without the token embedding and LM head."""
    skip = set()
    if exclude_embeddings and isinstance(model, DSALanguageModel):
        skip = {id(model.embed.weight), id(model.lm_head.weight)}
    return sum(p.numel() for p in model.parameters() if id(p) not in skip)


def _init_weights(module: nn.Module) -> None:
    """GPT-2's initialisation: normal(0, 0.02) for linear and embedding weights."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        with torch.no_grad():
            module.weight.normal_(0.0, 0.02)
