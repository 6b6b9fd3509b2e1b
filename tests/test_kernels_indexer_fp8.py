"""The fp8 TileLang indexer against its oracle, the fp8 simulation (skipped without CUDA + tilelang).

The oracle is `dsa_ref.fp8`'s simulation on the *same* quantised tensors: ``lightning_indexer`` in
float64 of the dequantised ``y * s`` (`fp8_dequant` of what the wrapper's `act_quant_block128`
returned). e4m3 x e4m3 products are exact, and the power-of-two scales fold exactly, so the kernel
differs from the oracle only in its accumulation: the order, and the Hopper fp8 tensor cores'
reduced internal precision (DeepSeek-V3 reports about 14 bits). The bounds, per entry and overall:

* ``|kernel - oracle| <= 2^-10 * M`` with ``M = sum_h |w q_scale| sum_d |y_q y_k| k_scale``, the
  magnitude the accumulation rounds;
* relative L2 over the finite entries below ``5e-3``, and below a quarter of the kernel's
  distance to the *unquantised* scores (about 3.6e-2 on these inputs): the kernel computes the
  fp8 scores, not merely something close to the bf16 ones;
* the ``-inf`` pattern (outside each window) identical.

Both bounds hold with a 5-10x margin even for an accumulator that keeps only 10 bits below the
largest addend of each 32-product step (truncating, not rounding), emulated on the CPU: worst
entry 1.8e-4 of its magnitude, relative L2 1.7e-3; with 13 bits, 1.2e-5 and 1.2e-4
(at 64 queries x 256 keys x 64 heads of Gaussian inputs).

The top-k overlap with the bf16 kernel's selection is printed and held only loosely (fp8 moves
the keys near each row's k-th score; ``benchmarks/bench_indexer_fp8.py`` reports it at scale).
"""

import pytest
import torch

from dsa_ref import cp_shard_index, key_windows, lightning_indexer
from dsa_ref.fp8 import fp8_dequant, fp8_roundtrip
from dsa_ref.kernels.shapes import INDEXER_FP8_SCHEDULES, PERSISTENT_FP8, PERSISTENT_FP8_PINGPONG
from gpu_helpers import rel_l2, requires_kernels

pytestmark = [requires_kernels, pytest.mark.gpu]

ENTRY = 2**-10
REL = 5e-3


def _inputs(T, S, H, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(T, H, 128, generator=g).to("cuda", torch.bfloat16)
    k = torch.randn(S, 128, generator=g).to("cuda", torch.bfloat16)
    w = torch.randn(T, H, generator=g).to("cuda") * H**-0.5 * 128**-0.5
    return q, k, w


def _scores(q, k, w, starts, ends, schedule, relu):
    """The kernel's scores and the quantised operands they came from."""
    from dsa_ref.kernels.indexer_fwd_fp8 import (
        indexer_fp8_kernel, lightning_indexer_fp8_tilelang, quantize_indexer_operands)

    q8, qs, k8, ks = quantize_indexer_operands(q, k)
    if schedule is None:  # the public wrapper: quantises, then the default kernel
        got = lightning_indexer_fp8_tilelang(q, k, w, starts=starts, ends=ends, relu=relu)
    else:  # the kernel itself in one of its schedules; NaN marks any entry it fails to write
        T, S = q.shape[0], k.shape[0]
        st = torch.zeros(T, dtype=torch.int32, device="cuda") if starts is None else starts.int()
        en = torch.full((T,), S, dtype=torch.int32, device="cuda") if ends is None else ends.int()
        got = torch.full((T, S), float("nan"), device="cuda")
        indexer_fp8_kernel(q.shape[1], q.shape[2], relu, **schedule)(q8, qs, k8, ks, w.float(), st, en, got)
        assert not torch.isnan(got).any(), "every entry is written"
    return got, (q8, qs, k8, ks)


def fp8_scores(q, k, w, starts, ends, schedule):
    """The scores through the public path with a schedule's knobs (`fp8_indexer_scores_tilelang`)."""
    from dsa_ref.kernels.indexer_fwd_fp8 import fp8_indexer_scores_tilelang, quantize_indexer_operands

    q8, qs, k8, ks = quantize_indexer_operands(q, k)
    return fp8_indexer_scores_tilelang(q8, qs, k8, ks, w, starts=starts, ends=ends, **schedule)


def _check(q, k, w, starts, ends, schedule=None, relu=True):
    got, (q8, qs, k8, ks) = _scores(q, k, w, starts, ends, schedule, relu)
    qf, kf = fp8_dequant(q8, qs[..., None]), fp8_dequant(k8, ks[:, None])  # float32, exact
    assert q8.dtype == k8.dtype == torch.float8_e4m3fn and qs.shape == q.shape[:2] and ks.shape == k.shape[:1]
    assert torch.equal(qf, fp8_roundtrip(q)) and torch.equal(kf, fp8_roundtrip(k)), "DeepSeek's act_quant"
    oracle = lightning_indexer(qf.double(), kf.double(), w.double(), starts=starts, ends=ends, relu=relu)
    magnitude = lightning_indexer(qf.double().abs(), kf.double().abs(), w.double().abs(), relu=False)
    assert got.dtype == torch.float32 and got.shape == oracle.shape
    assert torch.equal(torch.isneginf(got), torch.isneginf(oracle)), "-inf exactly outside the windows"
    finite = torch.isfinite(oracle)
    err = (got.double() - oracle)[finite].abs()
    worst = float((err / magnitude[finite].clamp_min(1e-30)).max()) if err.numel() else 0.0
    rel = rel_l2(got[finite], oracle[finite])
    unquantised = lightning_indexer(q.double(), k.double(), w.double(), starts=starts, ends=ends, relu=relu)
    rel_bf16 = rel_l2(got[finite], unquantised[finite])
    report = f"worst entry {worst:.3g} of its magnitude, rel L2 {rel:.3g} (to the bf16 scores {rel_bf16:.3g})"
    assert worst <= ENTRY, report
    assert rel < REL and rel < 0.25 * rel_bf16, report
    return got


@pytest.mark.parametrize("H", [16, 32, 64])
def test_fp8_indexer_no_windows(H):
    q, k, w = _inputs(301, 700, H, seed=H)  # neither T nor S a multiple of the tiles
    _check(q, k, w, None, None)


def test_fp8_indexer_without_relu():
    q, k, w = _inputs(130, 200, 64, seed=5)
    _check(q, k, w, None, None, schedule={}, relu=False)


def test_fp8_indexer_packed_and_cp_windows():
    cu = torch.tensor([0, 1, 100, 100, 333, 640])
    q, k, w = _inputs(640, 640, 64, seed=1)
    starts, ends = key_windows(cu)
    _check(q, k, w, starts.cuda(), ends.cuda())
    qi = cp_shard_index(torch.tensor([0, 256, 640]), 4, 2)  # a CP rank: its queries, all keys
    starts, ends = key_windows(torch.tensor([0, 256, 640]), qi)
    _check(q[: qi.numel()].contiguous(), k, w[: qi.numel()].contiguous(), starts.cuda(), ends.cuda())


@pytest.mark.parametrize("schedule", [{}] + INDEXER_FP8_SCHEDULES, ids=str)
def test_fp8_indexer_schedules(schedule):
    cu = torch.tensor([0, 1, 100, 100, 333, 700])
    q, k, w = _inputs(700, 700, 64, seed=3)
    starts, ends = key_windows(cu)
    _check(q, k, w, starts.cuda(), ends.cuda(), schedule)
    _check(q[:301].contiguous(), k, w[:301].contiguous(), None, None, schedule)


@pytest.mark.parametrize("schedule", [dict(consumers=2), PERSISTENT_FP8, PERSISTENT_FP8_PINGPONG],
                         ids=["ws", "persistent", "persistent-pingpong"])
@pytest.mark.parametrize("H", [16, 32])
def test_fp8_indexer_warp_specialised_schedule_other_heads(H, schedule):
    cu = torch.tensor([0, 1, 100, 100, 333, 700])
    q, k, w = _inputs(700, 700, H, seed=H + 7)
    starts, ends = key_windows(cu)
    _check(q, k, w, starts.cuda(), ends.cuda(), schedule)
    _check(q[:3].contiguous(), k[:5].contiguous(), w[:3].contiguous(), None, None, schedule)


@pytest.mark.parametrize("schedule", [PERSISTENT_FP8, PERSISTENT_FP8_PINGPONG],
                         ids=["persistent", "persistent-pingpong"])
def test_fp8_indexer_persistent_more_pairs_than_blocks(schedule):
    """389 query pairs on 132 resident blocks (each walks three), an odd T, and S not a multiple of
    a stage (192 or 128 keys), with packed windows: every pair's scores, wherever it runs."""
    cu = torch.tensor([0, 37, 38, 501, 777])
    q, k, w = _inputs(777, 777, 64, seed=21)
    starts, ends = key_windows(cu)
    _check(q, k, w, starts.cuda(), ends.cuda(), schedule)
    _check(q, k, w, None, None, schedule, relu=False)


@pytest.mark.parametrize("S", [1, 127, 129, 131, 193, 385])
@pytest.mark.parametrize("schedule", [PERSISTENT_FP8, PERSISTENT_FP8_PINGPONG],
                         ids=["persistent", "persistent-pingpong"])
def test_fp8_indexer_persistent_partial_last_tile(S, schedule):
    """S short of a stage (192 or 128 keys) by a few keys, or one key past one: the last tile's keys
    and key scales come in by bulk-tensor copy, zeros past S, and every key's score is right."""
    q, k, w = _inputs(67, S, 64, seed=S)
    _check(q, k, w, None, None, schedule)


@pytest.mark.parametrize("schedule", [PERSISTENT_FP8, PERSISTENT_FP8_PINGPONG],
                         ids=["persistent", "persistent-pingpong"])
def test_fp8_indexer_persistent_arbitrary_windows(schedule):
    """Windows that start inside the keys, end before the last one, or are empty (for one query of a
    pair, or both: a pair with no key tile at all): the ``-inf`` before and after a pair's tiles."""
    T_, S = 258, 643
    g = torch.Generator(device="cpu").manual_seed(41)
    starts = torch.randint(0, S, (T_,), generator=g)
    ends = torch.minimum(starts + torch.randint(0, S, (T_,), generator=g), torch.tensor(S))
    starts[10:12], ends[10:12] = 384, 384  # queries 10 and 11, one pair: empty windows at a tile boundary
    starts[12:14], ends[12:14] = 0, 0  # (both stage sizes, 128 and 192 keys): the pair has no key tile
    ends[20] = starts[20]  # one query of a pair
    starts[30:32], ends[30:32] = S, S  # an empty pair past the last key
    starts[40:42], ends[40:42] = 200, 201  # one key, inside a tile
    q, k, w = _inputs(T_, S, 64, seed=41)
    _check(q, k, w, starts.int().cuda(), ends.int().cuda(), schedule)


@pytest.mark.parametrize("schedule", [{}, PERSISTENT_FP8], ids=["default", "persistent"])
def test_fp8_indexer_misaligned_key_scales(schedule):
    """Key scales in a view 4 bytes past a 16-byte boundary: the persistent kernel copies the scales
    in bulk, which needs a 16-byte aligned address, so the wrapper copies them first; the scores are
    those of the aligned scales, bit for bit."""
    from dsa_ref.kernels.indexer_fwd_fp8 import fp8_indexer_scores_tilelang, quantize_indexer_operands

    cu = torch.tensor([0, 37, 38, 501, 777])
    starts, ends = (t.cuda() for t in key_windows(cu))
    q, k, w = _inputs(777, 777, 64, seed=43)
    q8, qs, k8, ks = quantize_indexer_operands(q, k)
    storage = torch.empty(ks.numel() + 1, dtype=torch.float32, device="cuda")
    storage[1:] = ks
    shifted = storage[1:]
    assert shifted.data_ptr() % 16 and torch.equal(shifted, ks)
    aligned = fp8_indexer_scores_tilelang(q8, qs, k8, ks, w, starts=starts, ends=ends, **schedule)
    got = fp8_indexer_scores_tilelang(q8, qs, k8, shifted, w, starts=starts, ends=ends, **schedule)
    assert torch.equal(got, aligned)
    got = fp8_indexer_scores_tilelang(q8, qs, k8, shifted[:, None], w, starts=starts, ends=ends, **schedule)  # [S, 1]
    assert torch.equal(got, aligned)


@pytest.mark.parametrize("junk", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_fp8_indexer_ignores_keys_outside_the_window(junk):
    """A NaN or Inf key quantises to NaN values and a NaN or Inf scale: only queries that see it may change."""
    cu = torch.tensor([0, 300, 301, 700], device="cuda")
    starts, ends = key_windows(cu)
    q, k, w = _inputs(700, 700, 64, seed=11)
    dirty = k.clone()
    dirty[450] = junk  # a key of the third sequence
    outside = torch.ones(700, dtype=torch.bool, device="cuda")
    outside[450:] = False  # queries 450.. read key 450
    for schedule in (dict(consumers=0), PERSISTENT_FP8, PERSISTENT_FP8_PINGPONG):  # one warpgroup, persistent
        a = fp8_scores(q, k, w, starts, ends, schedule)
        b = fp8_scores(q, dirty, w, starts, ends, schedule)
        assert torch.equal(a[outside], b[outside]), schedule
        assert not torch.isnan(b[outside]).any(), schedule


def test_fp8_indexer_takes_prequantised_operands_and_declines_others():
    from dsa_ref.kernels.indexer_fwd_fp8 import (
        fp8_indexer_scores_tilelang, indexer_fp8_supported, lightning_indexer_fp8_tilelang, quantize_indexer_operands)

    q, k, w = _inputs(70, 90, 32, seed=7)
    q8, qs, k8, ks = quantize_indexer_operands(q, k)
    a = fp8_indexer_scores_tilelang(q8, qs[..., None], k8, ks[:, None], w)  # [T, H, 1] / [S, 1] scales accepted
    assert torch.equal(a, lightning_indexer_fp8_tilelang(q, k, w))
    assert not a.requires_grad
    assert indexer_fp8_supported(q.float(), k.float(), w) is None  # any float dtype is quantised
    assert "D_I = 128" in indexer_fp8_supported(q[..., :64], k[:, :64], w)
    assert "quantised" in indexer_fp8_supported(q8, k8, w)
    assert "CUDA" in indexer_fp8_supported(q.cpu(), k.cpu(), w.cpu())
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_indexer_scores_tilelang(q, qs, k8, ks, w)
    empty = lightning_indexer_fp8_tilelang(q[:0], k, w[:0])
    assert empty.shape == (0, 90)


def test_fp8_topk_overlap_with_bf16(capsys):
    """Reported, held loosely: the share of the bf16 kernel's top-k that the fp8 kernel also selects."""
    from dsa_ref.kernels.autograd import lightning_indexer_tilelang
    from dsa_ref.kernels.indexer_fwd_fp8 import lightning_indexer_fp8_tilelang
    from dsa_ref.kernels.topk import topk_indices_tilelang

    T, topk = 2048, 256
    cu = torch.tensor([0, T])
    starts, ends = (t.cuda() for t in key_windows(cu))
    q, k, w = _inputs(T, T, 64, seed=13)
    bf16 = topk_indices_tilelang(lightning_indexer_tilelang(q, k, w, starts=starts, ends=ends), topk)
    fp8 = topk_indices_tilelang(lightning_indexer_fp8_tilelang(q, k, w, starts=starts, ends=ends), topk)
    overlap = topk_overlap(fp8, bf16, T)
    with capsys.disabled():
        print(f"\nfp8 vs bf16 top-{topk} overlap over {T} causal queries: {overlap:.4f}")
    assert overlap > 0.8, overlap


def topk_overlap(a: torch.Tensor, b: torch.Tensor, num_keys: int) -> float:
    """``|a ∩ b| / |b|`` over all rows (``-1`` slots ignored): the share of ``b``'s selection ``a`` keeps."""
    def mask(idx):
        m = torch.zeros(idx.shape[0], num_keys + 1, dtype=torch.bool, device=idx.device)
        m.scatter_(1, torch.where(idx >= 0, idx, num_keys), True)
        return m[:, :num_keys]

    ma, mb = mask(a), mask(b)
    return float((ma & mb).sum()) / max(float(mb.sum()), 1.0)


def test_dsattention_fp8_switch_on_the_kernel(monkeypatch):
    """``IndexerConfig.fp8`` with ``backend="tilelang"`` selects with the fp8 kernel, close to the
    simulation's selection (``backend="reference"``); the rest of the layer is the bf16 kernels'."""
    from dataclasses import replace

    from dsa_ref import DSAttention
    from dsa_ref.kernels import indexer_fwd_fp8
    from test_kernels_dsa import gpu_small

    cfg = gpu_small()
    cfg = replace(cfg, indexer=replace(cfg.indexer, fp8=True))
    torch.manual_seed(0)
    ref = DSAttention(cfg, stage="sparse", backend="reference", device="cuda", dtype=torch.bfloat16)
    fast = DSAttention(cfg, stage="sparse", backend="tilelang", device="cuda", dtype=torch.bfloat16)
    fast.load_state_dict(ref.state_dict())
    calls = []
    real = indexer_fwd_fp8.lightning_indexer_fp8_tilelang
    monkeypatch.setattr(indexer_fwd_fp8, "lightning_indexer_fp8_tilelang",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    cu = torch.tensor([0, 300, 1024], device="cuda")
    x = torch.randn(1024, cfg.mla.dim, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        r_ref, r_fast = ref(x, cu), fast(x, cu)
    assert calls, "the fp8 kernel selected"
    overlap = topk_overlap(r_fast.topk_indices, r_ref.topk_indices, 1024)
    assert overlap > 0.97, overlap  # the same fp8 scores up to accumulation: only near-ties move
    assert rel_l2(r_fast.output, r_ref.output) < 5e-2
