"""Hyper-parameters of one DSA attention layer, as dataclasses, with two presets.

* `deepseek_v32()` is the attention of DeepSeek-V3.2 (and V3.2-Exp): 128 MLA heads over a 512-dim
  latent, a 64-head lightning indexer of dim 128, top-2048 selection, YaRN factor 40.
* `tiny()` keeps the structure and the ratios that matter (latent = 4 x nope dim, rope = nope / 2,
  indexer rope dims = MLA rope dims, top-k well below the sequence lengths used in tests) at a size
  where every CPU test and notebook runs in seconds.

Every config validates itself in ``__post_init__`` and raises ``ValueError`` naming the bad field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding with optional YaRN context extension.

    Attributes:
        theta: RoPE base (DeepSeek: 10000).
        factor: YaRN scaling factor; 1.0 switches YaRN off (plain RoPE, mscale 1).
        original_max_position: context length the model was pre-trained with (DeepSeek: 4096).
        beta_fast: YaRN: dimensions rotating more than ``beta_fast`` times over the original
            context keep their frequency.
        beta_slow: YaRN: dimensions rotating fewer than ``beta_slow`` times are fully interpolated
            (divided by ``factor``); the ones in between are blended linearly.
        mscale: YaRN attention-temperature coefficient (DeepSeek: 1.0).
    """

    theta: float = 10000.0
    factor: float = 1.0
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0

    def __post_init__(self) -> None:
        _require(self.theta > 1.0, "theta", self.theta, "> 1")
        _require(self.factor >= 1.0, "factor", self.factor, ">= 1 (1 = YaRN off)")
        _require(self.original_max_position >= 1, "original_max_position", self.original_max_position, ">= 1")
        _require(self.beta_fast > self.beta_slow > 0, "beta_fast/beta_slow",
                 (self.beta_fast, self.beta_slow), "beta_fast > beta_slow > 0")
        _require(self.mscale > 0, "mscale", self.mscale, "> 0")

    @property
    def yarn(self) -> bool:
        """Whether YaRN frequency interpolation and the attention temperature are active."""
        return self.factor > 1.0


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3 MLA).

    Attributes:
        dim: model hidden size.
        n_heads: number of attention heads H.
        q_lora_rank: width of the compressed query latent (``wq_a`` output).
        kv_lora_rank: width of the compressed KV latent ``c_kv`` (``wkv_a`` output, without rope).
        qk_nope_head_dim: per-head query/key dims that carry no position.
        qk_rope_head_dim: decoupled RoPE dims: per head for q, one shared head for ``k_pe``.
        v_head_dim: per-head value dims.
        norm_eps: epsilon of the RMSNorms on the q and kv latents.
        rope_interleaved: MLA's RoPE layout; DeepSeek rotates interleaved pairs (2i, 2i+1).
        rope: RoPE/YaRN settings (shared with the indexer).
    """

    dim: int
    n_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    norm_eps: float = 1e-6
    rope_interleaved: bool = True
    rope: RopeConfig = field(default_factory=RopeConfig)

    def __post_init__(self) -> None:
        for name in ("dim", "n_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            _require(getattr(self, name) >= 1, name, getattr(self, name), ">= 1")
        _require(self.qk_rope_head_dim >= 2 and self.qk_rope_head_dim % 2 == 0,
                 "qk_rope_head_dim", self.qk_rope_head_dim, "an even number >= 2")
        _require(self.norm_eps > 0, "norm_eps", self.norm_eps, "> 0")

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width of the dense form: nope + rope (DeepSeek-V3.2: 192)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one latent KV row in the absorbed form: kv_lora_rank + rope (DeepSeek-V3.2: 576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def mscale(self) -> float:
        """YaRN attention temperature ``0.1 * mscale * ln(factor) + 1`` (1.0 without YaRN)."""
        return yarn_mscale(self.rope.factor, self.rope.mscale)

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim ** -0.5 * mscale ** 2``; the absorbed 576-dim form keeps this scale."""
        return self.qk_head_dim ** -0.5 * self.mscale ** 2


@dataclass(frozen=True)
class IndexerConfig:
    """The lightning indexer of DSA.

    Attributes:
        n_heads: indexer heads H_I (DeepSeek-V3.2: 64).
        head_dim: indexer head dim D_I (DeepSeek-V3.2: 128); the first ``rope_head_dim`` dims carry RoPE.
        topk: number of keys each query selects (DeepSeek-V3.2: 2048).
        rope_head_dim: RoPE dims at the front of each indexer head (= the MLA rope dims).
        rope_interleaved: indexer RoPE layout; DeepSeek-V3.2 uses half-split pairs (i, i + d/2).
        use_hadamard: rotate q and k by the same orthonormal Hadamard matrix (matters only under fp8).
        k_norm_eps: epsilon of the LayerNorm on the indexer key.
        use_relu: ``relu(q . k)`` inside the score (DeepSeek-V3.2: on).
        fp8: select the top-k by fp8 scores, as DeepSeek-V3.2 does: q and k (after the rotation)
            quantised to e4m3 with one power-of-two scale per 128 channels (per head vector when
            ``head_dim`` < 128), `dsa_ref.fp8`. The reference backend selects by the simulation
            (`dsa_ref.fp8.fp8_indexer_scores`), the TileLang backend by the fp8 kernel
            (`dsa_ref.kernels.indexer_fwd_fp8`; ``"auto"`` falls back to the simulation where it
            declines). Only the selection changes: the indexer loss and its gradient use the
            unquantised scores at the selected keys (a quantiser has no useful gradient; DeepSeek's
            fp8 kernel is forward-only too). Default off.
    """

    n_heads: int
    head_dim: int
    topk: int
    rope_head_dim: int
    rope_interleaved: bool = False
    use_hadamard: bool = True
    k_norm_eps: float = 1e-6
    use_relu: bool = True
    fp8: bool = False

    def __post_init__(self) -> None:
        _require(isinstance(self.fp8, bool), "fp8", self.fp8, "True or False")
        for name in ("n_heads", "head_dim", "topk"):
            _require(getattr(self, name) >= 1, name, getattr(self, name), ">= 1")
        _require(2 <= self.rope_head_dim <= self.head_dim and self.rope_head_dim % 2 == 0,
                 "rope_head_dim", self.rope_head_dim, f"an even number in [2, head_dim={self.head_dim}]")
        if self.use_hadamard:
            _require(self.head_dim & (self.head_dim - 1) == 0, "head_dim", self.head_dim,
                     "a power of two when use_hadamard=True")
        _require(self.k_norm_eps > 0, "k_norm_eps", self.k_norm_eps, "> 0")


@dataclass(frozen=True)
class DSAConfig:
    """One DSA attention layer: MLA plus its lightning indexer."""

    mla: MLAConfig
    indexer: IndexerConfig

    def __post_init__(self) -> None:
        if self.indexer.rope_head_dim != self.mla.qk_rope_head_dim:
            raise ValueError(
                f"indexer.rope_head_dim={self.indexer.rope_head_dim} must equal "
                f"mla.qk_rope_head_dim={self.mla.qk_rope_head_dim} (the indexer shares MLA's RoPE frequencies)"
            )

    def with_topk(self, topk: int) -> "DSAConfig":
        """A copy with another ``indexer.topk``."""
        return replace(self, indexer=replace(self.indexer, topk=topk))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(factor) + 1``; exactly 1.0 for ``factor <= 1``."""
    if factor <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def deepseek_v32() -> DSAConfig:
    """The DeepSeek-V3.2 attention layer (``config_671B_v3.2.json`` and the model's defaults)."""
    rope = RopeConfig(theta=10000.0, factor=40.0, original_max_position=4096, beta_fast=32.0, beta_slow=1.0)
    mla = MLAConfig(dim=7168, n_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope=rope)
    indexer = IndexerConfig(n_heads=64, head_dim=128, topk=2048, rope_head_dim=64)
    return DSAConfig(mla=mla, indexer=indexer)


def tiny() -> DSAConfig:
    """A small layer with DeepSeek-V3.2's structure, for CPU tests and notebooks.

    The ratios follow V3.2: latent 64 = 4 x nope 16 (512 = 4 x 128), rope = nope / 2 (64 = 128 / 2),
    indexer head dim = nope dim with the MLA rope dims at its front. YaRN is on, over 32 original
    positions, so the interpolated frequencies and the mscale are exercised at the sequence
    lengths tests use; top-k 8 lies below most test lengths, so selection really drops keys.
    """
    rope = RopeConfig(theta=10000.0, factor=40.0, original_max_position=32, beta_fast=32.0, beta_slow=1.0)
    mla = MLAConfig(dim=64, n_heads=4, q_lora_rank=32, kv_lora_rank=64,
                    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rope=rope)
    indexer = IndexerConfig(n_heads=4, head_dim=16, topk=8, rope_head_dim=8)
    return DSAConfig(mla=mla, indexer=indexer)


def _require(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"invalid config: {name}={value!r}, expected {expected}")
