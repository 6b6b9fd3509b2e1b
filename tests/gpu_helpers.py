"""Shared pieces of the GPU kernel tests: the skip marker, input builders and error metrics."""

import pytest
import torch

from dsa_ref.dispatch import kernels_available

_ok, _why = kernels_available()
requires_kernels = pytest.mark.skipif(not _ok, reason=f"TileLang kernels unavailable: {_why}")


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||a - e|| / ||e||`` over finite entries, in float64."""
    a, e = actual.double(), expected.double()
    return float((a - e).norm() / e.norm().clamp_min(1e-30))


def max_abs(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).abs().max())


def causal_packed_indices(cu_seqlens: torch.Tensor, topk: int, *, query_index=None, seed: int = 0,
                          device="cuda") -> torch.Tensor:
    """Top-k indices of random scores under causal packed windows (``-1`` where a window is short)."""
    from dsa_ref import key_windows, topk_indices, window_mask

    g = torch.Generator(device="cpu").manual_seed(seed)
    starts, ends = key_windows(cu_seqlens, query_index)
    T, S = starts.numel(), int(cu_seqlens[-1])
    scores = torch.randn(T, S, generator=g, dtype=torch.float64)
    scores = scores.masked_fill(~window_mask(starts, ends, S), float("-inf"))
    return topk_indices(scores, topk).to(device)


def messy_indices(T: int, S: int, K: int, *, seed: int = 0, device="cuda") -> torch.Tensor:
    """Random indices with -1 slots, duplicates within rows and a few rows with no valid slot."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    idx = torch.randint(0, S, (T, K), generator=g)
    idx[torch.rand(T, K, generator=g) < 0.2] = -1  # unused slots anywhere in the row
    dup_rows = torch.arange(0, T, 5)
    idx[dup_rows, 1] = idx[dup_rows, 0]  # duplicates (valid or -1 twice)
    idx[::17] = -1  # empty rows
    return idx.to(device)
