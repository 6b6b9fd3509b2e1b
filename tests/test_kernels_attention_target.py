"""The TileLang head-summed attention probabilities (the indexer loss's target numerator).

CPU tests (always run) pin down the quantity itself with a readable float64 reference,
`head_sum_reference`:

* L1-normalised over each row it *is* the sparse-stage target of `dsa_ref.indexer_loss`
  (`indexer_target`) when the indices come from `topk_indices` (no duplicates): this is the
  decomposition the fast path relies on (sparse MLA's LSE + one exponential per slot and head);
* each live row sums to ``H`` (every head's probabilities sum to 1 over the slots), duplicates
  included, because the LSE of `dsa_ref.sparse_mla` counts every slot;
* the wrapper's input validation (needs ``tilelang`` importable, no GPU).

GPU tests (skipped without CUDA + tilelang) compare the kernel with the reference on the *same*
bf16 inputs, the reference in float64 with the float64 LSE, the kernel with that LSE rounded to
fp32 (what the sparse MLA kernel hands over). Tolerances and why:

* a score ``q . kv`` is a sum of 576 products of bf16 values, each exact in fp32; fp32
  accumulation in the tensor cores adds rounding errors of about ``2^-24 |partial sum|`` per step,
  ``~ sqrt(576) * 2^-24 * 24 ~ 3e-5`` for unit-normal inputs, i.e. ``~ 5e-6`` after the softmax
  scale; the base-2 exponent ``s * scale2 - lse2`` rounds to ``~ 2^-24 * 30 ~ 2e-6`` absolute,
  ``exp2`` in fast math adds ``~ 2^-22`` relative, the fp32 LSE ``~ 1e-6``. So every probability
  carries a relative error of about ``1e-5``, and so does every head sum (a sum of positive terms).
* Bounds: relative L2 over the tensor ``REL = 1e-4`` (10x margin); max-abs ``MAX_ABS_PER_HEAD * H``
  with ``MAX_ABS_PER_HEAD = 2e-4``: an entry is at most ``H`` (every head fully on one slot), so its
  error is at most ``~1e-5 * H``; 20x margin for the tensor cores' accumulation order.
* ``-1`` slots, slots of rows whose LSE is ``-inf``, and all slots of empty rows must be exactly 0.
"""

import pytest
import torch

from dsa_ref import key_windows, sparse_mla
from dsa_ref.indexer_loss import indexer_target
from dsa_ref.kernels.shapes import DIM, DIM_V, SM_SCALE
from gpu_helpers import causal_packed_indices, max_abs, messy_indices, rel_l2, requires_kernels

REL, MAX_ABS_PER_HEAD = 1e-4, 2e-4


# --8<-- [start:head_sum_reference]
def head_sum_reference(q, kv, indices, lse, sm_scale, rows_per_chunk=64):
    """``sum_h exp(sm_scale * q[t, h] . kv[indices[t, i]] - lse[t, h])`` in float64, ``[T, K]``.

    0 at ``-1`` slots and wherever ``lse`` is ``-inf``. Chunked over queries only for memory.
    """
    kv = kv[:, 0] if kv.dim() == 3 else kv  # [S, D]
    out = []
    for lo in range(0, q.shape[0], rows_per_chunk):
        idx = indices[lo:lo + rows_per_chunk].long()  # [C, K]
        lse_c = lse[lo:lo + rows_per_chunk].double()[:, :, None]  # [C, H, 1]
        kv_sel = kv.double()[idx.clamp_min(0)]  # [C, K, D]; -1 slots read row 0, masked below
        scores = torch.einsum("thd,tkd->thk", q[lo:lo + rows_per_chunk].double(), kv_sel) * sm_scale  # [C, H, K]
        valid = (idx >= 0)[:, None, :] & torch.isfinite(lse_c)  # [C, H, K]
        probs = torch.where(valid, torch.exp(scores - torch.where(valid, lse_c, 0.0)), 0.0)  # [C, H, K]
        out.append(probs.sum(dim=1))  # [C, K]
    return torch.cat(out) if out else torch.zeros(0, indices.shape[1], dtype=torch.float64)
# --8<-- [end:head_sum_reference]


# ----------------------------------------------------------------------------- CPU


def _cpu_inputs(T, S, H, D, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64)
    kv = torch.randn(S, D, generator=g, dtype=torch.float64)
    return q, kv


@pytest.mark.parametrize("H", [1, 4])
def test_l1_normalised_head_sum_is_the_sparse_stage_target(H):
    """L1(head sum over the slots, from sparse MLA's LSE) == `indexer_target` on the selected set."""
    cu = torch.tensor([0, 1, 30, 30, 47, 70])  # a length-1 and an empty sequence among them
    T = S = int(cu[-1])
    q, kv = _cpu_inputs(T, S, H, 24, seed=H)
    starts, ends = key_windows(cu)
    idx = causal_packed_indices(cu, 16, seed=H, device="cpu")  # top-k: no duplicates, -1 in short windows
    idx[[5, 40]] = -1  # two rows with no valid slot at all
    _, lse = sparse_mla(q, kv, idx, sm_scale=SM_SCALE, d_v=8)  # [T, H]; -inf on the empty rows
    summed = head_sum_reference(q, kv, idx, lse, SM_SCALE)  # [T, K]
    total = summed.sum(dim=1, keepdim=True)  # [T, 1]
    on_slots = summed / torch.where(total > 0, total, torch.ones_like(total))  # rows of zeros stay zeros
    dense = torch.zeros(T, S + 1, dtype=torch.float64)  # column S collects the -1 slots, then is dropped
    dense.scatter_(1, torch.where(idx >= 0, idx, S), on_slots)
    expected = indexer_target(q, kv, sm_scale=SM_SCALE, starts=starts, ends=ends, topk_indices=idx)  # [T, S]
    torch.testing.assert_close(dense[:, :S], expected, rtol=1e-12, atol=1e-15)
    assert (summed[[5, 40]] == 0).all() and (summed[idx < 0] == 0).all()


def test_live_rows_sum_to_the_number_of_heads_even_with_duplicates():
    T, S, H = 60, 90, 3
    q, kv = _cpu_inputs(T, S, H, 16, seed=7)
    idx = messy_indices(T, S, 20, seed=7, device="cpu")  # -1 anywhere, duplicates, empty rows
    _, lse = sparse_mla(q, kv, idx, sm_scale=SM_SCALE, d_v=8)
    summed = head_sum_reference(q, kv, idx, lse, SM_SCALE)
    live = (idx >= 0).any(dim=1)
    torch.testing.assert_close(summed[live].sum(dim=1), torch.full((int(live.sum()),), float(H), dtype=torch.float64))
    assert (summed[~live] == 0).all() and (summed[idx < 0] == 0).all()


def test_duplicates_are_where_head_sum_and_target_part():
    """With a key selected twice, the attention counts both slots, the loss's target the key once.

    So the fast path needs duplicate-free indices (`topk_indices` gives them) or a dedupe first.
    """
    T, S, H = 4, 10, 2
    q, kv = _cpu_inputs(T, S, H, 8, seed=3)
    idx = torch.tensor([[0, 1, 2, 3]] * T)
    idx_dup = torch.tensor([[0, 1, 2, 2]] * T)
    for ind, same in ((idx, True), (idx_dup, False)):
        _, lse = sparse_mla(q, kv, ind, sm_scale=SM_SCALE, d_v=4)
        summed = head_sum_reference(q, kv, ind, lse, SM_SCALE)
        dense = torch.zeros(T, S, dtype=torch.float64).scatter_add_(1, ind, summed / summed.sum(1, keepdim=True))
        expected = indexer_target(q, kv, sm_scale=SM_SCALE, topk_indices=ind)
        assert torch.allclose(dense, expected) == same


def test_wrapper_rejects_bad_inputs():
    pytest.importorskip("tilelang")
    from dsa_ref.kernels.attention_target import attention_head_sum_supported, attention_head_sum_tilelang

    T, S, H = 8, 20, 16
    q = torch.randn(T, H, DIM).bfloat16()
    kv = torch.randn(S, DIM).bfloat16()
    idx = torch.randint(0, S, (T, 5))
    lse = torch.zeros(T, H)
    call = lambda *a: attention_head_sum_tilelang(*a, sm_scale=SM_SCALE)  # noqa: E731
    with pytest.raises(ValueError, match="q must have shape"):
        call(q[0], kv, idx, lse)
    with pytest.raises(ValueError, match="kv has size"):
        call(q, kv[:, :512], idx, lse)
    with pytest.raises(ValueError, match="kv has size"):
        call(q, kv[:, None].expand(S, 2, DIM), idx, lse)
    with pytest.raises(TypeError, match="indices must be an integer"):
        call(q, kv, idx.float(), lse)
    with pytest.raises(ValueError, match="indices values"):
        call(q, kv, idx + S, lse)
    with pytest.raises(ValueError, match="indices has size"):
        call(q, kv, idx[:-1], lse)
    with pytest.raises(ValueError, match="lse has size"):
        call(q, kv, idx, lse[:, :-1])
    with pytest.raises(TypeError, match="lse must be a floating-point"):
        call(q, kv, idx, lse.long())
    with pytest.raises(ValueError, match="sm_scale"):
        attention_head_sum_tilelang(q, kv, idx, lse, sm_scale=-1.0)
    with pytest.raises(ValueError, match="not on CUDA"):  # shapes fine, but this is the CPU
        call(q, kv, idx, lse)
    assert attention_head_sum_supported(q, kv, idx, lse) == "inputs are not on CUDA"


# ----------------------------------------------------------------------------- GPU


def _inputs(T, S, H, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(T, H, DIM, generator=g).to("cuda", torch.bfloat16)
    kv = torch.randn(S, DIM, generator=g).to("cuda", torch.bfloat16)
    return q, kv


def _check(q, kv, idx, *, lse=None):
    """Kernel vs float64 reference on the same bf16 inputs; returns the kernel's output."""
    from dsa_ref.kernels.attention_target import attention_head_sum_tilelang

    if lse is None:
        _, lse = sparse_mla(q.double(), kv.double(), idx, sm_scale=SM_SCALE, d_v=DIM_V)  # [T, H] float64
    got = attention_head_sum_tilelang(q, kv, idx, lse.float(), sm_scale=SM_SCALE)
    ref = head_sum_reference(q, kv, idx, lse, SM_SCALE)
    T, H, _ = q.shape
    assert got.dtype == torch.float32 and got.shape == (T, idx.shape[-1])
    assert torch.isfinite(got).all()
    assert (got[idx < 0] == 0).all(), "-1 slots must be exactly 0"
    dead = torch.isinf(lse).any(dim=1)  # empty rows, or rows whose lse was set to -inf
    assert (got[dead] == 0).all(), "rows with lse = -inf must be exactly 0"
    assert rel_l2(got, ref) < REL
    assert max_abs(got, ref) < MAX_ABS_PER_HEAD * H
    return got


@pytest.mark.gpu
@requires_kernels
@pytest.mark.parametrize("H", [16, 32, 64, 128])
@pytest.mark.parametrize("K", [128, 100])  # 100: a last block of 36 slots, masked in the kernel
def test_messy_indices(H, K):
    T, S = 203, 517
    q, kv = _inputs(T, S, H, seed=H + K)
    idx = messy_indices(T, S, K, seed=K)  # -1 anywhere, duplicates, empty rows
    _, lse = sparse_mla(q.double(), kv.double(), idx, sm_scale=SM_SCALE, d_v=DIM_V)
    lse[3, :] = float("-inf")  # a row with valid slots but lse = -inf: every p must be 0
    got = _check(q, kv, idx, lse=lse)
    live = torch.isfinite(lse).all(dim=1)
    torch.testing.assert_close(got[live].sum(dim=1).double(), torch.full_like(lse[live, 0], float(H)),
                               rtol=REL, atol=0)


@pytest.mark.gpu
@requires_kernels
@pytest.mark.parametrize("H", [64, 128])
def test_causal_packed_and_cp_indices(H):
    from dsa_ref import cp_shard_index

    cu = torch.tensor([0, 1, 64, 64, 200, 512])  # a length-1 and an empty sequence among them
    q, kv = _inputs(512, 512, H, seed=1)
    _check(q, kv, causal_packed_indices(cu, 128))
    cu_cp = torch.tensor([0, 128, 512])  # a CP rank's queries (zigzag shard of 2 ranks) over all keys
    qi = cp_shard_index(cu_cp, 2, 1)
    _check(q[: qi.numel()].contiguous(), kv, causal_packed_indices(cu_cp, 128, query_index=qi))


@pytest.mark.gpu
@requires_kernels
def test_trailing_minus_one_blocks_are_skipped():
    """Rows visit only their blocks up to the last valid slot; the skipped slots read 0."""
    from dsa_ref.kernels.attention_target import attention_head_sum_tilelang

    T, S, H = 96, 700, 128
    q, kv = _inputs(T, S, H, seed=21)
    g = torch.Generator(device="cpu").manual_seed(21)
    idx = torch.randint(0, S, (T, 128), generator=g)
    lengths = torch.arange(T) * 128 // (T - 1)  # 0 ... 128 valid slots per row
    idx = torch.where(torch.arange(128)[None] < lengths[:, None], idx, -1).cuda()
    padded = torch.cat([idx, torch.full((T, 333), -1, device="cuda", dtype=idx.dtype)], dim=1)  # K = 461
    _, lse = sparse_mla(q.double(), kv.double(), idx, sm_scale=SM_SCALE, d_v=DIM_V)
    a = attention_head_sum_tilelang(q, kv, idx, lse.float(), sm_scale=SM_SCALE)
    b = attention_head_sum_tilelang(q, kv, padded, lse.float(), sm_scale=SM_SCALE)
    assert torch.equal(a, b[:, :128]) and (b[:, 128:] == 0).all()
    _check(q, kv, padded, lse=lse)


@pytest.mark.gpu
@requires_kernels
def test_layouts_dtypes_and_reproducibility():
    """kv [S, 1, D], int64 and [T, 1, K] indices, float64 lse; H = 128 (two atomic adds) is bitwise stable."""
    from dsa_ref.kernels.attention_target import attention_head_sum_tilelang

    T, S, H = 150, 300, 128
    q, kv = _inputs(T, S, H, seed=5)
    idx = messy_indices(T, S, 77, seed=5)  # int64
    _, lse = sparse_mla(q.double(), kv.double(), idx, sm_scale=SM_SCALE, d_v=DIM_V)
    a = attention_head_sum_tilelang(q, kv, idx, lse.float(), sm_scale=SM_SCALE)
    lse64 = lse.float().double()  # a float64 lse with the same values as the fp32 one
    b = attention_head_sum_tilelang(q, kv[:, None], idx[:, None].int(), lse64, sm_scale=SM_SCALE)
    c = attention_head_sum_tilelang(q, kv, idx, lse.float(), sm_scale=SM_SCALE)
    assert torch.equal(a, b) and torch.equal(a, c)
    assert rel_l2(a, head_sum_reference(q, kv, idx, lse, SM_SCALE)) < REL


@pytest.mark.gpu
@requires_kernels
def test_large_causal_selection():
    """T = 512 queries at the end of a causal sequence of S = 8192 keys, top-2048, H = 128."""
    S, T, K = 8192, 512, 2048
    q, kv = _inputs(T, S, 128, seed=9)
    idx = causal_packed_indices(torch.tensor([0, S]), K, query_index=torch.arange(S - T, S), seed=9)
    _check(q, kv, idx)


@pytest.mark.gpu
@requires_kernels
def test_with_the_kernels_lse_gives_the_indexer_target():
    """The fast path end to end: sparse MLA kernel's LSE -> head sum -> L1 == `indexer_target`.

    The kernel LSE is within ``1e-3`` of the exact one (test_kernels_sparse_mla.py; typically
    ``1e-5``), which moves each probability by that relative amount: relative L2 bound ``2e-3``.
    """
    from dsa_ref.kernels.attention_target import attention_head_sum_tilelang
    from dsa_ref.kernels.autograd import sparse_mla_tilelang

    cu = torch.tensor([0, 100, 384])
    T = S = 384
    q, kv = _inputs(T, S, 128, seed=11)
    idx = causal_packed_indices(cu, 128, seed=11)
    _, lse = sparse_mla_tilelang(q, kv, idx, sm_scale=SM_SCALE, d_v=DIM_V)
    mass = attention_head_sum_tilelang(q, kv, idx, lse, sm_scale=SM_SCALE).double()  # [T, K]
    on_slots = mass / mass.sum(dim=1, keepdim=True)
    dense = torch.zeros(T, S + 1, dtype=torch.float64, device="cuda")
    dense.scatter_(1, torch.where(idx >= 0, idx, S), on_slots)
    starts, ends = (w.cuda() for w in key_windows(cu))
    expected = indexer_target(q.double(), kv.double(), sm_scale=SM_SCALE, starts=starts, ends=ends, topk_indices=idx)
    assert rel_l2(dense[:, :S], expected) < 2e-3


@pytest.mark.gpu
@requires_kernels
def test_validate_false_skips_the_range_check_only():
    """``validate=False`` (the layer's own slots) gives bit-identical results on valid indices;
    the default raises ValueError for an index out of range."""
    from dsa_ref.kernels.attention_target import attention_head_sum_tilelang

    q, kv = _inputs(97, 300, 64, seed=5)
    idx = messy_indices(97, 300, 128, seed=5)
    _, lse = sparse_mla(q.double(), kv.double(), idx, sm_scale=SM_SCALE, d_v=DIM_V)
    checked = attention_head_sum_tilelang(q, kv, idx, lse.float(), sm_scale=SM_SCALE)
    unchecked = attention_head_sum_tilelang(q, kv, idx, lse.float(), sm_scale=SM_SCALE, validate=False)
    assert torch.equal(checked, unchecked)
    bad = idx.clone()
    bad[4, 0] = 300
    with pytest.raises(ValueError, match=r"values must be -1 \(unused slot\) or in \[0, num_keys=300\)"):
        attention_head_sum_tilelang(q, kv, bad, lse.float(), sm_scale=SM_SCALE)
