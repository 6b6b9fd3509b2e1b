r"""Chapter 2: absorbed MLA -- fold ``W_UK`` into the query and ``W_UV`` after attention.

The dense form (chapter 1) up-projects every cached latent ``c_kv[s]`` to per-head keys
``k_nope[s, h] = W_UK[h] c_kv[s]``. But the query only ever meets that key in a dot product, and a
dot product lets the matrix move to the other side:

$$
q^{\text{nope}}_{t,h} \cdot \big(W^{UK}_h\, c_s\big) \;=\; \big(W^{UK\,\top}_h\, q^{\text{nope}}_{t,h}\big) \cdot c_s .
$$

So each head's query is mapped *once* into the 512-dim latent space, and every key is just the
shared latent row ``[c_kv[s] ; k_pe[s]]`` (576 wide): attention becomes multi-query attention (MQA)
with a single KV head. Values work the same way on the other side of the softmax: attention
averages latents, and ``W_UV`` maps the average to each head's 128 value dims afterwards,

$$
\sum_s p_{t,h,s}\, W^{UV}_h c_s \;=\; W^{UV}_h \sum_s p_{t,h,s}\, c_s .
$$

Both steps are exact rewrites (associativity of matrix products), so the scores, the softmax scale
(``192 ** -0.5 * mscale ** 2``, *not* ``576 ** -0.5``) and the outputs are the same as the dense
form up to rounding. What changes is the cost: keys and values are never materialised per head.
This is the form DSA's sparse kernels use.
"""

from __future__ import annotations

import torch
from torch import nn

from ._checks import check_dim, check_rank
from .attention import dense_mla_attention
from .layout import key_windows, positions
from .mla import MLA, MLAProjections, tokens_cu_seqlens

__all__ = ["AbsorbedMLA", "absorb_query", "latent_kv", "apply_w_uv"]


# --8<-- [start:absorb]
def absorb_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """Map each head's no-position query into the latent space and append its rope part.

    Args:
        q_nope: ``[T, H, nope]``.
        q_pe: ``[T, H, rope]`` (already rotated).
        w_uk: ``[H, nope, r]``, the key half of ``wkv_b`` per head.

    Returns:
        ``[T, H, r + rope]`` (DeepSeek-V3.2: ``[T, 128, 576]``).
    """
    check_rank("q_nope", q_nope, 3, "[T, H, nope]")
    check_rank("w_uk", w_uk, 3, "[H, nope, r]")
    check_dim("w_uk", w_uk, 0, q_nope.shape[1], "q_nope's heads")
    check_dim("w_uk", w_uk, 1, q_nope.shape[2], "q_nope's head dim")
    q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)  # [T, H, r]
    return torch.cat([q_latent, q_pe], dim=-1)  # [T, H, r + rope]


def latent_kv(c_kv: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """The single shared KV head: ``[c_kv ; k_pe]``, ``[T, r] + [T, rope] -> [T, r + rope]``."""
    return torch.cat([c_kv, k_pe], dim=-1)  # [T, r + rope]


def apply_w_uv(o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Map each head's attention-averaged latent to its value dims: ``[T, H, r] -> [T, H, v]``."""
    return torch.einsum("thr,hvr->thv", o_latent, w_uv)  # [T, H, v]
# --8<-- [end:absorb]


class AbsorbedMLA(nn.Module):
    """MLA in its absorbed (MQA-over-the-latent) form, sharing the weights of a dense `MLA`.

    Args:
        mla: the dense module whose parameters are used (not copied): gradients of this module
            flow into ``mla``'s parameters, and both forms stay equal as training changes them.
    """

    def __init__(self, mla: MLA) -> None:
        super().__init__()
        if not isinstance(mla, MLA):
            raise TypeError(f"mla must be a dsa_ref.mla.MLA, got {type(mla).__name__}")
        self.mla = mla
        self.config = mla.config

    def absorbed_qkv(self, p: MLAProjections) -> tuple[torch.Tensor, torch.Tensor]:
        """Absorbed queries ``[T, H, r + rope]`` and latent KV rows ``[T, r + rope]``."""
        w_uk, _ = self.mla.kv_up_weights()
        return absorb_query(p.q_nope, p.q_pe, w_uk), latent_kv(p.c_kv, p.k_pe)

    def output(self, o_latent: torch.Tensor) -> torch.Tensor:
        """``W_UV`` then ``wo``: ``[T, H, r] -> [T, dim]``."""
        _, w_uv = self.mla.kv_up_weights()
        return self.mla.output(apply_w_uv(o_latent, w_uv))

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, *,
                chunk_size: int | None = None) -> torch.Tensor:
        """Causal absorbed MLA over packed sequences; equals ``self.mla(x, cu_seqlens)`` up to rounding.

        Args:
            x: ``[T, dim]``.
            cu_seqlens: int ``[num_seqs + 1]``; default one sequence.
            chunk_size: queries per attention chunk (memory only).

        Returns:
            ``[T, dim]``.
        """
        cu = tokens_cu_seqlens(x, cu_seqlens)
        p = self.mla.project(x, positions(cu))
        q, kv = self.absorbed_qkv(p)  # [T, H, 576], [T, 576]
        starts, ends = key_windows(cu)
        o_latent, _ = dense_mla_attention(q, kv, sm_scale=self.mla.softmax_scale,
                                          d_v=self.config.kv_lora_rank, starts=starts, ends=ends,
                                          chunk_size=chunk_size)  # [T, H, r]
        return self.output(o_latent)
