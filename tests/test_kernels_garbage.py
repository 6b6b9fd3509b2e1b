"""The TileLang kernels never read memory they do not need: garbage there changes nothing.

The same property as tests/test_garbage.py, on the GPU: NaN or Inf in kv / key rows that no slot
selects (row 0, the ``-1`` slots' placeholder, among them), in keys outside every window, and after
the last valid slot of a row (K not a multiple of the kernels' block, padded with ``-1``) leaves
outputs, LSE and scores bitwise as they are with those rows zeroed; the gradient of an unselected
row is exactly 0. Gradients that the kernels accumulate with atomic adds (``dkv``, ``dk``) are
compared with a tolerance of a few bf16 roundings on the selected rows, since the order of
atomic additions is not fixed; NaN anywhere fails.
"""

import pytest
import torch

from dsa_ref.kernels.shapes import DIM, DIM_V, INDEXER_DIM, SM_SCALE
from gpu_helpers import messy_indices, rel_l2, requires_kernels

pytestmark = [requires_kernels, pytest.mark.gpu]

JUNK = [float("nan"), float("inf")]


def _unselected(idx: torch.Tensor, S: int) -> torch.Tensor:
    read = torch.zeros(S, dtype=torch.bool, device=idx.device)
    read[idx[idx >= 0]] = True
    return ~read


def _pair(x: torch.Tensor, rows: torch.Tensor, junk: float):
    clean, dirty = x.clone(), x.clone()
    clean[rows] = 0
    dirty[rows] = junk
    return clean, dirty


def _indices(T, S, K, seed):
    idx = messy_indices(T, S, K, seed=seed)
    idx[idx == 0] = 1  # row 0, the placeholder of -1 slots, is never selected
    idx[:, -7:] = -1  # slots after the last valid one
    return idx


@pytest.mark.parametrize("junk", JUNK, ids=["nan", "inf"])
@pytest.mark.parametrize("schedule", ["simple", "warp_specialized", "staggered"])
def test_sparse_mla_forward_and_backward(junk, schedule):
    from dsa_ref.kernels.autograd import sparse_mla_tilelang

    T, S, H, K = 131, 4000, 64, 100  # K = 100: padded to the kernels' block with -1
    g = torch.Generator(device="cpu").manual_seed(7)
    q = torch.randn(T, H, DIM, generator=g).to("cuda", torch.bfloat16)
    kv = torch.randn(S, DIM, generator=g).to("cuda", torch.bfloat16)
    idx = _indices(T, S, K, seed=5)
    rows = _unselected(idx, S)
    assert rows[0] and rows.sum() > 100
    d_out = torch.randn(T, H, DIM_V, generator=g).to("cuda", torch.bfloat16)

    def run(kv_):
        q_, kv_ = q.clone().requires_grad_(True), kv_.clone().requires_grad_(True)
        out, lse = sparse_mla_tilelang(q_, kv_, idx, sm_scale=SM_SCALE, d_v=DIM_V, schedule=schedule)
        out.backward(d_out)
        return out.detach(), lse.detach(), q_.grad, kv_.grad

    clean, dirty = _pair(kv, rows, junk)
    out_a, lse_a, dq_a, dkv_a = run(clean)
    out_b, lse_b, dq_b, dkv_b = run(dirty)
    assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b)
    assert torch.isfinite(dq_b).all() and torch.isfinite(dkv_b).all()
    assert rel_l2(dq_b, dq_a) < 1e-2
    assert (dkv_b[rows] == 0).all(), "an unselected row got a gradient"
    assert rel_l2(dkv_b[~rows], dkv_a[~rows]) < 1e-2


@pytest.mark.parametrize("junk", JUNK, ids=["nan", "inf"])
def test_attention_head_sum_and_index_scores_at(junk):
    from dsa_ref.kernels.attention_target import attention_head_sum_tilelang
    from dsa_ref.kernels.autograd import sparse_mla_tilelang
    from dsa_ref.kernels.indexer_bwd import index_scores_at_tilelang

    T, S, H, K, H_I = 131, 4000, 64, 100, 64
    g = torch.Generator(device="cpu").manual_seed(9)
    q = torch.randn(T, H, DIM, generator=g).to("cuda", torch.bfloat16)
    kv = torch.randn(S, DIM, generator=g).to("cuda", torch.bfloat16)
    idx = _indices(T, S, K, seed=6)
    rows = _unselected(idx, S)
    clean, dirty = _pair(kv, rows, junk)
    _, lse = sparse_mla_tilelang(q, clean, idx, sm_scale=SM_SCALE, d_v=DIM_V)
    mass_a = attention_head_sum_tilelang(q, clean, idx, lse, sm_scale=SM_SCALE)
    mass_b = attention_head_sum_tilelang(q, dirty, idx, lse, sm_scale=SM_SCALE)
    assert torch.equal(mass_a, mass_b)

    q_i = torch.randn(T, H_I, INDEXER_DIM, generator=g).to("cuda", torch.bfloat16)
    k_i = torch.randn(S, INDEXER_DIM, generator=g).to("cuda", torch.bfloat16)
    w_i = torch.randn(T, H_I, generator=g).to("cuda", torch.float32)
    d_scores = torch.randn(T, K, generator=g).to("cuda", torch.float32)

    def run(k_):
        leaves = [x.clone().requires_grad_(True) for x in (q_i, k_, w_i)]
        s = index_scores_at_tilelang(*leaves, idx)
        torch.where(idx >= 0, s, torch.zeros_like(s)).mul(d_scores).sum().backward()
        return (s.detach(), *(x.grad for x in leaves))

    k_clean, k_dirty = _pair(k_i, rows, junk)
    s_a, dq_a, dk_a, dw_a = run(k_clean)
    s_b, dq_b, dk_b, dw_b = run(k_dirty)
    assert torch.equal(s_a, s_b)
    assert torch.isfinite(dq_b).all() and torch.isfinite(dk_b).all() and torch.isfinite(dw_b).all()
    assert rel_l2(dq_b, dq_a) < 1e-2 and rel_l2(dw_b, dw_a) < 1e-2
    assert (dk_b[rows] == 0).all(), "an unselected key got a gradient"
    assert rel_l2(dk_b[~rows], dk_a[~rows]) < 1e-2


@pytest.mark.parametrize("junk", JUNK, ids=["nan", "inf"])
def test_indexer_scores_ignore_keys_outside_the_window(junk):
    from dsa_ref import key_windows
    from dsa_ref.kernels.autograd import lightning_indexer_tilelang

    cu = torch.tensor([0, 300, 301, 700], device="cuda")
    T = 700
    starts, ends = key_windows(cu)
    g = torch.Generator(device="cpu").manual_seed(11)
    q = torch.randn(T, 64, INDEXER_DIM, generator=g).to("cuda", torch.bfloat16)
    k = torch.randn(T, INDEXER_DIM, generator=g).to("cuda", torch.bfloat16)
    w = torch.randn(T, 64, generator=g).to("cuda", torch.float32)
    dirty = k.clone()
    dirty[450] = junk  # a key of the third sequence
    a = lightning_indexer_tilelang(q, k, w, starts=starts, ends=ends)
    b = lightning_indexer_tilelang(q, dirty, w, starts=starts, ends=ends)
    outside = torch.ones(T, dtype=torch.bool, device="cuda")
    outside[450:] = False  # queries 450.. read key 450
    assert torch.equal(a[outside], b[outside])
