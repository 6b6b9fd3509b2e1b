r"""Chapter 3.1: the lightning indexer and top-k selection.

DSA lets every query attend to only ``k`` keys (DeepSeek-V3.2: 2048). Which keys is decided by a
small, cheap scorer, the **lightning indexer**:

$$
I_{t,s} = \sum_{j=1}^{H_I} w_{t,j}\, \operatorname{ReLU}\!\big(q_{t,j} \cdot k_s\big),
$$

with ``H_I = 64`` indexer heads of dim ``D_I = 128``, one key ``k_s`` per token shared by all indexer
heads, and per-query head weights ``w_{t,j}`` (which may be negative). The constants
``H_I ** -0.5 * D_I ** -0.5`` are folded into ``w``. Where things come from (DeepSeek-V3.2):

* ``q = wq_b(qr)``, from the MLA's normalised query latent ``qr``;
* ``k = LayerNorm(wk(x))``, from the hidden state;
* RoPE (half-split layout, unlike MLA) on the first 64 dims of q and k -- pe first, then nope;
* optionally the same orthonormal Hadamard rotation on q and k: ``(Hq)·(Hk) = q·k``, so it
  changes nothing in exact arithmetic; it spreads outliers before fp8 quantisation;
* ``w = weights_proj(x) * H_I ** -0.5 * D_I ** -0.5``, computed in float32.

Then each query keeps the ``topk`` highest-scoring keys of its window (`topk_indices`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ._checks import (
    accumulation_dtype,
    check_dim,
    check_float,
    check_int,
    check_positive_int,
    check_rank,
    check_same_device,
    check_windows,
)
from .attention import (DEFAULT_CHUNK_ELEMENTS, _reads_any, auto_chunk_size, ordinary_rows, run_chunked, select_rows,
                        split_window_keys, window_breaks, window_span)
from .config import DSAConfig
from .layout import key_windows, positions
from .mla import check_tokens, tokens_cu_seqlens
from .rope import apply_rope, rope_cos_sin, rope_dtype_for, rope_inv_freq

__all__ = ["LightningIndexer", "lightning_indexer", "index_scores_at", "topk_indices", "hadamard_matrix", "rotate_activation"]


def hadamard_matrix(n: int, *, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix ``H_n / sqrt(n)`` (symmetric, so its own inverse).

    Args:
        n: size, a power of two.

    Returns:
        ``[n, n]``.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n & (n - 1):
        raise ValueError(f"hadamard_matrix: n must be a power of two, got {n!r}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        # Sylvester's construction: H_2m = [[H_m, H_m], [H_m, -H_m]]
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return (h / n ** 0.5).to(dtype=dtype, device=device)


@functools.lru_cache(maxsize=16)
def _hadamard_on(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`hadamard_matrix` built once per ``(n, dtype, device)``: a layer step copies nothing to the device."""
    return hadamard_matrix(n, dtype=dtype, device=device)


def rotate_activation(x: torch.Tensor) -> torch.Tensor:
    """Multiply the last dim of ``x`` by the orthonormal Hadamard matrix (``[..., d] -> [..., d]``)."""
    h = _hadamard_on(x.shape[-1], accumulation_dtype(x), x.device)  # [d, d], shared: never written
    return (x.to(h.dtype) @ h).to(x.dtype)


class LightningIndexer(nn.Module):
    """The lightning indexer of one DSA layer.

    Args:
        config: the layer's `DSAConfig` (the indexer reads ``mla.dim``, ``mla.q_lora_rank`` and the RoPE settings).
        device, dtype: where and in which dtype to create the weights; ``weights_proj`` is kept in
            float32 (float64 when ``dtype`` is float64), as DeepSeek-V3.2 does.

    Parameters: ``wq_b`` (``q_lora_rank -> H_I * D_I``), ``wk`` (``dim -> D_I``), ``k_norm``
    (LayerNorm over ``D_I``), ``weights_proj`` (``dim -> H_I``).
    """

    def __init__(self, config: DSAConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        if not isinstance(config, DSAConfig):
            raise TypeError(f"config must be a DSAConfig, got {type(config).__name__}")
        self.config = config
        ic, mc = config.indexer, config.mla
        kw = dict(device=device, dtype=dtype)
        self.wq_b = nn.Linear(mc.q_lora_rank, ic.n_heads * ic.head_dim, bias=False, **kw)
        self.wk = nn.Linear(mc.dim, ic.head_dim, bias=False, **kw)
        self.k_norm = nn.LayerNorm(ic.head_dim, eps=ic.k_norm_eps, **kw)
        w_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.weights_proj = nn.Linear(mc.dim, ic.n_heads, bias=False, device=device, dtype=w_dtype)

    @property
    def weight_scale(self) -> float:
        """``H_I ** -0.5 * D_I ** -0.5``, folded into the head weights."""
        ic = self.config.indexer
        return ic.n_heads ** -0.5 * ic.head_dim ** -0.5

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """RoPE on the first ``rope_head_dim`` channels of ``[T, ..., D_I]`` (pe first, then nope)."""
        ic = self.config.indexer
        x_pe, x_nope = x.split([ic.rope_head_dim, ic.head_dim - ic.rope_head_dim], dim=-1)
        inv_freq = rope_inv_freq(ic.rope_head_dim, self.config.mla.rope, device=pos.device)  # float64, never rounded
        cos, sin = rope_cos_sin(pos, inv_freq, dtype=rope_dtype_for(x))  # [T, rope/2] each
        x_pe = apply_rope(x_pe, cos, sin, interleaved=ic.rope_interleaved)
        return torch.cat([x_pe, x_nope], dim=-1)  # [T, ..., D_I]

    def forward(self, x: torch.Tensor, qr: torch.Tensor, cu_seqlens: torch.Tensor | None = None, *,
                relu: bool | None = None) -> torch.Tensor:
        """The indexer on its own: index scores of packed causal sequences.

        Projects queries, keys and head weights at each token's RoPE position in its own sequence
        (`project`), then scores every key of each query's causal window (`lightning_indexer`).
        ``topk_indices(indexer(x, qr, cu_seqlens), topk)`` is the selection `dsa_ref.DSAttention`
        makes; the layer itself calls `project` and scores with its backend.

        Args:
            x: ``[T, dim]`` hidden states (the layer's input after its norm).
            qr: ``[T, q_lora_rank]`` MLA's normalised query latent of the same tokens.
            cu_seqlens: int ``[num_seqs + 1]`` packed sequence boundaries; default one sequence.
            relu: the ReLU of the scores; default ``config.indexer.use_relu``.

        Returns:
            ``[T, T]`` float32 (float64 for float64 inputs), ``-inf`` outside each causal window.
        """
        check_tokens(x, self.config.mla.dim)
        cu = tokens_cu_seqlens(x, cu_seqlens)
        q, k, weights = self.project(x, qr, positions(cu))  # [T, H_I, D_I], [T, D_I], [T, H_I]
        starts, ends = key_windows(cu)  # [T] each
        return lightning_indexer(q, k, weights, starts=starts, ends=ends,
                                 relu=self.config.indexer.use_relu if relu is None else relu)  # [T, T]

    # --8<-- [start:indexer_project]
    def project(self, x: torch.Tensor, qr: torch.Tensor, pos: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The indexer's queries, keys and head weights.

        Args:
            x: ``[T, dim]`` hidden states (the layer's input; DSA detaches it first).
            qr: ``[T, q_lora_rank]`` MLA's normalised query latent (detached likewise).
            pos: int ``[T]`` RoPE positions (`dsa_ref.layout.positions`).

        Returns:
            ``q [T, H_I, D_I]``, ``k [T, D_I]`` (in x's dtype) and ``weights [T, H_I]`` (float32,
            float64 for float64), scales folded in.
        """
        ic, mc = self.config.indexer, self.config.mla
        check_tokens(x, mc.dim)
        check_tokens(qr, mc.q_lora_rank, name="qr")
        check_dim("qr", qr, 0, x.shape[0], "one query latent per token of x")
        check_int("pos", pos)
        check_dim("pos", pos, 0, x.shape[0], "one position per token of x")
        T = x.shape[0]
        q = self.wq_b(qr).view(T, ic.n_heads, ic.head_dim)  # [T, H_I, D_I]
        q = self.rope(q, pos)  # [T, H_I, D_I]
        k = self.wk(x)  # [T, D_I]
        k = F.layer_norm(k.to(accumulation_dtype(k)), (ic.head_dim,), self.k_norm.weight.to(accumulation_dtype(k)),
                         self.k_norm.bias.to(accumulation_dtype(k)), self.k_norm.eps).to(x.dtype)  # [T, D_I], LN in fp32
        k = self.rope(k, pos)  # [T, D_I]
        if ic.use_hadamard:
            q, k = rotate_activation(q), rotate_activation(k)  # same rotation on both sides
        # float32 (float64 for float64) whatever dtype the module was cast to, as DeepSeek-V3.2 keeps it
        w_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        weights = F.linear(x.to(w_dtype), self.weights_proj.weight.to(w_dtype)) * self.weight_scale  # [T, H_I]
        return q, k, weights
    # --8<-- [end:indexer_project]


def _check_indexer_operands(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor) -> tuple[int, int]:
    """Check the indexer's ``q [T, H_I, D_I]``, ``k [S, D_I]``, ``weights [T, H_I]``; return ``(T, H_I)``."""
    check_float("q", q)
    check_float("k", k)
    check_float("weights", weights)
    check_rank("q", q, 3, "[T, H_I, D_I]")
    check_rank("k", k, 2, "[S, D_I]")
    check_rank("weights", weights, 2, "[T, H_I]")
    T, H, D = q.shape
    check_dim("k", k, 1, D, "q's head dim D_I")
    check_dim("weights", weights, 0, T, "one row per query")
    check_dim("weights", weights, 1, H, "one weight per indexer head")
    return T, H

# --8<-- [start:lightning_indexer]
def lightning_indexer(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, *,
                      starts: torch.Tensor | None = None, ends: torch.Tensor | None = None,
                      relu: bool = True, chunk_size: int | None = None) -> torch.Tensor:
    """Index scores ``I[t, s] = sum_j weights[t, j] * relu(q[t, j] . k[s])``, ``-inf`` outside the window.

    Args:
        q: ``[T, H_I, D_I]`` indexer queries.
        k: ``[S, D_I]`` indexer keys (one head shared by all indexer heads).
        weights: ``[T, H_I]`` head weights with the scales already folded in.
        starts, ends: int ``[T]`` key windows in the keys' index space; both ``None`` = no mask.
        relu: apply the ReLU (DeepSeek-V3.2: yes; GLM-5 style indexers: no).
        chunk_size: queries per chunk; bounds the ``[chunk, H_I, S]`` intermediate.

    Returns:
        ``scores [T, S]``, float32 (float64 for float64 inputs).
    """
    T, H = _check_indexer_operands(q, k, weights)
    check_same_device(q=q, k=k, weights=weights, starts=starts, ends=ends)
    windows = check_windows(starts, ends, T, k.shape[0])
    starts, ends = windows if windows is not None else (None, None)
    acc = torch.float64 if torch.float64 in (q.dtype, k.dtype, weights.dtype) else torch.float32
    S = k.shape[0]

    def finish(logits, w_c):  # [C, H_I, n] -> [C, n]: ReLU, then the weighted sum over heads
        return torch.einsum("thn,th->tn", logits.relu() if relu else logits, w_c)

    def plain(q_c, w_c, starts_c, ends_c, k_):
        """A chunk as one product over the keys its windows cover, masked by selection afterwards."""
        q_c, w_c = q_c.to(acc), w_c.to(acc)
        if starts_c is None:  # no mask: every key, as it is
            return (finish(torch.einsum("thd,sd->ths", q_c, k_.to(acc)), w_c),)  # [C, S]
        lo, hi = window_span(starts_c, ends_c)
        key = torch.arange(lo, hi, device=q_c.device)  # [S']
        inside = (key[None, :] >= starts_c[:, None]) & (key[None, :] < ends_c[:, None])  # [C, S']
        inner = finish(torch.einsum("thd,sd->ths", q_c, k_[lo:hi].to(acc)), w_c)  # [C, S']
        inner = torch.where(inside, inner, torch.full((), float("-inf"), dtype=acc, device=q_c.device))
        return (_place(inner, lo, S),)  # [C, S], -inf outside the span

    def selecting(q_c, w_c, starts_c, ends_c, k_):
        """A chunk whose rows read garbage: each row's keys gathered by selection, nothing else touched."""
        q_c, w_c = q_c.to(acc), w_c.to(acc)
        keys = split_window_keys(starts_c, ends_c)
        k_common, k_ragged = keys.select(k_.to(acc))  # [L, D_I], [C, R, D_I]
        logits = torch.cat([torch.einsum("thd,sd->ths", q_c, k_common),  # [C, H_I, L]
                            torch.einsum("thd,trd->thr", q_c, k_ragged)], dim=-1)  # [C, H_I, L + R]
        inner = torch.where(keys.valid, finish(logits, w_c),
                            torch.full((), float("-inf"), dtype=acc, device=q_c.device))  # [C, L + R]
        scores = torch.full((q_c.shape[0], S), float("-inf"), dtype=acc, device=q_c.device)  # [C, S]
        return (scores.index_copy(1, keys.keys, inner),)  # -inf outside the window

    chunk = auto_chunk_size(T, H * S, chunk_size)
    if starts is None:
        return run_chunked(plain, T, chunk, (q, weights, None, None), (k,))[0]
    # As in `dsa_ref.attention.windowed_attention`: keys that are not ordinary numbers are zeroed by
    # selection, so the masked product is exact for every row that does not read them (a masked
    # score's gradient is exactly 0, and so is its product with an ordinary key); the rows whose
    # windows hold such a key are scored again by the selecting path, from the keys as they are.
    bad = ~ordinary_rows(k)  # [S]
    has_bad = bool(bad.any())
    k_plain = torch.where(bad[:, None], torch.zeros((), dtype=k.dtype, device=k.device), k) if has_bad else k
    (scores,) = run_chunked(plain, T, chunk, (q, weights, starts, ends), (k_plain,))
    readers = _reads_any(bad, starts, ends).nonzero().flatten() if has_bad else None  # [R]
    if readers is not None and readers.numel():
        r_starts, r_ends = starts[readers], ends[readers]
        chunk_r = indexer_chunk_size(readers.numel(), H, S, q.shape[-1], chunk_size, windowed=True)
        (scores_r,) = run_chunked(selecting, readers.numel(), chunk_r, (q[readers], weights[readers], r_starts, r_ends),
                                  (k,), breaks=window_breaks(r_starts))
        scores = scores.index_put((readers,), scores_r)
    return scores


def _place(block: torch.Tensor, lo: int, width: int) -> torch.Tensor:
    """``[C, n]`` scores of keys ``lo .. lo + n - 1`` as ``[C, width]``, ``-inf`` for every other key."""
    C, n = block.shape
    pad = lambda m: torch.full((C, m), float("-inf"), dtype=block.dtype, device=block.device)  # noqa: E731
    return torch.cat([pad(lo), block, pad(width - lo - n)], dim=1)  # [C, width]
# --8<-- [end:lightning_indexer]


def indexer_chunk_size(num_queries: int, heads: int, num_keys: int, head_dim: int, chunk_size: int | None,
                       *, windowed: bool, budget: int = DEFAULT_CHUNK_ELEMENTS) -> int:
    """Queries per chunk of `lightning_indexer`: ``chunk_size`` if given, else what keeps both of a
    chunk's large intermediates within ``budget`` elements.

    They are the ``[C, H_I, S]`` logits and, with windows, the ragged keys gathered per query,
    ``[C, R, D_I]`` with ``R`` up to ``C`` (a causal chunk's own diagonal block, `split_window_keys`):
    so ``C <= budget / (H_I S)`` and ``C <= sqrt(budget / D_I)``.
    """
    chunk = auto_chunk_size(num_queries, heads * num_keys, chunk_size, budget)
    if chunk_size is None and windowed:
        chunk = max(1, min(chunk, int((budget // max(head_dim, 1)) ** 0.5)))
    return chunk


# --8<-- [start:index_scores_at]
def index_scores_at(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, *,
                    relu: bool = True, chunk_size: int | None = None) -> torch.Tensor:
    """The index scores of the selected keys only: ``out[t, j] = I[t, indices[t, j]]``.

    The same numbers as ``lightning_indexer(q, k, weights)`` gathered at ``indices`` (without key
    windows: the selection already respects them), computed from the gathered keys, so it costs
    ``O(T K)`` instead of ``O(T S)``. The sparse-stage KL loss needs nothing else from the indexer;
    the TileLang path (chapter 5) computes it, and its backward, with kernels.

    Args:
        q: ``[T, H_I, D_I]`` indexer queries.
        k: ``[S, D_I]`` indexer keys.
        weights: ``[T, H_I]`` head weights.
        indices: int ``[T, K]`` selected keys, ``-1`` = unused slot (duplicates allowed).
        relu: as in `lightning_indexer`.
        chunk_size: queries per chunk; bounds the ``[chunk, H_I, K]`` logits and ``[chunk, K, D_I]`` gathered keys.

    Returns:
        ``[T, K]`` float32 (float64 for float64 inputs); ``-inf`` at ``-1`` slots.
    """
    from .sparse_attention import check_indices

    T, H = _check_indexer_operands(q, k, weights)
    check_same_device(q=q, k=k, weights=weights, indices=indices)
    indices = check_indices(indices, T, k.shape[0])
    acc = torch.float64 if torch.float64 in (q.dtype, k.dtype, weights.dtype) else torch.float32

    def score(q_c, w_c, idx_c, k_):
        valid = idx_c >= 0  # [C, K]
        k_sel = select_rows(k_, idx_c, valid).to(acc)  # [C, K, D_I]; -1 slots: zeros, by selection
        logits = torch.einsum("thd,tkd->thk", q_c.to(acc), k_sel)  # [C, H_I, K]
        if relu:
            logits = logits.relu()
        scores = torch.einsum("thk,th->tk", logits, w_c.to(acc))  # [C, K]
        return (torch.where(valid, scores, torch.full((), float("-inf"), dtype=acc, device=scores.device)),)

    chunk = auto_chunk_size(T, max(indices.shape[1], 1) * max(H, q.shape[2]), chunk_size)  # [C, K, D_I], [C, H_I, K]
    (scores,) = run_chunked(score, T, chunk, (q, weights, indices), (k,))
    return scores
# --8<-- [end:index_scores_at]


# --8<-- [start:topk_indices]
def topk_indices(scores: torch.Tensor, topk: int, *, chunk_size: int | None = None) -> torch.Tensor:
    """The ``topk`` highest-scoring keys of every row, by dsa_ref's canonical rule.

    * highest score first; equal scores go to the **lower key index** first;
    * ``-inf`` keys (outside the window) are never selected;
    * a row with fewer than ``topk`` selectable keys is padded with ``-1`` at the end, so
      ``k_eff = min(topk, window size)`` slots are valid.

    Args:
        scores: float ``[T, S]`` index scores (``-inf`` = not selectable); NaN is an error.
        topk: number of slots per row (>= 1); may exceed ``S``.
        chunk_size: rows per chunk (memory only).

    Returns:
        int64 ``[T, topk]``.
    """
    check_float("scores", scores)
    check_rank("scores", scores, 2, "[T, S]")
    topk = check_positive_int("topk", topk)
    if bool(torch.isnan(scores).any()):
        raise ValueError("scores contain NaN; mark unselectable keys with -inf instead")
    T, S = scores.shape
    k_sel = min(topk, S)
    out = torch.full((T, topk), -1, dtype=torch.int64, device=scores.device)  # [T, topk]
    chunk = auto_chunk_size(T, S, chunk_size)
    for lo in range(0, T, chunk):
        rows = scores[lo: lo + chunk].detach()  # [C, S]
        # a stable descending sort keeps equal scores in index order: ties go to the lower index
        values, order = torch.sort(rows, dim=-1, descending=True, stable=True)  # [C, S] each
        values, order = values[:, :k_sel], order[:, :k_sel]  # [C, k_sel]
        out[lo: lo + chunk, :k_sel] = torch.where(values > float("-inf"), order, torch.full_like(order, -1))
    return out
# --8<-- [end:topk_indices]
