"""TileLang lightning indexer scores against the readable reference (skipped without CUDA + tilelang).

The reference runs in float64 on the same bf16 inputs. Products of bf16 values are exact in fp32;
the kernel's fp32 sums over 128 dims and 64 heads carry relative errors of about 1e-6 of the
magnitudes summed, so scores must agree to ``MAX_SCORE = 1e-4`` relative to the largest |score|
(a generous 100x margin), and the ``-inf`` pattern (outside the windows) must match exactly.
"""

import pytest
import torch

from dsa_ref import cp_shard_index, key_windows, lightning_indexer
from dsa_ref.kernels.shapes import INDEXER_SCHEDULES, PERSISTENT_BF16
from gpu_helpers import max_abs, requires_kernels

pytestmark = [requires_kernels, pytest.mark.gpu]

MAX_SCORE = 1e-4


def _inputs(T, S, H, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(T, H, 128, generator=g).to("cuda", torch.bfloat16)
    k = torch.randn(S, 128, generator=g).to("cuda", torch.bfloat16)
    w = torch.randn(T, H, generator=g).to("cuda") * H**-0.5 * 128**-0.5
    return q, k, w


def _check(q, k, w, starts, ends, schedule=None):
    from dsa_ref.kernels.autograd import lightning_indexer_tilelang
    from dsa_ref.kernels.indexer_fwd import indexer_kernel

    if schedule is None:
        got = lightning_indexer_tilelang(q, k, w, starts=starts, ends=ends)
    else:  # the kernel itself, in one of its schedules; NaN marks any entry it fails to write
        T, S = q.shape[0], k.shape[0]
        st = torch.zeros(T, dtype=torch.int32, device="cuda") if starts is None else starts.int()
        en = torch.full((T,), S, dtype=torch.int32, device="cuda") if ends is None else ends.int()
        got = torch.full((T, S), float("nan"), device="cuda")
        indexer_kernel(q.shape[1], q.shape[2], True, **schedule)(q, k, w.float(), st, en, got)
        assert not torch.isnan(got).any(), "every entry is written"
    ref = lightning_indexer(q.double(), k.double(), w.double(), starts=starts, ends=ends)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref)), "-inf exactly outside the windows"
    finite = torch.isfinite(ref)
    assert max_abs(got[finite], ref[finite]) < MAX_SCORE * float(ref[finite].abs().max())


@pytest.mark.parametrize("H", [16, 32, 64])
def test_indexer_no_windows(H):
    q, k, w = _inputs(301, 700, H, seed=H)  # neither T nor S a multiple of the tiles
    _check(q, k, w, None, None)


def test_indexer_packed_and_cp_windows():
    cu = torch.tensor([0, 1, 100, 100, 333, 640])
    q, k, w = _inputs(640, 640, 64, seed=1)
    starts, ends = key_windows(cu)
    _check(q, k, w, starts.cuda(), ends.cuda())
    qi = cp_shard_index(torch.tensor([0, 256, 640]), 4, 2)  # a CP rank: its queries, all keys
    starts, ends = key_windows(torch.tensor([0, 256, 640]), qi)
    _check(q[: qi.numel()].contiguous(), k, w[: qi.numel()].contiguous(), starts.cuda(), ends.cuda())


# the kernel's schedules (benchmarks/tune_kernels.py), against the reference; packed windows
@pytest.mark.parametrize("schedule", INDEXER_SCHEDULES, ids=str)
def test_indexer_schedules(schedule):
    cu = torch.tensor([0, 1, 100, 100, 333, 700])
    q, k, w = _inputs(700, 700, 64, seed=3)
    starts, ends = key_windows(cu)
    _check(q, k, w, starts.cuda(), ends.cuda(), schedule)
    _check(q[:301].contiguous(), k, w[:301].contiguous(), None, None, schedule)


@pytest.mark.parametrize("schedule", [dict(consumers=2), PERSISTENT_BF16], ids=["ws", "persistent"])
@pytest.mark.parametrize("H", [16, 32])
def test_indexer_warp_specialised_schedule_other_heads(H, schedule):
    cu = torch.tensor([0, 1, 100, 100, 333, 700])
    q, k, w = _inputs(700, 700, H, seed=H + 7)
    starts, ends = key_windows(cu)
    _check(q, k, w, starts.cuda(), ends.cuda(), schedule)
    _check(q[:3].contiguous(), k[:5].contiguous(), w[:3].contiguous(), None, None, schedule)


def test_indexer_persistent_more_pairs_than_blocks():
    """389 query pairs on 132 resident blocks (each walks three), an odd T, S not a multiple of the
    192-key stage, packed windows."""
    cu = torch.tensor([0, 37, 38, 501, 777])
    q, k, w = _inputs(777, 777, 64, seed=21)
    starts, ends = key_windows(cu)
    _check(q, k, w, starts.cuda(), ends.cuda(), PERSISTENT_BF16)


def test_indexer_backward_equals_reference():
    from dsa_ref.kernels.autograd import lightning_indexer_tilelang

    cu = torch.tensor([0, 50, 200])
    starts, ends = (t.cuda() for t in key_windows(cu))
    q, k, w = _inputs(200, 200, 64, seed=3)
    grads = []
    for fn in (lightning_indexer_tilelang, lightning_indexer):
        qq, kk, ww = (t.clone().requires_grad_(True) for t in (q, k, w))
        s = fn(qq, kk, ww, starts=starts, ends=ends)
        upstream = torch.linspace(-1, 1, s.numel(), device=s.device).view_as(s)
        (torch.where(torch.isfinite(s), s, 0) * upstream).sum().backward()
        grads.append((qq.grad, kk.grad, ww.grad))
    for a, b in zip(*grads):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
