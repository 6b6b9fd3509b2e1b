r"""fp8 simulation of the lightning indexer: DeepSeek's block-128 activation quantisation.

DeepSeek-V3.2 runs the indexer in fp8 (e4m3). Before the score kernel, ``act_quant`` quantises each
indexer query head and each indexer key (one block of 128 channels = one head vector) with one
scale per block:

$$
\begin{gathered}
s = \frac{\max(\max_i |x_i|,\ 10^{-4})}{448}, \qquad s \leftarrow 2^{\lceil \log_2 s \rceil}
\ \text{(power-of-two "ue8m0" scales)}, \\
y = \operatorname{e4m3}\!\big(\operatorname{clamp}(x / s, \pm 448)\big),
\end{gathered}
$$

and the kernel computes $I_{t,s} = \sum_j w_{t,j}\, \mathrm{ReLU}\big((y^q_{t,j} s^q_{t,j}) \cdot (y^k_s s^k_s)\big)$
(the positive scales are folded into the weights and the keys, which gives the same numbers).

e4m3 keeps 3 mantissa bits, so every element carries a relative error of up to $2^{-4}$. A dot
product's error is then dominated by its largest terms: when a few channels carry outliers, their
products' errors swamp the signal of all the other channels. The **Hadamard rotation**
$x \mapsto x H / \sqrt{d}$ (applied to q and k alike, so $(qH)\cdot(kH) = q\cdot k$ exactly) spreads every
outlier over all channels; the errors of the $d$ products are then independent and partly cancel,
and the score error shrinks by up to $\sqrt{d}$ relative to the outlier terms. In exact arithmetic
the rotation changes nothing -- which is why bf16 code may skip it and fp8 code must not.

`act_quant_block128` quantises (with ``torch.float8_e4m3fn`` when PyTorch has it, else a faithful
round-to-nearest-even emulation, `e4m3_round`), `fp8_roundtrip` quantises and dequantises, and
`fp8_indexer_scores` computes the indexer scores the way the fp8 kernel does.
`fp8_selection_operands` is what `dsa_ref.DSAttention` selects with under ``IndexerConfig.fp8``
on the reference backend; `dsa_ref.kernels.indexer_fwd_fp8` is the fp8 kernel itself.
"""

from __future__ import annotations

import torch

from ._checks import check_float, check_positive_int
from .indexer import lightning_indexer, rotate_activation

__all__ = ["E4M3_MAX", "HAS_TORCH_FP8", "e4m3_round", "act_quant_block128", "act_quant_pow2", "fp8_dequant", "fp8_roundtrip",
           "fp8_indexer_scores", "selection_block_size", "fp8_selection_operands"]

#: Largest finite e4m3 (``fn`` variant: no infinities) value.
E4M3_MAX = 448.0
#: Whether this PyTorch has ``torch.float8_e4m3fn``.
HAS_TORCH_FP8 = hasattr(torch, "float8_e4m3fn")
_MIN_NORMAL_EXP = -6  # smallest normal e4m3 magnitude is 2^-6; subnormals step by 2^-9
_MANTISSA_BITS = 3


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e4m3 value (ties to even), saturating at ``±448``; returns float32.

    A software model of ``x.to(torch.float8_e4m3fn)`` for values already clamped to ``[-448, 448]``:
    3 mantissa bits for normal numbers (``|x| >= 2^-6``), a fixed step of ``2^-9`` below (subnormals).
    Used when PyTorch has no float8 dtype; tested bit-for-bit against it where it does.
    """
    check_float("x", x)
    xd = x.to(torch.float64)
    _, exp = torch.frexp(xd)  # xd = m * 2^exp with 0.5 <= |m| < 1, so floor(log2|x|) = exp - 1
    e = torch.clamp(exp - 1, min=_MIN_NORMAL_EXP)
    step = torch.ldexp(torch.ones_like(xd), (e - _MANTISSA_BITS).to(torch.int32))  # spacing at that exponent
    rounded = torch.round(xd / step) * step  # torch.round rounds half to even
    return rounded.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float32)


def act_quant_block128(x: torch.Tensor, *, block_size: int = 128, pow2_scale: bool = True,
                       emulate: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's ``act_quant``: e4m3 values with one float32 scale per block of the last dim.

    Args:
        x: float ``[..., D]``, ``D`` a multiple of ``block_size``.
        block_size: channels per scale (DeepSeek: 128, one indexer head vector).
        pow2_scale: round each scale *up* to a power of two (DeepSeek-V3.2's ``scale_fmt="ue8m0"``);
            with it the block's largest magnitude lands in ``[224, 448]``.
        emulate: ``True`` always uses `e4m3_round`; ``False`` requires ``torch.float8_e4m3fn``;
            ``None`` (default) uses the PyTorch dtype when available.

    Returns:
        ``(y, scale)``: ``y [..., D]`` (``torch.float8_e4m3fn`` or, emulated, float32 holding e4m3
        values) and ``scale [..., D // block_size]`` float32, with ``x ~= y * scale`` per block.
    """
    check_float("x", x)
    block_size = check_positive_int("block_size", block_size)
    if x.dim() < 1 or x.shape[-1] % block_size:
        raise ValueError(f"x's last dim must be a multiple of block_size={block_size}, got shape {tuple(x.shape)} "
                         f"(pass block_size=x.shape[-1] for one scale per vector)")
    if emulate is False and not HAS_TORCH_FP8:
        raise RuntimeError("emulate=False needs torch.float8_e4m3fn, which this PyTorch lacks")
    use_torch = HAS_TORCH_FP8 if emulate is None else not emulate
    blocks = x.detach().to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4)  # [..., nb, 1]
    scale = amax / E4M3_MAX
    if pow2_scale:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    scaled = (blocks / scale).clamp(-E4M3_MAX, E4M3_MAX)
    y = scaled.to(torch.float8_e4m3fn) if use_torch else e4m3_round(scaled)
    return y.reshape(x.shape), scale.squeeze(-1)


def act_quant_pow2(x: torch.Tensor, *, block_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """`act_quant_block128` with power-of-two scales (``pow2_scale=True, emulate=False``), the same
    bytes in three passes over ``x``: what the fp8 kernel's wrapper quantises with.

    The block maxima come from one ``aminmax`` in ``x``'s own dtype (exact), the scales from the same
    float32 operations as in `act_quant_block128`. Dividing by a power of two is exact, so ``x``
    is multiplied by ``1 / scale`` in its own dtype (bfloat16 or float32; others go through float32)
    instead of being copied to float32 and divided. No clamp is needed: ``scale >= amax / 448``
    up to float32 rounding, so ``|x| / scale <= 448 (1 + 2^-23)``, which e4m3 rounds to 448 as the
    clamp would. (A value reaching 464 would round to e4m3fn's NaN pattern.)

    Args:
        x: float ``[..., D]``, ``D`` a multiple of ``block_size``.
        block_size: channels per scale.

    Returns:
        ``(y [..., D]`` ``torch.float8_e4m3fn``, ``scale [..., D // block_size]`` float32``)``, equal
        to ``act_quant_block128(x, block_size=block_size, emulate=False)`` (NaN where it has NaN).
    """
    check_float("x", x)
    block_size = check_positive_int("block_size", block_size)
    if x.dim() < 1 or x.shape[-1] % block_size:
        raise ValueError(f"x's last dim must be a multiple of block_size={block_size}, got shape {tuple(x.shape)}")
    if not HAS_TORCH_FP8:
        raise RuntimeError("act_quant_pow2 needs torch.float8_e4m3fn, which this PyTorch lacks")
    work = x.dtype if x.dtype in (torch.bfloat16, torch.float32) else torch.float32
    blocks = x.detach().to(work).reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)  # [..., nb, B]
    low, high = torch.aminmax(blocks, dim=-1, keepdim=True)  # [..., nb, 1] each
    amax = torch.maximum(high.to(torch.float32), -low.to(torch.float32)).clamp_min(1e-4)  # [..., nb, 1]
    scale = torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)))  # [..., nb, 1], as act_quant_block128
    y = (blocks * (1.0 / scale).to(work)).to(torch.float8_e4m3fn)  # [..., nb, B]: exact scaling, one rounding
    return y.reshape(x.shape), scale.squeeze(-1)


def fp8_dequant(y: torch.Tensor, scale: torch.Tensor, *, block_size: int = 128) -> torch.Tensor:
    """``y * scale`` per block, as float32: the values an fp8 kernel effectively computes with."""
    yf = y.to(torch.float32)
    blocks = yf.reshape(*yf.shape[:-1], yf.shape[-1] // block_size, block_size)
    return (blocks * scale.to(torch.float32)[..., None]).reshape(yf.shape)


def fp8_roundtrip(x: torch.Tensor, *, block_size: int = 128, pow2_scale: bool = True,
                  emulate: bool | None = None) -> torch.Tensor:
    """Quantise with `act_quant_block128` and dequantise: ``x`` as the fp8 kernel sees it (float32)."""
    y, s = act_quant_block128(x, block_size=block_size, pow2_scale=pow2_scale, emulate=emulate)
    return fp8_dequant(y, s, block_size=block_size)


# --8<-- [start:fp8_indexer_scores]
def fp8_indexer_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, *, hadamard: bool,
                       starts: torch.Tensor | None = None, ends: torch.Tensor | None = None,
                       quantize: bool = True, block_size: int = 128, pow2_scale: bool = True,
                       relu: bool = True, emulate: bool | None = None) -> torch.Tensor:
    """Indexer scores as DeepSeek's fp8 kernel computes them: rotate (optionally), quantise, score.

    Args:
        q: ``[T, H_I, D_I]`` indexer queries *before* the rotation (after RoPE).
        k: ``[S, D_I]`` indexer keys before the rotation.
        weights: ``[T, H_I]`` head weights (scales folded in).
        hadamard: rotate q and k by the orthonormal Hadamard matrix first (DeepSeek-V3.2: yes).
        starts, ends: int ``[T]`` key windows; both ``None`` = every key.
        quantize: ``False`` skips the fp8 step (exact path: then ``hadamard`` changes nothing).
        block_size: channels per scale (``D_I`` must be a multiple).
        pow2_scale: power-of-two scales (DeepSeek-V3.2's ue8m0).
        relu: the ReLU of the score.
        emulate: see `act_quant_block128`.

    Returns:
        ``[T, S]`` float32 scores (float64 when ``quantize=False`` and the inputs are float64).
    """
    check_float("q", q)
    check_float("k", k)
    if hadamard:
        q, k = rotate_activation(q), rotate_activation(k)  # the same rotation on both sides
    if quantize:
        q = fp8_roundtrip(q, block_size=block_size, pow2_scale=pow2_scale, emulate=emulate)  # one scale per head
        k = fp8_roundtrip(k, block_size=block_size, pow2_scale=pow2_scale, emulate=emulate)  # one scale per token
        weights = weights.to(torch.float32)
    return lightning_indexer(q, k, weights, starts=starts, ends=ends, relu=relu)
# --8<-- [end:fp8_indexer_scores]


# --8<-- [start:fp8_selection_operands]
def selection_block_size(head_dim: int) -> int:
    """Channels per scale of the fp8 selection: 128 (DeepSeek's block, one per 128-channel head
    vector), or the whole head vector when ``head_dim`` is not a multiple of 128 (small test configs)."""
    return 128 if head_dim % 128 == 0 else head_dim


def fp8_selection_operands(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The indexer's operands as the fp8 kernel sees them: dequantised float32 ``q``, ``k`` and float32 weights.

    ``lightning_indexer`` of these is `fp8_indexer_scores` with ``hadamard=False`` (``q`` and ``k``
    come rotated from `dsa_ref.LightningIndexer.project`) and ``block_size=selection_block_size(D_I)``,
    so ``streamed_topk_indices`` of them is the top-k of the simulated fp8 scores. No gradient.
    """
    block = selection_block_size(q.shape[-1])
    return (fp8_roundtrip(q.detach(), block_size=block), fp8_roundtrip(k.detach(), block_size=block),
            weights.detach().to(torch.float32))
# --8<-- [end:fp8_selection_operands]
