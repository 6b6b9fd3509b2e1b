"""The TileLang radix-select top-k against `dsa_ref.topk_indices`.

Two layers:

* on the CPU (always run): `_radix_select_reference`, a PyTorch emulation of the kernel's exact
  algorithm (byte histograms, the suffix-sum bin choice, the packed per-warp counts of the
  compaction), reordered by the wrapper's `_to_reference_order`, must equal `topk_indices` on
  inputs full of edge cases: exact ties, all-equal rows, rows entirely ``-inf``, ``-0.0`` next to
  ``+0.0``, ``+inf``, denormals, ``topk >= S``, causal windows, several block sizes. This proves
  the algorithm; the input checks of the wrapper are tested here too.
* on the GPU (``gpu`` marker, skipped without CUDA + tilelang): the kernel itself, exactly equal
  to the reference (``sorted=True``) and to the reference's set in ascending index order
  (``sorted=False``) on random inputs, with the same edge cases and one large shape.

The random seeds change from run to run (``DSA_REF_TEST_SEED`` pins them); failures print them.
"""

import os
import random

import pytest
import torch

from dsa_ref import key_windows, topk_indices, window_mask
from dsa_ref.kernels.topk import (
    _radix_keys,
    _radix_select_reference,
    _to_reference_order,
    topk_indices_tilelang,
    topk_supported,
)
from gpu_helpers import requires_kernels

SEED = int(os.environ.get("DSA_REF_TEST_SEED", random.SystemRandom().randrange(2**31)))
NEG_INF = float("-inf")


# ----------------------------------------------------------------------------- inputs


def _gen(offset: int) -> torch.Generator:
    return torch.Generator().manual_seed(SEED + offset)


def _edge_scores(T: int, S: int, *, offset: int = 0) -> torch.Tensor:
    """fp32 ``[T, S]`` random scores with a zoo of edge-case rows cycling over the row index.

    Rows by ``t % 9``: 0 random normal; 1 entirely ``-inf``; 2 all equal; 3 rounded to 5 values
    (heavy ties); 4 random ``-inf`` holes (about half); 5 ``-0.0`` and ``+0.0`` mixed with a few
    positives/negatives; 6 ``+inf`` entries and huge values; 7 negatives only, some denormal;
    8 a causal-like prefix window (the first ``t % S + 1`` keys).
    """
    g = _gen(offset)
    x = torch.randn(T, S, generator=g)
    for t in range(T):
        kind = t % 9
        if kind == 1:
            x[t] = NEG_INF
        elif kind == 2:
            x[t] = 0.25
        elif kind == 3:
            x[t] = torch.randint(-2, 3, (S,), generator=g).float()
        elif kind == 4:
            x[t][torch.rand(S, generator=g) < 0.5] = NEG_INF
        elif kind == 5:
            signs = torch.randint(0, 2, (S,), generator=g).bool()
            x[t] = torch.where(signs, torch.tensor(-0.0), torch.tensor(0.0))
            few = torch.rand(S, generator=g) < 0.1
            x[t][few] = torch.randn(int(few.sum()), generator=g)
        elif kind == 6:
            x[t][torch.rand(S, generator=g) < 0.1] = float("inf")
            x[t][torch.rand(S, generator=g) < 0.1] = 3.0e38
        elif kind == 7:
            x[t] = -x[t].abs()
            tiny = torch.rand(S, generator=g) < 0.3
            x[t][tiny] = -torch.randint(1, 4, (int(tiny.sum()),), generator=g).float() * 1e-45  # denormals
        elif kind == 8:
            x[t][t % S + 1:] = NEG_INF
    return x


def _causal_scores(num_q: int, num_kv: int, *, offset: int = 0, ties: bool = False) -> torch.Tensor:
    """fp32 ``[num_q, num_kv]``: the last ``num_q`` queries of a causal sequence; random scores."""
    g = _gen(offset)
    starts, ends = key_windows(torch.tensor([0, num_kv]), torch.arange(num_kv - num_q, num_kv))
    x = torch.rand(num_q, num_kv, generator=g)
    if ties:
        x = (x * 8).floor()  # 8 distinct values
    return x.masked_fill(~window_mask(starts, ends, num_kv), NEG_INF)


def _packed_scores(cu: list[int], *, offset: int = 0) -> torch.Tensor:
    """fp32 ``[T, T]`` random scores under causal packed-sequence windows (``-inf`` outside)."""
    starts, ends = key_windows(torch.tensor(cu))
    g = _gen(offset)
    x = torch.randn(cu[-1], cu[-1], generator=g)
    return x.masked_fill(~window_mask(starts, ends, cu[-1]), NEG_INF)


def _ascending_set(ref: torch.Tensor) -> torch.Tensor:
    """The reference's selected keys of each row in ascending index order, ``-1`` at the end."""
    big = torch.iinfo(torch.int64).max
    asc = torch.where(ref < 0, torch.full_like(ref, big), ref).sort(dim=1).values
    return torch.where(asc == big, torch.full_like(asc, -1), asc)


# ----------------------------------------------------------------------------- CPU: the algorithm


def _check_algorithm(scores: torch.Tensor, topk: int, threads: int = 256) -> None:
    ref = topk_indices(scores, topk)
    got = _radix_select_reference(scores, topk, threads=threads)  # asserts its own invariants
    msg = f"seed {SEED}, shape {tuple(scores.shape)}, topk {topk}, threads {threads}"
    assert got.dtype == torch.int64 and got.shape == ref.shape, msg
    assert torch.equal(got, _ascending_set(ref)), msg
    assert torch.equal(_to_reference_order(scores, got), ref), msg


@pytest.mark.parametrize("T,S,topk", [
    (9, 1, 1), (9, 1, 4), (18, 7, 3), (18, 20, 8), (18, 31, 31), (18, 33, 64),
    (27, 256, 16), (27, 511, 511), (27, 512, 100), (27, 513, 512), (18, 1000, 2048),
    (18, 2047, 2048), (18, 2048, 2048), (18, 2049, 2048), (9, 5000, 1000),
])
def test_algorithm_edge_rows(T, S, topk):
    _check_algorithm(_edge_scores(T, S, offset=S * 31 + topk), topk)


@pytest.mark.parametrize("threads", [512, 1024])
def test_algorithm_other_block_sizes(threads):
    # several loop steps (VEC sub-chunks of `threads` keys), more/fewer warps per sub-chunk
    _check_algorithm(_edge_scores(18, 3 * 4 * threads + 5, offset=threads), 300, threads)


@pytest.mark.parametrize("topk", [1, 5, 64, 700])
def test_algorithm_packed_and_causal_windows(topk):
    _check_algorithm(_packed_scores([0, 1, 100, 100, 333, 640], offset=topk), topk)
    _check_algorithm(_causal_scores(300, 1200, offset=topk), topk)
    _check_algorithm(_causal_scores(300, 1200, offset=topk + 1, ties=True), topk)


def test_algorithm_signed_zeros_and_infinities():
    inf = float("inf")
    # one tie group of zeros (both signs), then +inf ranks first and -inf is never taken
    row = torch.tensor([[-0.0, 1.0, 0.0, -inf, inf, -0.0, 0.0, -1.0]])
    for topk in range(1, 10):
        _check_algorithm(row, topk)
    assert _to_reference_order(row, _radix_select_reference(row, 5)).tolist() == [[4, 1, 0, 2, 5]]


def test_keys_preserve_float_order():
    inf = float("inf")
    values = torch.tensor([-inf, -3.0e38, -1.0, -1e-38, -1e-45, -0.0, 0.0, 1e-45, 1e-38, 1.0, 3.0e38, inf])
    keys = _radix_keys(values[None])[0]
    assert keys[5] == keys[6], "-0.0 and +0.0 get one key"
    assert bool((keys[1:] >= keys[:-1]).all()) and int((keys[1:] > keys[:-1]).sum()) == len(values) - 2
    assert int(keys[0]) == 0x007FFFFF, "the key of -inf"
    assert int(keys.min()) >= 0 and int(keys.max()) < 2**32


# ----------------------------------------------------------------------------- CPU: input checks


def test_wrapper_input_errors():
    with pytest.raises(TypeError, match="scores must be a torch.Tensor"):
        topk_indices_tilelang([[1.0]], 1)
    with pytest.raises(TypeError, match="topk must be an int"):
        topk_indices_tilelang(torch.zeros(2, 3), 1.5)
    with pytest.raises(TypeError, match="topk must be an int"):
        topk_indices_tilelang(torch.zeros(2, 3), True)
    with pytest.raises(ValueError, match="topk must be >= 1"):
        topk_indices_tilelang(torch.zeros(2, 3), 0)
    with pytest.raises(ValueError, match="must be on CUDA"):
        topk_indices_tilelang(torch.zeros(2, 3), 1)
    assert "CUDA" in topk_supported(torch.zeros(2, 3), 1)
    assert "topk" in topk_supported(torch.zeros(2, 3), 0)
    assert "torch.Tensor" in topk_supported(None, 1)


# ----------------------------------------------------------------------------- GPU: the kernel


def _check_kernel(scores: torch.Tensor, topk: int) -> None:
    scores = scores.cuda()
    ref = topk_indices(scores, topk)
    msg = f"seed {SEED}, shape {tuple(scores.shape)}, topk {topk}"
    got = topk_indices_tilelang(scores, topk)
    assert got.dtype == torch.int64 and got.shape == ref.shape and got.is_cuda, msg
    assert torch.equal(got, ref), msg
    unsorted = topk_indices_tilelang(scores, topk, sorted=False)
    assert torch.equal(unsorted, _ascending_set(ref)), msg  # the same set, ascending, -1 at the end


@pytest.mark.parametrize("T,S,topk", [
    (1, 1, 1), (1, 7, 3), (1, 700, 2048), (9, 20, 8), (18, 31, 32), (37, 513, 128), (37, 2048, 2048),
    (64, 2049, 2048), (301, 3000, 128), (100, 5000, 2048), (27, 9000, 7000),
])
@pytest.mark.parametrize("kind", ["random", "edge"])
@pytest.mark.gpu
@requires_kernels
def test_kernel_matches_reference(T, S, topk, kind):
    offset = T * 7 + S * 31 + topk
    if kind == "random":
        scores = torch.randn(T, S, generator=_gen(offset))
    else:
        scores = _edge_scores(T, S, offset=offset)
    _check_kernel(scores, topk)


@pytest.mark.parametrize("topk", [1, 64, 2048])
@pytest.mark.gpu
@requires_kernels
def test_kernel_windows(topk):
    _check_kernel(_packed_scores([0, 1, 100, 100, 333, 640, 3000], offset=topk), topk)
    _check_kernel(_causal_scores(1000, 3000, offset=topk), topk)
    _check_kernel(_causal_scores(1000, 3000, offset=topk + 1, ties=True), topk)


@pytest.mark.gpu
@requires_kernels
def test_kernel_special_rows():
    inf = float("inf")
    row = torch.tensor([[-0.0, 1.0, 0.0, -inf, inf, -0.0, 0.0, -1.0]])
    for topk in range(1, 10):
        _check_kernel(row, topk)
    # the canonical rule, not just agreement: computed on the CPU reference as well
    assert topk_indices_tilelang(row.cuda(), 5).tolist() == [[4, 1, 0, 2, 5]]
    S = 4000
    rows = torch.stack([
        torch.full((S,), NEG_INF),  # nothing selectable
        torch.full((S,), -0.0),  # all equal (signed zeros)
        torch.full((S,), 7.0),  # all equal
        torch.where(torch.arange(S) % 3 == 0, torch.tensor(inf), torch.tensor(NEG_INF)),
    ])
    for topk in (1, 100, S, S + 5):
        _check_kernel(rows, topk)


@pytest.mark.gpu
@requires_kernels
def test_kernel_non_contiguous_and_empty():
    scores = torch.randn(700, 300, generator=_gen(5)).cuda().t()  # [300, 700], strided
    assert torch.equal(topk_indices_tilelang(scores, 50), topk_indices(scores, 50))
    assert topk_indices_tilelang(torch.zeros(0, 5, device="cuda"), 3).shape == (0, 3)
    assert torch.equal(topk_indices_tilelang(torch.zeros(4, 0, device="cuda"), 3),
                       torch.full((4, 3), -1, device="cuda"))


@pytest.mark.gpu
@requires_kernels
def test_kernel_rejects_nan_and_bad_inputs():
    scores = torch.randn(4, 100, device="cuda")
    scores[2, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        topk_indices_tilelang(scores, 8)
    with pytest.raises(TypeError, match="float32"):
        topk_indices_tilelang(torch.zeros(2, 3, device="cuda", dtype=torch.float64), 1)
    with pytest.raises(ValueError, match=r"\[T, S\]"):
        topk_indices_tilelang(torch.zeros(2, 3, 4, device="cuda"), 1)
    assert topk_supported(torch.zeros(2, 3, device="cuda"), 4) is None


@pytest.mark.gpu
@requires_kernels
def test_kernel_large():
    # the benchmark's shape: 4096 queries at the end of a causal sequence of 8192 keys
    _check_kernel(_causal_scores(4096, 8192, offset=11), 2048)
    # heavy ties on long rows: 8 distinct values, so thousands of keys equal the threshold
    _check_kernel(_causal_scores(1024, 16384, offset=12, ties=True), 2048)
