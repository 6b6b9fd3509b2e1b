"""Adversarial inputs for DSA kernels: each generator hunts one class of bug.

Random ``randn`` inputs are the easy case: scores never tie, every row has plenty of valid keys,
no index repeats, no sequence has length 1. The bugs public kernels shipped with live exactly in
the cases random inputs avoid. Every generator here builds one such case, names the bug class it
hunts in its docstring ("Bug class: ..."), is deterministic for a given ``seed``, and returns an
`AdversarialCase`: named tensors plus metadata (``k``, ``sm_scale``, ``d_v``, what each row tests).

Feed the tensors to your kernel and to the reference (or to `dsa_ref.oracle`'s adapters):

    case = adversarial.duplicate_indices()
    out, lse = my_kernel(case["q"], case["kv"], case["indices"], case.meta["sm_scale"])
    check_sparse_mla(out, lse, case["q"], case["kv"], case["indices"], convention=DSA_REF,
                     sm_scale=case.meta["sm_scale"], d_v=case.meta["d_v"]).assert_ok()

Attention cases use the reference's conventions (packed ``[T, ...]``, ``-1`` for unused slots);
convert them with `dsa_ref.oracle.kernel_inputs` for another convention. `GENERATORS` lists them all.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .config import yarn_mscale
from .indexer import topk_indices
from .layout import cp_shard_index, key_windows, positions

__all__ = [
    "AdversarialCase",
    "GENERATORS",
    "DEEPSEEK_SM_SCALE",
    "exactly_tied_scores",
    "near_tied_scores",
    "valid_count_rows",
    "long_rows",
    "all_masked_rows",
    "duplicate_indices",
    "future_indices",
    "stale_topk_tail",
    "packed_sequences",
    "cp_shards",
    "outlier_channels",
]

#: DeepSeek-V3.2's MLA softmax scale, ``192 ** -0.5 * mscale ** 2`` with YaRN factor 40 (0.13524).
DEEPSEEK_SM_SCALE = 192 ** -0.5 * yarn_mscale(40.0) ** 2


@dataclass
class AdversarialCase:
    """One adversarial input.

    Attributes:
        name: the generator's name.
        bug_class: the class of bug it hunts (one line).
        tensors: the inputs, by name (``scores``, ``q``, ``kv``, ``indices``, ``starts``, ``ends``,
            ``cu_seqlens``, ...).
        meta: everything else: ``k``, ``sm_scale``, ``d_v``, ``seed``, per-row descriptions.
    """

    name: str
    bug_class: str
    tensors: dict[str, torch.Tensor]
    meta: dict = field(default_factory=dict)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __repr__(self) -> str:
        shapes = ", ".join(f"{n}={list(t.shape)}" for n, t in self.tensors.items())
        return f"AdversarialCase({self.name}: {shapes})"


def _gen(seed: int) -> torch.Generator:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    return torch.Generator().manual_seed(seed)


def _attention_inputs(T: int, S: int, heads: int, dim: int, g: torch.Generator, dtype: torch.dtype
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries ``[T, H, D]`` and RMS-normalised latent rows ``[S, D]`` (entries ~ 1, like c_kv after its norm)."""
    q = torch.randn(T, heads, dim, generator=g, dtype=torch.float64) * 0.5
    kv = torch.randn(S, dim, generator=g, dtype=torch.float64)
    kv = kv / kv.square().mean(-1, keepdim=True).sqrt()
    return q.to(dtype), kv.to(dtype)


def _check_k(k: int, name: str = "k") -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"{name} must be an int >= 1, got {k!r}")
    return k


# ------------------------------------------------------------------------------------- top-k


def exactly_tied_scores(rows: int = 6, num_keys: int = 64, k: int = 8, *, seed: int = 0) -> AdversarialCase:
    """Index-score rows whose k-th boundary falls inside a block of exactly equal scores.

    Bug class: tie-breaking -- ``torch.topk`` leaves the order of equal values unspecified, so two
    runs, ranks or a recomputed forward pick different keys (Megatron-LM#7169, sglang#24654); a
    threshold rule ``score >= kth`` selects more than k keys on ties. ReLU scoring makes exact
    zeros common, so this is the normal case, not a corner case.

    Rows, cycling: every score equal; ReLU-style (a few positives, the rest exactly 0, the boundary
    inside the zeros); two values only, split at the boundary; ties at the boundary between random
    values. Compare with `dsa_ref.compare.compare_topk` (any tie-breaking passes) and check the
    canonical rule (lowest index first) with `dsa_ref.topk_indices`.
    """
    _check_k(k)
    if num_keys < 2 * k:
        raise ValueError(f"num_keys must be >= 2k={2 * k} so ties straddle the boundary, got {num_keys}")
    g = _gen(seed)
    scores = torch.empty(rows, num_keys)
    kinds = []
    for r in range(rows):
        kind = r % 4
        if kind == 0:
            scores[r] = 1.0
            kinds.append("all equal")
        elif kind == 1:
            row = torch.zeros(num_keys)
            pos = torch.randperm(num_keys, generator=g)[: k // 2]
            row[pos] = torch.rand(len(pos), generator=g) + 0.5
            scores[r] = row
            kinds.append(f"{len(pos)} positives, the rest exactly 0 (ReLU)")
        elif kind == 2:
            row = torch.full((num_keys,), -1.0)
            row[torch.randperm(num_keys, generator=g)[: k + k // 2]] = 2.0
            scores[r] = row
            kinds.append(f"{k + k // 2} keys tie at the top value")
        else:
            row = torch.randn(num_keys, generator=g)
            order = row.argsort(descending=True)
            row[order[k - 2: k + 3]] = float(row[order[k - 2]])  # 5 keys tie across the boundary
            scores[r] = row
            kinds.append("5 keys tie across the k-th place")
    return AdversarialCase("exactly_tied_scores", _first_line_bug(exactly_tied_scores), {"scores": scores},
                           {"k": k, "seed": seed, "rows": kinds})


def near_tied_scores(rows: int = 4, num_keys: int = 8192, k: int = 64, *, seed: int = 0) -> AdversarialCase:
    """Scores that differ only in their lowest float32 bits and are equal after rounding to fp16/bf16.

    Bug class: radix/histogram top-k -- a first pass that bins by the top bits of the fp16 value
    (TileLang's selector) puts every key into one bin and overflows its candidate buffer
    (tile-ai/tilelang#1351, sglang#35257, #36807), and a kernel that rounds scores to 16 bits before
    selecting cannot tell the keys apart at all.

    Every score is ``1 + n * 2^-23`` for a distinct random integer ``n < 2^15``: all inside
    ``[1, 1 + 2^-8)``, all distinct in float32, all equal to 1.0 in bfloat16, all in one bin of the
    top 8 bits of fp16. The exact top-k is unique (no exact ties).
    """
    _check_k(k)
    spread = 1 << 15
    if num_keys > spread:
        raise ValueError(f"num_keys must be <= {spread} (distinct values below bfloat16 resolution), got {num_keys}")
    g = _gen(seed)
    scores = torch.empty(rows, num_keys)
    for r in range(rows):
        n = torch.randperm(spread, generator=g)[:num_keys].to(torch.float64)
        scores[r] = (1.0 + n * 2.0 ** -23).to(torch.float32)
    return AdversarialCase("near_tied_scores", _first_line_bug(near_tied_scores), {"scores": scores},
                           {"k": k, "seed": seed, "distinct_in": "float32", "equal_in": "bfloat16"})


def valid_count_rows(k: int = 8, num_keys: int = 40, *, seed: int = 0) -> AdversarialCase:
    """Rows with 0, 1, k-1, k, k+1, 2k and all keys valid (the rest ``-inf``), with their windows.

    Bug class: off-by-one at ``k_eff = min(k, #valid)`` -- rows with exactly k valid keys found no
    threshold bin (tile-ai/tilelang#2513); slots of short rows left as the caller initialised them
    (TileLang's selector leaves zeros, which point at key 0); a ``-inf`` key selected to fill k slots;
    bugs that hide whenever ``topk >= seq_len`` (1bit-MONSTER#2418).

    Tensors: ``scores [R, S]`` (finite exactly inside each window), ``starts``, ``ends`` ``[R]``.
    Meta ``valid`` lists the number of valid keys per row.
    """
    _check_k(k)
    counts = sorted({0, 1, max(k - 1, 0), k, k + 1, 2 * k, num_keys})
    counts = [c for c in counts if c <= num_keys]
    g = _gen(seed)
    R = len(counts)
    scores = torch.full((R, num_keys), -math.inf)
    starts = torch.zeros(R, dtype=torch.int64)
    ends = torch.zeros(R, dtype=torch.int64)
    for r, c in enumerate(counts):
        lo = int(torch.randint(0, num_keys - c + 1, (1,), generator=g))
        starts[r], ends[r] = lo, lo + c
        scores[r, lo: lo + c] = torch.randn(c, generator=g)
    return AdversarialCase("valid_count_rows", _first_line_bug(valid_count_rows),
                           {"scores": scores, "starts": starts, "ends": ends}, {"k": k, "seed": seed, "valid": counts})


def long_rows(rows: int = 2, num_keys: int = 1 << 17, k: int = 2048, *, seed: int = 0) -> AdversarialCase:
    """Very long, low-contrast score rows (default 131072 keys, top-2048).

    Bug class: length-dependent top-k failures -- candidate buffers sized for short rows overflow
    (sglang#36807: fast top-k wrong on 64 of 64 rows at 1M keys while 64K passes), 16-bit counters or
    index types wrap, multi-pass radix selection runs out of passes; the dense ``[T, S]`` score
    buffer does not fit (68.7 GB at 128K tokens).

    Scores are ``1 + 1e-3 * randn``: thousands of keys fall into any coarse bin near the boundary.
    """
    _check_k(k)
    g = _gen(seed)
    scores = (1.0 + 1e-3 * torch.randn(rows, num_keys, generator=g, dtype=torch.float64)).to(torch.float32)
    return AdversarialCase("long_rows", _first_line_bug(long_rows), {"scores": scores}, {"k": k, "seed": seed})


# ------------------------------------------------------------------------------ sparse attention


def all_masked_rows(tokens: int = 16, num_keys: int = 48, k: int = 8, *, heads: int = 16, dim: int = 576,
                    d_v: int = 512, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> AdversarialCase:
    """Sparse-attention inputs where some rows have no valid slot at all.

    Bug class: fully masked rows -- ``0 / 0`` gives NaN outputs; the LSE of an empty row comes out as
    ``+inf`` in one kernel and ``-inf`` in another (FlashMLA reports ``+inf``, flashinfer#4452 expects
    ``-inf``); a ``0 * NaN`` in the backward poisons gradients (miles#1253, Megatron's
    "all-invalid top-k rows keep gradients finite"); masked rows counted in a loss mean.

    Rows ``t % 4 == 0`` are all ``-1``; rows ``t % 4 == 1`` keep one valid slot; the others are full.
    The reference gives out = 0 and lse = -inf on the empty rows, with finite gradients everywhere.
    """
    _check_k(k)
    g = _gen(seed)
    q, kv = _attention_inputs(tokens, num_keys, heads, dim, g, dtype)
    indices = torch.stack([torch.randperm(num_keys, generator=g)[:k] for _ in range(tokens)])
    t = torch.arange(tokens)
    indices[t % 4 == 0] = -1
    indices[t % 4 == 1, 1:] = -1
    return AdversarialCase("all_masked_rows", _first_line_bug(all_masked_rows),
                           {"q": q, "kv": kv, "indices": indices},
                           {"k": k, "sm_scale": DEEPSEEK_SM_SCALE, "d_v": d_v, "seed": seed,
                            "empty_rows": (t % 4 == 0).nonzero().flatten().tolist()})


def duplicate_indices(tokens: int = 16, num_keys: int = 48, k: int = 8, *, heads: int = 16, dim: int = 576,
                      d_v: int = 512, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> AdversarialCase:
    """Rows that repeat a key in several slots, and every query selecting the same few "sink" keys.

    Bug class: duplicate semantics and dKV accumulation -- a kernel that deduplicates (or a mask-based
    reference that cannot count a key twice) disagrees with gather-based kernels, which count every
    slot; cross-query duplicates are the normal causal case and broke backward kernels through racing
    or mis-vectorised atomic adds into dKV (cudnn-frontend#385 "catastrophically wrong gradients",
    tile-ai/tilelang#1588, #2478).

    Slots 0-2 of every row select keys 0, 1, 2 (sinks); rows ``t % 3 == 0`` repeat their slot-3 key in
    slots 4 and 5. In the reference each slot is one softmax term.
    """
    if k < 6:
        raise ValueError(f"k must be >= 6 for duplicate_indices, got {k}")
    g = _gen(seed)
    q, kv = _attention_inputs(tokens, num_keys, heads, dim, g, dtype)
    rest = torch.stack([3 + torch.randperm(num_keys - 3, generator=g)[: k - 3] for _ in range(tokens)])
    indices = torch.cat([torch.arange(3).expand(tokens, 3), rest], dim=1)
    rows = torch.arange(tokens) % 3 == 0
    indices[rows, 4] = indices[rows, 3]
    indices[rows, 5] = indices[rows, 3]
    return AdversarialCase("duplicate_indices", _first_line_bug(duplicate_indices),
                           {"q": q, "kv": kv, "indices": indices},
                           {"k": k, "sm_scale": DEEPSEEK_SM_SCALE, "d_v": d_v, "seed": seed,
                            "rows_with_repeats": rows.nonzero().flatten().tolist(), "sink_keys": [0, 1, 2]})


def future_indices(tokens: int = 16, k: int = 8, *, heads: int = 16, dim: int = 576, d_v: int = 512,
                   dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> AdversarialCase:
    """Causal inputs (keys = the queries' own tokens) where some slots point at *future* keys.

    Bug class: causality enforcement -- TileLang's kernels mask ``index > position`` themselves,
    FlashMLA only range-checks (P19), so a future index that leaks from an indexer is silently
    attended by one and dropped by the other; and an off-by-one (``<`` for ``<=``) drops the diagonal.

    Every row holds its own position (the diagonal) in slot 0; rows ``t % 2 == 1`` with ``t < T - 1``
    put key ``t + 1`` in slot 1. Meta ``future_slots`` counts them. Check with a causal convention
    (the future slots must be ignored) and a non-causal one (they must be attended).
    """
    _check_k(k)
    g = _gen(seed)
    q, kv = _attention_inputs(tokens, tokens, heads, dim, g, dtype)
    indices = torch.full((tokens, k), -1, dtype=torch.int64)
    future = 0
    for t in range(tokens):
        past = torch.randperm(t + 1, generator=g)[: k].tolist()
        row = [t] + [p for p in past if p != t][: k - 1]
        if t % 2 == 1 and t < tokens - 1 and k >= 2:
            row = [t, t + 1] + row[1: k - 1]
            future += 1
        indices[t, : len(row)] = torch.tensor(row)
    return AdversarialCase("future_indices", _first_line_bug(future_indices), {"q": q, "kv": kv, "indices": indices},
                           {"k": k, "sm_scale": DEEPSEEK_SM_SCALE, "d_v": d_v, "seed": seed, "future_slots": future})


def stale_topk_tail(tokens: int = 16, num_keys: int = 48, k: int = 16, *, heads: int = 16, dim: int = 576,
                    d_v: int = 512, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> AdversarialCase:
    """Index rows whose slots beyond ``topk_length`` hold stale but valid-looking keys.

    Bug class: length-contract violations -- a kernel or caller that ignores ``topk_length`` reads
    the stale tail as real keys (flashinfer#5075, #5095; tokenspeed#528), and consumers fed an all-``-1``
    buffer repeat tokens (vllm#52512).

    Tensors: ``indices [T, k]`` (every slot in range, no ``-1``), ``topk_length [T]`` (between 0 and k;
    row 0 has length 0), and ``reference_indices``: the same with the tail replaced by ``-1``.
    """
    _check_k(k)
    g = _gen(seed)
    q, kv = _attention_inputs(tokens, num_keys, heads, dim, g, dtype)
    indices = torch.stack([torch.randperm(num_keys, generator=g)[:k] for _ in range(tokens)])
    length = torch.randint(0, k + 1, (tokens,), generator=g)
    length[0] = 0
    length[-1] = k
    ref = torch.where(torch.arange(k)[None, :] < length[:, None], indices, torch.full_like(indices, -1))
    return AdversarialCase("stale_topk_tail", _first_line_bug(stale_topk_tail),
                           {"q": q, "kv": kv, "indices": indices, "topk_length": length.to(torch.int32),
                            "reference_indices": ref},
                           {"k": k, "sm_scale": DEEPSEEK_SM_SCALE, "d_v": d_v, "seed": seed})


# ------------------------------------------------------------------------------------- layouts


def packed_sequences(lengths: tuple[int, ...] = (1, 6, 1, 13, 1, 9, 0, 1), k: int = 4, *, heads: int = 16,
                     dim: int = 576, d_v: int = 512, dtype: torch.dtype = torch.bfloat16,
                     seed: int = 0) -> AdversarialCase:
    """Packed (THD) sequences with length-1 and zero-length members, and their causal selections.

    Bug class: packing -- attention leaking across document boundaries (torchtitan#4801: position
    reset is not isolation), sequence offsets off by one or assumed to be multiples of a block size
    (native-sparse-attention#23), the first token of a sequence (a window of one key), positions that
    do not restart per sequence, and per-sequence index spaces (TileLang's finetune kernels count
    indices from each sequence's start).

    Tensors: ``cu_seqlens``, ``starts``/``ends`` (causal windows in global packed order),
    ``positions``, ``scores`` (random inside the windows, ``-inf`` outside), ``indices`` (their top-k),
    ``q``, ``kv``.
    """
    _check_k(k)
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in lengths) or not lengths:
        raise ValueError(f"lengths must be non-negative ints, got {lengths!r}")
    g = _gen(seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    T = int(cu[-1])
    starts, ends = key_windows(cu)
    s = torch.arange(T)
    inside = (s[None, :] >= starts[:, None]) & (s[None, :] < ends[:, None])
    scores = torch.where(inside, torch.randn(T, T, generator=g), torch.full((T, T), -math.inf))
    q, kv = _attention_inputs(T, T, heads, dim, g, dtype)
    return AdversarialCase("packed_sequences", _first_line_bug(packed_sequences),
                           {"cu_seqlens": cu, "starts": starts, "ends": ends, "positions": positions(cu),
                            "scores": scores, "indices": topk_indices(scores, k), "q": q, "kv": kv},
                           {"k": k, "sm_scale": DEEPSEEK_SM_SCALE, "d_v": d_v, "seed": seed, "lengths": list(lengths)})


def cp_shards(lengths: tuple[int, ...] = (8, 24, 16), cp_size: int = 2, *, seed: int = 0) -> AdversarialCase:
    """The tokens, key windows and positions every context-parallel rank owns (zigzag layout).

    Bug class: context parallelism -- key windows computed in the local instead of the global index
    space, gathered keys not permuted back to global order, RoPE positions of the local instead of
    the global place (sglang#28463), short sequences that give a rank no tokens (sglang#18280),
    uneven per-rank lengths (Megatron requires padding to 2 * cp).

    Tensors: ``cu_seqlens`` and, per rank r, ``query_index_r`` (global packed indices in local order),
    ``starts_r``/``ends_r`` (windows in the global key order) and ``positions_r``; each rank's rows of
    any global result are ``result[query_index_r]``.
    """
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be an int >= 1, got {cp_size!r}")
    _gen(seed)  # validates seed; the layout itself is deterministic
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    tensors = {"cu_seqlens": cu}
    for r in range(cp_size):
        idx = cp_shard_index(cu, cp_size, r)
        st, en = key_windows(cu, idx)
        tensors[f"query_index_{r}"] = idx
        tensors[f"starts_{r}"] = st
        tensors[f"ends_{r}"] = en
        tensors[f"positions_{r}"] = positions(cu, idx)
    return AdversarialCase("cp_shards", _first_line_bug(cp_shards), tensors,
                           {"cp_size": cp_size, "lengths": list(lengths), "seed": seed})


# ---------------------------------------------------------------------------------------- fp8


def outlier_channels(tokens: int = 64, num_keys: int = 256, *, heads: int = 8, dim: int = 128,
                     n_outliers: int = 4, magnitude: float = 30.0, seed: int = 0) -> AdversarialCase:
    """Indexer queries and keys with a few outlier channels ``magnitude`` times larger than the rest.

    Bug class: fp8 quantisation without the Hadamard rotation -- with one scale per 128 channels,
    the outlier channels' rounding errors dominate every score (vllm#55459: a missing rotation
    "changes the quantized values themselves"; ROCm/ATOM#1507: the rotation on one side only
    scrambles the dot product). Compare `dsa_ref.fp8.fp8_indexer_scores` with and without
    ``hadamard`` against the exact scores.

    Tensors: ``q [T, H, D]``, ``k [S, D]``, ``weights [T, H]`` (float64), meta ``outlier_channels``.
    """
    g = _gen(seed)
    q = torch.randn(tokens, heads, dim, generator=g, dtype=torch.float64)
    k = torch.randn(num_keys, dim, generator=g, dtype=torch.float64)
    channels = torch.randperm(dim, generator=g)[:n_outliers]
    q[..., channels] *= magnitude
    k[:, channels] *= magnitude
    weights = torch.randn(tokens, heads, generator=g, dtype=torch.float64) * heads ** -0.5 * dim ** -0.5
    return AdversarialCase("outlier_channels", _first_line_bug(outlier_channels),
                           {"q": q, "k": k, "weights": weights},
                           {"seed": seed, "outlier_channels": channels.tolist(), "magnitude": magnitude})


def _first_line_bug(fn: Callable) -> str:
    """The "Bug class:" paragraph of a generator's docstring, as one line."""
    doc = fn.__doc__ or ""
    start = doc.find("Bug class:")
    if start < 0:
        return ""
    para = doc[start + len("Bug class:"):].split("\n\n")[0]
    return " ".join(para.split())


#: Every generator by name, in the order of the docs' table.
GENERATORS: dict[str, Callable[..., AdversarialCase]] = {
    fn.__name__: fn for fn in (
        exactly_tied_scores, near_tied_scores, valid_count_rows, long_rows, all_masked_rows,
        duplicate_indices, future_indices, stale_topk_tail, packed_sequences, cp_shards, outlier_channels)
}
