"""Rotary position embedding (RoPE) with YaRN, in the two layouts DSA uses.

RoPE rotates pairs of channels of a query or key by an angle proportional to the token's position,
so the dot product of a rotated query at position ``m`` and a rotated key at position ``n`` depends
on ``m - n`` only. Pair ``i`` rotates with frequency ``inv_freq[i] = theta ** (-2i / d)``.

Which channels form a pair is a layout choice, and DSA uses both:

* **interleaved** (MLA, DeepSeek's ``view_as_complex``): pairs ``(2i, 2i + 1)``;
* **half-split** (the lightning indexer of DeepSeek-V3.2, "NeoX style"): pairs ``(i, i + d/2)``.

Mixing them up gives finite, plausible, wrong numbers, so the layout is always an explicit flag.

YaRN (used by DeepSeek-V3.2 to reach 128K from 4K pre-training) divides the low frequencies by
``factor``, keeps the high ones, blends linearly in between, and raises the attention temperature by
``mscale = 0.1 * ln(factor) + 1`` (applied squared to the softmax scale, see `MLAConfig.softmax_scale`).
"""

from __future__ import annotations

import functools
import math

import torch

from ._checks import check_float, check_int, check_rank, check_tensor
from .config import RopeConfig


def rope_inv_freq(rope_dim: int, rope: RopeConfig, *, dtype: torch.dtype = torch.float64,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """The rotation frequency of each channel pair, YaRN-interpolated when ``rope.factor > 1``.

    Args:
        rope_dim: number of rotated channels (even); there are ``rope_dim // 2`` pairs.
        rope: RoPE/YaRN settings.
        dtype: dtype of the result.
        device: where the result lives (default the CPU, where it is computed). On an accelerator
            the copy is made once per ``(rope_dim, rope, dtype, device)`` and shared by later calls
            (a layer step then copies nothing to the device): do not modify it in place.

    Returns:
        ``inv_freq`` of shape ``[rope_dim // 2]``.
    """
    if device is not None and torch.device(device).type != "cpu":
        return _inv_freq_on(rope_dim, rope, dtype, torch.device(device))
    return _inv_freq(rope_dim, rope, dtype)


@functools.lru_cache(maxsize=64)
def _inv_freq_on(rope_dim: int, rope: RopeConfig, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _inv_freq(rope_dim, rope, dtype).to(device)


def _inv_freq(rope_dim: int, rope: RopeConfig, dtype: torch.dtype) -> torch.Tensor:
    if rope_dim < 2 or rope_dim % 2:
        raise ValueError(f"rope_dim must be an even number >= 2, got {rope_dim}")
    pair = torch.arange(0, rope_dim, 2, dtype=torch.float64)  # [d/2]
    inv_freq = rope.theta ** (-pair / rope_dim)  # [d/2]
    if rope.yarn:
        low, high = _yarn_correction_range(rope, rope_dim)
        # ramp = 0 for fast pairs (kept), 1 for slow pairs (interpolated), linear in between
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
        inv_freq = inv_freq / rope.factor * ramp + inv_freq * (1 - ramp)  # [d/2]
    return inv_freq.to(dtype)


def _yarn_correction_range(rope: RopeConfig, rope_dim: int) -> tuple[int, int]:
    """Pair indices where YaRN starts and stops interpolating (DeepSeek's ``find_correction_range``)."""

    def pair_rotating(num_rotations: float) -> float:
        # the (fractional) pair index whose wavelength fits num_rotations times into the original context
        return rope_dim * math.log(rope.original_max_position / (num_rotations * 2 * math.pi)) / (
            2 * math.log(rope.theta)
        )

    low = math.floor(pair_rotating(rope.beta_fast))
    high = math.ceil(pair_rotating(rope.beta_slow))
    return max(low, 0), min(high, rope_dim - 1)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, *, dtype: torch.dtype = torch.float32
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine of every (token, pair) angle ``positions[t] * inv_freq[i]``.

    Args:
        positions: int ``[T]``, each token's position inside its own sequence (see `dsa_ref.layout.positions`).
        inv_freq: ``[d/2]`` from `rope_inv_freq`.
        dtype: dtype of the results; angles are computed in float64 first so large positions stay exact.

    Returns:
        ``(cos, sin)``, each ``[T, d/2]``.
    """
    check_int("positions", positions)
    check_rank("positions", positions, 1, "[T]")
    check_tensor("inv_freq", inv_freq)
    angle = positions.to(torch.float64)[:, None] * inv_freq.to(positions.device, torch.float64)[None, :]  # [T, d/2]
    return angle.cos().to(dtype), angle.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool) -> torch.Tensor:
    """Rotate the channel pairs of ``x`` by the angles whose cosines and sines are given.

    Args:
        x: ``[T, ..., d]`` (any number of head dims between the token dim and the channels).
        cos, sin: ``[T, d/2]`` from `rope_cos_sin`.
        interleaved: ``True`` pairs channels ``(2i, 2i+1)`` (MLA); ``False`` pairs ``(i, i+d/2)`` (indexer).

    Returns:
        The rotated tensor, same shape and dtype as ``x`` (the rotation is computed in ``cos``'s dtype).
    """
    check_float("x", x)
    d = x.shape[-1]
    if d % 2 or cos.shape != (x.shape[0], d // 2) or sin.shape != cos.shape:
        raise ValueError(
            f"apply_rope: x {tuple(x.shape)} needs cos and sin of shape [{x.shape[0]}, {d // 2}], "
            f"got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    # broadcast the [T, d/2] angles over the head dims of x
    view = (x.shape[0],) + (1,) * (x.dim() - 2) + (d // 2,)
    cos, sin = cos.view(view), sin.view(view)
    xf = x.to(cos.dtype)
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]  # [T, ..., d/2] each: even and odd channels
    else:
        a, b = xf[..., : d // 2], xf[..., d // 2:]  # [T, ..., d/2] each: first and second half
    # (a + i b) * (cos + i sin) = (a cos - b sin) + i (a sin + b cos)
    ra = a * cos - b * sin
    rb = a * sin + b * cos
    if interleaved:
        out = torch.stack((ra, rb), dim=-1).flatten(-2)  # [T, ..., d]: back to (2i, 2i+1) order
    else:
        out = torch.cat((ra, rb), dim=-1)  # [T, ..., d]
    return out.to(x.dtype)


def rope_dtype_for(x: torch.Tensor) -> torch.dtype:
    """The dtype RoPE computes in for ``x``: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32
