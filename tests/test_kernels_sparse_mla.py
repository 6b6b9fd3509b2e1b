"""TileLang sparse MLA (forward and backward) against the readable reference.

Skipped without CUDA + tilelang. The reference runs in float64 on the *same* bf16 inputs, so the
only differences are the kernel's own roundings. Tolerances (relative L2 over the tensor, max-abs
relative to the reference's largest magnitude) and why:

* ``out`` (bf16): the output is rounded to bf16 (relative error <= 2^-9 per element, RMS about
  2^-9 / sqrt(3)), and ``P`` is rounded to bf16 before the ``P V`` product (independent relative
  errors of 2^-9 on terms that mostly average out). Expected relative L2 about 1.5e-3:
  bound ``REL_OUT = 6e-3``; max-abs ``MAX_OUT = 8 * 2^-9`` of the largest |out| (a few ulps).
* ``lse`` (fp32): products of bf16 values are exact in fp32, sums of 576 terms carry about
  1e-6 relative error, exp2/log2 in fast math about 1e-6: bound ``MAX_LSE = 1e-3`` absolute.
* ``dq``, ``dkv``: ``P`` and ``dS`` are rounded to bf16 before their GEMMs and the results are
  rounded to bf16: a few 2^-9 relative errors compounded: bound ``REL_GRAD = 1.5e-2``.
* ``Delta`` (the backward's ``sum_d out * d_out``, fp32): products of bf16 values are exact in
  fp32 and a sum of 512 of them carries about 512 * 2^-24 relative error of the sum of absolute
  values: bound ``MAX_DELTA = 1e-5`` of ``sum_d |out * d_out|``.
"""

import pytest
import torch

from dsa_ref import sparse_mla
from dsa_ref.kernels.shapes import BACKWARD_SCHEDULES, DIM, DIM_V, SM_SCALE, TEST_TOPK
from gpu_helpers import causal_packed_indices, max_abs, messy_indices, rel_l2, requires_kernels

pytestmark = [requires_kernels, pytest.mark.gpu]

REL_OUT, MAX_OUT, MAX_LSE, REL_GRAD, MAX_DELTA = 6e-3, 8 * 2**-9, 1e-3, 1.5e-2, 1e-5


def _inputs(T, S, H, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(T, H, DIM, generator=g).to("cuda", torch.bfloat16)
    kv = torch.randn(S, DIM, generator=g).to("cuda", torch.bfloat16)
    return q, kv


def _reference_backward(q, kv, idx, d_out):
    """The float64 reference forward and backward, and the kernels' inputs from it as
    `SparseMLAFunction.backward` prepares them: ``(qr, kvr, ref_lse, idx32, delta)`` with the
    gradients in ``qr.grad`` / ``kvr.grad``, ``idx32`` padded to 64 slots and ``delta [T, H]`` fp32."""
    from dsa_ref.kernels.autograd import _pad_indices

    qr, kvr = q.double().requires_grad_(True), kv.double().requires_grad_(True)
    ref_out, ref_lse = sparse_mla(qr, kvr, idx, sm_scale=SM_SCALE, d_v=DIM_V)
    (ref_out * d_out.double()).sum().backward()
    delta = (ref_out.to(torch.bfloat16).float() * d_out.float()).sum(-1).contiguous()  # [T, H]
    return qr, kvr, ref_lse, _pad_indices(idx, 64), delta


def _check_forward(q, kv, idx, schedule):
    from dsa_ref.kernels.autograd import sparse_mla_tilelang

    out, lse = sparse_mla_tilelang(q, kv, idx, sm_scale=SM_SCALE, d_v=DIM_V, schedule=schedule)
    ref_out, ref_lse = sparse_mla(q.double(), kv.double(), idx, sm_scale=SM_SCALE, d_v=DIM_V)
    empty = (idx < 0).all(dim=1)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all(), "empty rows: out 0, lse -inf"
    live = ~empty
    assert rel_l2(out[live], ref_out[live]) < REL_OUT
    assert max_abs(out[live], ref_out[live]) < MAX_OUT * float(ref_out.abs().max())
    assert max_abs(lse[live], ref_lse[live]) < MAX_LSE
    return out, lse


@pytest.mark.parametrize("H", [16, 32, 64, 128])
@pytest.mark.parametrize("K", [TEST_TOPK, 100])  # 100: not a multiple of 64, padded with -1
def test_forward_messy_indices_simple(H, K):
    q, kv = _inputs(203, 517, H, seed=H + K)
    _check_forward(q, kv, messy_indices(203, 517, K, seed=K), "simple")


@pytest.mark.parametrize("schedule", ["warp_specialized", "staggered"])
@pytest.mark.parametrize("H", [64, 128])
def test_forward_messy_indices_warp_specialized(H, schedule):
    q, kv = _inputs(203, 517, H, seed=H)
    _check_forward(q, kv, messy_indices(203, 517, TEST_TOPK, seed=3), schedule)


@pytest.mark.parametrize("schedule", ["simple", "warp_specialized", "staggered"])
def test_forward_packed_and_cp_windows(schedule):
    from dsa_ref import cp_shard_index

    cu = torch.tensor([0, 1, 64, 64, 200, 512])  # a length-1 and an empty sequence among them
    q, kv = _inputs(512, 512, 128, seed=1)
    _check_forward(q, kv, causal_packed_indices(cu, TEST_TOPK), schedule)
    # a CP rank's queries (zigzag shard of 2 ranks) over all keys: cu lengths divisible by 4
    cu_cp = torch.tensor([0, 128, 512])
    qi = cp_shard_index(cu_cp, 2, 1)
    _check_forward(q[: qi.numel()].contiguous(), kv, causal_packed_indices(cu_cp, TEST_TOPK, query_index=qi),
                   schedule)


def test_forward_staggered_reads_int32_and_int64_indices_alike():
    """The staggered kernel takes int64 indices as they are (no int32 copy): the same ``out`` and
    ``lse`` bit for bit as on int32 ones, with ``-1`` slots, padding and empty rows among them."""
    from dsa_ref.kernels.autograd import sparse_mla_tilelang

    q, kv = _inputs(203, 517, 128, seed=7)
    idx = messy_indices(203, 517, 100, seed=7)  # int64; 100 slots: padded to 128
    out64, lse64 = _check_forward(q, kv, idx, "staggered")
    out32, lse32 = sparse_mla_tilelang(q, kv, idx.to(torch.int32), sm_scale=SM_SCALE, d_v=DIM_V,
                                       schedule="staggered")
    assert torch.equal(out64, out32) and torch.equal(lse64, lse32)


@pytest.mark.parametrize("backward", ["one_pass", "two_pass"])
@pytest.mark.parametrize("H", [16, 32, 64, 128])
def test_backward_matches_reference(H, backward):
    from dsa_ref.kernels.autograd import sparse_mla_tilelang

    T, S = 150, 300
    q, kv = _inputs(T, S, H, seed=10 + H)
    idx = messy_indices(T, S, TEST_TOPK, seed=H)
    idx[:, 2:6] = 7  # many queries select the same key several times: atomics must add them all
    g = torch.Generator(device="cpu").manual_seed(5)
    d_out = torch.randn(T, H, DIM_V, generator=g).to("cuda", torch.bfloat16)

    qk, kvk = q.clone().requires_grad_(True), kv.clone().requires_grad_(True)
    out, lse = sparse_mla_tilelang(qk, kvk, idx, sm_scale=SM_SCALE, d_v=DIM_V, backward=backward)
    (out.float() * d_out.float()).sum().backward()

    qr, kvr = q.double().requires_grad_(True), kv.double().requires_grad_(True)
    ref_out, _ = sparse_mla(qr, kvr, idx, sm_scale=SM_SCALE, d_v=DIM_V)
    (ref_out * d_out.double()).sum().backward()

    assert torch.isfinite(qk.grad).all() and torch.isfinite(kvk.grad).all()
    assert rel_l2(qk.grad, qr.grad) < REL_GRAD
    assert rel_l2(kvk.grad, kvr.grad) < REL_GRAD
    empty = (idx < 0).all(dim=1)
    assert (qk.grad[empty] == 0).all()


def _schedule_id(knobs):
    return "-".join(f"{n}={v}" for n, v in knobs.items())


# every schedule of the backward kernel computes the same sums: each one against the float64
# reference, with duplicates (several atomics / bulk reductions to one row in one step)
@pytest.mark.parametrize("knobs", BACKWARD_SCHEDULES, ids=_schedule_id)
def test_backward_kernel_schedules_match_reference(knobs):
    from dsa_ref.kernels import sparse_mla_bwd as bwd
    from dsa_ref.kernels.autograd import _base2_lse, _block_counts

    T, S, H = 97, 260, 128
    q, kv = _inputs(T, S, H, seed=31)
    idx = messy_indices(T, S, TEST_TOPK, seed=4)
    idx[:, 3:9] = 11  # one row selected six times by every query: inside one 16-row half
    idx[5] = -1  # a row with no valid slot
    g = torch.Generator(device="cpu").manual_seed(6)
    d_out = torch.randn(T, H, DIM_V, generator=g).to("cuda", torch.bfloat16)

    # the kernel's inputs as SparseMLAFunction.backward prepares them, from the float64 forward
    qr, kvr, ref_lse, idx32, delta = _reference_backward(q, kv, idx, d_out)
    lse2 = _base2_lse(ref_lse)  # float64 here: rounded to fp32 at the launch below
    dkv = torch.zeros(S, DIM, dtype=torch.float32, device="cuda")
    kernel = bwd.backward_kernel(H, DIM, DIM_V, SM_SCALE, **knobs)
    dq = kernel(q, kv, d_out, idx32, _block_counts(idx32, bwd.BLOCK_S), lse2.float().contiguous(), delta, dkv)

    assert torch.isfinite(dq).all() and torch.isfinite(dkv).all()
    assert rel_l2(dq, qr.grad) < REL_GRAD
    assert rel_l2(dkv, kvr.grad) < REL_GRAD
    assert (dq[5] == 0).all()


def _two_pass_cases():
    """(name, T, S, H, indices): messy slots (duplicates, -1 anywhere, empty rows, K = 100 padded to
    128), packed causal windows with an empty and a length-1 sequence, one CP rank's zigzag shard."""
    from dsa_ref import cp_shard_index

    cu = torch.tensor([0, 1, 64, 64, 200, 512])
    cu_cp = torch.tensor([0, 128, 512])
    qi = cp_shard_index(cu_cp, 2, 1)
    messy = messy_indices(150, 300, 100, seed=3)
    messy[:, 2:6] = 7
    return [("messy_k100_h16", 150, 300, 16, messy), ("messy_k100_h128", 150, 300, 128, messy),
            ("packed_h64", 512, 512, 64, causal_packed_indices(cu, TEST_TOPK)),
            ("cp_rank1_h128", qi.numel(), 512, 128, causal_packed_indices(cu_cp, TEST_TOPK, query_index=qi))]


@pytest.mark.parametrize("chunked", [False, True], ids=["one_chunk", "chunks_of_7"])
def test_two_pass_backward_matches_one_pass_and_reference(chunked):
    """The two passes against the one-pass kernel on the same prepared inputs (``dq`` to rounding,
    ``dkv`` to the order of fp32 additions) and both against float64; NaN in every kv row no slot
    selects (the zero row's place included) changes nothing; in chunks of 7 queries (last one short)
    the result is the same as in one chunk."""
    from dsa_ref.kernels import sparse_mla_bwd as bwd
    from dsa_ref.kernels.autograd import _base2_lse, _block_counts, with_zero_row
    from dsa_ref.kernels.sparse_mla_bwd_two_pass import two_pass_backward

    for name, T, S, H, idx in _two_pass_cases():
        q, kv = _inputs(T, S, H, seed=len(name))
        g = torch.Generator(device="cpu").manual_seed(T)
        d_out = torch.randn(T, H, DIM_V, generator=g).to("cuda", torch.bfloat16)
        qr, kvr, ref_lse, idx32, delta = _reference_backward(q, kv, idx, d_out)
        lse2 = _base2_lse(ref_lse).float().contiguous()  # [T, H]
        dkv1 = torch.zeros(S + 1, DIM, dtype=torch.float32, device="cuda")
        dq1 = bwd.backward_kernel(H, DIM, DIM_V, SM_SCALE)(q, with_zero_row(kv), d_out, idx32,
                                                          _block_counts(idx32, bwd.BLOCK_S), lse2, delta, dkv1)
        read = torch.zeros(S, dtype=torch.bool, device="cuda")
        read[idx[idx >= 0]] = True
        dirty = kv.clone()
        dirty[~read] = float("nan")  # rows no slot selects
        budget = 7 * 2 * H * idx32.shape[1] * 2 if chunked else 1 << 30
        dq2, dkv2 = two_pass_backward(q, with_zero_row(dirty), d_out, idx32, lse2, delta, sm_scale=SM_SCALE,
                                      d_v=DIM_V, buffer_bytes=budget)

        assert torch.isfinite(dq2).all() and torch.isfinite(dkv2[:-1]).all(), name
        assert rel_l2(dq2, dq1) < 1e-3, name
        assert rel_l2(dkv2[:-1], dkv1[:-1]) < 1e-5, name
        assert (dkv2[:-1][~read] == 0).all(), name
        assert rel_l2(dq2, qr.grad) < REL_GRAD and rel_l2(dkv2[:-1], kvr.grad) < REL_GRAD, name
        empty = (idx < 0).all(dim=1)
        assert (dq2[empty] == 0).all(), name


@pytest.mark.parametrize("H", [64, 128])
def test_pass_a_with_batched_waits_equals_one_wait_per_product(H):
    """`dq_kernel(batch_waits=True)` (S and dP issued together, P / dS stored while dQ's products run;
    the default at 64-head blocks) writes the P, dS and dQ of ``batch_waits=False`` bit for bit: the same products in the same order (messy slots,
    duplicates, -1 anywhere, an empty row, K = 100 padded to 128)."""
    from dsa_ref.kernels.autograd import _base2_lse, _block_counts, with_zero_row
    from dsa_ref.kernels.sparse_mla_bwd_two_pass import BLOCK_S, dq_kernel

    T, S = 150, 300
    q, kv = _inputs(T, S, H, seed=H)
    idx = messy_indices(T, S, 100, seed=4)
    idx[:, 2:6] = 7
    g = torch.Generator(device="cpu").manual_seed(H + 1)
    d_out = torch.randn(T, H, DIM_V, generator=g).to("cuda", torch.bfloat16)
    _, _, ref_lse, idx32, delta = _reference_backward(q, kv, idx, d_out)
    counts = _block_counts(idx32, BLOCK_S)
    lse2 = _base2_lse(ref_lse).float().contiguous()  # [T, H]
    results = []
    for batch_waits in (False, True):
        P = torch.zeros(T, H, idx32.shape[1], dtype=torch.bfloat16, device="cuda")  # [T, H, K']
        dS, dq = torch.zeros_like(P), torch.empty_like(q)
        dq_kernel(H, DIM, DIM_V, SM_SCALE, batch_waits=batch_waits)(q, with_zero_row(kv), d_out, idx32, counts,
                                                                     lse2, delta, P, dS, dq)
        results.append((P, dS, dq))
    for name, a, b in zip(("P", "dS", "dq"), *results):
        assert torch.equal(a, b), name


def test_two_pass_backward_through_the_public_call_and_lse():
    """``backward="two_pass"`` through `sparse_mla_tilelang` (staggered forward, int64 indices), with
    a gradient on ``lse`` too; an unknown ``backward`` is a ValueError."""
    from dsa_ref.kernels.autograd import sparse_mla_tilelang

    T, S, H = 64, 200, 128
    q, kv = _inputs(T, S, H, seed=2)
    idx = messy_indices(T, S, TEST_TOPK, seed=9)
    qk, kvk = q.clone().requires_grad_(True), kv.clone().requires_grad_(True)
    out, lse = sparse_mla_tilelang(qk, kvk, idx, sm_scale=SM_SCALE, d_v=DIM_V, backward="two_pass")
    (out.float().sum() + lse[torch.isfinite(lse)].sum()).backward()
    qr, kvr = q.double().requires_grad_(True), kv.double().requires_grad_(True)
    ref_out, ref_lse = sparse_mla(qr, kvr, idx, sm_scale=SM_SCALE, d_v=DIM_V)
    (ref_out.sum() + ref_lse[torch.isfinite(ref_lse)].sum()).backward()
    assert rel_l2(qk.grad, qr.grad) < REL_GRAD and rel_l2(kvk.grad, kvr.grad) < REL_GRAD
    with pytest.raises(ValueError, match="backward must be"):
        sparse_mla_tilelang(q, kv, idx, sm_scale=SM_SCALE, d_v=DIM_V, backward="fused")


@pytest.mark.parametrize("H", [16, 32, 64, 128])
def test_delta_kernel_matches_float64(H):
    from dsa_ref.kernels.sparse_mla_bwd import delta_kernel

    g = torch.Generator(device="cpu").manual_seed(H)
    out = torch.randn(77, H, DIM_V, generator=g).to("cuda", torch.bfloat16)
    d_out = (torch.randn(77, H, DIM_V, generator=g) * 3).to("cuda", torch.bfloat16)
    delta = delta_kernel(H, DIM_V)(out, d_out)  # [T, H]
    prod = out.double() * d_out.double()
    assert delta.shape == (77, H) and delta.dtype == torch.float32
    assert ((delta.double() - prod.sum(-1)).abs() <= MAX_DELTA * prod.abs().sum(-1)).all()


def test_backward_through_lse():
    """A gradient on lse (d lse / d s = p) is folded into Delta by the wrapper."""
    from dsa_ref.kernels.autograd import sparse_mla_tilelang

    T, S, H = 64, 200, 64
    q, kv = _inputs(T, S, H, seed=2)
    idx = messy_indices(T, S, TEST_TOPK, seed=9)
    qk = q.clone().requires_grad_(True)
    out, lse = sparse_mla_tilelang(qk, kv, idx, sm_scale=SM_SCALE, d_v=DIM_V)
    lse[torch.isfinite(lse)].sum().backward()
    qr = q.double().requires_grad_(True)
    _, ref_lse = sparse_mla(qr, kv.double(), idx, sm_scale=SM_SCALE, d_v=DIM_V)
    ref_lse[torch.isfinite(ref_lse)].sum().backward()
    assert rel_l2(qk.grad, qr.grad) < REL_GRAD


def test_dispatch_auto_uses_the_kernel_and_falls_back():
    from dsa_ref import dispatch

    q, kv = _inputs(64, 128, 64, seed=4)
    idx = messy_indices(64, 128, TEST_TOPK, seed=4)
    out, _ = dispatch.sparse_mla(q, kv, idx, sm_scale=SM_SCALE, d_v=DIM_V, backend="tilelang")
    ref, _ = sparse_mla(q, kv, idx, sm_scale=SM_SCALE, d_v=DIM_V)
    assert rel_l2(out, ref) < REL_OUT
    # float32 inputs are not supported by the kernels: auto falls back, tilelang refuses
    out32, _ = dispatch.sparse_mla(q.float(), kv.float(), idx, sm_scale=SM_SCALE, d_v=DIM_V, backend="auto")
    assert out32.dtype == torch.float32
    with pytest.raises(RuntimeError, match="declined"):
        dispatch.sparse_mla(q.float(), kv.float(), idx, sm_scale=SM_SCALE, d_v=DIM_V, backend="tilelang")


def test_forward_staggered_counts_its_pairs_over_every_slot():
    """The staggered kernel counts each row's pairs of 64-slot blocks itself, 2048 slots at a time:
    a row's last valid slot may lie in any pair of either chunk (at a pair's first or last slot, on
    either side of slot 2048), after whole pairs of ``-1`` slots. A count one pair short would drop
    that slot's row from the output; every row must match the float64 reference."""
    T, S, H, K = 64, 3000, 128, 2500  # 2500 slots: padded to 2560, 20 pairs in two chunks
    q, kv = _inputs(T, S, H, seed=5)
    g = torch.Generator(device="cpu").manual_seed(5)
    idx = torch.randint(0, S, (T, K), generator=g)
    last = torch.tensor([0, 1, 63, 64, 127, 128, 129, 1023, 1024, 2047, 2048, 2049, 2175, 2176, 2431, 2499])
    last = torch.cat([last, torch.randint(0, K, (T - last.numel(),), generator=g)])  # [T]
    slot = torch.arange(K)[None]  # [1, K]
    keep = (slot <= last[:, None]) & ((slot // 128) % 3 != 1)  # whole -1 pairs between valid ones ...
    keep |= slot == last[:, None]  # ... and the last valid slot itself
    idx = torch.where(keep, idx, -1).cuda()  # [T, K] int64
    _check_forward(q, kv, idx, "staggered")
    _check_forward(q, kv, idx.to(torch.int32), "staggered")


@pytest.mark.parametrize("schedule", ["simple", "warp_specialized", "staggered"])
def test_trailing_minus_one_blocks_are_skipped_and_any_k_works(schedule):
    """Rows visit only their blocks up to the last valid slot; K need not be a compile-time size.

    Same inputs with the valid slots first and 320 trailing -1 slots (K = 448, not a multiple of
    128) must give the same result as without the padding, and rows of every length work.
    """
    from dsa_ref.kernels.autograd import sparse_mla_tilelang

    T, S, H = 96, 700, 64
    q, kv = _inputs(T, S, H, seed=21)
    g = torch.Generator(device="cpu").manual_seed(21)
    idx = torch.randint(0, S, (T, 128), generator=g)
    lengths = torch.arange(T) * 128 // T  # 0 ... 126 valid slots per row
    idx = torch.where(torch.arange(128)[None] < lengths[:, None], idx, -1).cuda()
    padded = torch.cat([idx, torch.full((T, 320), -1, device="cuda", dtype=idx.dtype)], dim=1)
    out_a, lse_a = sparse_mla_tilelang(q, kv, idx, sm_scale=SM_SCALE, d_v=DIM_V, schedule=schedule)
    out_b, lse_b = sparse_mla_tilelang(q, kv, padded, sm_scale=SM_SCALE, d_v=DIM_V, schedule=schedule)
    assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b)
    _check_forward(q, kv, padded, schedule)


@pytest.mark.parametrize("schedule", ["simple", "warp_specialized", "staggered"])
def test_index_range_is_checked_after_the_launch_and_can_be_skipped(schedule):
    """``validate=True`` (the default) raises ValueError for an index out of range, although the
    kernel is already queued: its gathers stay inside ``kv``, so the GPU is unharmed and the next
    call is exact. ``validate=False`` on valid indices gives bit-identical results."""
    from dsa_ref.kernels.autograd import sparse_mla_tilelang

    T, S, H = 130, 300, 64
    q, kv = _inputs(T, S, H, seed=31)
    idx = messy_indices(T, S, TEST_TOPK, seed=31)
    out, lse = sparse_mla_tilelang(q, kv, idx, sm_scale=SM_SCALE, d_v=DIM_V, schedule=schedule)
    out_u, lse_u = sparse_mla_tilelang(q, kv, idx, sm_scale=SM_SCALE, d_v=DIM_V, schedule=schedule,
                                       validate=False)
    assert torch.equal(out, out_u) and torch.equal(lse, lse_u)
    for bad_value in (S, 10 * S, -2):
        bad = idx.clone()
        bad[T // 2, 3] = bad_value
        with pytest.raises(ValueError, match=rf"indices values must be -1 .*num_keys={S}.*{bad_value}"):
            sparse_mla_tilelang(q, kv, bad, sm_scale=SM_SCALE, d_v=DIM_V, schedule=schedule)
    int64_wraps = idx.long().clone()
    int64_wraps[0, 0] = 2**32 + 1  # int32 of it is 1: in range for the kernel, still an error
    with pytest.raises(ValueError, match="num_keys"):
        sparse_mla_tilelang(q, kv, int64_wraps, sm_scale=SM_SCALE, d_v=DIM_V, schedule=schedule)
    torch.cuda.synchronize()  # no fault was left behind
    again, _ = sparse_mla_tilelang(q, kv, idx, sm_scale=SM_SCALE, d_v=DIM_V, schedule=schedule)
    assert torch.equal(again, out)
