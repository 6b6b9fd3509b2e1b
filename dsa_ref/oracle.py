r"""Check a DSA kernel against the reference, in the kernel's own conventions.

Public sparse-MLA kernels agree on the math and disagree on everything around it:

| | layout | unused top-k slot | LSE | empty row |
|---|---|---|---|---|
| FlashMLA sparse prefill | ``[S_q, H, D]``, kv ``[S_kv, 1, D]``, idx ``[S_q, 1, K]`` | ``< 0`` or ``>= S_kv`` | natural log | ``lse = +inf`` |
| TileLang ``deepseek_v32`` | ``[B, S, H, D]``, kv ``[B, S_kv, 1, D]`` | ``> query position`` (pads with ``S_kv``) | **base 2** | ``-inf``, out NaN |
| TileLang ``dsa_sparse_finetune`` | packed ``[T, H, D]`` + offsets, per-sequence indices | ``-1`` or ``> position`` | natural log | ``-inf`` |
| Megatron-LM (absorbed DSA) | ``[S, B, H, D]``, indices ``[B, S, K]`` | ``-1`` | (none returned) | |
| Megatron-LM TileLang ops | ``[S, H, D]``, kv ``[S_kv, 1, D]``, idx ``[S, 1, K]`` | ``-1`` only | **base 2** | ``lse = 0``, out 0 |

and their default softmax scales are ``576 ** -0.5`` where DeepSeek-V3.2 needs ``192 ** -0.5 * mscale ** 2``.
Each row is a `Convention` preset here, named after its source, never guessed from the data. An
adapter converts the kernel's inputs into the reference's conventions (`dsa_ref` packs tokens as
``[T, ...]``, marks unused slots with ``-1``, uses natural-log LSE with ``-inf`` on empty rows),
computes the reference exactly (float64) from the very inputs the kernel saw, converts the result
back into the kernel's layout, and compares with `dsa_ref.compare.compare`:

    report = check_sparse_mla(out, lse, q, kv, indices, convention=TILELANG_DEEPSEEK_V32,
                              sm_scale=cfg.mla.softmax_scale, d_v=512)
    print(report)          # per tensor: rel. L2, max abs + where, cosine, non-finite, worst rows
    report.assert_ok()

`reference_kernel` goes the other way: it returns what a correct kernel of a convention returns,
which is also how the tests build "fake kernels" with planted bugs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from ._checks import check_float, check_int, check_scale, check_tensor
from .compare import LSE_TOLERANCE, Comparison, Tolerance, TopkComparison, compare, compare_topk, tolerance_for
from .attention import auto_chunk_size, chunk_bounds, masked_softmax_with_lse, select_rows
from .indexer import lightning_indexer
from .layout import check_cu_seqlens
from .sparse_attention import first_occurrence, sparse_mla

__all__ = [
    "Convention",
    "DSA_REF",
    "FLASHMLA_SPARSE_PREFILL",
    "TILELANG_DEEPSEEK_V32",
    "TILELANG_SPARSE_FINETUNE",
    "MEGATRON_SBHD",
    "MEGATRON_TILELANG_OPS",
    "CONVENTIONS",
    "Report",
    "check_sparse_mla",
    "check_sparse_mla_backward",
    "sparse_mla_backward_magnitudes",
    "sparse_mla_backward_delta_terms",
    "indexer_backward_magnitudes",
    "accumulation_rtol",
    "delta_allowance_scale",
    "ACCUMULATION_TERMS",
    "DELTA_LAMBDA",
    "check_indexer",
    "check_topk",
    "reference_kernel",
    "to_reference_indices",
    "from_reference_indices",
    "lse_to_natural",
    "lse_from_natural",
    "to_thd",
    "from_thd",
    "keys_to_thd",
    "kernel_inputs",
]

LAYOUTS = ("THD", "BSHD", "SBHD")
INDEX_SPACES = ("global", "per_batch", "per_sequence")
SENTINELS = {
    "minus_one": "-1 marks an unused slot; any other value outside [0, S_kv) is an error",
    "out_of_range": "any value < 0 or >= S_kv marks an unused slot",
    "after_position": "any value > the query's position marks an unused slot (the kernel pads with S_kv); "
                      "-1 is an error (the kernel would read KV[-1])",
    "minus_one_or_after_position": "-1, or any value > the query's position, marks an unused slot",
}
LSE_BASES = ("e", "2", None)
LN2 = math.log(2.0)


# --8<-- [start:convention]
@dataclass(frozen=True)
class Convention:
    """How one kernel interface lays out sparse-MLA inputs and outputs.

    Attributes:
        name: the kernel interface and where it is defined.
        layout: ``"THD"`` (q ``[T, H, D]``, kv ``[S_kv, 1, D]`` or ``[S_kv, D]``, out ``[T, H, d_v]``,
            lse ``[T, H]``); ``"BSHD"`` (q ``[B, S, H, D]``, kv ``[B, S_kv, 1, D]``, out ``[B, S, H, d_v]``,
            lse ``[B, S, H]``); ``"SBHD"`` (q ``[S, B, H, D]``, kv ``[S_kv, B, 1, D]``, out ``[S, B, H, d_v]``,
            lse ``[S, B, H]``).
        indices_layout: the shape of the index tensor, e.g. ``"[T, 1, K]"``.
        indices_group_dim: whether the index tensor carries the size-1 KV-group dim (``[T, 1, K]``,
            ``[B, S, 1, K]``); `from_reference_indices` writes it, every adapter accepts both.
        index_space: ``"global"`` (indices address rows of the whole kv), ``"per_batch"`` (rows of the
            query's batch entry, ``[0, S_kv)``) or ``"per_sequence"`` (rows of the query's packed
            sequence, counted from its start; needs ``cu_seqlens``).
        sentinel: which index values mark an unused slot, one of `SENTINELS` (see there).
        lse_base: ``"e"`` (natural log), ``"2"`` (``log2 sum 2^(s * scale * log2 e)``) or ``None`` (the
            kernel returns no LSE).
        empty_row_lse: the LSE the kernel reports for a row with no valid slot (``-inf``, ``+inf`` or ``0``).
        causal: the kernel itself masks keys after the query's position (``index > position``), so
            such slots contribute nothing even when selected. The position of query ``s`` is
            ``q_start + s`` in ``BSHD``/``SBHD`` and its offset inside its sequence for ``per_sequence``.
        duplicates: ``"per_slot"`` (a key in two slots is two softmax terms, as gather-based kernels
            do) or ``"once"`` (the selection is a set, as mask-based implementations do).
        pad_value: the value `from_reference_indices` writes into unused slots; ``None`` means ``S_kv``.
        index_dtype: the index dtype the kernel takes.
        default_sm_scale: what the kernel uses when no scale is passed -- always pass one.
        source: where the convention was read.
        empty_row_out: what the kernel writes into the output of a row with no valid slot: ``0.0``
            (the reference) or ``nan`` (a kernel that divides by an empty softmax sum).
    """

    name: str
    layout: str
    indices_layout: str
    indices_group_dim: bool
    index_space: str
    sentinel: str
    lse_base: str | None
    empty_row_lse: float
    causal: bool
    duplicates: str
    pad_value: int | None
    index_dtype: torch.dtype
    default_sm_scale: str
    source: str
    empty_row_out: float = 0.0

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"Convention.layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.index_space not in INDEX_SPACES:
            raise ValueError(f"Convention.index_space must be one of {INDEX_SPACES}, got {self.index_space!r}")
        if self.index_space == "per_sequence" and self.layout != "THD":
            raise ValueError("Convention.index_space='per_sequence' needs layout='THD' (packed sequences)")
        if self.sentinel not in SENTINELS:
            raise ValueError(f"Convention.sentinel must be one of {sorted(SENTINELS)}, got {self.sentinel!r}")
        if self.lse_base not in LSE_BASES:
            raise ValueError(f"Convention.lse_base must be one of {LSE_BASES}, got {self.lse_base!r}")
        if self.empty_row_lse not in (-math.inf, math.inf, 0.0):
            raise ValueError(f"Convention.empty_row_lse must be -inf, +inf or 0.0, got {self.empty_row_lse!r}")
        if not (self.empty_row_out == 0.0 or math.isnan(self.empty_row_out)):
            raise ValueError(f"Convention.empty_row_out must be 0.0 or nan, got {self.empty_row_out!r}")
        if self.duplicates not in ("per_slot", "once"):
            raise ValueError(f"Convention.duplicates must be 'per_slot' or 'once', got {self.duplicates!r}")
        if self.sentinel in ("after_position", "minus_one_or_after_position") and not self.causal:
            raise ValueError(f"Convention.sentinel={self.sentinel!r} marks slots by the query position: "
                             "it needs causal=True")

    def describe(self) -> str:
        """A few lines stating every field, for reports and docs."""
        lse = "none returned" if self.lse_base is None else f"base {self.lse_base}, {self.empty_row_lse} on empty rows"
        lse += f"; empty rows' output {self.empty_row_out}"
        return (f"{self.name}\n  layout {self.layout}, indices {self.indices_layout} ({self.index_space}, "
                f"{self.index_dtype}); unused slot: {SENTINELS[self.sentinel]}\n  LSE: {lse}; causal mask in kernel: "
                f"{self.causal}; duplicate indices count {'once' if self.duplicates == 'once' else 'once per slot'}\n"
                f"  default sm_scale: {self.default_sm_scale}")


DSA_REF = Convention(
    name="dsa_ref (sparse_mla and dsa_ref.kernels)",
    layout="THD", indices_layout="[T, K] (or [T, 1, K])", indices_group_dim=False, index_space="global",
    sentinel="minus_one",
    lse_base="e", empty_row_lse=-math.inf, causal=False, duplicates="per_slot", pad_value=-1,
    index_dtype=torch.int64, default_sm_scale="none: sm_scale is a required keyword",
    source="this package: DESIGN.md conventions")
"""The reference's own: layout ``THD`` (q ``[T, H, D]``, kv ``[S_kv, D]``, indices ``[T, K]`` global);
sentinel ``-1``; LSE base e, ``-inf`` on empty rows; no causal mask; a repeated key counts per slot."""

FLASHMLA_SPARSE_PREFILL = Convention(
    name="FlashMLA sparse prefill (flash_mla_sparse_fwd)",
    layout="THD", indices_layout="[S_q, 1, K] (h_kv = 1)", indices_group_dim=True, index_space="global",
    sentinel="out_of_range",
    lse_base="e", empty_row_lse=math.inf, causal=False, duplicates="per_slot", pad_value=-1,
    index_dtype=torch.int32,
    default_sm_scale="none: sm_scale is a required argument (the decode path defaults to 576 ** -0.5)",
    source="deepseek-ai/FlashMLA flash_mla/flash_mla_interface.py and tests/ref.py (natural-log LSE, "
           "+inf for rows without a valid index; the README's formulas show base 2)")
"""FlashMLA's ``flash_mla_sparse_fwd``: layout ``THD`` without a batch dim (q ``[S_q, H, D]``, kv
``[S_kv, 1, D]``, indices ``[S_q, 1, K]`` int32 global); sentinel: any value ``< 0`` or ``>= S_kv``;
LSE base e with ``+inf`` on empty rows; no causal mask; a repeated key counts per slot."""

TILELANG_DEEPSEEK_V32 = Convention(
    name="TileLang examples/deepseek_v32 sparse_mla_fwd",
    layout="BSHD", indices_layout="[B, S, 1, K] (kv_group = 1)", indices_group_dim=True, index_space="per_batch",
    sentinel="after_position",
    lse_base="2", empty_row_lse=-math.inf, causal=True, duplicates="per_slot", pad_value=None,
    index_dtype=torch.int32,
    default_sm_scale="576 ** -0.5 (dim + tail_dim); DeepSeek-V3.2 needs 192 ** -0.5 * mscale ** 2",
    source="tile-ai/tilelang examples/deepseek_v32/sparse_mla_fwd.py: mask Indices <= s_i, "
           "Lse = log2(sumexp) + m * sm_scale * log2(e); the tests pad indices with SKV; a row with no "
           "valid slot gives out NaN and lse -inf (measured on the H200, shared/peers/README.md)",
    empty_row_out=math.nan)
"""TileLang's ``deepseek_v32`` example: layout ``BSHD`` (q ``[B, S, H, D]``, kv ``[B, S_kv, 1, D]``, indices
``[B, S, 1, K]`` int32 within each batch entry); sentinel: any value ``> q_start + s`` (pad with ``S_kv``; ``-1``
is an error); LSE **base 2**, ``-inf`` on empty rows, whose output is **NaN**; the kernel masks
``index > q_start + s`` itself; a repeated key counts per slot."""

TILELANG_SPARSE_FINETUNE = Convention(
    name="TileLang examples/dsa_sparse_finetune sparse_mla_fwd",
    layout="THD", indices_layout="[T, 1, K] (kv_group = 1)", indices_group_dim=True, index_space="per_sequence",
    sentinel="minus_one_or_after_position", lse_base="e", empty_row_lse=-math.inf, causal=True,
    duplicates="per_slot", pad_value=-1, index_dtype=torch.int32,
    default_sm_scale="576 ** -0.5 (dim + tail_dim); DeepSeek-V3.2 needs 192 ** -0.5 * mscale ** 2",
    source="tile-ai/tilelang examples/dsa_sparse_finetune/sparse_mla_fwd.py: KV[bos + index], mask "
           "(index <= s_i) & (index != -1) with s_i the position inside the sequence, Lse = log(sumexp) + m * sm_scale")
"""TileLang's ``dsa_sparse_finetune`` example: layout ``THD`` packed with offsets (q ``[T, H, D]``, kv
``[T, 1, D]``, indices ``[T, 1, K]`` int32 counted from each sequence's start); sentinel: ``-1`` or any value
``>`` the query's position in its sequence; LSE base e, ``-inf`` on empty rows; causal by that position; a
repeated key counts per slot."""

MEGATRON_SBHD = Convention(
    name="Megatron-LM DSA, absorbed path (_unfused_absorbed_dsa_fn)",
    layout="SBHD", indices_layout="[B, S, K]", indices_group_dim=False, index_space="per_batch", sentinel="minus_one",
    lse_base=None, empty_row_lse=-math.inf, causal=True, duplicates="once", pad_value=-1,
    index_dtype=torch.int64, default_sm_scale="none: softmax_scale is an argument",
    source="NVIDIA/Megatron-LM DSA (dsa.py): query [sq, b, np, 576], key [skv, b, 1, 576], topk_indices "
           "[b, sq, k] with -1; a top-k support mask (scatter amax) plus the causal mask, so a key selected "
           "twice counts once; no LSE returned")
"""Megatron-LM's absorbed DSA: layout ``SBHD`` (q ``[S, B, H, D]``, kv ``[S_kv, B, 1, D]``, indices
``[B, S, K]`` int64 within each batch entry); sentinel ``-1``; no LSE returned; causal mask on
``index <= q_start + s``; a repeated key counts **once** (the selection is a support mask)."""

MEGATRON_TILELANG_OPS = Convention(
    name="Megatron-LM TileLang DSA ops (sparse_mla_fwd_interface)",
    layout="THD", indices_layout="[S, 1, K] (kv_group = 1)", indices_group_dim=True, index_space="global",
    sentinel="minus_one",
    lse_base="2", empty_row_lse=0.0, causal=False, duplicates="per_slot", pad_value=-1,
    index_dtype=torch.int32, default_sm_scale="576 ** -0.5 (dim + tail_dim); DeepSeek-V3.2 needs 192 ** -0.5 * mscale ** 2",
    source="NVIDIA/Megatron-LM core/transformer/experimental_attention_variant/ops (TileLang): only -1 is "
           "masked (a -2 is read as row 0 and counted), Lse = log2(sumexp) + m * sm_scale * log2(e); rows "
           "with no valid slot give out 0 and lse 0 (measured on the H200, shared/peers/README.md)")
"""Megatron-LM's TileLang DSA ops: layout ``THD`` (``[S, H, 576]``; the ``[B, S, H, 576]`` form is the same
per batch entry), kv ``[S_kv, 1, 576]``, indices ``[S, 1, K]`` int32; sentinel exactly ``-1``; LSE **base 2**,
**0** on empty rows (whose output is 0); no causal mask; a repeated key counts per slot."""

#: Every preset, by a short name.
CONVENTIONS: dict[str, Convention] = {
    "dsa_ref": DSA_REF,
    "flashmla_sparse_prefill": FLASHMLA_SPARSE_PREFILL,
    "tilelang_deepseek_v32": TILELANG_DEEPSEEK_V32,
    "tilelang_sparse_finetune": TILELANG_SPARSE_FINETUNE,
    "megatron_sbhd": MEGATRON_SBHD,
    "megatron_tilelang_ops": MEGATRON_TILELANG_OPS,
}
# --8<-- [end:convention]


def _check_convention(convention: object) -> Convention:
    if not isinstance(convention, Convention):
        raise TypeError(f"convention must be a dsa_ref.oracle.Convention (e.g. FLASHMLA_SPARSE_PREFILL), "
                        f"got {type(convention).__name__}")
    return convention


# ------------------------------------------------------------------------------------- layouts


def to_thd(x: torch.Tensor, layout: str, *, name: str = "x") -> torch.Tensor:
    """Per-token tensor of a layout -> packed ``[T, ...]`` (token ``t = b * S + s``).

    ``"THD"``: unchanged; ``"BSHD"``: ``[B, S, ...] -> [B * S, ...]``; ``"SBHD"``: ``[S, B, ...] -> [B * S, ...]``.
    """
    check_tensor(name, x)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "THD":
        return x
    if x.dim() < 2:
        raise ValueError(f"{name} must have at least 2 dims in layout {layout}, got shape {tuple(x.shape)}")
    if layout == "SBHD":
        x = x.transpose(0, 1)  # [B, S, ...]
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def from_thd(x: torch.Tensor, layout: str, *, batch: int = 1, name: str = "x") -> torch.Tensor:
    """Packed ``[T, ...]`` -> the layout's per-token shape (the inverse of `to_thd`; ``T = batch * S``)."""
    check_tensor(name, x)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "THD":
        return x
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1 or x.shape[0] % batch:
        raise ValueError(f"batch must be an int >= 1 dividing {name}'s {x.shape[0]} tokens, got {batch!r}")
    x = x.reshape(batch, x.shape[0] // batch, *x.shape[1:])  # [B, S, ...]
    return x.transpose(0, 1) if layout == "SBHD" else x


def keys_to_thd(kv: torch.Tensor, layout: str, *, name: str = "kv") -> torch.Tensor:
    """Latent KV rows of a layout -> ``[N, D]`` (one KV head; the size-1 head dim is dropped).

    ``"THD"``: ``[S_kv, 1, D]`` or ``[S_kv, D]``; ``"BSHD"``: ``[B, S_kv, 1, D]`` or ``[B, S_kv, D]`` ->
    ``[B * S_kv, D]``;
    ``"SBHD"``: ``[S_kv, B, 1, D]`` or ``[S_kv, B, D]`` -> ``[B * S_kv, D]`` (row ``b * S_kv + s``).
    """
    check_float(name, kv)
    want = 2 if layout == "THD" else 3
    if kv.dim() == want + 1:
        if kv.shape[-2] != 1:
            raise ValueError(f"{name} has {kv.shape[-2]} KV heads (shape {tuple(kv.shape)}); sparse MLA has one "
                             "latent KV head (kv_group = 1)")
        kv = kv.squeeze(-2)
    if kv.dim() != want:
        shapes = {"THD": "[S_kv, 1, D] or [S_kv, D]", "BSHD": "[B, S_kv, 1, D] or [B, S_kv, D]",
                  "SBHD": "[S_kv, B, 1, D] or [S_kv, B, D]"}[layout]
        raise ValueError(f"{name} must have shape {shapes} in layout {layout}, got shape {tuple(kv.shape)}")
    return to_thd(kv, layout, name=name)


def _keys_from_thd(x: torch.Tensor, layout: str, like: torch.Tensor) -> torch.Tensor:
    """``[N, D]`` -> the shape of ``like`` (the kernel's kv tensor)."""
    if layout == "THD":
        return x.reshape(like.shape)
    if layout == "BSHD":
        B = like.shape[0]
        return x.reshape(B, x.shape[0] // B, x.shape[-1]).reshape(like.shape)
    B = like.shape[1]
    return x.reshape(B, x.shape[0] // B, x.shape[-1]).transpose(0, 1).reshape(like.shape)


@dataclass(frozen=True)
class _Geometry:
    """Sizes of one call: tokens T = B * S, keys N = B * S_kv (per_batch) or S_kv."""

    layout: str
    B: int
    S: int
    S_kv: int
    H: int
    D: int


def _geometry(q: torch.Tensor, kv: torch.Tensor, convention: Convention) -> _Geometry:
    check_float("q", q)
    check_float("kv", kv)
    lay = convention.layout
    if lay == "THD":
        if q.dim() != 3:
            raise ValueError(f"q must have shape [T, H, D] for {convention.name}, got shape {tuple(q.shape)}")
        T, H, D = q.shape
        kv2 = keys_to_thd(kv, lay)
        return _Geometry(lay, 1, T, kv2.shape[0], H, D)
    if q.dim() != 4:
        want = "[B, S, H, D]" if lay == "BSHD" else "[S, B, H, D]"
        raise ValueError(f"q must have shape {want} for {convention.name}, got shape {tuple(q.shape)}")
    if lay == "BSHD":
        B, S, H, D = q.shape
    else:
        S, B, H, D = q.shape
    kv_b = kv.shape[0] if lay == "BSHD" else (kv.shape[1] if kv.dim() >= 2 else -1)
    if kv.dim() not in (3, 4) or kv_b != B:
        want = "[B, S_kv, 1, D]" if lay == "BSHD" else "[S_kv, B, 1, D]"
        raise ValueError(f"kv must have shape {want} with B={B} (from q {tuple(q.shape)}) for {convention.name}, "
                         f"got shape {tuple(kv.shape)}")
    S_kv = kv.shape[1] if lay == "BSHD" else kv.shape[0]
    return _Geometry(lay, B, S, S_kv, H, D)


# ------------------------------------------------------------------------------------- indices


@dataclass
class _IndexStats:
    unused: int = 0
    causal_masked: int = 0
    length_masked: int = 0
    duplicates_dropped: int = 0
    duplicate_slots: int = 0
    empty_rows: int = 0

    def notes(self, convention: Convention) -> list[str]:
        out = [f"{self.unused} unused slots (by the sentinel rule: {SENTINELS[convention.sentinel]})"]
        if self.causal_masked:
            out.append(f"{self.causal_masked} slots point after the query position and are masked (causal kernel)")
        if self.length_masked:
            out.append(f"{self.length_masked} slots beyond topk_length are ignored")
        if self.duplicate_slots:
            how = "dropped (the selection is a set)" if convention.duplicates == "once" else "each counted (per slot)"
            out.append(f"{self.duplicate_slots} slots repeat a key of their row: {how}")
        if self.empty_rows:
            out.append(f"{self.empty_rows} rows have no valid slot: reference out = 0, lse = -inf "
                       f"(kernel convention: {convention.empty_row_lse})")
        return out


def _flatten_indices(indices: torch.Tensor, convention: Convention, g: _Geometry) -> torch.Tensor:
    """Kernel-layout indices -> ``[T, K]`` in token order (still in the kernel's index space)."""
    check_int("indices", indices)
    lay = convention.layout
    if lay == "THD":
        if indices.dim() == 3:
            if indices.shape[1] != 1:
                raise ValueError(f"indices has {indices.shape[1]} KV groups (shape {tuple(indices.shape)}); expected 1")
            indices = indices[:, 0]
        if indices.dim() != 2 or indices.shape[0] != g.S:
            raise ValueError(f"indices must have shape [T={g.S}, K] or [T, 1, K] for {convention.name}, "
                             f"got shape {tuple(indices.shape)}")
        return indices
    # BSHD kernels take [B, S, 1, K]; Megatron takes [B, S, K]: both are batch-major
    if indices.dim() == 4:
        if indices.shape[2] != 1:
            raise ValueError(f"indices has {indices.shape[2]} KV groups (shape {tuple(indices.shape)}); expected 1")
        indices = indices[:, :, 0]
    if indices.dim() != 3 or indices.shape[0] != g.B or indices.shape[1] != g.S:
        raise ValueError(f"indices must have shape [B={g.B}, S={g.S}, K] (or [B, S, 1, K]) for {convention.name}, "
                         f"got shape {tuple(indices.shape)}")
    return indices.reshape(g.B * g.S, indices.shape[-1])


def _token_frame(convention: Convention, g: _Geometry, cu_seqlens: torch.Tensor | None, q_start: int,
                 device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token: query position, base offset of its index space and the size of that space."""
    T = g.B * g.S
    if convention.index_space == "per_sequence":
        if cu_seqlens is None:
            raise ValueError(f"{convention.name} counts indices from each sequence's start: pass cu_seqlens")
        cu = check_cu_seqlens(cu_seqlens).to(device)
        if int(cu[-1]) != T:
            raise ValueError(f"cu_seqlens must end at T={T} (the tokens of q), got {cu.tolist()[-4:]}")
        if g.S_kv != T:
            raise ValueError(f"{convention.name} needs kv rows for the same packed tokens as q: kv has {g.S_kv}, q {T}")
        t = torch.arange(T, device=device)
        seq = torch.searchsorted(cu[1:], t, right=True)
        base = cu[seq]
        return t - base, base, cu[seq + 1] - base
    if cu_seqlens is not None:
        raise ValueError(f"cu_seqlens is only meaningful for per-sequence index spaces, not {convention.name}")
    if isinstance(q_start, bool) or not isinstance(q_start, int) or q_start < 0:
        raise ValueError(f"q_start must be an int >= 0, got {q_start!r}")
    s = torch.arange(g.S, device=device).repeat(g.B)  # [T]
    b = torch.arange(g.B, device=device).repeat_interleave(g.S)  # [T]
    pos = q_start + s
    if convention.index_space == "global":
        return pos, torch.zeros(T, dtype=torch.int64, device=device), torch.full((T,), g.S_kv, device=device)
    return pos, b * g.S_kv, torch.full((T,), g.S_kv, device=device)


def _convert_indices(indices, convention, g, *, cu_seqlens, q_start, topk_length):
    idx = _flatten_indices(indices, convention, g).long()  # [T, K] kernel index space
    T, K = idx.shape
    pos, base, limit = _token_frame(convention, g, cu_seqlens, q_start, idx.device)
    pos, base, limit = pos[:, None], base[:, None], limit[:, None]  # [T, 1]
    stats = _IndexStats()
    rule = convention.sentinel
    if rule == "out_of_range":
        unused = (idx < 0) | (idx >= limit)
    elif rule == "minus_one":
        unused = idx == -1
        bad = (idx < -1) | (idx >= limit)
        if bool(bad.any()):
            t, j = (int(v) for v in bad.nonzero()[0])
            raise ValueError(f"indices[{t}, {j}] = {int(idx[t, j])}: {convention.name} marks unused slots with -1 "
                             f"only; other values must lie in [0, {int(limit[t, 0])})")
    else:
        if rule == "after_position":
            if bool((idx < 0).any()):
                t, j = (int(v) for v in (idx < 0).nonzero()[0])
                raise ValueError(f"indices[{t}, {j}] = {int(idx[t, j])}: {convention.name} masks only indices "
                                 f"> the query position, so a negative index is read as a real row (KV[-1]); "
                                 f"pad unused slots with S_kv instead")
            unused = idx > pos
        else:
            if bool((idx < -1).any()):
                t, j = (int(v) for v in (idx < -1).nonzero()[0])
                raise ValueError(f"indices[{t}, {j}] = {int(idx[t, j])}: {convention.name} accepts -1 or indices "
                                 f"> the query position as unused markers, nothing more negative")
            unused = (idx == -1) | (idx > pos)
        bad = ~unused & (idx >= limit)
        if bool(bad.any()):  # a query position beyond the keys (S > S_kv, or a large q_start)
            t, j = (int(v) for v in bad.nonzero()[0])
            raise ValueError(f"indices[{t}, {j}] = {int(idx[t, j])} is <= the query position but >= the "
                             f"{int(limit[t, 0])} keys: an out-of-bounds read in {convention.name}")
    stats.unused = int(unused.sum())
    if convention.causal and rule in ("minus_one", "out_of_range"):
        future = ~unused & (idx > pos)
        stats.causal_masked = int(future.sum())
        unused = unused | future
    if topk_length is not None:
        check_int("topk_length", topk_length)
        if topk_length.dim() != 1 or topk_length.shape[0] != T:
            raise ValueError(f"topk_length must have shape [T={T}], got {tuple(topk_length.shape)}")
        beyond = torch.arange(K, device=idx.device)[None, :] >= topk_length.to(idx.device).long()[:, None]
        stats.length_masked = int((beyond & ~unused).sum())
        unused = unused | beyond
    ref = torch.where(unused, torch.full_like(idx, -1), idx + base)  # [T, K] global, -1 unused
    dup = _repeated_slots(ref)
    stats.duplicate_slots = int(dup.sum())
    if convention.duplicates == "once" and stats.duplicate_slots:
        ref = torch.where(dup, torch.full_like(ref, -1), ref)
        stats.duplicates_dropped = stats.duplicate_slots
    stats.empty_rows = int((ref < 0).all(dim=1).sum()) if K else T
    return ref, stats


def _repeated_slots(idx: torch.Tensor) -> torch.Tensor:
    """Bool ``[T, K]``: valid slots whose key already appeared in an earlier slot of the row."""
    return (idx >= 0) & ~first_occurrence(idx)


def to_reference_indices(indices: torch.Tensor, convention: Convention, *, num_keys: int,
                         batch: int = 1, cu_seqlens: torch.Tensor | None = None, q_start: int = 0,
                         topk_length: torch.Tensor | None = None) -> torch.Tensor:
    """Kernel-convention indices -> the reference's: int64 ``[T, K]``, global rows, ``-1`` = unused.

    Applies, in order: the convention's sentinel rule, its causal mask (slots after the query
    position become ``-1``), ``topk_length`` (slots at or beyond it become ``-1``), and for
    ``duplicates="once"`` drops repeated keys. Values the kernel would misread raise ``ValueError``.

    Args:
        indices: in the kernel's layout (``convention.indices_layout``), any integer dtype.
        convention: the kernel's `Convention`.
        num_keys: ``S_kv``: keys per batch entry (``per_batch``) or in total (``global``, ``per_sequence``).
        batch: ``B`` for ``BSHD``/``SBHD`` conventions.
        cu_seqlens: int ``[num_seqs + 1]``, required for ``per_sequence`` index spaces.
        q_start: position of the first query (``BSHD``/``SBHD``, causal conventions).
        topk_length: optional int ``[T]``: only the first ``topk_length[t]`` slots of row t are read.

    Returns:
        int64 ``[T, K]`` with ``T = B * S``.
    """
    convention = _check_convention(convention)
    check_int("indices", indices)
    if convention.layout == "THD":
        S = indices.shape[0]
        g = _Geometry("THD", 1, S, int(num_keys), 0, 0)
    else:
        if indices.dim() not in (3, 4):
            raise ValueError(f"indices must have shape [B, S, K] or [B, S, 1, K] for {convention.name}, "
                             f"got shape {tuple(indices.shape)}")
        g = _Geometry(convention.layout, indices.shape[0], indices.shape[1], int(num_keys), 0, 0)
        if batch != g.B:
            raise ValueError(f"batch={batch} but indices has {g.B} batch entries (shape {tuple(indices.shape)})")
    ref, _ = _convert_indices(indices, convention, g, cu_seqlens=cu_seqlens, q_start=q_start, topk_length=topk_length)
    return ref


def from_reference_indices(indices: torch.Tensor, convention: Convention, *, num_keys: int, batch: int = 1,
                           cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Reference indices (int ``[T, K]``, global rows, ``-1`` = unused) -> a kernel's convention.

    Valid indices are moved into the kernel's index space (minus the start of the query's batch
    entry or sequence) and unused slots get ``convention.pad_value`` (``S_kv`` when it is ``None``).
    The result has the kernel's index layout and dtype.

    Args:
        indices: int ``[T, K]`` reference indices.
        convention: the target `Convention`.
        num_keys: ``S_kv`` of the kernel call (per batch entry for ``per_batch``).
        batch: ``B`` for ``BSHD``/``SBHD`` (``T = B * S``).
        cu_seqlens: required for ``per_sequence`` index spaces.

    Raises:
        ValueError: when a valid index lies outside the query's batch entry or sequence (the
            kernel's index space cannot express it).
    """
    convention = _check_convention(convention)
    check_int("indices", indices)
    if indices.dim() != 2:
        raise ValueError(f"indices must be reference indices [T, K], got shape {tuple(indices.shape)}")
    T, K = indices.shape
    if convention.layout != "THD" and (batch < 1 or T % batch):
        raise ValueError(f"batch={batch} must divide the {T} rows of indices")
    S = T if convention.layout == "THD" else T // batch
    g = _Geometry(convention.layout, 1 if convention.layout == "THD" else batch, S, int(num_keys), 0, 0)
    pos, base, limit = _token_frame(convention, g, cu_seqlens, 0, indices.device)
    idx = indices.long()
    valid = idx >= 0
    local = idx - base[:, None]
    outside = valid & ((local < 0) | (local >= limit[:, None]))
    if bool(outside.any()):
        t, j = (int(v) for v in outside.nonzero()[0])
        raise ValueError(f"indices[{t}, {j}] = {int(idx[t, j])} lies outside the index space of query {t} in "
                         f"{convention.name} ({convention.index_space}); it cannot be expressed there")
    if convention.sentinel == "after_position":
        over = valid & (local > pos[:, None])
        if bool(over.any()):
            t, j = (int(v) for v in over.nonzero()[0])
            raise ValueError(f"indices[{t}, {j}] = {int(idx[t, j])} is after query {t}'s position: "
                             f"{convention.name} would read it as an unused slot")
    pad = num_keys if convention.pad_value is None else convention.pad_value
    out = torch.where(valid, local, torch.full_like(local, pad)).to(convention.index_dtype)
    if convention.layout == "THD":
        return out[:, None, :] if convention.indices_group_dim else out  # [T, 1, K] or [T, K]
    out = out.reshape(batch, S, K)
    return out[:, :, None, :] if convention.indices_group_dim else out  # [B, S, 1, K] or Megatron's [B, S, K]


# ----------------------------------------------------------------------------------------- LSE


def lse_to_natural(lse: torch.Tensor, convention: Convention) -> torch.Tensor:
    """A kernel's LSE -> natural log with ``-inf`` on empty rows (the reference's convention).

    Base 2 is multiplied by ``ln 2``. If the convention reports empty rows as ``+inf``, the signs of
    the infinities are swapped, so a kernel that follows its convention matches the reference and
    one that reports the other infinity does not. A convention whose empty rows report ``0`` cannot
    be told from a real LSE of 0 here; `check_sparse_mla` maps it on the rows it knows are empty.
    """
    convention = _check_convention(convention)
    check_float("lse", lse)
    if convention.lse_base is None:
        raise ValueError(f"{convention.name} returns no LSE")
    x = lse.to(torch.float64)
    if convention.lse_base == "2":
        x = torch.where(torch.isfinite(x), x * LN2, x)
    if convention.empty_row_lse == math.inf:
        x = torch.where(torch.isinf(x), -x, x)
    return x


def lse_from_natural(lse: torch.Tensor, convention: Convention) -> torch.Tensor:
    """Reference LSE (natural log, ``-inf`` on empty rows) -> a kernel's convention (inverse of `lse_to_natural`)."""
    convention = _check_convention(convention)
    check_float("lse", lse)
    if convention.lse_base is None:
        raise ValueError(f"{convention.name} returns no LSE")
    x = lse
    if convention.lse_base == "2":
        x = torch.where(torch.isfinite(x), x / LN2, x)
    if convention.empty_row_lse == math.inf:
        x = torch.where(torch.isinf(x), -x, x)
    elif convention.empty_row_lse == 0.0:
        x = torch.where(torch.isneginf(x), torch.zeros_like(x), x)
    return x


# -------------------------------------------------------------------------------------- report


@dataclass
class Report:
    """What an adapter found: one `Comparison` per output tensor, plus notes about the inputs.

    Attributes:
        check: which adapter produced it (``"sparse_mla"``, ``"sparse_mla_backward"``, ``"indexer"``).
        convention: the kernel's `Convention` (``None`` where conventions do not apply).
        comparisons: one per compared tensor (``out``, ``lse``, ``dq``, ``dkv``, ``scores``).
        notes: facts about the inputs worth knowing when reading the numbers (unused slots, empty rows, ...).
    """

    check: str
    convention: Convention | None
    comparisons: list[Comparison]
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether every comparison passes."""
        return all(c.ok for c in self.comparisons)

    def assert_ok(self) -> "Report":
        """Raise ``AssertionError`` with the full report unless `ok`; return ``self`` otherwise."""
        if not self.ok:
            raise AssertionError(str(self))
        return self

    def __getitem__(self, name: str) -> Comparison:
        for c in self.comparisons:
            if c.name == name:
                return c
        raise KeyError(f"no comparison named {name!r}; have {[c.name for c in self.comparisons]}")

    def __str__(self) -> str:
        head = f"{self.check}: {'ok' if self.ok else 'FAIL'}"
        if self.convention is not None:
            head += f"  [{self.convention.name}]"
        lines = [head]
        for c in self.comparisons:
            lines.extend("  " + line for line in str(c).splitlines())
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def as_dict(self) -> dict:
        """Plain Python values (for JSON)."""
        return {"check": self.check, "ok": self.ok,
                "convention": None if self.convention is None else self.convention.name,
                "comparisons": [c.as_dict() for c in self.comparisons], "notes": list(self.notes)}


# ------------------------------------------------------------------------------------ adapters


def _reference_inputs(q, kv, indices, convention, *, cu_seqlens, q_start, topk_length, dtype=torch.float64):
    g = _geometry(q, kv, convention)
    q_ref = to_thd(q.detach(), convention.layout, name="q").to(dtype)  # [T, H, D]
    kv_ref = keys_to_thd(kv.detach(), convention.layout).to(dtype)  # [N, D]
    if kv_ref.shape[-1] != g.D:
        raise ValueError(f"kv has width {kv_ref.shape[-1]} but q has {g.D} (both are [c_kv ; k_pe], e.g. 576)")
    idx_ref, stats = _convert_indices(indices, convention, g, cu_seqlens=cu_seqlens, q_start=q_start,
                                      topk_length=topk_length)
    return g, q_ref, kv_ref, idx_ref, stats


def reference_kernel(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, *, convention: Convention,
                     sm_scale: float, d_v: int = 512, cu_seqlens: torch.Tensor | None = None, q_start: int = 0,
                     topk_length: torch.Tensor | None = None, compute_dtype: torch.dtype = torch.float64
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What a correct kernel of ``convention`` returns for these inputs: ``(out, lse)`` in its layout.

    ``out`` has the kernel's layout and q's dtype; ``lse`` is float32 in the convention's base with
    its empty-row marker (``None`` when the convention returns none). Computed in ``compute_dtype``.
    """
    convention = _check_convention(convention)
    sm_scale = check_scale("sm_scale", sm_scale)
    g, q_ref, kv_ref, idx_ref, _ = _reference_inputs(q, kv, indices, convention, cu_seqlens=cu_seqlens,
                                                     q_start=q_start, topk_length=topk_length, dtype=compute_dtype)
    out, lse = sparse_mla(q_ref, kv_ref, idx_ref, sm_scale=sm_scale, d_v=d_v)
    empty = torch.isneginf(lse)[..., None]  # [T, H, 1]: rows with no valid slot
    out = torch.where(empty, torch.full_like(out, convention.empty_row_out), out)  # the convention's marker
    out = from_thd(out, convention.layout, batch=g.B).to(q.dtype)
    if convention.lse_base is None:
        return out, None
    lse = from_thd(lse_from_natural(lse, convention), convention.layout, batch=g.B).to(torch.float32)
    return out, lse


# --8<-- [start:check_sparse_mla]
def check_sparse_mla(kernel_out: torch.Tensor, kernel_lse: torch.Tensor | None, q: torch.Tensor, kv: torch.Tensor,
                     indices: torch.Tensor, *, convention: Convention, sm_scale: float, d_v: int = 512,
                     cu_seqlens: torch.Tensor | None = None, q_start: int = 0,
                     topk_length: torch.Tensor | None = None, tol: Tolerance | None = None,
                     lse_tol: Tolerance | None = None) -> Report:
    """Check a sparse-MLA kernel's forward outputs against the exact reference, in its convention.

    The inputs are the ones the kernel was called with, in its layout; the reference is computed in
    float64 from them (so bf16 inputs are used exactly as the kernel saw them), converted to the
    kernel's layout, and compared: ``out`` with ``tol`` (default: the preset for ``kernel_out``'s
    dtype), the LSE (converted to natural log) with ``lse_tol`` (default `LSE_TOLERANCE`).

    Args:
        kernel_out: the kernel's output, ``[..., H, d_v]`` in ``convention.layout``.
        kernel_lse: the kernel's LSE in its base and layout, or ``None`` to skip it.
        q: the queries the kernel got (``[T, H, D]``, ``[B, S, H, D]`` or ``[S, B, H, D]``).
        kv: the latent rows it got (``[S_kv, 1, D]``, ``[B, S_kv, 1, D]`` or ``[S_kv, B, 1, D]``).
        indices: its top-k indices, in its layout, index space and sentinel.
        convention: the kernel's `Convention`.
        sm_scale: the softmax scale the kernel was asked to use (DeepSeek-V3.2: ``192 ** -0.5 * mscale ** 2``).
        d_v: value width (DeepSeek-V3.2: 512).
        cu_seqlens: for ``per_sequence`` conventions (TileLang's finetune kernels call it ``offsets``).
        q_start: position of the first query, for causal ``BSHD``/``SBHD`` kernels (TileLang's pipelined
            kernel takes it as ``q_start_index_s``).
        topk_length: optional int ``[T]``: the kernel reads only the first ``topk_length[t]`` slots.
        tol: tolerance for ``out``.
        lse_tol: tolerance for the LSE.

    Returns:
        A `Report` with comparisons ``out`` (and ``lse``) and notes on unused, masked and duplicate slots.
    """
    convention = _check_convention(convention)
    sm_scale = check_scale("sm_scale", sm_scale)
    check_float("kernel_out", kernel_out)
    g, q_ref, kv_ref, idx_ref, stats = _reference_inputs(q, kv, indices, convention, cu_seqlens=cu_seqlens,
                                                         q_start=q_start, topk_length=topk_length)
    out_ref, lse_ref = sparse_mla(q_ref, kv_ref, idx_ref, sm_scale=sm_scale, d_v=d_v)  # [T, H, d_v], [T, H]
    expected_out = from_thd(out_ref, convention.layout, batch=g.B)
    if tuple(kernel_out.shape) != tuple(expected_out.shape):
        raise ValueError(f"kernel_out has shape {tuple(kernel_out.shape)}, expected {tuple(expected_out.shape)} "
                         f"({convention.layout} with d_v={d_v})")
    empty = from_thd(torch.isneginf(lse_ref), convention.layout, batch=g.B)  # rows with no valid slot
    kernel_out = _empty_rows_as_reference(kernel_out, empty[..., None], convention.empty_row_out, 0.0)
    comparisons = [compare(kernel_out, expected_out, name="out", tol=tol)]
    if kernel_lse is not None:
        check_float("kernel_lse", kernel_lse)
        expected_lse = from_thd(lse_ref, convention.layout, batch=g.B)
        if tuple(kernel_lse.shape) != tuple(expected_lse.shape):
            raise ValueError(f"kernel_lse has shape {tuple(kernel_lse.shape)}, expected {tuple(expected_lse.shape)}")
        natural = lse_to_natural(kernel_lse, convention).to(kernel_lse.dtype)  # float32 rounding: ~6e-8 rel.
        if convention.empty_row_lse == 0.0:
            natural = _empty_rows_as_reference(natural, empty, 0.0, -math.inf)
        comparisons.append(compare(natural, expected_lse, name="lse",
                                   tol=LSE_TOLERANCE if lse_tol is None else lse_tol, head_dim=expected_lse.dim() - 1))
    notes = stats.notes(convention)
    if convention.lse_base == "2" and kernel_lse is not None:
        notes.append("kernel LSE is base 2: compared as lse * ln 2")
    return Report("sparse_mla", convention, comparisons, notes)
# --8<-- [end:check_sparse_mla]


def _empty_rows_as_reference(x: torch.Tensor, empty: torch.Tensor, marker: float, reference: float) -> torch.Tensor:
    """On the rows the reference knows are ``empty``: the convention's ``marker`` becomes the reference's
    value, and any other value becomes NaN, so the comparison flags a kernel that breaks its convention
    (say ``-inf`` where it promises 0). Elsewhere ``x`` is unchanged."""
    if marker == reference or (math.isnan(marker) and math.isnan(reference)):
        return x
    is_marker = torch.isnan(x) if math.isnan(marker) else x == marker
    fixed = torch.where(is_marker, torch.full_like(x, reference), torch.full_like(x, math.nan))
    return torch.where(empty, fixed, x)


#: Sequential float32 additions into one gradient element that `accumulation_rtol` covers in the
#: worst case (and, with overwhelming probability, ``(2^16 / 10)^2 ~ 4e7`` of them: see there).
ACCUMULATION_TERMS = 2 ** 16


def accumulation_rtol(dtype) -> float:
    r"""The ``rtol`` of the magnitude-based elementwise bound for a sparse-MLA gradient of ``dtype``.

    A gradient element is a sum $e = \sum_i x_i$ of contributions (for $dkv_s$: one per head and per
    slot that reads key row $s$; for $dq_{t,h}$: one per slot), and a kernel computes it as follows,
    with $u$ the unit roundoff of ``dtype`` ($2^{-8}$ for bfloat16):

    1. each contribution's probability $P$ or score gradient $dS$ is rounded to ``dtype`` before its
       GEMM (FlashAttention-style kernels do): $\le u\,|x_i|$;
    2. $P$ and $dS$ carry the errors of their own float32 computation (scores, the forward's LSE,
       $\delta = \operatorname{rowsum}(O \circ dO)$ from a rounded $O$): allowed another $u\,|x_i|$;
    3. the contributions are accumulated in float32 ($u_{32} = 2^{-24}$): Higham's bound
       $|\hat e - e| \le \gamma_n \sum_i |x_i|$ with $\gamma_n \approx n\,u_{32}$ for $n$ sequential
       additions (worst case; blocked GEMM sums and atomics do better), and
       $\lambda\sqrt{n}\,u_{32}$ with probability $\ge 1 - 2n e^{-\lambda^2(1-u_{32})^2/2}$ for
       independent rounding errors (Higham and Mary, SIAM J. Sci. Comput. 41(5), 2019);
    4. the result is rounded to ``dtype``: $\le u\,|e| \le u\,m$.

    With $m = \sum_i |x_i|$ the magnitude (`sparse_mla_backward_magnitudes`), the sum of the four is

    $$ |\hat e - e| \le (3u + \gamma_n)\, m, $$

    and this function returns $3u + 2^{16} u_{32}$: the accumulation allowance $2^{16} u_{32} =
    2^{-8}$ is the worst-case $\gamma_n$ of `ACCUMULATION_TERMS` $= 2^{16}$ sequential additions, and
    the probabilistic bound with $\lambda = 10$ (failure probability below $2 \cdot 10^{-14}$ per
    element) for up to $(2^{16}/10)^2 \approx 4\cdot 10^7$ contributions, above DeepSeek-V3.2's 128
    heads $\times$ 16384 queries $= 2^{21}$ reading one key. For bfloat16 that is $4u = 2^{-6}
    \approx 0.0156$ (half the doubled bfloat16 preset's ``rtol`` relative to $|e|$, 0.032); float16:
    $5.4\cdot 10^{-3}$; float32 (where the accumulation dominates): $3.9\cdot 10^{-3}$; float64
    (accumulated in float64): $7.3\cdot 10^{-12}$.

    Step 2 holds relative to $|x_i|$ except for the error a kernel's $\delta$ carries in: it is
    computed from the kernel's rounded output $\hat O$, and where $dP \approx \delta$ inside one
    $dS$ that error does not shrink with $|dS|$. `sparse_mla_backward_delta_terms` and
    `delta_allowance_scale` bound it on their own, as an absolute allowance beside $\text{rtol}\cdot m$.

    Args:
        dtype: the kernel gradient's ``torch`` float dtype.
    """
    u = torch.finfo(dtype).eps / 2  # unit roundoff of the gradient's dtype
    u_acc = 2.0 ** -53 if dtype == torch.float64 else 2.0 ** -24  # float64 kernels accumulate in float64
    return 3 * u + ACCUMULATION_TERMS * u_acc


def sparse_mla_backward_magnitudes(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_out: torch.Tensor,
                                   *, sm_scale: float, d_v: int = 512, chunk_size: int | None = None
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The "absolute" sparse-MLA backward: each gradient element's contributions, in absolute value, summed.

    With $P$ the softmax probabilities of the selected slots, $dP_{t,h,j} = dO_{t,h} \cdot
    v_{\mathrm{idx}_{t,j}}$, $\delta_{t,h} = \sum_j P_{t,h,j}\, dP_{t,h,j}$ and the score gradient
    $dS = \sigma\, P \circ (dP - \delta)$ (the reference's: `dsa_ref.sparse_mla` returns no LSE
    gradient, so there is no $d\mathrm{lse}$ term), the backward is

    $$ dq_{t,h} = \sum_j dS_{t,h,j}\, kv_{\mathrm{idx}_{t,j}}, \qquad
       dkv_s = \sum_{(t,j):\,\mathrm{idx}_{t,j} = s} \sum_h \big( dS_{t,h,j}\, q_{t,h}
               + P_{t,h,j}\, [dO_{t,h} ; 0] \big) $$

    and this function returns the same sums of absolute values, per channel:

    $$ m^{dq}_{t,h} = \sum_j |dS_{t,h,j}|\, |kv_{\mathrm{idx}_{t,j}}|, \qquad
       m^{dkv}_s = \sum_{(t,j):\,\mathrm{idx}_{t,j} = s} \sum_h \big( |dS_{t,h,j}|\, |q_{t,h}|
               + P_{t,h,j}\, [|dO_{t,h}| ; 0] \big). $$

    ``-1`` slots contribute nothing; a key in two slots of a row contributes once per slot, as in
    `dsa_ref.sparse_mla`. $m \ge |\text{gradient}|$ elementwise, with equality when nothing cancels.
    Computed in float64, in query chunks (no ``[T, S]`` tensor).

    Args:
        q: ``[T, H, D]`` queries (any float dtype; used as float64).
        kv: ``[N, D]`` latent rows (``[N, 1, D]`` accepted).
        indices: int ``[T, K]`` reference indices, ``-1`` = unused (convert a kernel's first:
            `to_reference_indices`).
        d_out: ``[T, H, d_v]`` output gradient.
        sm_scale: softmax scale $\sigma$.
        d_v: value width (the first ``d_v`` channels of each latent row).
        chunk_size: queries per chunk (memory only).

    Returns:
        ``(m_dq [T, H, D], m_dkv [N, D])``, float64, on q's device.
    """
    (magnitudes,) = _backward_sums(q, kv, indices, d_out, (_magnitude_terms,), sm_scale=sm_scale, d_v=d_v,
                                   chunk_size=chunk_size)
    return magnitudes


def _magnitude_terms(c: _Chunk, sm_scale: float, d_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's terms of `sparse_mla_backward_magnitudes`: ``(m_dq [C, H, D], per slot [C, K, D])``."""
    dS_abs = (c.P * (c.dP - c.delta) * sm_scale).abs()  # [C, H, K]
    per_slot = torch.einsum("thk,thd->tkd", dS_abs, c.q.abs())  # [C, K, D]: |dS|^T |q|
    per_slot[..., :d_v] += torch.einsum("thk,thv->tkv", c.P, c.d_out.abs())  # [C, K, d_v]: P^T |dO|
    return torch.einsum("thk,tkd->thd", dS_abs, c.kv_sel.abs()), per_slot  # [C, H, D], [C, K, D]


#: $\lambda$ of `sparse_mla_backward_delta_terms`: a kernel's delta is off by more than $\lambda u\, r$
#: with probability below $4 e^{-\lambda^2/2} \approx 8\cdot 10^{-22}$ (Hoeffding, two sums of independent
#: rounding errors), the $\lambda$ of `accumulation_rtol`'s probabilistic bound
DELTA_LAMBDA = 10.0


def delta_allowance_scale(dtype) -> float:
    r"""$\lambda u$: what `sparse_mla_backward_delta_terms` is multiplied by to bound, per gradient
    element, the error a kernel's $\delta = \operatorname{rowsum}(\hat O \circ dO)$ brings in,
    with $u$ the unit roundoff of ``dtype`` (the forward output's, which ``d_out`` shares) and
    $\lambda$ = `DELTA_LAMBDA`. For bfloat16: $10 \cdot 2^{-8} \approx 0.039$.
    """
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a torch float dtype (the forward output's), got {dtype!r}")
    return DELTA_LAMBDA * torch.finfo(dtype).eps / 2


def sparse_mla_backward_delta_terms(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_out: torch.Tensor,
                                    *, sm_scale: float, d_v: int = 512, chunk_size: int | None = None
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
    r"""How far a kernel's $\delta$ can move each gradient element, in units of $\lambda u$.

    A kernel computes $\delta_{t,h} = \sum_v \hat O_{t,h,v}\, dO_{t,h,v}$ from its own output
    $\hat O$, which differs from the exact $O = \sum_j P_j v_j$ by the rounding of each $P_j$
    before the $PV$ product ($|\epsilon_j| \le u$) and of each output element ($|\eta_v| \le u$).
    Hence $\hat\delta - \delta = \sum_j \epsilon_j P_j\, dP_j + \sum_v \eta_v O_v\, dO_v$, two sums of
    independent rounding errors, which exceed $\lambda u\, r_{t,h}$ with
    $r = \lVert P \circ dP \rVert_2 + \lVert O \circ dO \rVert_2$ only with probability
    $\le 4 e^{-\lambda^2/2}$. Every $dS_{t,h,j} = \sigma P_j (dP_j - \delta)$ of that row takes the
    error $\sigma P_j (\hat\delta - \delta)$, which does not shrink where $dP_j \approx \delta$ (one key
    holding most of the attention), so $\text{rtol}\cdot m$ (`sparse_mla_backward_magnitudes`) does
    not cover it there. Its sum over the terms of each gradient element, in absolute value, is

    $$ t^{dq}_{t,h} = \sum_j \sigma P_{t,h,j}\, r_{t,h}\, |kv_{\mathrm{idx}_{t,j}}|, \qquad
       t^{dkv}_s = \sum_{(t,j):\,\mathrm{idx}_{t,j} = s} \sum_h \sigma P_{t,h,j}\, r_{t,h}\, |q_{t,h}|, $$

    and `check_sparse_mla_backward` allows ``delta_allowance_scale(d_out.dtype) * t`` beside
    $\text{rtol}\cdot m$. Same arguments and chunking as `sparse_mla_backward_magnitudes`.

    Returns:
        ``(t_dq [T, H, D], t_dkv [N, D])``, float64, on q's device.
    """
    (terms,) = _backward_sums(q, kv, indices, d_out, (_delta_terms,), sm_scale=sm_scale, d_v=d_v,
                              chunk_size=chunk_size)
    return terms


def _delta_terms(c: _Chunk, sm_scale: float, d_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's terms of `sparse_mla_backward_delta_terms`: ``(t_dq [C, H, D], per slot [C, K, D])``."""
    out = torch.einsum("thk,tkv->thv", c.P, c.kv_sel[..., :d_v])  # [C, H, d_v]: the exact O
    r = (c.P * c.dP).norm(dim=-1, keepdim=True) + (out * c.d_out).norm(dim=-1, keepdim=True)  # [C, H, 1]
    w = sm_scale * c.P * r  # [C, H, K]: each dS's share of the delta error
    return torch.einsum("thk,tkd->thd", w, c.kv_sel.abs()), torch.einsum("thk,thd->tkd", w, c.q.abs())


@dataclass
class _BackwardInputs:
    """The arguments of `_backward_sums`, checked, in float64 on q's device."""

    q: torch.Tensor  # [T, H, D]
    kv: torch.Tensor  # [N, D]
    idx: torch.Tensor  # [T, K] int64, -1 = unused
    d_out: torch.Tensor  # [T, H, d_v]


@dataclass
class _Chunk:
    """One chunk of queries of the float64 backward: what the parts of `_backward_sums` read."""

    q: torch.Tensor  # [C, H, D]
    d_out: torch.Tensor  # [C, H, d_v]
    idx: torch.Tensor  # [C, K]
    valid: torch.Tensor  # [C, K]
    kv_sel: torch.Tensor  # [C, K, D]; -1 slots: zeros
    P: torch.Tensor  # [C, H, K]; 0 on -1 slots and empty rows
    dP: torch.Tensor  # [C, H, K]
    delta: torch.Tensor  # [C, H, 1]


def _backward_inputs(q, kv, indices, d_out, *, d_v) -> _BackwardInputs:
    """Check the arguments of `_backward_sums` (ValueError / TypeError naming them)."""
    check_float("q", q)
    check_float("kv", kv)
    check_float("d_out", d_out)
    check_int("indices", indices)
    q64 = q.detach().to(torch.float64)  # [T, H, D]
    kv64 = kv.detach().to(device=q.device, dtype=torch.float64)
    if kv64.dim() == 3 and kv64.shape[1] == 1:
        kv64 = kv64[:, 0]  # [N, D]
    dout64 = d_out.detach().to(device=q.device, dtype=torch.float64)  # [T, H, d_v]
    idx = indices.detach().to(q.device).long()
    if idx.dim() == 3 and idx.shape[1] == 1:
        idx = idx[:, 0]  # [T, K]
    if q64.dim() != 3 or kv64.dim() != 2 or kv64.shape[1] != q64.shape[2]:
        raise ValueError(f"q must be [T, H, D] and kv [N, D] with the same D, got {tuple(q.shape)} and "
                         f"{tuple(kv.shape)}")
    T, H, D = q64.shape
    N = kv64.shape[0]
    if idx.dim() != 2 or idx.shape[0] != T:
        raise ValueError(f"indices must be [T={T}, K], got {tuple(indices.shape)}")
    if dout64.shape != (T, H, d_v) or not 1 <= d_v <= D:
        raise ValueError(f"d_out must be [T={T}, H={H}, d_v={d_v}] with d_v <= D={D}, got {tuple(d_out.shape)}")
    if idx.numel() and (int(idx.min()) < -1 or int(idx.max()) >= N):
        raise ValueError(f"indices must be -1 or in [0, {N})")
    return _BackwardInputs(q64, kv64, idx, dout64)


def _backward_sums(q, kv, indices, d_out, parts, *, sm_scale, d_v,
                   chunk_size) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Sum each of ``parts`` over the float64 backward, in one pass of query chunks (no ``[T, S]`` tensor).

    A part maps a `_Chunk` (and ``sm_scale``, ``d_v``) to ``(per query [C, H, D], per slot [C, K, D])``;
    its sums are ``(dq-like [T, H, D], dkv-like [N, D])``, the per-slot terms added to their key rows
    (valid slots only, once per slot). Returns one pair per part.
    """
    sm_scale = check_scale("sm_scale", sm_scale)
    x = _backward_inputs(q, kv, indices, d_out, d_v=d_v)
    sums = [(torch.zeros_like(x.q), torch.zeros_like(x.kv)) for _ in parts]  # [T, H, D], [N, D] each
    (T, H, D), K = x.q.shape, x.idx.shape[1]
    chunk = auto_chunk_size(T, max(H * K, K * D, H * D), chunk_size)
    for lo, hi in chunk_bounds(T, chunk):
        q_c, idx_c, dout_c = x.q[lo:hi], x.idx[lo:hi], x.d_out[lo:hi]  # [C, H, D], [C, K], [C, H, d_v]
        valid = idx_c >= 0  # [C, K]
        kv_sel = select_rows(x.kv, idx_c, valid)  # [C, K, D]; -1 slots: zeros
        scores = torch.einsum("thd,tkd->thk", q_c, kv_sel) * sm_scale  # [C, H, K]
        P, _ = masked_softmax_with_lse(scores, valid[:, None, :])  # [C, H, K]; 0 on -1 slots and empty rows
        dP = torch.einsum("thv,tkv->thk", dout_c, kv_sel[..., :d_v])  # [C, H, K]
        delta = (P * dP).sum(dim=-1, keepdim=True)  # [C, H, 1]
        c = _Chunk(q_c, dout_c, idx_c, valid, kv_sel, P, dP, delta)
        for part, (per_query, per_key) in zip(parts, sums):
            q_terms, slot_terms = part(c, sm_scale, d_v)  # [C, H, D], [C, K, D]
            per_query[lo:hi] = q_terms
            per_key.index_add_(0, idx_c[valid], slot_terms[valid])  # [N, D]
    return sums


def indexer_backward_magnitudes(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                                d_scores: torch.Tensor, *, relu: bool = True, chunk_size: int | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""The "absolute" backward of the scores at the slots (`dsa_ref.index_scores_at`).

    With $z_{t,h,j} = q_{t,h} \cdot k_{\mathrm{idx}_{t,j}}$, $r = \operatorname{relu}$ (or the
    identity) and $g_{t,h,j} = d_{t,j}\, w_{t,h}\, r'(z_{t,h,j})$ for the upstream gradient
    $d$ of the scores $s_{t,j} = \sum_h w_{t,h}\, r(z_{t,h,j})$, the gradients are

    $$ dq_{t,h} = \sum_j g_{t,h,j}\, k_{\mathrm{idx}_{t,j}}, \quad
       dk_s = \sum_{(t,j):\,\mathrm{idx}_{t,j} = s} \sum_h g_{t,h,j}\, q_{t,h}, \quad
       dw_{t,h} = \sum_j d_{t,j}\, r(z_{t,h,j}) $$

    and this function returns the same sums with every term in absolute value (the magnitudes
    $m$ of `dsa_ref.compare.compare`), counting as active every logit within the float32 rounding of
    a ``D_I``-term dot product of 0 ($|z| \le D_I\, 2^{-24} \sum_d |q_d k_d|$), whose sign a
    kernel may see flipped. An early key of a causal sequence is read by most queries:
    its $dk$ sums thousands of terms that cancel, and a kernel's rounding error there scales with
    $m$, not with $|dk|$. ``-1`` slots contribute nothing; a key in two slots of a row contributes
    twice. Computed in float64, in query chunks.

    Args:
        q: ``[T, H_I, D_I]``; k: ``[S, D_I]``; weights: ``[T, H_I]``; indices: int ``[T, K]``
            (``-1`` = unused); d_scores: ``[T, K]`` (its values at ``-1`` slots are ignored).
        relu: as in `dsa_ref.index_scores_at`.
        chunk_size: queries per chunk (memory only).

    Returns:
        ``(m_dq [T, H_I, D_I], m_dk [S, D_I], m_dw [T, H_I])``, float64, on q's device.
    """
    for name, x in (("q", q), ("k", k), ("weights", weights), ("d_scores", d_scores)):
        check_float(name, x)
    check_int("indices", indices)
    if q.dim() != 3 or k.dim() != 2 or k.shape[1] != q.shape[2] or weights.shape != q.shape[:2]:
        raise ValueError(f"q must be [T, H_I, D_I], k [S, D_I] and weights [T, H_I], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(weights.shape)}")
    T, H, D = q.shape
    S = k.shape[0]
    if indices.dim() != 2 or indices.shape[0] != T or d_scores.shape != indices.shape:
        raise ValueError(f"indices and d_scores must be [T={T}, K], got {tuple(indices.shape)} and "
                         f"{tuple(d_scores.shape)}")
    idx = indices.detach().to(q.device).long()
    if idx.numel() and (int(idx.min()) < -1 or int(idx.max()) >= S):
        raise ValueError(f"indices must be -1 or in [0, {S})")
    q64, w64 = q.detach().to(torch.float64), weights.detach().to(device=q.device, dtype=torch.float64)
    k64 = k.detach().to(device=q.device, dtype=torch.float64)  # [S, D_I]
    d64 = d_scores.detach().to(device=q.device, dtype=torch.float64)  # [T, K]
    m_dq, m_dk, m_dw = torch.zeros_like(q64), torch.zeros_like(k64), torch.zeros_like(w64)
    K = idx.shape[1]
    chunk = auto_chunk_size(T, max(K * H, K * D, 1), chunk_size)
    for lo, hi in chunk_bounds(T, chunk):
        idx_c = idx[lo:hi]  # [C, K]
        valid = idx_c >= 0  # [C, K]
        k_sel = select_rows(k64, idx_c, valid)  # [C, K, D_I]; -1 slots: zeros
        z = torch.einsum("thd,tkd->thk", q64[lo:hi], k_sel)  # [C, H_I, K]
        d_abs = torch.where(valid, d64[lo:hi], 0.0).abs()  # [C, K]
        # r'(z), counting as active every z within the float32 rounding of a D_I-term dot product of 0,
        # where a kernel may see the other sign (Higham: |fl(z) - z| <= D_I 2^-24 sum_d |q_d k_d|)
        band = D * 2.0 ** -24 * torch.einsum("thd,tkd->thk", q64[lo:hi].abs(), k_sel.abs())  # [C, H_I, K]
        active = (z > -band).to(torch.float64) if relu else torch.ones_like(z)  # [C, H_I, K]
        g_abs = d_abs[:, None, :] * w64[lo:hi, :, None].abs() * active  # [C, H_I, K]
        m_dq[lo:hi] = torch.einsum("thk,tkd->thd", g_abs, k_sel.abs())  # [C, H_I, D_I]
        per_slot = torch.einsum("thk,thd->tkd", g_abs, q64[lo:hi].abs())  # [C, K, D_I]
        m_dk.index_add_(0, idx_c[valid], per_slot[valid])  # [S, D_I]
        m_dw[lo:hi] = torch.einsum("tk,thk->th", d_abs, (z.relu() if relu else z.abs()))  # [C, H_I]
    return m_dq, m_dk, m_dw


def check_sparse_mla_backward(kernel_dq: torch.Tensor, kernel_dkv: torch.Tensor, d_out: torch.Tensor,
                              q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, *,
                              convention: Convention, sm_scale: float, d_v: int = 512,
                              cu_seqlens: torch.Tensor | None = None, q_start: int = 0,
                              topk_length: torch.Tensor | None = None, tol: Tolerance | None = None,
                              accumulation_aware: bool = True) -> Report:
    r"""Check a sparse-MLA backward kernel: ``dq`` and ``dkv`` for the output gradient ``d_out``.

    The reference gradients come from autograd through `dsa_ref.sparse_mla` in float64. The default
    tolerance is the preset of each gradient's dtype, doubled: a backward kernel rounds the softmax
    probabilities *and* their gradients before its GEMMs, twice the roundings of the forward.

    **Accumulation-aware elementwise bound** (``accumulation_aware=True``, the default). A gradient
    element is a sum of many contributions -- a key row that thousands of queries select (early
    keys under causal selection) gets $128 \times$ thousands of them -- which partly cancel: the
    result is small while the rounding error of the sum scales with the sum of the contributions'
    absolute values. The elementwise test is then

    $$ |a - e| \le \text{atol}\cdot\operatorname{rms}(e) + \text{rtol}\cdot m $$

    with $m$ the magnitude from `sparse_mla_backward_magnitudes` (the same backward with every
    term in absolute value, float64, from the same inputs) and ``rtol`` the larger of the doubled
    preset's and `accumulation_rtol` of the gradient's dtype ($4u = 2^{-6}$ for bfloat16; see there
    for the derivation), so the check is never stricter than the strict one. Relative L2, cosine and
    ``atol`` stay those of the tolerance. Where terms cancel the relative term grows by $m/|e|$, so
    a bug as small as the rounding noise of a heavily read row (one slot among thousands) passes
    elementwise there. To that bound each element adds ``delta_allowance_scale(d_out.dtype) * t``, with
    $t$ from `sparse_mla_backward_delta_terms`: the error of a kernel's $\delta$, computed from its
    rounded output, which $\text{rtol}\cdot m$ does not cover where one key holds most of a row's
    attention ($dP \approx \delta$, so $dS$ and $m$ are small while that error is not).
    ``accumulation_aware=False`` gives the strict ``rtol * |e|`` test, without either.

    Args:
        kernel_dq: like ``q``.
        kernel_dkv: like ``kv``.
        d_out: the output gradient the kernel got, like the forward output.
        q, kv, indices: the forward inputs, in the convention's layout.
        convention, sm_scale, d_v, cu_seqlens, q_start, topk_length: as for `check_sparse_mla`.
        tol: tolerance for both gradients. With ``accumulation_aware`` a given ``tol`` is used as it is
            (its ``rtol`` then multiplies $m$); by default it is the doubled preset with ``rtol``
            replaced by `accumulation_rtol`.
        accumulation_aware: use the magnitude-based elementwise bound (default) or the strict one.
    """
    convention = _check_convention(convention)
    sm_scale = check_scale("sm_scale", sm_scale)
    for name, x in (("kernel_dq", kernel_dq), ("kernel_dkv", kernel_dkv), ("d_out", d_out)):
        check_float(name, x)
    if kernel_dq.shape != q.shape:
        raise ValueError(f"kernel_dq has shape {tuple(kernel_dq.shape)}, expected q's {tuple(q.shape)}")
    if kernel_dkv.shape != kv.shape:
        raise ValueError(f"kernel_dkv has shape {tuple(kernel_dkv.shape)}, expected kv's {tuple(kv.shape)}")
    if not isinstance(accumulation_aware, bool):
        raise TypeError(f"accumulation_aware must be a bool, got {type(accumulation_aware).__name__}")
    g, q_ref, kv_ref, idx_ref, stats = _reference_inputs(q, kv, indices, convention, cu_seqlens=cu_seqlens,
                                                         q_start=q_start, topk_length=topk_length)
    dout_ref = to_thd(d_out.detach(), convention.layout, name="d_out").to(torch.float64)  # [T, H, d_v]
    if dout_ref.shape != (g.B * g.S, g.H, d_v):
        raise ValueError(f"d_out must be shaped like the forward output ({convention.layout}, d_v={d_v}), "
                         f"got {tuple(d_out.shape)}")
    q_ref.requires_grad_(True)
    kv_ref.requires_grad_(True)
    with torch.enable_grad():
        out, _ = sparse_mla(q_ref, kv_ref, idx_ref, sm_scale=sm_scale, d_v=d_v)
        dq, dkv = torch.autograd.grad(out, (q_ref, kv_ref), dout_ref)  # [T, H, D], [N, D]
    expected_dq = from_thd(dq, convention.layout, batch=g.B)
    expected_dkv = _keys_from_thd(dkv, convention.layout, kv)
    notes = stats.notes(convention)
    mag_dq = mag_dkv = allow_dq = allow_dkv = None
    if accumulation_aware:
        # sparse_mla_backward_magnitudes and sparse_mla_backward_delta_terms, in one pass
        (m_dq, m_dkv), (t_dq, t_dkv) = _backward_sums(q_ref.detach(), kv_ref.detach(), idx_ref, dout_ref,
                                                      (_magnitude_terms, _delta_terms), sm_scale=sm_scale,
                                                      d_v=d_v, chunk_size=None)  # [T, H, D], [N, D] each
        mag_dq = from_thd(m_dq, convention.layout, batch=g.B)
        mag_dkv = _keys_from_thd(m_dkv, convention.layout, kv)
        scale = delta_allowance_scale(d_out.dtype)  # u of the output delta is taken from (d_out's dtype)
        allow_dq = from_thd(t_dq, convention.layout, batch=g.B) * scale
        allow_dkv = _keys_from_thd(t_dkv, convention.layout, kv) * scale

    def tolerance(x: torch.Tensor) -> Tolerance:
        if tol is not None:
            return tol
        doubled = tolerance_for(x.dtype).scaled(2.0)
        if not accumulation_aware:
            return doubled
        # never stricter than the strict check (m >= |e|), looser where contributions cancel
        rtol = max(doubled.rtol, accumulation_rtol(x.dtype))
        return replace(doubled, rtol=rtol, reason=f"{doubled.reason}; elementwise rtol {rtol:.3g} x the magnitude "
                                                  "(sum of |contributions|): see accumulation_rtol")

    comparisons = [compare(kernel_dq, expected_dq, name="dq", tol=tolerance(kernel_dq), magnitude=mag_dq,
                           allowance=allow_dq),
                   compare(kernel_dkv, expected_dkv, name="dkv", tol=tolerance(kernel_dkv), head_dim=None,
                           magnitude=mag_dkv, allowance=allow_dkv)]
    if accumulation_aware:
        notes.append("elementwise bound relative to the magnitude m = sum of |contributions| of each gradient "
                     "element, plus the error a kernel's delta (from its rounded output) brings in "
                     "(accumulation_aware=True; False gives rtol * |e|)")
    return Report("sparse_mla_backward", convention, comparisons, notes)


def check_indexer(kernel_scores: torch.Tensor, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, *,
                  starts: torch.Tensor | None = None, ends: torch.Tensor | None = None, relu: bool = True,
                  outside: str = "-inf", tol: Tolerance | None = None) -> Report:
    """Check lightning-indexer scores (DeepGEMM ``fp8_mqa_logits`` / TileLang style) against the reference.

    Convention (DeepGEMM and TileLang agree): q ``[T, H_I, D_I]``, k ``[S, D_I]`` (one key head),
    weights ``[T, H_I]`` with every scale folded in, per-query key windows ``[starts[t], ends[t])``
    (DeepGEMM's ``cu_seq_len_k_start`` / ``_end``; ``ends`` exclusive, so a causal diagonal needs
    ``pos + 1``), scores ``[T, S]`` float32. For fp8 kernels pass the *dequantised* q and k (the
    quantiser of `dsa_ref.fp8` reproduces DeepSeek's), so the comparison isolates the kernel's
    arithmetic from the quantisation.

    Args:
        kernel_scores: ``[T, S]`` (a strided view is fine).
        q, k, weights: the kernel's inputs (any float dtype).
        starts, ends: int ``[T]`` windows; both ``None`` = every key.
        relu: whether the kernel applies ReLU to ``q . k`` (DeepSeek-V3.2: yes).
        outside: ``"-inf"``: positions outside the window must be ``-inf`` (DeepGEMM's
            ``clean_logits=True``); ``"any"``: they are not compared.
        tol: default: the float32 preset.
    """
    check_float("kernel_scores", kernel_scores)
    if outside not in ("-inf", "any"):
        raise ValueError(f"outside must be '-inf' or 'any', got {outside!r}")
    expected = lightning_indexer(q.detach().double(), k.detach().double(), weights.detach().double(),
                                 starts=starts, ends=ends, relu=relu)
    if kernel_scores.shape != expected.shape:
        raise ValueError(f"kernel_scores has shape {tuple(kernel_scores.shape)}, expected {tuple(expected.shape)}")
    actual = kernel_scores
    notes = []
    if outside == "any":
        actual = torch.where(torch.isfinite(expected), kernel_scores.double(), expected).to(kernel_scores.dtype)
        notes.append("positions outside the windows are not compared (outside='any')")
    n_in = int(torch.isfinite(expected).sum())
    notes.append(f"{n_in} of {expected.numel()} (query, key) pairs inside the windows")
    comp = compare(actual, expected, name="scores", tol=tol or tolerance_for(torch.float32), head_dim=None)
    return Report("indexer", None, [comp], notes)


def check_topk(kernel_indices: torch.Tensor, scores: torch.Tensor, *, k: int | None = None,
               convention: Convention = FLASHMLA_SPARSE_PREFILL, tie_tol: float = 0.0) -> TopkComparison:
    """Check a top-k kernel's selection against the exact scores, accepting any tie-breaking.

    ``kernel_indices`` ``[T, K]`` index the keys of ``scores [T, S]`` (``-inf`` = not selectable).
    Unused slots are read by ``convention``'s sentinel rule; the default (FlashMLA's: anything ``< 0``
    or ``>= S``) accepts kernels that pad with ``-1`` and kernels that pad with ``S``. A kernel that
    leaves short rows as the caller initialised them (zeros, as TileLang's selector does) shows up
    as "keys selected twice" or "selected keys below the boundary or masked". Wraps `compare_topk`.
    """
    convention = _check_convention(convention)
    if convention.layout != "THD" or convention.index_space != "global":
        raise ValueError(f"check_topk needs a THD convention with global indices, got {convention.name}")
    check_float("scores", scores)
    if scores.dim() != 2:
        raise ValueError(f"scores must have shape [T, S], got shape {tuple(scores.shape)}")
    ref = to_reference_indices(kernel_indices, convention, num_keys=scores.shape[1])
    return compare_topk(ref, None, scores, k if k is not None else ref.shape[1], tie_tol=tie_tol)


def kernel_inputs(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, convention: Convention, *,
                  batch: int = 1, cu_seqlens: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference inputs -> a kernel's: ``(q, kv, indices)`` in ``convention``'s layout and index space.

    Args:
        q: ``[T, H, D]`` packed queries, ``T = batch * S`` (token ``t = b * S + s``).
        kv: ``[N, D]`` latent rows, ``N = batch * S_kv`` for ``BSHD``/``SBHD`` (row ``b * S_kv + s``).
        indices: int ``[T, K]`` reference indices (``-1`` unused); for ``per_batch`` conventions each
            must lie in its query's batch entry, for ``per_sequence`` in its query's sequence.
        convention: the target `Convention`.
        batch: ``B``.
        cu_seqlens: for ``per_sequence`` conventions.
    """
    convention = _check_convention(convention)
    check_float("q", q)
    check_float("kv", kv)
    if q.dim() != 3 or kv.dim() != 2:
        raise ValueError(f"q must be [T, H, D] and kv [N, D], got {tuple(q.shape)} and {tuple(kv.shape)}")
    lay = convention.layout
    if lay == "THD":
        S_kv = kv.shape[0]
        return q, kv[:, None, :], from_reference_indices(indices, convention, num_keys=S_kv, cu_seqlens=cu_seqlens)
    if kv.shape[0] % batch or q.shape[0] % batch:
        raise ValueError(f"batch={batch} must divide q's {q.shape[0]} tokens and kv's {kv.shape[0]} rows")
    S_kv = kv.shape[0] // batch
    kv4 = kv.reshape(batch, S_kv, 1, kv.shape[-1])  # [B, S_kv, 1, D]
    if lay == "SBHD":
        kv4 = kv4.transpose(0, 1)  # [S_kv, B, 1, D]
    return (from_thd(q, lay, batch=batch), kv4,
            from_reference_indices(indices, convention, num_keys=S_kv, batch=batch))
