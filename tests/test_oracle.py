"""dsa_ref.oracle: every adapter passes a correct "fake kernel" of its convention and catches planted bugs.

Each fake kernel below is written by hand from the convention's definition (layout, index space,
sentinel, causal mask, LSE base, empty-row marker, duplicate semantics) on top of
`dsa_ref.sparse_mla`, without the oracle's converters, so the two are independent. ``bug=...``
plants one of the bugs real kernels and their callers have shipped.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from dsa_ref import sparse_mla, topk_indices
from dsa_ref.adversarial import duplicate_indices, packed_sequences
from dsa_ref.compare import Tolerance, compare
from dsa_ref.oracle import (
    CONVENTIONS,
    DSA_REF,
    FLASHMLA_SPARSE_PREFILL,
    MEGATRON_SBHD,
    MEGATRON_TILELANG_OPS,
    TILELANG_DEEPSEEK_V32,
    TILELANG_SPARSE_FINETUNE,
    Convention,
    accumulation_rtol,
    check_indexer,
    check_sparse_mla,
    check_sparse_mla_backward,
    check_topk,
    from_reference_indices,
    from_thd,
    kernel_inputs,
    lse_from_natural,
    lse_to_natural,
    reference_kernel,
    sparse_mla_backward_delta_terms,
    indexer_backward_magnitudes,
    sparse_mla_backward_magnitudes,
    delta_allowance_scale,
    to_reference_indices,
    to_thd,
)

SCALE = 192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2  # DeepSeek-V3.2
WRONG_SCALE = 576 ** -0.5  # the kernels' default
H, D, DV = 4, 80, 64  # small widths keep the tests fast; the conventions do not depend on them
LOG2E = 1 / math.log(2)


def _inputs(T, S, *, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(T, H, D, generator=g) * 0.5).to(dtype)
    kv = torch.randn(S, D, generator=g).to(dtype)
    return q, kv


def _dedup(idx):
    """-1 for every slot whose key already appeared earlier in its row."""
    out = idx.clone()
    for t in range(idx.shape[0]):
        seen = set()
        for j, v in enumerate(idx[t].tolist()):
            if v >= 0 and v in seen:
                out[t, j] = -1
            seen.add(v)
    return out


def _empty_to(lse, value):
    return torch.where(torch.isinf(lse), torch.full_like(lse, value), lse)


# ------------------------------------------------------------------------------ fake kernels


def flashmla_kernel(q, kv, indices, sm_scale, d_v, *, bug=None, topk_length=None):
    """flash_mla_sparse_fwd: q [S_q, H, D], kv [S_kv, 1, D], indices [S_q, 1, K] int32; unused = <0 or >=S_kv;
    natural-log LSE with +inf on empty rows."""
    S_kv = kv.shape[0]
    idx = indices[:, 0].long()
    if bug == "sentinel":  # only -1 is treated as unused; S_kv is clamped to the last row
        idx = torch.where(idx == -1, idx, idx.clamp(max=S_kv - 1))
    else:
        idx = torch.where((idx < 0) | (idx >= S_kv), torch.full_like(idx, -1), idx)
    if topk_length is not None and bug != "topk_length":
        idx = torch.where(torch.arange(idx.shape[1])[None] < topk_length[:, None].long(), idx, torch.full_like(idx, -1))
    if bug == "dedup":
        idx = _dedup(idx)
    scale = WRONG_SCALE if bug == "scale" else sm_scale
    out, lse = sparse_mla(q, kv[:, 0], idx, sm_scale=scale, d_v=d_v)
    return out, lse if bug == "empty_lse" else _empty_to(lse, math.inf)


def tilelang_v32_kernel(q, kv, indices, sm_scale, d_v, *, bug=None, q_start=0):
    """deepseek_v32 sparse_mla_fwd: q [B, S, H, D], kv [B, S_kv, 1, D], indices [B, S, 1, K] int32 per batch;
    a slot is used iff index <= q_start + s (the kernel's mask); base-2 LSE."""
    B, S = q.shape[:2]
    outs, lses = [], []
    for b in range(B):
        idx = indices[b, :, 0].long()
        pos = q_start + torch.arange(S)[:, None]
        used = idx < pos if bug == "off_by_one" else idx <= pos
        idx = torch.where(used, idx, torch.full_like(idx, -1))
        scale = WRONG_SCALE if bug == "scale" else sm_scale
        o, lse = sparse_mla(q[b], kv[b, :, 0], idx, sm_scale=scale, d_v=d_v)
        o = torch.where(torch.isneginf(lse)[..., None], torch.full_like(o, math.nan), o)  # empty rows: NaN
        outs.append(o)
        lses.append(lse if bug == "natural_lse" else lse * LOG2E)
    return torch.stack(outs), torch.stack(lses)


def tilelang_finetune_kernel(q, kv, indices, offsets, sm_scale, d_v, *, bug=None):
    """dsa_sparse_finetune sparse_mla_fwd: packed q [T, H, D], kv [T, 1, D], indices [T, 1, K] counted from
    each sequence's start (KV[bos + index]); used iff index != -1 and index <= position in the sequence."""
    T = q.shape[0]
    idx = indices[:, 0].long()
    glob = torch.full_like(idx, -1)
    for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        for t in range(a, b):
            for j, v in enumerate(idx[t].tolist()):
                if v != -1 and v <= t - a:
                    glob[t, j] = v if bug == "global_indices" else a + v
    out, lse = sparse_mla(q, kv[:, 0], glob, sm_scale=sm_scale, d_v=d_v)
    assert out.shape[0] == T
    return out, lse


def megatron_ops_kernel(q, kv, indices, sm_scale, d_v, *, bug=None):
    """Megatron's TileLang sparse_mla_fwd_interface: q [S, H, D], kv [S_kv, 1, D], indices [S, 1, K] int32,
    only -1 unused; base-2 LSE; a row with no valid slot gives out 0 and lse 0."""
    idx = indices[:, 0].long()
    out, lse = sparse_mla(q, kv[:, 0], idx, sm_scale=sm_scale, d_v=d_v)
    empty = torch.isneginf(lse)
    if bug == "nan_out":
        out = torch.where(empty[..., None], torch.full_like(out, math.nan), out)
    lse2 = torch.where(empty, torch.full_like(lse, -math.inf if bug == "neg_inf_lse" else 0.0), lse * LOG2E)
    return out, lse2


def megatron_kernel(q, kv, indices, sm_scale, d_v, *, bug=None):
    """Megatron's absorbed DSA: q [S, B, H, D], kv [S_kv, B, 1, D], indices [B, S, K] with -1; a dense
    softmax over the top-k *support mask* and the causal mask (a key selected twice counts once)."""
    S, B = q.shape[:2]
    S_kv = kv.shape[0]
    if bug == "bshd":  # the kernel reads [S, B, ...] as if it were [B, S, ...]
        q = q.reshape(B, S, *q.shape[2:]).transpose(0, 1)
    out = torch.zeros(S, B, q.shape[2], d_v, dtype=torch.float32)
    for b in range(B):
        idx = indices[b]  # [S, K]
        if bug == "per_slot":  # a gather-based kernel: duplicates count once per slot
            idx = torch.where(idx <= torch.arange(S)[:, None], idx, torch.full_like(idx, -1))
            o, _ = sparse_mla(q[:, b], kv[:, b, 0], idx, sm_scale=sm_scale, d_v=d_v)
            out[:, b] = o.float()
            continue
        support = torch.zeros(S, S_kv + 1, dtype=torch.bool)
        support.scatter_(1, torch.where(idx >= 0, idx, torch.full_like(idx, S_kv)), True)
        mask = support[:, :S_kv] & (torch.arange(S_kv)[None] <= torch.arange(S)[:, None])
        scores = torch.einsum("shd,kd->shk", q[:, b].float(), kv[:, b, 0].float()) * sm_scale
        scores = scores.masked_fill(~mask[:, None], -math.inf)
        p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out[:, b] = torch.einsum("shk,kd->shd", p, kv[:, b, 0, :d_v].float())
    return out.to(q.dtype), None


# ------------------------------------------------------------------------------ FlashMLA


def _flashmla_case(seed=0):
    """S_q=12 queries over S_kv=20 keys, K=8 slots: -1 and S_kv sentinels, an empty row, duplicates."""
    q, kv = _inputs(12, 20, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    idx = torch.stack([torch.randperm(20, generator=g)[:8] for _ in range(12)])
    idx[1, 5:] = -1
    idx[2, 4:] = 20  # FlashMLA also accepts >= S_kv
    idx[3, 6:] = 57
    idx[4] = -1  # no valid slot
    idx[5, 1] = idx[5, 0]  # a duplicate
    return q, kv[:, None, :], idx[:, None, :].to(torch.int32)


def test_flashmla_adapter_passes_a_correct_kernel():
    q, kv, idx = _flashmla_case()
    out, lse = flashmla_kernel(q, kv, idx, SCALE, DV)
    rep = check_sparse_mla(out, lse, q, kv, idx, convention=FLASHMLA_SPARSE_PREFILL, sm_scale=SCALE, d_v=DV)
    assert rep.ok, str(rep)
    assert rep["out"].dtype == torch.bfloat16 and rep["lse"].nonfinite_actual == H  # row 4: +inf, converted
    assert any("1 rows have no valid slot" in n for n in rep.notes)
    assert any("repeat a key" in n for n in rep.notes)


@pytest.mark.parametrize("bug", ["scale", "sentinel", "dedup", "empty_lse"])
def test_flashmla_adapter_catches_planted_bugs(bug):
    q, kv, idx = _flashmla_case()
    out, lse = flashmla_kernel(q, kv, idx, SCALE, DV, bug=bug)
    rep = check_sparse_mla(out, lse, q, kv, idx, convention=FLASHMLA_SPARSE_PREFILL, sm_scale=SCALE, d_v=DV)
    assert not rep.ok, f"planted bug {bug!r} was not caught:\n{rep}"
    if bug == "empty_lse":  # -inf where the convention says +inf: only the lse of the empty row is off
        assert rep["out"].ok and rep["lse"].nonfinite_mismatch == H


def test_flashmla_topk_length():
    q, kv, idx = _flashmla_case(seed=3)
    length = torch.tensor([8, 3, 0, 5, 8, 8, 1, 8, 2, 8, 8, 4], dtype=torch.int32)
    good = flashmla_kernel(q, kv, idx, SCALE, DV, topk_length=length)
    kw = dict(convention=FLASHMLA_SPARSE_PREFILL, sm_scale=SCALE, d_v=DV, topk_length=length)
    assert check_sparse_mla(*good, q, kv, idx, **kw).ok
    stale = flashmla_kernel(q, kv, idx, SCALE, DV, topk_length=length, bug="topk_length")
    assert not check_sparse_mla(*stale, q, kv, idx, **kw).ok, "reading slots beyond topk_length must fail"


# ------------------------------------------------------------------------------ TileLang deepseek_v32


def _v32_case(seed=0, B=2, S=10, K=8):
    """B=2 batches of S=10 causal queries over their own 10 keys; unused slots padded with S_kv (as its tests do)."""
    q, kv = _inputs(B * S, B * S, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    idx = torch.full((B, S, 1, K), S, dtype=torch.int32)
    for b in range(B):
        for s in range(S):
            keys = torch.randperm(s + 1, generator=g)[:K]
            if s % 3 == 0:  # make sure the diagonal is selected on some rows
                keys = torch.cat([torch.tensor([s]), keys[keys != s]])[:K]
            idx[b, s, 0, : len(keys)] = keys.to(torch.int32)
    idx[1, 4, 0, 1] = idx[1, 4, 0, 0]  # a duplicate
    idx[0, 7, 0, 2] = 9  # a future key: the kernel masks it
    return q.reshape(B, S, H, D), kv.reshape(B, S, 1, D), idx


def test_tilelang_v32_adapter_passes_a_correct_kernel():
    q, kv, idx = _v32_case()
    out, lse = tilelang_v32_kernel(q, kv, idx, SCALE, DV)
    rep = check_sparse_mla(out, lse, q, kv, idx, convention=TILELANG_DEEPSEEK_V32, sm_scale=SCALE, d_v=DV)
    assert rep.ok, str(rep)
    assert any("base 2" in n for n in rep.notes)


@pytest.mark.parametrize("bug", ["scale", "natural_lse", "off_by_one"])
def test_tilelang_v32_adapter_catches_planted_bugs(bug):
    q, kv, idx = _v32_case()
    out, lse = tilelang_v32_kernel(q, kv, idx, SCALE, DV, bug=bug)
    rep = check_sparse_mla(out, lse, q, kv, idx, convention=TILELANG_DEEPSEEK_V32, sm_scale=SCALE, d_v=DV)
    assert not rep.ok, f"planted bug {bug!r} was not caught:\n{rep}"
    if bug == "natural_lse":
        assert rep["out"].ok and not rep["lse"].ok


def test_tilelang_v32_q_start():
    q, kv, idx = _v32_case(seed=5)
    out, lse = tilelang_v32_kernel(q, kv, idx, SCALE, DV, q_start=3)
    kw = dict(convention=TILELANG_DEEPSEEK_V32, sm_scale=SCALE, d_v=DV)
    assert check_sparse_mla(out, lse, q, kv, idx, q_start=3, **kw).ok
    assert not check_sparse_mla(out, lse, q, kv, idx, **kw).ok


def test_tilelang_v32_rejects_minus_one():
    q, kv, idx = _v32_case()
    idx[0, 3, 0, 5] = -1
    with pytest.raises(ValueError, match=r"KV\[-1\]"):
        check_sparse_mla(*tilelang_v32_kernel(q, kv, idx.clamp_min(0), SCALE, DV), q, kv, idx,
                         convention=TILELANG_DEEPSEEK_V32, sm_scale=SCALE, d_v=DV)


# ------------------------------------------------------------------------------ TileLang finetune


def _finetune_case(seed=0, K=4):
    case = packed_sequences(lengths=(1, 6, 1, 9, 3), k=K, heads=H, dim=D, d_v=DV, seed=seed)
    cu, glob = case["cu_seqlens"], case["indices"]
    seq_start = cu[torch.searchsorted(cu[1:], torch.arange(int(cu[-1])), right=True)]
    local = torch.where(glob >= 0, glob - seq_start[:, None], glob)  # counted from each sequence's start
    return case["q"], case["kv"][:, None, :], local[:, None, :].to(torch.int32), cu


def test_tilelang_finetune_adapter_passes_a_correct_kernel():
    q, kv, idx, cu = _finetune_case()
    out, lse = tilelang_finetune_kernel(q, kv, idx, cu, SCALE, DV)
    rep = check_sparse_mla(out, lse, q, kv, idx, convention=TILELANG_SPARSE_FINETUNE, sm_scale=SCALE, d_v=DV,
                           cu_seqlens=cu)
    assert rep.ok, str(rep)


def test_tilelang_finetune_adapter_catches_global_indices():
    q, kv, idx, cu = _finetune_case()
    out, lse = tilelang_finetune_kernel(q, kv, idx, cu, SCALE, DV, bug="global_indices")
    rep = check_sparse_mla(out, lse, q, kv, idx, convention=TILELANG_SPARSE_FINETUNE, sm_scale=SCALE, d_v=DV,
                           cu_seqlens=cu)
    assert not rep.ok
    with pytest.raises(ValueError, match="pass cu_seqlens"):
        check_sparse_mla(out, lse, q, kv, idx, convention=TILELANG_SPARSE_FINETUNE, sm_scale=SCALE, d_v=DV)


# ------------------------------------------------------------------------------ Megatron


def _megatron_case(seed=0, B=2, S=9, K=6):
    case = duplicate_indices(tokens=B * S, num_keys=S, k=K, heads=H, dim=D, d_v=DV, seed=seed)
    q, kv = case["q"], case["kv"]
    kv = torch.cat([kv, kv.flip(0)])  # B * S rows: one block of keys per batch entry
    g = torch.Generator().manual_seed(seed)
    idx = torch.full((B, S, K), -1, dtype=torch.int64)
    for b in range(B):
        for s in range(S):
            keys = torch.randperm(s + 1, generator=g)[: K - 2].tolist()
            row = keys + keys[:1] + [min(s + 1, S - 1)]  # a duplicate, and a future key the mask drops
            idx[b, s, : len(row)] = torch.tensor(row)
    q_sbhd = q.reshape(B, S, H, D).transpose(0, 1)
    kv_sbhd = kv.reshape(B, S, 1, D).transpose(0, 1)
    return q_sbhd, kv_sbhd, idx


def test_megatron_adapter_passes_a_correct_kernel():
    q, kv, idx = _megatron_case()
    out, lse = megatron_kernel(q, kv, idx, SCALE, DV)
    rep = check_sparse_mla(out, None, q, kv, idx, convention=MEGATRON_SBHD, sm_scale=SCALE, d_v=DV)
    assert rep.ok, str(rep)
    assert [c.name for c in rep.comparisons] == ["out"]
    assert any("dropped (the selection is a set)" in n for n in rep.notes)
    assert any("after the query position" in n for n in rep.notes)


@pytest.mark.parametrize("bug", ["per_slot", "bshd"])
def test_megatron_adapter_catches_planted_bugs(bug):
    q, kv, idx = _megatron_case()
    out, _ = megatron_kernel(q, kv, idx, SCALE, DV, bug=bug)
    rep = check_sparse_mla(out, None, q, kv, idx, convention=MEGATRON_SBHD, sm_scale=SCALE, d_v=DV)
    assert not rep.ok, f"planted bug {bug!r} was not caught:\n{rep}"


def test_duplicate_semantics_differ_between_conventions():
    """The same inputs under per-slot and set semantics give different answers: the convention matters."""
    q, kv, idx = _megatron_case()
    out, _ = megatron_kernel(q, kv, idx, SCALE, DV)
    per_slot = replace(MEGATRON_SBHD, duplicates="per_slot")
    assert not check_sparse_mla(out, None, q, kv, idx, convention=per_slot, sm_scale=SCALE, d_v=DV).ok


# ------------------------------------------------------------------------------ Megatron's TileLang ops


def _megatron_ops_case(seed=0):
    """The FlashMLA case with every unused slot written as -1 (the only sentinel these ops know)."""
    q, kv, idx = _flashmla_case(seed)
    idx = torch.where((idx < 0) | (idx >= kv.shape[0]), torch.full_like(idx, -1), idx)
    return q, kv, idx


def test_megatron_ops_adapter_passes_a_correct_kernel():
    q, kv, idx = _megatron_ops_case()
    out, lse = megatron_ops_kernel(q, kv, idx, SCALE, DV)
    assert (lse[4] == 0).all() and (out[4] == 0).all()  # the empty row, as the ops report it
    rep = check_sparse_mla(out, lse, q, kv, idx, convention=MEGATRON_TILELANG_OPS, sm_scale=SCALE, d_v=DV)
    assert rep.ok, str(rep)


@pytest.mark.parametrize("bug", ["nan_out", "neg_inf_lse"])
def test_megatron_ops_adapter_catches_the_wrong_empty_row_markers(bug):
    q, kv, idx = _megatron_ops_case()
    out, lse = megatron_ops_kernel(q, kv, idx, SCALE, DV, bug=bug)
    rep = check_sparse_mla(out, lse, q, kv, idx, convention=MEGATRON_TILELANG_OPS, sm_scale=SCALE, d_v=DV)
    assert not rep.ok, f"planted bug {bug!r} was not caught:\n{rep}"


def test_tilelang_v32_empty_rows_are_nan_by_its_convention():
    """TileLang's example writes NaN into rows with no valid slot: its preset accepts that, and
    only there (a NaN in a row that has valid slots is still a failure)."""
    q, kv, idx = _v32_case()
    idx[0, 3, 0, :] = 10  # every slot past the position: an empty row
    out, lse = tilelang_v32_kernel(q, kv, idx, SCALE, DV)
    assert torch.isnan(out[0, 3]).all()
    rep = check_sparse_mla(out, lse, q, kv, idx, convention=TILELANG_DEEPSEEK_V32, sm_scale=SCALE, d_v=DV)
    assert rep.ok, str(rep)
    out[0, 5, 0, 0] = math.nan
    rep = check_sparse_mla(out, lse, q, kv, idx, convention=TILELANG_DEEPSEEK_V32, sm_scale=SCALE, d_v=DV)
    assert not rep.ok


# ------------------------------------------------------------------------------ reference_kernel


@pytest.mark.parametrize("name", sorted(CONVENTIONS))
def test_reference_kernel_equals_the_hand_written_fake(name):
    conv = CONVENTIONS[name]
    f64 = dict(dtype=torch.float64)
    if name in ("dsa_ref", "flashmla_sparse_prefill"):
        q, kv, idx = _flashmla_case()
        q, kv = q.to(**f64), kv.to(**f64)
        if name == "dsa_ref":
            kv, idx = kv[:, 0], to_reference_indices(idx, FLASHMLA_SPARSE_PREFILL, num_keys=kv.shape[0])
            exp = sparse_mla(q, kv, idx, sm_scale=SCALE, d_v=DV)
        else:
            exp = flashmla_kernel(q, kv, idx, SCALE, DV)
        got = reference_kernel(q, kv, idx, convention=conv, sm_scale=SCALE, d_v=DV)
    elif name == "tilelang_deepseek_v32":
        q, kv, idx = _v32_case()
        q, kv = q.to(**f64), kv.to(**f64)
        exp, got = tilelang_v32_kernel(q, kv, idx, SCALE, DV), reference_kernel(q, kv, idx, convention=conv,
                                                                                 sm_scale=SCALE, d_v=DV)
    elif name == "tilelang_sparse_finetune":
        q, kv, idx, cu = _finetune_case()
        q, kv = q.to(**f64), kv.to(**f64)
        exp = tilelang_finetune_kernel(q, kv, idx, cu, SCALE, DV)
        got = reference_kernel(q, kv, idx, convention=conv, sm_scale=SCALE, d_v=DV, cu_seqlens=cu)
    elif name == "megatron_tilelang_ops":
        q, kv, idx = _megatron_ops_case()
        q, kv = q.to(**f64), kv.to(**f64)
        exp = megatron_ops_kernel(q, kv, idx, SCALE, DV)
        got = reference_kernel(q, kv, idx, convention=conv, sm_scale=SCALE, d_v=DV)
    else:
        q, kv, idx = _megatron_case()
        q, kv = q.to(**f64), kv.to(**f64)
        exp, got = megatron_kernel(q, kv, idx, SCALE, DV), reference_kernel(q, kv, idx, convention=conv,
                                                                             sm_scale=SCALE, d_v=DV)
    torch.testing.assert_close(got[0], exp[0].to(got[0].dtype), atol=1e-6, rtol=0)
    if exp[1] is None:
        assert got[1] is None
    else:
        torch.testing.assert_close(got[1], exp[1].float(), atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------ converters


def test_index_round_trip_through_every_convention():
    case = packed_sequences(lengths=(6, 6, 6), k=4, heads=H, dim=D, d_v=DV, seed=9)
    idx, cu = case["indices"], case["cu_seqlens"]
    for conv in CONVENTIONS.values():
        batch = 1 if conv.layout == "THD" else 3
        num_keys = 6 if conv.index_space == "per_batch" else 18
        kw = {"cu_seqlens": cu} if conv.index_space == "per_sequence" else {}
        k_idx = from_reference_indices(idx, conv, num_keys=num_keys, batch=batch, **kw)
        assert k_idx.dtype == conv.index_dtype, conv.name
        back = to_reference_indices(k_idx, conv, num_keys=num_keys, batch=batch, **kw)
        assert torch.equal(back, idx), conv.name
    v32 = from_reference_indices(idx, TILELANG_DEEPSEEK_V32, num_keys=6, batch=3)
    assert v32.shape == (3, 6, 1, 4) and int(v32.max()) == 6  # unused slots padded with S_kv
    with pytest.raises(ValueError, match="outside the index space"):
        from_reference_indices(torch.tensor([[7]] * 18), TILELANG_DEEPSEEK_V32, num_keys=6, batch=3)


def test_sentinel_rules():
    idx = torch.tensor([[0, -1, 5, 7, -3]])
    assert to_reference_indices(idx, FLASHMLA_SPARSE_PREFILL, num_keys=6).tolist() == [[0, -1, 5, -1, -1]]
    with pytest.raises(ValueError, match="marks unused slots with -1 only"):
        to_reference_indices(idx, DSA_REF, num_keys=6)
    with pytest.raises(ValueError, match="nothing more negative"):
        to_reference_indices(idx, TILELANG_SPARSE_FINETUNE, num_keys=1, cu_seqlens=torch.tensor([0, 1]))


def test_lse_conversions():
    lse = torch.tensor([[1.5, -math.inf], [0.0, 3.0]])
    for conv in (FLASHMLA_SPARSE_PREFILL, TILELANG_DEEPSEEK_V32, TILELANG_SPARSE_FINETUNE):
        assert torch.allclose(lse_to_natural(lse_from_natural(lse, conv), conv).float(), lse)
    assert lse_from_natural(lse, FLASHMLA_SPARSE_PREFILL)[0, 1] == math.inf
    assert lse_from_natural(lse, TILELANG_DEEPSEEK_V32)[1, 1] == pytest.approx(3.0 * LOG2E)
    assert lse_to_natural(torch.tensor([-math.inf]), FLASHMLA_SPARSE_PREFILL)[0] == math.inf, \
        "a -inf from a +inf convention must not silently match"
    with pytest.raises(ValueError, match="returns no LSE"):
        lse_to_natural(lse, MEGATRON_SBHD)


def test_layout_conversions():
    x = torch.arange(2 * 3 * 4).reshape(2, 3, 4)  # [B, S, ...]
    assert torch.equal(from_thd(to_thd(x, "BSHD"), "BSHD", batch=2), x)
    sb = x.transpose(0, 1)  # [S, B, ...]
    assert torch.equal(to_thd(sb, "SBHD"), to_thd(x, "BSHD"))
    assert torch.equal(from_thd(to_thd(sb, "SBHD"), "SBHD", batch=2), sb)
    with pytest.raises(ValueError, match="batch"):
        from_thd(torch.zeros(5, 2), "BSHD", batch=2)


def test_kernel_inputs_match_the_layouts():
    case = packed_sequences(lengths=(5, 5), k=3, heads=H, dim=D, d_v=DV, seed=2)
    q, kv, idx = case["q"], case["kv"], case["indices"]
    qk, kvk, ik = kernel_inputs(q, kv, idx, MEGATRON_SBHD, batch=2)
    assert qk.shape == (5, 2, H, D) and kvk.shape == (5, 2, 1, D) and ik.shape == (2, 5, 3)
    qk, kvk, ik = kernel_inputs(q, kv, idx, TILELANG_DEEPSEEK_V32, batch=2)
    assert qk.shape == (2, 5, H, D) and kvk.shape == (2, 5, 1, D) and ik.shape == (2, 5, 1, 3)


def test_input_validation_names_the_argument():
    q, kv, idx = _flashmla_case()
    out, lse = flashmla_kernel(q, kv, idx, SCALE, DV)
    kw = dict(sm_scale=SCALE, d_v=DV)
    with pytest.raises(TypeError, match="convention must be"):
        check_sparse_mla(out, lse, q, kv, idx, convention="flashmla", **kw)
    with pytest.raises(ValueError, match="kernel_out has shape"):
        check_sparse_mla(out[:, :, :8], lse, q, kv, idx, convention=FLASHMLA_SPARSE_PREFILL, **kw)
    with pytest.raises(ValueError, match=r"q must have shape \[B, S, H, D\]"):
        check_sparse_mla(out, lse, q, kv, idx, convention=TILELANG_DEEPSEEK_V32, **kw)
    with pytest.raises(TypeError, match="indices must be an integer tensor"):
        check_sparse_mla(out, lse, q, kv, idx.float(), convention=FLASHMLA_SPARSE_PREFILL, **kw)
    with pytest.raises(ValueError, match="sm_scale must be a finite positive"):
        check_sparse_mla(out, lse, q, kv, idx, convention=FLASHMLA_SPARSE_PREFILL, sm_scale=-1.0, d_v=DV)
    with pytest.raises(ValueError, match="KV heads"):
        check_sparse_mla(out, lse, q, kv.expand(-1, 2, -1), idx, convention=FLASHMLA_SPARSE_PREFILL, **kw)
    with pytest.raises(ValueError, match="layout must be one of"):
        Convention(**{**FLASHMLA_SPARSE_PREFILL.__dict__, "layout": "BHSD"})
    with pytest.raises(ValueError, match="needs causal=True"):
        replace(TILELANG_DEEPSEEK_V32, causal=False)


def test_every_preset_states_its_conventions():
    for conv in CONVENTIONS.values():
        text = conv.describe()
        for word in ("layout", "unused slot", "LSE", "causal", "default sm_scale"):
            assert word in text, (conv.name, word)
        assert conv.source


def test_report_str_and_dict():
    q, kv, idx = _flashmla_case()
    out, lse = flashmla_kernel(q, kv, idx, SCALE, DV, bug="scale")
    rep = check_sparse_mla(out, lse, q, kv, idx, convention=FLASHMLA_SPARSE_PREFILL, sm_scale=SCALE, d_v=DV)
    text = str(rep)
    assert text.startswith("sparse_mla: FAIL  [FlashMLA") and "rel_l2" in text and "note:" in text
    d = rep.as_dict()
    assert d["ok"] is False and {c["name"] for c in d["comparisons"]} == {"out", "lse"}
    with pytest.raises(AssertionError):
        rep.assert_ok()
    with pytest.raises(KeyError, match="no comparison named"):
        rep["dq"]


# ------------------------------------------------------------------------------ backward, indexer, top-k


def test_backward_adapter():
    q, kv, idx = _flashmla_case(seed=4)
    q, kv = q.float().requires_grad_(True), kv.float().requires_grad_(True)
    d_out = torch.randn(q.shape[0], H, DV, generator=torch.Generator().manual_seed(0))
    kw = dict(convention=FLASHMLA_SPARSE_PREFILL, sm_scale=SCALE, d_v=DV)
    for bug, should_pass in ((None, True), ("dedup", False), ("scale", False)):
        out, _ = flashmla_kernel(q, kv, idx, SCALE, DV, bug=bug)
        dq, dkv = torch.autograd.grad(out, (q, kv), d_out)
        rep = check_sparse_mla_backward(dq, dkv, d_out, q.detach(), kv.detach(), idx, **kw)
        assert rep.ok == should_pass, f"bug={bug}:\n{rep}"
    with pytest.raises(ValueError, match="kernel_dkv has shape"):
        check_sparse_mla_backward(dq, dkv[:, 0], d_out, q.detach(), kv.detach(), idx, **kw)


# ------------------------------------------------------------------ backward: accumulation-aware bound


def _brute_force_backward(q, kv, idx, d_out, sm_scale, d_v):
    """(dq, dkv, m_dq, m_dkv) by scalar loops in float64: the textbook formulas, slot by slot."""
    q, kv, d_out = q.double(), kv.double(), d_out.double()
    T, Hq, Dq = q.shape
    dq, m_dq = torch.zeros(T, Hq, Dq, dtype=torch.float64), torch.zeros(T, Hq, Dq, dtype=torch.float64)
    dkv, m_dkv = torch.zeros(kv.shape, dtype=torch.float64), torch.zeros(kv.shape, dtype=torch.float64)
    for t in range(T):
        slots = [j for j in range(idx.shape[1]) if int(idx[t, j]) >= 0]  # duplicates: one term per slot
        for h in range(Hq):
            s = {j: sm_scale * float(q[t, h] @ kv[int(idx[t, j])]) for j in slots}
            top = max(s.values(), default=0.0)
            z = sum(math.exp(v - top) for v in s.values())
            p = {j: math.exp(s[j] - top) / z for j in slots}
            dp = {j: float(d_out[t, h] @ kv[int(idx[t, j]), :d_v]) for j in slots}
            delta = sum(p[j] * dp[j] for j in slots)
            for j in slots:
                ds = sm_scale * p[j] * (dp[j] - delta)
                r = int(idx[t, j])
                dq[t, h] += ds * kv[r]
                m_dq[t, h] += abs(ds) * kv[r].abs()
                dkv[r] += ds * q[t, h]
                m_dkv[r] += abs(ds) * q[t, h].abs()
                dkv[r, :d_v] += p[j] * d_out[t, h]
                m_dkv[r, :d_v] += p[j] * d_out[t, h].abs()
    return dq, dkv, m_dq, m_dkv


def test_backward_magnitudes_equal_a_brute_force_loop():
    """m_dq, m_dkv from the chunked float64 code equal scalar loops, -1 slots, duplicates and an empty row included."""
    q, kv = _inputs(5, 6, seed=11)
    q, kv = q[:, :2, :7], kv[:, :7]  # [T, 2, 7], [6, 7]: a tiny case
    idx = torch.tensor([[0, 3, -1, 5], [2, 2, 1, -1], [-1, -1, -1, -1], [5, 4, 3, 0], [1, -1, 1, 1]])
    d_out = torch.randn(5, 2, 4, generator=torch.Generator().manual_seed(12))
    dq, dkv, m_dq, m_dkv = _brute_force_backward(q, kv, idx, d_out, SCALE, 4)
    got_dq, got_dkv = sparse_mla_backward_magnitudes(q, kv, idx, d_out, sm_scale=SCALE, d_v=4, chunk_size=2)
    torch.testing.assert_close(got_dq, m_dq, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(got_dkv, m_dkv, rtol=1e-12, atol=1e-15)
    # the signed loop is the reference's backward, and |gradient| <= magnitude
    q64, kv64 = q.double().requires_grad_(True), kv.double().requires_grad_(True)
    out, _ = sparse_mla(q64, kv64, idx, sm_scale=SCALE, d_v=4)
    ref_dq, ref_dkv = torch.autograd.grad(out, (q64, kv64), d_out.double())
    torch.testing.assert_close(ref_dq, dq, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(ref_dkv, dkv, rtol=1e-12, atol=1e-15)
    slack = 1e-15  # float64 rounding of the reference where nothing is left (row 4 reads one key 3 times: dS = 0)
    assert bool((ref_dq.abs() <= got_dq + slack).all()) and bool((ref_dkv.abs() <= got_dkv + slack).all())
    assert bool((got_dq[2] == 0).all()) and bool((got_dq[4] == 0).all())  # the empty row; one key only: dS = 0


def bf16_backward_kernel(q, kv, idx, d_out, sm_scale, d_v, *, bug=None, slot=(0, 0), block=16):
    """A sparse-MLA backward on bf16 inputs computed the way the TileLang kernels are (dsa_ref's, Megatron's).

    P is recomputed in float32 and rounded to bf16 before the dV GEMM; delta = rowsum(O * dO) with O the
    bf16 forward output; dS = P (dP - delta) sm_scale in float32, rounded to bf16 before the dK and dQ
    GEMMs; dkv accumulates in float32 block by block of queries, last block first (atomics, in an order
    unlike the reference's); both gradients are rounded to bf16. ``bug`` plants one error at ``slot``
    ``(t, j)``: ``"drop_slot"`` (its dkv contribution is lost), ``"wrong_row"`` (it goes to the next
    key row), ``"dq_wrong_key"`` (dq reads the previous key row there); or everywhere: ``"sign"``
    (the P^T dO part of dkv negated), ``"no_scale"`` (dS without sm_scale).
    """
    qf, kvf, dof = q.float(), kv.float(), d_out.float()  # [T, H, D], [N, D], [T, H, d_v]
    N = kv.shape[0]
    valid = idx >= 0  # [T, K]
    kv_sel = kvf[idx.clamp_min(0)] * valid[..., None]  # [T, K, D]
    s = (torch.einsum("thd,tkd->thk", qf, kv_sel) * sm_scale).masked_fill(~valid[:, None, :], -math.inf)  # [T, H, K]
    P = torch.softmax(s, dim=-1)  # [T, H, K]; every row here has a valid slot
    o = torch.einsum("thk,tkv->thv", P, kv_sel[..., :d_v]).bfloat16().float()  # [T, H, d_v]: the forward's output
    delta = (o * dof).sum(-1, keepdim=True)  # [T, H, 1]
    dP = torch.einsum("thv,tkv->thk", dof, kv_sel[..., :d_v])  # [T, H, K]
    dS = (P * (dP - delta) * (1.0 if bug == "no_scale" else sm_scale)).bfloat16().float()  # [T, H, K]
    P = P.bfloat16().float()
    t0, j0 = slot
    kv_dq = kv_sel.clone()
    if bug == "dq_wrong_key":
        kv_dq[t0, j0] = kvf[(idx[t0, j0] - 1) % N]
    dq = torch.einsum("thk,tkd->thd", dS, kv_dq)  # [T, H, D]
    keep, target = valid.clone(), idx.clone()
    if bug == "drop_slot":
        keep[t0, j0] = False
    if bug == "wrong_row":
        target[t0, j0] = (idx[t0, j0] + 1) % N
    dkv = torch.zeros(N, kv.shape[1])  # [N, D] float32
    for lo in reversed(range(0, q.shape[0], block)):
        hi = min(lo + block, q.shape[0])
        per_slot = torch.einsum("thk,thd->tkd", dS[lo:hi], qf[lo:hi])  # [C, K, D]
        per_slot[..., :d_v] += (-1 if bug == "sign" else 1) * torch.einsum("thk,thv->tkv", P[lo:hi], dof[lo:hi])
        dkv.index_add_(0, target[lo:hi][keep[lo:hi]], per_slot[keep[lo:hi]])  # [N, D]
    return dq.bfloat16(), dkv.bfloat16()


def _cancellation_case(pairs=256, cold_queries=256, cold_keys=128, K=8, A=8.0, eps=0.05, seed=0):
    """Heavy cancellation on two "hot" key rows, as early keys get under causal top-k selection.

    ``2 * pairs`` queries all select hot keys 0 and 1 (2048 contributions per hot row at H=4). Query
    ``t`` and ``t + pairs`` have the same q and opposite output gradients up to ``eps``:
    ``d_out = A r`` and ``-A r + eps A r'``, so the hot rows of dkv nearly cancel while each
    contribution is ``A`` times a normal one. ``cold_queries`` queries with ``d_out`` of size 1 select
    ``K`` of the ``cold_keys`` other rows each and make up most of dkv's norm and RMS.
    """
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2 + cold_keys, D, generator=g).bfloat16()  # [N, D]
    q_pair = torch.randn(pairs, H, D, generator=g) * 0.5
    q = torch.cat([q_pair, q_pair, torch.randn(cold_queries, H, D, generator=g) * 0.5]).bfloat16()  # [T, H, D]
    r, r2 = torch.randn(2, pairs, H, DV, generator=g)
    d_out = torch.cat([A * r, -A * r + eps * A * r2, torch.randn(cold_queries, H, DV, generator=g)]).bfloat16()
    idx = torch.full((2 * pairs + cold_queries, K), -1, dtype=torch.int64)  # [T, K]
    idx[: 2 * pairs, :2] = torch.tensor([0, 1])
    for t in range(cold_queries):
        idx[2 * pairs + t] = 2 + torch.randperm(cold_keys, generator=g)[:K]
    return q, kv, idx, d_out


BWD = dict(convention=DSA_REF, sm_scale=SCALE, d_v=DV)


def test_backward_delta_terms_equal_a_brute_force_loop():
    """t_dq, t_dkv from the chunked float64 code equal their definition written as scalar loops:
    r = ||P o dP|| + ||O o dO|| per (t, h), each slot's share sigma P_j r, times |kv| or |q|."""
    q, kv = _inputs(5, 6, seed=13)
    q, kv = q[:, :2, :7].double(), kv[:, :7].double()  # [T, 2, 7], [6, 7]
    idx = torch.tensor([[0, 3, -1, 5], [2, 2, 1, -1], [-1, -1, -1, -1], [5, 4, 3, 0], [1, -1, 1, 1]])
    d_out = torch.randn(5, 2, 4, generator=torch.Generator().manual_seed(14), dtype=torch.float64)
    t_dq, t_dkv = torch.zeros_like(q), torch.zeros_like(kv)
    for t in range(5):
        slots = [j for j in range(4) if idx[t, j] >= 0]
        for h in range(2):
            s = torch.stack([SCALE * (q[t, h] @ kv[idx[t, j]]) for j in slots]) if slots else None
            if s is None:
                continue
            p = torch.softmax(s, 0)
            dp = torch.stack([d_out[t, h] @ kv[idx[t, j], :4] for j in slots])
            o = sum(p[i] * kv[idx[t, j], :4] for i, j in enumerate(slots))
            r = (p * dp).norm() + (o * d_out[t, h]).norm()
            for i, j in enumerate(slots):
                t_dq[t, h] += SCALE * p[i] * r * kv[idx[t, j]].abs()
                t_dkv[idx[t, j]] += SCALE * p[i] * r * q[t, h].abs()
    got_dq, got_dkv = sparse_mla_backward_delta_terms(q, kv, idx, d_out, sm_scale=SCALE, d_v=4, chunk_size=2)
    torch.testing.assert_close(got_dq, t_dq, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(got_dkv, t_dkv, rtol=1e-12, atol=1e-15)
    assert delta_allowance_scale(torch.bfloat16) == 10 * 2.0 ** -8
    assert delta_allowance_scale(torch.float64) == 10 * 2.0 ** -53
    with pytest.raises(TypeError, match="dtype must be a torch float dtype"):
        delta_allowance_scale(torch.int32)


def _concentrated_case(T=48, N=64, K=8, sharpness=3.5, seed=21):
    """Each query's attention held by one key of its slots (``q`` a scaled copy of that key), so
    ``dP ~ delta`` there: ``dS`` and the magnitude are small while the error of a kernel's delta
    (from its bf16 output) is not."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(N, D, generator=g).bfloat16()  # [N, D]
    idx = torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(T)])  # [T, K]
    hot = kv[idx[:, 0]].float()  # [T, D]: the key each query attends to
    q = (sharpness * hot[:, None, :] / hot.norm(dim=-1)[:, None, None] + 0.3 * torch.randn(T, H, D, generator=g))
    d_out = torch.randn(T, H, DV, generator=g).bfloat16()
    return q.bfloat16(), kv, idx, d_out


def test_the_delta_allowance_covers_a_kernels_delta_where_attention_is_concentrated():
    """A kernel that takes delta from its bf16 output (`bf16_backward_kernel`, as the TileLang kernels do)
    breaks atol=0 + rtol * m where one key holds the attention, and stays inside once the delta
    allowance is added; the default check passes it, well inside its bound."""
    q, kv, idx, d_out = _concentrated_case()
    dq, dkv = bf16_backward_kernel(q, kv, idx, d_out, SCALE, DV)
    q64, kv64 = q.double().requires_grad_(True), kv.double().requires_grad_(True)
    out, _ = sparse_mla(q64, kv64, idx, sm_scale=SCALE, d_v=DV)
    e_dq, e_dkv = torch.autograd.grad(out, (q64, kv64), d_out.double())
    m_dq, m_dkv = sparse_mla_backward_magnitudes(q, kv, idx, d_out, sm_scale=SCALE, d_v=DV)
    t_dq, t_dkv = sparse_mla_backward_delta_terms(q, kv, idx, d_out, sm_scale=SCALE, d_v=DV)
    tol = Tolerance(rel_l2=1.0, atol=0.0, rtol=accumulation_rtol(torch.bfloat16), min_cosine=0.0)
    scale = delta_allowance_scale(torch.bfloat16)
    for name, a, e, m, t in (("dq", dq, e_dq, m_dq, t_dq), ("dkv", dkv, e_dkv, m_dkv, t_dkv)):
        without = compare(a, e, name=name, tol=tol, magnitude=m, head_dim=None)
        with_delta = compare(a, e, name=name, tol=tol, magnitude=m, allowance=scale * t, head_dim=None)
        assert without.violations > 0, f"{name}: the case should need the allowance\n{without}"
        assert with_delta.violations == 0 and with_delta.worst_ratio < 0.5, str(with_delta)
        assert "+ allowance" in " ".join(compare(a, e, name=name, tol=replace(tol, rtol=0.0), magnitude=m,
                                                 allowance=0.0 * t, head_dim=None).failures)
    assert check_sparse_mla_backward(dq, dkv, d_out, q, kv, idx, **BWD).ok


def test_accumulation_rtol_is_the_derived_bound():
    assert accumulation_rtol(torch.bfloat16) == 2.0 ** -6  # 3u + 2^16 * 2^-24 = 4u at u = 2^-8
    assert accumulation_rtol(torch.float32) == pytest.approx(3 * 2.0 ** -24 + 2.0 ** -8)
    assert accumulation_rtol(torch.float64) == pytest.approx((3 + 2 ** 16) * 2.0 ** -53)


def test_rounding_under_cancellation_passes_only_the_accumulation_aware_check():
    q, kv, idx, d_out = _cancellation_case()
    dq, dkv = bf16_backward_kernel(q, kv, idx, d_out, SCALE, DV)
    strict = check_sparse_mla_backward(dq, dkv, d_out, q, kv, idx, accumulation_aware=False, **BWD)
    aware = check_sparse_mla_backward(dq, dkv, d_out, q, kv, idx, **BWD)
    # the strict check flags rounding noise on the hot rows, and only there
    assert not strict["dkv"].ok and strict["dkv"].violations > 0, str(strict)
    assert strict["dkv"].max_abs_index[0] in (0, 1) and strict["dkv"].rel_l2 <= strict["dkv"].tol.rel_l2
    assert aware.ok, str(aware)
    assert aware["dkv"].magnitude_based and aware["dq"].magnitude_based and not strict["dkv"].magnitude_based
    assert aware["dkv"].tol.rtol == max(strict["dkv"].tol.rtol, 2.0 ** -6) and "rtol*magnitude" in str(aware)
    assert aware["dkv"].worst_ratio < 0.5  # well inside the bound, not at its edge
    # without the eps the pair contributions cancel exactly in both: nothing for the strict check to flag
    q, kv, idx, d_out = _cancellation_case(eps=0.0)
    exact = check_sparse_mla_backward(*bf16_backward_kernel(q, kv, idx, d_out, SCALE, DV), d_out, q, kv, idx,
                                      accumulation_aware=False, **BWD)
    assert exact.ok, str(exact)


@pytest.mark.parametrize("bug, slot, caught_by", [
    ("drop_slot", (512, 0), "dkv"),  # a cold key's contribution lost: ~1/8 of its row
    ("wrong_row", (512, 0), "dkv"),
    ("sign", None, "dkv"),
    ("no_scale", None, "dq"),
    ("dq_wrong_key", (0, 0), "dq"),
    ("drop_slot", (0, 0), "dkv"),  # on a hot row: lost in the elementwise bound, caught by rel. L2
])
def test_planted_backward_bugs_fail_the_accumulation_aware_check(bug, slot, caught_by):
    q, kv, idx, d_out = _cancellation_case()
    dq, dkv = bf16_backward_kernel(q, kv, idx, d_out, SCALE, DV, bug=bug, slot=slot or (0, 0))
    rep = check_sparse_mla_backward(dq, dkv, d_out, q, kv, idx, **BWD)
    assert not rep.ok and not rep[caught_by].ok, f"planted bug {bug!r} at {slot} was not caught:\n{rep}"
    if bug in ("drop_slot", "wrong_row") and slot[0] >= 512:  # a cold row: the elementwise bound catches it ...
        assert rep["dkv"].violations > 0, str(rep)
    if bug == "drop_slot" and slot[0] >= 512:  # ... where relative L2 alone would not
        assert rep["dkv"].rel_l2 <= rep["dkv"].tol.rel_l2, str(rep)


def test_backward_accumulation_aware_in_a_kernel_layout():
    """The magnitudes follow the kernel's layout (BSHD, per-batch indices, causal sentinel)."""
    q, kv, idx = _v32_case(seed=5)
    qg, kvg = q.float().requires_grad_(True), kv.float().requires_grad_(True)
    d_out = torch.randn(*q.shape[:3], DV, generator=torch.Generator().manual_seed(1))
    kw = dict(convention=TILELANG_DEEPSEEK_V32, sm_scale=SCALE, d_v=DV)
    for bug, should_pass in ((None, True), ("off_by_one", False)):
        out, _ = tilelang_v32_kernel(qg, kvg, idx, SCALE, DV, bug=bug)
        out = torch.nan_to_num(out)  # empty rows: NaN by the convention; their gradient is 0 either way
        dq, dkv = torch.autograd.grad(out, (qg, kvg), d_out)
        for aware in (True, False):
            rep = check_sparse_mla_backward(dq, dkv, d_out, q, kv, idx, accumulation_aware=aware, **kw)
            assert rep.ok == should_pass, f"bug={bug}, accumulation_aware={aware}:\n{rep}"
            assert rep["dkv"].magnitude_based == aware


def test_compare_magnitude():
    g = torch.Generator().manual_seed(3)
    e = torch.randn(6, 4, 8, generator=g, dtype=torch.float64)
    a = (e + 1e-3 * torch.randn(6, 4, 8, generator=g, dtype=torch.float64)).float()
    plain = compare(a, e)
    same = compare(a, e, magnitude=e.abs())  # m = |e|: the same bound
    assert not plain.magnitude_based and same.magnitude_based
    assert (same.violations, same.worst_ratio, same.allowed_at_max) == (plain.violations, plain.worst_ratio,
                                                                        plain.allowed_at_max)
    assert "rtol*|e|" in str(plain) and "rtol*magnitude" in str(same) and same.as_dict()["magnitude_based"]
    assert not plain.ok and compare(a, e, magnitude=e.abs() + 100.0).violations == 0  # a large m loosens
    for bad, what in ((e.abs()[:, :2], "shape"), (-e.abs(), "negative"),
                      (e.abs().masked_fill(e > 1, math.nan), "non-finite"),
                      (e.abs().masked_fill(e > 1, math.inf), "non-finite"), (e.abs().long(), "float")):
        with pytest.raises(ValueError, match=f"magnitude.*{what}|{what}.*magnitude"):
            compare(a, e, magnitude=bad)


def test_indexer_adapter():
    g = torch.Generator().manual_seed(6)
    T, HI, DI = 12, 4, 32
    q, k = torch.randn(T, HI, DI, generator=g).bfloat16(), torch.randn(T, DI, generator=g).bfloat16()
    w = torch.randn(T, HI, generator=g)
    starts = torch.zeros(T, dtype=torch.int64)
    ends = torch.arange(1, T + 1)
    from dsa_ref import lightning_indexer

    good = lightning_indexer(q, k, w, starts=starts, ends=ends)
    assert check_indexer(good, q, k, w, starts=starts, ends=ends).ok
    # DeepGEMM's ke is exclusive: a kernel that forgets the diagonal's +1
    off = lightning_indexer(q, k, w, starts=starts, ends=ends - 1)
    assert not check_indexer(off, q, k, w, starts=starts, ends=ends).ok
    garbage = torch.where(torch.isfinite(good), good, torch.full_like(good, 123.0))  # clean_logits=False
    assert not check_indexer(garbage, q, k, w, starts=starts, ends=ends).ok
    assert check_indexer(garbage, q, k, w, starts=starts, ends=ends, outside="any").ok
    no_relu = lightning_indexer(q, k, w, starts=starts, ends=ends, relu=False)
    assert not check_indexer(no_relu, q, k, w, starts=starts, ends=ends).ok


def test_topk_adapter():
    s = torch.randn(6, 10, generator=torch.Generator().manual_seed(7))
    s[0, 3:] = -math.inf  # a short row: 3 valid keys for k = 4
    ref = topk_indices(s, 4)
    padded_with_s = torch.where(ref >= 0, ref, torch.full_like(ref, 10))
    assert check_topk(padded_with_s, s).ok
    zeros = torch.where(ref >= 0, ref, torch.zeros_like(ref))  # slots left as the caller initialised them
    r = check_topk(zeros, s)
    assert not r.ok and r.wrong[0]["row"] == 0
    assert not check_topk(padded_with_s.flip(0), s).ok
    with pytest.raises(ValueError, match="THD convention with global indices"):
        check_topk(ref, s, convention=MEGATRON_SBHD)


def test_custom_tolerance_is_used():
    q, kv, idx = _flashmla_case()
    out, lse = flashmla_kernel(q, kv, idx, SCALE, DV)
    strict = Tolerance(rel_l2=1e-9, atol=1e-9, rtol=1e-9, min_cosine=1.0)
    rep = check_sparse_mla(out, lse, q, kv, idx, convention=FLASHMLA_SPARSE_PREFILL, sm_scale=SCALE, d_v=DV,
                           tol=strict)
    assert not rep["out"].ok and rep["lse"].ok


def test_indexer_backward_magnitudes_equal_a_brute_force_loop():
    """m_dq, m_dk, m_dw equal scalar loops over the terms of index_scores_at's backward (-1 slots, a
    duplicate key, ReLU on and off), and bound the float64 autograd gradients."""
    from dsa_ref import index_scores_at

    g = torch.Generator().manual_seed(31)
    T, HI, DI, S = 4, 3, 5, 6
    q, k = torch.randn(T, HI, DI, generator=g, dtype=torch.float64), torch.randn(S, DI, generator=g, dtype=torch.float64)
    w = torch.randn(T, HI, generator=g, dtype=torch.float64)
    idx = torch.tensor([[0, 3, -1], [2, 2, 5], [-1, -1, -1], [5, 4, 1]])
    d = torch.randn(T, 3, generator=g, dtype=torch.float64)
    for relu in (True, False):
        m_dq, m_dk, m_dw = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(w)
        for t in range(T):
            for j in range(3):
                s = int(idx[t, j])
                if s < 0:
                    continue
                for h in range(HI):
                    z = float(q[t, h] @ k[s])
                    on = z > 0 if relu else True
                    m_dq[t, h] += abs(d[t, j] * w[t, h]) * on * k[s].abs()
                    m_dk[s] += abs(d[t, j] * w[t, h]) * on * q[t, h].abs()
                    m_dw[t, h] += abs(d[t, j]) * (max(z, 0.0) if relu else abs(z))
        got = indexer_backward_magnitudes(q, k, w, idx, d, relu=relu, chunk_size=2)
        for name, a, b in zip(("dq", "dk", "dw"), got, (m_dq, m_dk, m_dw)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15, msg=name)
        qg, kg, wg = (x.clone().requires_grad_(True) for x in (q, k, w))
        scores = index_scores_at(qg, kg, wg, idx, relu=relu)  # [T, K], -inf at -1 slots
        grads = torch.autograd.grad(scores, (qg, kg, wg), torch.where(idx >= 0, d, 0.0))
        for name, grad, m in zip(("dq", "dk", "dw"), grads, got):
            assert bool((grad.abs() <= m + 1e-12).all()), name


def test_indexer_backward_magnitudes_count_logits_at_zero_as_active():
    """A logit within float32 rounding of 0 counts as active (a kernel may see either sign), one
    clearly below 0 does not."""
    q = torch.tensor([[[1.0, 1.0]]], dtype=torch.float64)  # [1, 1, 2]
    k = torch.tensor([[1.0, -1.0], [1.0, -1.5]], dtype=torch.float64)  # logits 0 and -0.5
    w, d = torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64)
    m_dq, m_dk, _ = indexer_backward_magnitudes(q, k, w, torch.tensor([[0, 1]]), d)
    assert torch.equal(m_dk[0], q[0, 0].abs()) and torch.equal(m_dk[1], torch.zeros(2, dtype=torch.float64))
    torch.testing.assert_close(m_dq[0, 0], k[0].abs())
