"""The fused TileLang KL kernel over the slots against `indexer_loss_on_slots` in float64.

The kernel computes in float32 what the reference computes; the reference here runs in float64 on
the very float32 inputs. Tolerances and why: each row's log-partition and total mass are float32
sums of at most a few thousand positive terms (relative error ``~ sqrt(K) * 2^-24 ~ 3e-6`` typical),
every ``log q`` then carries an absolute error of about ``1e-6 * |s|``, each gradient entry
``q - p`` an absolute error of about ``1e-6 * q``; the loss is a sum of ``T`` row sums. Bounds:
relative L2 ``1e-5`` on the gradient and ``1e-5`` relative on the loss (10x margin).

Cases: ``K`` below, equal to and above the kernel's tile (2048) and not a multiple of it; rows
with no valid slot; rows whose mass is all 0; garbage (NaN, +-inf) in every invalid slot of
scores and mass; valid slots with zero mass; large score ranges; the reductions ``mean``/``sum``,
``coeff``, ``num_rows`` and ``head_sum_reduce``; the whole sparse stage of `DSAttention` with the
kernel against the reference ops.
"""

import pytest
import torch

from dsa_ref.indexer_loss import indexer_loss_on_slots
from gpu_helpers import rel_l2, requires_kernels

pytestmark = requires_kernels

REL = 1e-5


def _case(T: int, K: int, *, seed: int, garbage: bool = True, spread: float = 3.0):
    """``(scores, mass, valid)`` on CUDA: random validity, empty rows, all-zero-mass rows, zero-mass slots."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(T, K, generator=g) * spread  # [T, K]
    mass = torch.rand(T, K, generator=g) ** 4  # [T, K], many tiny
    mass[torch.rand(T, K, generator=g) < 0.1] = 0.0  # valid slots without mass
    valid = torch.rand(T, K, generator=g) < 0.8  # [T, K]
    valid[::7] = False  # rows with no valid slot
    mass[3::11] = 0.0  # rows whose mass is all 0
    if garbage:  # what sits in invalid slots must never reach the result
        junk = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30])
        pick = torch.randint(0, 4, (T, K), generator=g)
        scores = torch.where(valid, scores, junk[pick])
        mass = torch.where(valid, mass, junk[(pick + 1) % 4])
    return scores.cuda(), mass.cuda(), valid.cuda()


def _both(scores, mass, valid, **kw):
    """``(loss, d_scores)`` of the kernel and of the float64 reference, with an upstream gradient of 0.7."""
    from dsa_ref.kernels.indexer_loss_slots import indexer_loss_on_slots_tilelang

    out = []
    for fn, dtype in ((indexer_loss_on_slots_tilelang, torch.float32), (indexer_loss_on_slots, torch.float64)):
        s = scores.to(dtype).requires_grad_(True)
        loss = fn(s, mass.to(dtype), valid, **kw)
        (d,) = torch.autograd.grad(loss * 0.7, s)
        out.append((loss.detach(), d))
    return out


@pytest.mark.parametrize("T,K", [(64, 1), (96, 100), (128, 2048), (77, 2049), (40, 5000)])
def test_kernel_matches_reference(T, K):
    scores, mass, valid = _case(T, K, seed=K)
    (loss, d), (ref_loss, ref_d) = _both(scores, mass, valid, reduction="sum")
    assert torch.isfinite(loss) and torch.isfinite(d).all()
    assert abs(loss.double() - ref_loss) <= REL * max(1.0, abs(float(ref_loss)))
    assert rel_l2(d, ref_d) <= REL
    assert (d[~valid] == 0).all()  # nothing off the valid set
    assert (d[::7] == 0).all() and (d[3::11] == 0).all()  # empty rows, rows without mass


@pytest.mark.parametrize("reduction,coeff,num_rows", [("mean", 1.0, None), ("mean", 0.3, 1000), ("sum", 2.0, None)])
def test_reductions(reduction, coeff, num_rows):
    scores, mass, valid = _case(256, 300, seed=1)
    (loss, d), (ref_loss, ref_d) = _both(scores, mass, valid, reduction=reduction, coeff=coeff, num_rows=num_rows)
    assert abs(loss.double() - ref_loss) <= REL * max(1e-3, abs(float(ref_loss)))
    assert rel_l2(d, ref_d) <= REL


def test_head_sum_reduce_sees_zeroed_invalid_slots():
    scores, mass, valid = _case(64, 256, seed=2)
    seen = []

    def reduce(m):  # stands in for the TP all-reduce: doubles the mass, which normalising removes
        seen.append(m)
        return m * 2

    (loss, d), (ref_loss, ref_d) = _both(scores, mass, valid, reduction="sum", head_sum_reduce=reduce)
    assert (seen[0][~valid] == 0).all()
    assert abs(loss.double() - ref_loss) <= REL * abs(float(ref_loss)) and rel_l2(d, ref_d) <= REL


def test_large_score_range_and_one_slot_rows():
    scores, mass, valid = _case(128, 512, seed=3, spread=200.0)  # exp would overflow without the max
    valid[1::9] = False
    valid[1::9, 5] = True  # rows with one valid slot: q = 1, KL = 0 when it has mass
    scores[1::9, 5], mass[1::9, 5] = 7.0, 0.5  # (the slot held garbage while it was invalid)
    (loss, d), (ref_loss, ref_d) = _both(scores, mass, valid, reduction="sum")
    assert torch.isfinite(loss) and abs(loss.double() - ref_loss) <= REL * abs(float(ref_loss))
    assert rel_l2(d, ref_d) <= REL


def test_rejects_bad_input():
    from dsa_ref.kernels.indexer_loss_slots import indexer_loss_on_slots_tilelang

    s, m, v = _case(8, 16, seed=4)
    with pytest.raises(ValueError, match="share one"):
        indexer_loss_on_slots_tilelang(s, m[:, :8], v)
    with pytest.raises(TypeError, match="valid must be a bool"):
        indexer_loss_on_slots_tilelang(s, m, v.int())
    with pytest.raises(ValueError, match="reduction"):
        indexer_loss_on_slots_tilelang(s, m, v, reduction="max")
    with pytest.raises(ValueError, match="float64"):
        indexer_loss_on_slots_tilelang(s.double(), m.double(), v)


@pytest.mark.parametrize("T,K", [(96, 100), (128, 2048), (40, 5000)])
def test_slot_kl_without_autograd_is_the_loss_and_its_gradient(T, K):
    """`slot_kl_tilelang` returns the autograd path's loss and gradient (upstream gradient 1)."""
    from dsa_ref.kernels.indexer_loss_slots import slot_kl_tilelang

    scores, mass, valid = _case(T, K, seed=K + 1)
    kl_sum, d = slot_kl_tilelang(scores, mass, valid)
    s = scores.double().requires_grad_(True)
    ref = indexer_loss_on_slots(s, mass.double(), valid, reduction="sum")
    (ref_d,) = torch.autograd.grad(ref, s)
    assert kl_sum.dtype == torch.float32 and kl_sum.dim() == 0 and d.shape == (T, K)
    assert abs(kl_sum.double() - ref) <= REL * max(1.0, abs(float(ref)))
    assert rel_l2(d, ref_d) <= REL and (d[~valid] == 0).all()
    with pytest.raises(ValueError, match="contiguous torch.float32 CUDA"):
        slot_kl_tilelang(scores.double(), mass, valid)
    with pytest.raises(ValueError, match="not contiguous"):
        slot_kl_tilelang(scores.t().contiguous().t(), mass, valid)


def test_slot_ops_use_the_kernel_and_match_the_reference_ops():
    """The sparse stage's loss and indexer gradients with all kernels vs the reference's ops."""
    from dsa_ref import kernels
    from dsa_ref.kernels.indexer_loss_slots import indexer_loss_on_slots_tilelang
    from dsa_ref.slot_path import REFERENCE_OPS, attention_and_loss_on_slots
    from gpu_helpers import causal_packed_indices

    torch.manual_seed(5)
    cu = torch.tensor([0, 300, 700], dtype=torch.int32)
    from dsa_ref import key_windows

    starts, ends = key_windows(cu)
    T, H, H_I, D_I, K = 700, 16, 16, 64, 128
    q = (torch.randn(T, H, 576) * 0.5).bfloat16().cuda()
    kv = (torch.randn(T, 576) * 0.5).bfloat16().cuda()
    q_i = torch.randn(T, H_I, D_I).bfloat16().cuda().requires_grad_(True)
    k_i = torch.randn(T, D_I).bfloat16().cuda().requires_grad_(True)
    w_i = torch.randn(T, H_I).cuda().requires_grad_(True)
    topk = causal_packed_indices(cu, K, seed=5)
    ops = kernels.slot_ops(q, kv, q_i, k_i, w_i)
    assert ops.indexer_loss_on_slots is indexer_loss_on_slots_tilelang
    args = dict(stage="sparse", sm_scale=576 ** -0.5, d_v=512, relu=True, starts=starts.cuda(), ends=ends.cuda())
    results = []
    for which in (ops, REFERENCE_OPS):
        _, loss = attention_and_loss_on_slots(q, kv, q_i, k_i, w_i, topk, ops=which, **args)
        grads = torch.autograd.grad(loss, (q_i, k_i, w_i))
        results.append((loss.double(), [g.double() for g in grads]))
    (loss, grads), (ref_loss, ref_grads) = results
    # the other kernels (bf16 operands, fp32 sums) dominate the difference: the chapter-5 tolerances
    assert abs(loss - ref_loss) <= 2e-3 * abs(ref_loss)
    for g, r in zip(grads, ref_grads):
        assert rel_l2(g, r) <= 2e-2
