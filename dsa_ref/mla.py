"""Chapter 1: dense multi-head latent attention (MLA), as DeepSeek-V3.2 defines it.

MLA shrinks what attention has to remember per token. Instead of 128 heads of keys and values,
each token stores one **latent** ``c_kv`` (512 numbers) plus one small **shared rope key** ``k_pe``
(64 numbers). Keys and values of every head are up-projected from the latent on the fly:

    x ──wq_a──► q latent ──RMSNorm──► qr ──wq_b──► q = [q_nope | q_pe]      per head 128 | 64
    x ──wkv_a─► [c_kv | k_pe]; c_kv ──RMSNorm──► c_kv ──wkv_b──► [k_nope | v] per head 128 | 128

Position enters only through the **decoupled** rope parts: ``q_pe`` (per head) and ``k_pe``
(shared by all heads) are rotated with RoPE (interleaved pairs), while ``q_nope`` and ``k_nope``
carry no position. That is what later lets chapter 2 fold ``W_UK`` into the query.

The dense form attends with per-head keys ``k = [k_nope | k_pe]`` (192 wide) and values ``v`` (128
wide), with softmax scale ``192 ** -0.5 * mscale ** 2``, then projects the heads back with ``wo``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ._checks import accumulation_dtype, check_dim, check_float, check_int, check_rank, check_tensor
from .attention import dense_mla_attention, windowed_attention
from .config import MLAConfig
from .layout import _read_layout, key_windows, one_sequence, positions
from .rope import apply_rope, rope_cos_sin, rope_dtype_for, rope_inv_freq

__all__ = ["RMSNorm", "MLA", "MLAProjections", "dense_mla_attention", "check_tokens"]


# --8<-- [start:rmsnorm]
class RMSNorm(nn.Module):
    """Root-mean-square norm ``x / sqrt(mean(x^2) + eps) * weight``, computed in float32 (float64 for float64)."""

    def __init__(self, dim: int, eps: float = 1e-6, *, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(accumulation_dtype(x))
        normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (normed * self.weight.to(xf.dtype)).to(x.dtype)
# --8<-- [end:rmsnorm]


@dataclass
class MLAProjections:
    """What MLA computes per token before attention (all rope parts already rotated).

    Attributes:
        qr: ``[T, q_lora_rank]`` the normalised query latent (the indexer reads it too).
        q_nope: ``[T, H, qk_nope_head_dim]``.
        q_pe: ``[T, H, qk_rope_head_dim]`` rotated.
        c_kv: ``[T, kv_lora_rank]`` the normalised KV latent (what a KV cache stores).
        k_pe: ``[T, qk_rope_head_dim]`` rotated, one head shared by all query heads.
    """

    qr: torch.Tensor
    q_nope: torch.Tensor
    q_pe: torch.Tensor
    c_kv: torch.Tensor
    k_pe: torch.Tensor


class MLA(nn.Module):
    """Dense multi-head latent attention on packed tokens.

    Args:
        config: the MLA hyper-parameters.
        device, dtype: where and in which dtype to create the weights.

    The weights carry DeepSeek's names: ``wq_a``, ``q_norm``, ``wq_b``, ``wkv_a``, ``kv_norm``,
    ``wkv_b``, ``wo`` (no biases). `dsa_ref.absorbed_mla.AbsorbedMLA` reuses these same weights.
    """

    def __init__(self, config: MLAConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        if not isinstance(config, MLAConfig):
            raise TypeError(f"config must be an MLAConfig, got {type(config).__name__}")
        self.config = c = config
        kw = dict(device=device, dtype=dtype)
        self.wq_a = nn.Linear(c.dim, c.q_lora_rank, bias=False, **kw)
        self.q_norm = RMSNorm(c.q_lora_rank, c.norm_eps, **kw)
        self.wq_b = nn.Linear(c.q_lora_rank, c.n_heads * c.qk_head_dim, bias=False, **kw)
        self.wkv_a = nn.Linear(c.dim, c.kv_lora_rank + c.qk_rope_head_dim, bias=False, **kw)
        self.kv_norm = RMSNorm(c.kv_lora_rank, c.norm_eps, **kw)
        self.wkv_b = nn.Linear(c.kv_lora_rank, c.n_heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False, **kw)
        self.wo = nn.Linear(c.n_heads * c.v_head_dim, c.dim, bias=False, **kw)

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim ** -0.5 * mscale ** 2`` (DeepSeek-V3.2: 0.13523)."""
        return self.config.softmax_scale

    # --8<-- [start:kv_up_weights]
    def kv_up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK [H, nope, r]`` and ``W_UV [H, v, r]``: the two halves of ``wkv_b`` per head (views, not copies)."""
        c = self.config
        w = self.wkv_b.weight.view(c.n_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)  # [H, nope+v, r]
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim:]
    # --8<-- [end:kv_up_weights]

    # --8<-- [start:project]
    def project(self, x: torch.Tensor, pos: torch.Tensor) -> MLAProjections:
        """The per-token projections of MLA.

        Args:
            x: ``[T, dim]`` hidden states.
            pos: int ``[T]`` RoPE position of each token inside its sequence (`dsa_ref.layout.positions`).
        """
        c = self.config
        check_tokens(x, c.dim)
        check_int("pos", pos)
        check_rank("pos", pos, 1, "[T]")
        check_dim("pos", pos, 0, x.shape[0], "one position per token of x")
        T = x.shape[0]
        qr = self.q_norm(self.wq_a(x))  # [T, q_lora]
        q = self.wq_b(qr).view(T, c.n_heads, c.qk_head_dim)  # [T, H, nope+rope]
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)  # [T, H, nope], [T, H, rope]
        c_kv, k_pe = self.wkv_a(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)  # [T, r], [T, rope]
        c_kv = self.kv_norm(c_kv)  # [T, r]
        # frequencies in float64 from the config, never a module buffer that .to(bfloat16) would round
        inv_freq = rope_inv_freq(c.qk_rope_head_dim, c.rope, device=pos.device)  # [rope/2]
        cos, sin = rope_cos_sin(pos, inv_freq, dtype=rope_dtype_for(x))  # [T, rope/2] each
        q_pe = apply_rope(q_pe, cos, sin, interleaved=c.rope_interleaved)  # [T, H, rope]
        k_pe = apply_rope(k_pe, cos, sin, interleaved=c.rope_interleaved)  # [T, rope]
        return MLAProjections(qr=qr, q_nope=q_nope, q_pe=q_pe, c_kv=c_kv, k_pe=k_pe)
    # --8<-- [end:project]

    # --8<-- [start:dense_qkv]
    def dense_qkv(self, p: MLAProjections) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-head queries, keys and values of the dense form: ``[T, H, 192]``, ``[T, H, 192]``, ``[T, H, 128]``."""
        c = self.config
        T = p.c_kv.shape[0]
        kv = self.wkv_b(p.c_kv).view(T, c.n_heads, c.qk_nope_head_dim + c.v_head_dim)  # [T, H, nope+v]
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)  # [T, H, nope], [T, H, v]
        k_pe = p.k_pe[:, None, :].expand(T, c.n_heads, c.qk_rope_head_dim)  # [T, H, rope]: shared by all heads
        q = torch.cat([p.q_nope, p.q_pe], dim=-1)  # [T, H, 192]
        k = torch.cat([k_nope, k_pe], dim=-1)  # [T, H, 192]
        return q, k, v
    # --8<-- [end:dense_qkv]

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """``wo`` over the concatenated heads: ``[T, H, v] -> [T, dim]``."""
        return self.wo(o.flatten(1))  # [T, dim]

    # --8<-- [start:forward]
    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, *,
                chunk_size: int | None = None) -> torch.Tensor:
        """Causal dense MLA over packed sequences.

        Args:
            x: ``[T, dim]`` hidden states of the packed sequences.
            cu_seqlens: int ``[num_seqs + 1]``; default one sequence of ``T`` tokens.
            chunk_size: queries per attention chunk (memory only).

        Returns:
            ``[T, dim]``.
        """
        cu = tokens_cu_seqlens(x, cu_seqlens)
        p = self.project(x, positions(cu))
        q, k, v = self.dense_qkv(p)
        starts, ends = key_windows(cu)
        o, _ = windowed_attention(q, k, v, sm_scale=self.softmax_scale, starts=starts, ends=ends,
                                  chunk_size=chunk_size)  # [T, H, v]
        return self.output(o)
    # --8<-- [end:forward]


def check_tokens(x: torch.Tensor, dim: int, name: str = "x") -> torch.Tensor:
    """Raise unless ``x`` is a float ``[T, dim]`` tensor of packed tokens."""
    check_tensor(name, x)
    check_float(name, x)
    check_rank(name, x, 2, "[T, dim] (packed tokens; flatten a [B, S, dim] batch and pass cu_seqlens)")
    check_dim(name, x, 1, dim, "the config's dim")
    return x


def tokens_cu_seqlens(x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """Validated ``cu_seqlens`` for the tokens ``x`` (default: one sequence); it must end at ``T``."""
    check_tensor("x", x)
    if cu_seqlens is None:
        return one_sequence(x.shape[0], device=x.device)
    cu, _, total = _read_layout(cu_seqlens, None, "cu_seqlens")  # one read back to the host
    cu = cu.to(x.device)
    if total != x.shape[0]:
        raise ValueError(f"cu_seqlens must end at T={x.shape[0]} (the tokens of x), got {cu.tolist()[-4:]}")
    return cu
