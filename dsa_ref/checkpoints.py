r"""Real checkpoints: one DSA attention layer of DeepSeek-V3.2 or GLM-5, read from Hugging Face files.

A released checkpoint is a directory with ``config.json``, ``model.safetensors.index.json`` (which
tensor lives in which shard) and the shards; small ones have a single ``model.safetensors``. This
module reads **one layer** of it -- the few tensors of ``model.layers.{L}.self_attn.*`` -- with
`safetensors.safe_open`, so the memory needed is about one layer even for a 700 GB checkpoint:

    config.json ──config_from_hf──► DSAConfig
    model.layers.L.self_attn.* ──load_attention_layer──► DSAttention (dsa_ref's names)
    model.embed_tokens.weight[ids] ──embed_tokens──► x [T, dim]
    model.layers.L.input_layernorm ──load_input_norm──► RMSNorm

**Names.** Hugging Face's names map one to one onto dsa_ref's (`HF_TO_DSA_REF`); the layouts agree
(``q_b_proj`` rows are ``[nope | rope]`` per head, ``kv_a_proj_with_mqa`` rows ``[c_kv | k_pe]``,
``kv_b_proj`` rows ``[k_nope | v]`` per head, the indexer's ``wq_b`` rows ``[pe | nope]`` per head).

**fp8 weights.** DeepSeek-V3.2 stores its linear weights as ``float8_e4m3fn`` with one float32
``weight_scale_inv`` per block of 128 x 128 (the ``weight_block_size`` of its
``quantization_config``). `dequantize_fp8_block` multiplies every element by its block's scale in
float32, as DeepSeek's ``weight_dequant`` does: the grid has ``ceil(rows / 128) x ceil(cols / 128)``
blocks, so the blocks at the right and bottom edges are smaller and still get their own scale.
bf16 weights (GLM-5) are used as they are.

**Index sharing.** GLM-5's ``indexer_types`` (``"full"`` / ``"shared"`` per layer) says which
layers own an indexer; `indexer_layers` reads it and `topk_source_layer` names the layer whose top-k
a shared layer reuses. `load_attention_layer` builds a shared layer with ``has_indexer=False``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from .config import DSAConfig, IndexerConfig, MLAConfig, RopeConfig, yarn_mscale
from .dsa import DSAttention
from .mla import RMSNorm

__all__ = [
    "MODEL_TYPES",
    "HF_TO_DSA_REF",
    "Checkpoint",
    "TensorInfo",
    "config_from_hf",
    "indexer_layers",
    "topk_source_layer",
    "layer_tensor_names",
    "dequantize_fp8_block",
    "load_attention_layer",
    "load_input_norm",
    "embed_tokens",
    "inspect_layer",
]

#: The ``model_type`` values `config_from_hf` understands.
MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")

# --8<-- [start:names]
#: Hugging Face's name of each attention tensor (after ``model.layers.{L}.self_attn.``) -> dsa_ref's
#: name in `DSAttention.state_dict`. The ``indexer.*`` rows exist only in layers that own an indexer.
HF_TO_DSA_REF = {
    "q_a_proj.weight": "mla.wq_a.weight",  # [q_lora_rank, dim]
    "q_a_layernorm.weight": "mla.q_norm.weight",  # [q_lora_rank]
    "q_b_proj.weight": "mla.wq_b.weight",  # [H * (nope + rope), q_lora_rank]
    "kv_a_proj_with_mqa.weight": "mla.wkv_a.weight",  # [kv_lora_rank + rope, dim]
    "kv_a_layernorm.weight": "mla.kv_norm.weight",  # [kv_lora_rank]
    "kv_b_proj.weight": "mla.wkv_b.weight",  # [H * (nope + v), kv_lora_rank]
    "o_proj.weight": "mla.wo.weight",  # [dim, H * v]
    "indexer.wq_b.weight": "indexer.wq_b.weight",  # [H_I * D_I, q_lora_rank]
    "indexer.wk.weight": "indexer.wk.weight",  # [D_I, dim]
    "indexer.k_norm.weight": "indexer.k_norm.weight",  # [D_I]
    "indexer.k_norm.bias": "indexer.k_norm.bias",  # [D_I]
    "indexer.weights_proj.weight": "indexer.weights_proj.weight",  # [H_I, dim]
}
# --8<-- [end:names]

_SCALE_SUFFIX = "_scale_inv"  # "x.weight" is quantised when "x.weight_scale_inv" exists
_FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz") if hasattr(torch, n))


# ------------------------------------------------------------------------------------- config


def _read_config(config: str | os.PathLike | Mapping) -> tuple[dict, str]:
    """The config as a dict and a label naming where it came from (for error messages)."""
    if isinstance(config, Mapping):
        return dict(config), "config"
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(f"config must be a path to config.json (or its directory) or a dict, "
                        f"got {type(config).__name__}")
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json at {path}")
    with open(path) as f:
        try:
            return json.load(f), path
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from None


def _field(cfg: dict, name: str, where: str, *, default=None, required: bool = True):
    if name in cfg and cfg[name] is not None:
        return cfg[name]
    if required:
        raise ValueError(f"{where}: field {name!r} is missing; a {cfg.get('model_type')} config must give it")
    return default


# --8<-- [start:config_from_hf]
def config_from_hf(config: str | os.PathLike | Mapping) -> DSAConfig:
    """The `DSAConfig` of one attention layer of a Hugging Face ``deepseek_v32`` or ``glm_moe_dsa`` model.

    Every attention field is carried over: the MLA ranks and heads, RoPE theta and YaRN (factor,
    original context, ``beta_fast``/``beta_slow``, and the softmax temperature from ``mscale_all_dim``),
    the indexer's heads, dim and top-k. What the config file does not say is set the way the
    released models and transformers' modelling code use it:

    * MLA's ``q_a_layernorm``/``kv_a_layernorm`` eps is 1e-6 (transformers builds them with the
      default, whatever ``rms_norm_eps`` says; ``rms_norm_eps`` is the layer's *input* norm, see
      `load_input_norm`); the indexer's LayerNorm eps is 1e-6;
    * MLA's RoPE is interleaved; the indexer's is half-split for ``deepseek_v32`` and interleaved
      for ``glm_moe_dsa`` (an ``indexer_rope_interleave`` field overrides it);
    * the indexer's ReLU is on; the Hadamard rotation is on for ``deepseek_v32`` (its fp8 indexer
      rotates q and k) and off for ``glm_moe_dsa`` (it changes nothing in exact arithmetic).

    Args:
        config: path to ``config.json`` (or to the checkpoint directory), or the parsed dict.

    Returns:
        The `DSAConfig`.

    Raises:
        ValueError: another ``model_type``, a missing field, or a setting `DSAConfig` cannot express
            (no query compression, grouped KV heads, biases, a RoPE type other than YaRN, YaRN with
            ``truncate=False``, or a YaRN ``attention_factor`` other than 1, which scales only the rope
            part of the logits). The message names the field and its value.
    """
    cfg, where = _read_config(config)
    model_type = cfg.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"{where}: model_type={model_type!r} is not supported; expected one of {MODEL_TYPES}")
    if cfg.get("q_lora_rank") is None and "q_lora_rank" in cfg:
        raise ValueError(f"{where}: q_lora_rank=None (no query compression) cannot be expressed: DSA's indexer "
                         "reads the query latent")
    dim = int(_field(cfg, "hidden_size", where))
    n_heads = int(_field(cfg, "num_attention_heads", where))
    kv_heads = cfg.get("num_key_value_heads")
    if kv_heads is not None and int(kv_heads) != n_heads:
        raise ValueError(f"{where}: num_key_value_heads={kv_heads} != num_attention_heads={n_heads}; MLA has one "
                         "key/value head per query head")
    if cfg.get("attention_bias"):
        raise ValueError(f"{where}: attention_bias={cfg['attention_bias']!r} cannot be expressed (dsa_ref's MLA "
                         "has no biases)")
    rope = _rope_config(cfg, where)
    mla = MLAConfig(
        dim=dim, n_heads=n_heads,
        q_lora_rank=int(_field(cfg, "q_lora_rank", where)),
        kv_lora_rank=int(_field(cfg, "kv_lora_rank", where)),
        qk_nope_head_dim=int(_field(cfg, "qk_nope_head_dim", where)),
        qk_rope_head_dim=int(_field(cfg, "qk_rope_head_dim", where)),
        v_head_dim=int(_field(cfg, "v_head_dim", where)),
        norm_eps=1e-6,  # transformers: q_a_layernorm / kv_a_layernorm use RMSNorm's default eps
        rope_interleaved=bool(cfg.get("rope_interleave", True)),
        rope=rope,
    )
    glm = model_type == "glm_moe_dsa"
    indexer = IndexerConfig(
        n_heads=int(_field(cfg, "index_n_heads", where)),
        head_dim=int(_field(cfg, "index_head_dim", where)),
        topk=int(_field(cfg, "index_topk", where)),
        rope_head_dim=mla.qk_rope_head_dim,
        rope_interleaved=bool(cfg.get("indexer_rope_interleave", glm)),
        use_hadamard=not glm,
        k_norm_eps=1e-6,
        use_relu=True,
    )
    return DSAConfig(mla=mla, indexer=indexer)
# --8<-- [end:config_from_hf]


def _rope_config(cfg: dict, where: str) -> RopeConfig:
    """`RopeConfig` from ``rope_parameters`` (transformers 5) or ``rope_scaling`` + ``rope_theta`` (older files)."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return RopeConfig(theta=theta)
    if rope_type != "yarn":
        raise ValueError(f"{where}: rope type {rope_type!r} cannot be expressed; dsa_ref knows plain RoPE and YaRN")
    if params.get("truncate", True) is False:
        raise ValueError(f"{where}: YaRN with truncate=False cannot be expressed; dsa_ref rounds the correction "
                         "range to whole pairs as DeepSeek does")
    original = params.get("original_max_position_embeddings")
    if original is None:
        raise ValueError(f"{where}: YaRN needs rope original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None:  # transformers derives it from the two context lengths
        factor = _field(cfg, "max_position_embeddings", where) / original
    factor = float(factor)
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:  # transformers' derivation (_compute_yarn_parameters)
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    if not math.isclose(float(attention_factor), 1.0, rel_tol=0, abs_tol=1e-12):
        raise ValueError(
            f"{where}: YaRN attention_factor={float(attention_factor)!r} (from mscale={mscale!r}, "
            f"mscale_all_dim={mscale_all_dim!r}, factor={factor!r}) cannot be expressed: it scales cos/sin, i.e. "
            "only the rope part of the logits; dsa_ref scales every logit by mscale**2 (mscale == mscale_all_dim)")
    # the softmax scale: qk_head_dim ** -0.5 * yarn_mscale(factor, mscale_all_dim) ** 2 (1 without mscale_all_dim)
    if not mscale_all_dim:
        if factor > 1.0:
            raise ValueError(f"{where}: YaRN factor={factor} without mscale_all_dim leaves the softmax scale "
                             "unscaled, which dsa_ref cannot express (it scales by yarn_mscale(factor, mscale)**2)")
        mscale_all_dim = 1.0
    return RopeConfig(theta=theta, factor=factor, original_max_position=int(original),
                      beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
                      mscale=float(mscale_all_dim))


def _num_layers(cfg: dict, where: str) -> int:
    return int(_field(cfg, "num_hidden_layers", where))


# --8<-- [start:indexer_layers]
def indexer_layers(config: str | os.PathLike | Mapping) -> list[bool]:
    """Which layers own an indexer (``True``) and which reuse an earlier layer's top-k (``False``).

    ``deepseek_v32``: every layer. ``glm_moe_dsa``: ``indexer_types`` (``"full"`` / ``"shared"``)
    when given, else ``index_topk_pattern`` (``"F"`` / ``"S"``), else transformers' schedule from
    ``index_topk_freq`` (default 1) and ``index_skip_topk_offset`` (default 2): layer ``i`` is full
    when ``max(i - offset + 1, 0) % freq == 0``.
    """
    cfg, where = _read_config(config)
    n = _num_layers(cfg, where)
    if cfg.get("model_type") != "glm_moe_dsa":
        return [True] * n
    types = cfg.get("indexer_types")
    if types is None and cfg.get("index_topk_pattern") is not None:
        pattern = cfg["index_topk_pattern"]
        codes = {"F": "full", "S": "shared"}
        if isinstance(pattern, str) and any(c not in codes for c in pattern):
            raise ValueError(f"{where}: index_topk_pattern={pattern!r} may hold only 'F' and 'S'")
        types = [codes[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    if types is None:
        freq = max(int(cfg.get("index_topk_freq", 1)), 1)
        offset = int(cfg.get("index_skip_topk_offset", 2))
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if len(types) != n or any(t not in ("full", "shared") for t in types):
        raise ValueError(f"{where}: indexer_types must list 'full' or 'shared' for each of the {n} layers, "
                         f"got {types!r}")
    owns = [t == "full" for t in types]
    if not owns[0]:
        raise ValueError(f"{where}: layer 0 is 'shared' but no earlier layer owns an indexer")
    return owns
# --8<-- [end:indexer_layers]


def topk_source_layer(config: str | os.PathLike | Mapping, layer: int) -> int:
    """The layer whose top-k ``layer`` attends over: itself if it owns an indexer, else the last earlier one that does."""
    owns = indexer_layers(config)
    _check_layer(layer, len(owns), "config")
    return max(i for i in range(layer + 1) if owns[i])


def _check_layer(layer: int, n: int, where: str) -> int:
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise TypeError(f"layer must be an int, got {type(layer).__name__}")
    if not 0 <= layer < n:
        raise ValueError(f"layer={layer} is out of range: {where} has num_hidden_layers={n} (layers 0..{n - 1})")
    return layer


# ---------------------------------------------------------------------------------- the files


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor of a checkpoint is and what it is (read from the safetensors header only).

    Attributes:
        name: the checkpoint's key.
        file: the shard's file name.
        shape: its shape.
        dtype: its dtype as safetensors names it (``"BF16"``, ``"F8_E4M3"``, ``"F32"``, ...).
    """

    name: str
    file: str
    shape: tuple
    dtype: str


class Checkpoint:
    """A local Hugging Face checkpoint directory, read lazily, one tensor at a time.

    Args:
        path: the directory holding ``config.json`` and either ``model.safetensors.index.json`` and
            its shards, or a single ``model.safetensors``.

    Attributes:
        path: the directory.
        config: the parsed ``config.json``.
        weight_map: every tensor name -> its shard's file name.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a checkpoint directory, got {type(path).__name__}")
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise FileNotFoundError(f"checkpoint directory {self.path} does not exist")
        self.config, self._config_file = _read_config(self.path)
        index = os.path.join(self.path, "model.safetensors.index.json")
        single = os.path.join(self.path, "model.safetensors")
        if os.path.isfile(index):
            with open(index) as f:
                try:
                    self.weight_map = dict(json.load(f)["weight_map"])
                except (json.JSONDecodeError, KeyError, TypeError) as err:
                    raise ValueError(f"{index} has no valid 'weight_map' ({type(err).__name__}: {err})") from None
        elif os.path.isfile(single):
            from safetensors import safe_open

            with safe_open(single, framework="pt") as f:
                self.weight_map = {name: "model.safetensors" for name in f.keys()}
        else:
            raise FileNotFoundError(f"{self.path} has neither model.safetensors.index.json nor model.safetensors")

    @property
    def num_layers(self) -> int:
        """``num_hidden_layers`` of the config."""
        return _num_layers(self.config, self._config_file)

    def shard_path(self, name: str) -> str:
        """The file holding tensor ``name`` (ValueError if the checkpoint has no such tensor, FileNotFoundError
        if its shard is missing)."""
        if name not in self.weight_map:
            raise ValueError(f"checkpoint {self.path} has no tensor {name!r}")
        file = os.path.join(self.path, self.weight_map[name])
        if not os.path.isfile(file):
            raise FileNotFoundError(f"shard {file} (which holds {name!r} according to the index) does not exist")
        return file

    def info(self, names: Iterable[str]) -> list[TensorInfo]:
        """Shape and dtype of each tensor, from the shard headers (no tensor data is read)."""
        from safetensors import safe_open

        out = []
        for file, group in self._by_shard(names).items():
            with safe_open(file, framework="pt") as f:
                for name in group:
                    s = f.get_slice(name)
                    out.append(TensorInfo(name, os.path.basename(file), tuple(s.get_shape()), s.get_dtype()))
        return out

    def read(self, names: Iterable[str], *, progress: bool = False) -> dict[str, torch.Tensor]:
        """Read the named tensors (and only them), one shard open at a time, on the CPU.

        Args:
            names: checkpoint keys.
            progress: show a tqdm bar over the shards on stderr.
        """
        from safetensors import safe_open

        groups = self._by_shard(names)
        items = groups.items()
        if progress:
            from tqdm import tqdm

            items = tqdm(items, total=len(groups), desc="reading shards", unit="shard")
        out = {}
        for file, group in items:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in group:
                    out[name] = f.get_tensor(name)
        return out

    def read_rows(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` of a 2-D tensor, reading only those rows (e.g. a few token embeddings)."""
        from safetensors import safe_open

        with safe_open(self.shard_path(name), framework="pt", device="cpu") as f:
            s = f.get_slice(name)
            n = s.get_shape()[0]
            if rows.numel() and not (0 <= int(rows.min()) and int(rows.max()) < n):
                raise ValueError(f"row ids must lie in [0, {n}) for {name!r}, got min {int(rows.min())}, "
                                 f"max {int(rows.max())}")
            return torch.stack([s[int(r): int(r) + 1][0] for r in rows.tolist()]) if rows.numel() else \
                s[0:0]

    def _by_shard(self, names: Iterable[str]) -> dict[str, list[str]]:
        groups: dict[str, list[str]] = {}
        for name in names:
            groups.setdefault(self.shard_path(name), []).append(name)
        return groups


# ------------------------------------------------------------------------------ dequantisation


# --8<-- [start:dequantize]
def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, *, block_size: tuple[int, int] = (128, 128),
                         name: str = "weight") -> torch.Tensor:
    """``weight * scale_inv`` per block, in float32: DeepSeek's ``weight_dequant``.

    Element ``(i, j)`` is multiplied by ``scale_inv[i // 128, j // 128]``. The grid covers the edges:
    a ``[M, N]`` weight has ``ceil(M / 128) x ceil(N / 128)`` scales, the last row and column of
    blocks being smaller.

    Args:
        weight: ``[M, N]`` fp8 e4m3 values (any float dtype holding them works too).
        scale_inv: ``[ceil(M / b0), ceil(N / b1)]`` float32 (or bf16 / e8m0) block scales.
        block_size: ``(b0, b1)``, the ``weight_block_size`` of the ``quantization_config``.
        name: the tensor's name, for error messages.

    Returns:
        ``[M, N]`` float32.
    """
    if weight.dim() != 2:
        raise ValueError(f"{name}: an fp8 block-quantised weight must be 2-D, got shape {tuple(weight.shape)}")
    b0, b1 = block_size
    M, N = weight.shape
    grid = (math.ceil(M / b0), math.ceil(N / b1))
    if tuple(scale_inv.shape) != grid:
        raise ValueError(f"{name}_scale_inv has shape {tuple(scale_inv.shape)}, but a {M} x {N} weight in "
                         f"{b0} x {b1} blocks needs {grid[0]} x {grid[1]} scales")
    scale = scale_inv.to(torch.float32)
    scale = scale.repeat_interleave(b0, dim=0)[:M].repeat_interleave(b1, dim=1)[:, :N]  # [M, N]: each block's scale
    return weight.to(torch.float32) * scale  # [M, N]
# --8<-- [end:dequantize]


def _block_size(cfg: dict) -> tuple[int, int]:
    q = cfg.get("quantization_config") or {}
    block = q.get("weight_block_size") or [128, 128]
    if len(block) != 2:
        raise ValueError(f"quantization_config.weight_block_size must be [rows, cols], got {block!r}")
    return int(block[0]), int(block[1])


def _materialise(ckpt: Checkpoint, names: list[str], *, progress: bool
                 ) -> tuple[dict[str, torch.Tensor], dict[str, torch.dtype]]:
    """Read ``names`` and their ``*_scale_inv`` partners: the tensors (fp8 ones dequantised to float32)
    and the dtype each was stored in."""
    scales = [n + _SCALE_SUFFIX for n in names if n + _SCALE_SUFFIX in ckpt.weight_map]
    raw = ckpt.read(names + scales, progress=progress)
    block = _block_size(ckpt.config)
    out, stored = {}, {}
    for name in names:
        t = raw[name]
        stored[name] = t.dtype
        if name + _SCALE_SUFFIX in raw:
            t = dequantize_fp8_block(t, raw[name + _SCALE_SUFFIX], block_size=block, name=name)
        elif t.dtype in _FP8_DTYPES:
            raise ValueError(f"{name} is stored as {t.dtype} but the checkpoint has no {name + _SCALE_SUFFIX}")
        out[name] = t
    return out, stored


# ----------------------------------------------------------------------------------- loading


def layer_tensor_names(layer: int, *, has_indexer: bool = True, prefix: str = "model.layers") -> dict[str, str]:
    """Checkpoint key -> dsa_ref name for the attention tensors of ``layer``."""
    base = f"{prefix}.{layer}.self_attn."
    return {base + hf: ours for hf, ours in HF_TO_DSA_REF.items() if has_indexer or not hf.startswith("indexer.")}


# --8<-- [start:load_attention_layer]
def load_attention_layer(path: str | os.PathLike, layer: int, *, device=None, dtype: torch.dtype | None = None,
                         stage: str = "sparse", backend: str = "reference", progress: bool = False) -> DSAttention:
    """One attention layer of a local checkpoint as a `DSAttention`, reading only that layer's tensors.

    Args:
        path: checkpoint directory (``config.json``, ``model.safetensors.index.json`` and shards, or a
            single ``model.safetensors``).
        layer: the layer index, ``0 <= layer < num_hidden_layers``.
        device: where the weights go (default CPU).
        dtype: the weights' dtype; default: the checkpoint's (bfloat16 for fp8 weights, which are
            dequantised in float32 and then rounded, as DeepSeek's inference code does).
            ``indexer.weights_proj`` stays float32 (float64 for float64), as in the released models.
        stage, backend: passed to `DSAttention`.
        progress: a tqdm bar over the shards being read.

    Returns:
        The layer; ``has_indexer`` is ``False`` for a GLM-5 layer that reuses an earlier layer's top-k
        (`topk_source_layer` names that layer).

    Raises:
        FileNotFoundError: the directory, ``config.json``, the index or a shard is missing (named).
        ValueError: an unsupported config (see `config_from_hf`), a layer out of range, a tensor the
            checkpoint lacks, or a tensor whose shape does not match the config (the key, the shape
            found and the shape the config implies are named).
    """
    ckpt = Checkpoint(path)
    cfg = config_from_hf(ckpt._config_file)
    _check_layer(layer, ckpt.num_layers, ckpt._config_file)
    owns = indexer_layers(ckpt._config_file)[layer]
    names = layer_tensor_names(layer, has_indexer=owns)
    tensors, stored = _materialise(ckpt, list(names), progress=progress)

    if dtype is None:  # the dtype of q_a_proj.weight; bfloat16 where it was fp8 (DeepSeek's default dtype)
        first = stored[next(iter(names))]
        dtype = torch.bfloat16 if first in _FP8_DTYPES else first
    with torch.device("meta"):  # no memory, no random init: every weight comes from the checkpoint
        module = DSAttention(cfg, stage=stage, backend=backend, has_indexer=owns, dtype=dtype)
    expected = {name: (tuple(t.shape), t.dtype) for name, t in module.state_dict().items()}
    state = {}
    for key, ours in names.items():
        t = tensors[key]
        shape, target = expected[ours]  # target: dtype, except weights_proj (float32)
        if tuple(t.shape) != shape:
            raise ValueError(f"{key} has shape {tuple(t.shape)}, but {ckpt._config_file} implies "
                             f"{shape} for it ({_shape_reason(ours, cfg)})")
        state[ours] = t.to(device=device, dtype=target)
    module.load_state_dict(state, strict=True, assign=True)
    return module
# --8<-- [end:load_attention_layer]


def _shape_reason(name: str, cfg: DSAConfig) -> str:
    m, i = cfg.mla, cfg.indexer
    return {
        "mla.wq_a.weight": f"[q_lora_rank={m.q_lora_rank}, hidden_size={m.dim}]",
        "mla.q_norm.weight": f"[q_lora_rank={m.q_lora_rank}]",
        "mla.wq_b.weight": f"[num_attention_heads={m.n_heads} * (qk_nope_head_dim={m.qk_nope_head_dim} + "
                           f"qk_rope_head_dim={m.qk_rope_head_dim}), q_lora_rank={m.q_lora_rank}]",
        "mla.wkv_a.weight": f"[kv_lora_rank={m.kv_lora_rank} + qk_rope_head_dim={m.qk_rope_head_dim}, "
                            f"hidden_size={m.dim}]",
        "mla.kv_norm.weight": f"[kv_lora_rank={m.kv_lora_rank}]",
        "mla.wkv_b.weight": f"[num_attention_heads={m.n_heads} * (qk_nope_head_dim={m.qk_nope_head_dim} + "
                            f"v_head_dim={m.v_head_dim}), kv_lora_rank={m.kv_lora_rank}]",
        "mla.wo.weight": f"[hidden_size={m.dim}, num_attention_heads={m.n_heads} * v_head_dim={m.v_head_dim}]",
        "indexer.wq_b.weight": f"[index_n_heads={i.n_heads} * index_head_dim={i.head_dim}, "
                               f"q_lora_rank={m.q_lora_rank}]",
        "indexer.wk.weight": f"[index_head_dim={i.head_dim}, hidden_size={m.dim}]",
        "indexer.k_norm.weight": f"[index_head_dim={i.head_dim}]",
        "indexer.k_norm.bias": f"[index_head_dim={i.head_dim}]",
        "indexer.weights_proj.weight": f"[index_n_heads={i.n_heads}, hidden_size={m.dim}]",
    }[name]


def load_input_norm(path: str | os.PathLike, layer: int, *, device=None, dtype: torch.dtype | None = None) -> RMSNorm:
    """The RMSNorm in front of layer ``layer``'s attention (``input_layernorm``, eps = ``rms_norm_eps``).

    Run ``layer_module(load_input_norm(path, L)(x))`` on the hidden states ``x`` that enter layer ``L``.
    """
    ckpt = Checkpoint(path)
    _check_layer(layer, ckpt.num_layers, ckpt._config_file)
    key = f"model.layers.{layer}.input_layernorm.weight"
    weight = _materialise(ckpt, [key], progress=False)[0][key]
    dim = int(_field(ckpt.config, "hidden_size", ckpt._config_file))
    if tuple(weight.shape) != (dim,):
        raise ValueError(f"{key} has shape {tuple(weight.shape)}, but hidden_size={dim} implies ({dim},)")
    norm = RMSNorm(dim, float(ckpt.config.get("rms_norm_eps", 1e-6)), device=device,
                   dtype=dtype or (torch.bfloat16 if weight.dtype in _FP8_DTYPES else weight.dtype))
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


def embed_tokens(path: str | os.PathLike, token_ids: torch.Tensor, *, device=None,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    """The embeddings of ``token_ids``, reading only those rows of ``model.embed_tokens.weight``.

    Args:
        path: checkpoint directory.
        token_ids: int ``[T]`` token ids.
        device, dtype: of the result (default: CPU, the stored dtype).

    Returns:
        ``[T, hidden_size]``: the hidden states entering layer 0 (before its input norm).
    """
    if not isinstance(token_ids, torch.Tensor) or token_ids.dtype not in (torch.int32, torch.int64) \
            or token_ids.dim() != 1:
        raise ValueError(f"token_ids must be a 1-D int tensor [T], got "
                         f"{getattr(token_ids, 'dtype', type(token_ids).__name__)} "
                         f"{tuple(getattr(token_ids, 'shape', ()))}")
    ckpt = Checkpoint(path)
    key = "model.embed_tokens.weight"
    rows = ckpt.read_rows(key, token_ids.cpu())  # [T, dim]
    if key + _SCALE_SUFFIX in ckpt.weight_map:  # an fp8 embedding: each row's scales
        scale = ckpt.read([key + _SCALE_SUFFIX])[key + _SCALE_SUFFIX]
        b0, b1 = _block_size(ckpt.config)
        row_scale = scale.to(torch.float32)[token_ids.cpu().long() // b0]  # [T, ceil(dim / b1)]
        rows = rows.to(torch.float32) * row_scale.repeat_interleave(b1, dim=1)[:, : rows.shape[1]]
        dtype = dtype or torch.bfloat16
    return rows.to(device=device, dtype=dtype or rows.dtype)


# ------------------------------------------------------------------------------------ inspect


def inspect_layer(path: str | os.PathLike, layer: int = 0, *, tokens: int = 8, dtype: torch.dtype | None = None,
                  forward: bool = True, progress: bool = True) -> str:
    """A text report of what a checkpoint holds for one layer (``dsa-ref inspect``).

    Lists the layer's attention tensors (checkpoint key, dsa_ref name, shape, dtype, from the shard
    headers), the derived `DSAConfig`, and -- with ``forward`` -- runs token ids ``0 .. tokens-1``
    through the embedding, the input norm and the layer (a shared GLM-5 layer takes the top-k of its
    source layer, which is loaded and run first) and reports the output and the selection.
    """
    from dataclasses import asdict

    ckpt = Checkpoint(path)
    cfg = config_from_hf(ckpt._config_file)
    _check_layer(layer, ckpt.num_layers, ckpt._config_file)
    owns = indexer_layers(ckpt._config_file)
    names = layer_tensor_names(layer, has_indexer=owns[layer])
    keys = list(names) + [n + _SCALE_SUFFIX for n in names if n + _SCALE_SUFFIX in ckpt.weight_map]
    lines = [f"checkpoint {ckpt.path}: model_type {ckpt.config.get('model_type')}, {ckpt.num_layers} layers, "
             f"{len(set(ckpt.weight_map.values()))} shard(s), {sum(owns)} layers own an indexer",
             f"layer {layer}: " + ("owns an indexer" if owns[layer] else
                                   f"shares the top-k of layer {topk_source_layer(ckpt._config_file, layer)}"),
             "", "tensors:"]
    infos = {i.name: i for i in ckpt.info(keys)}
    width = max(len(k) for k in keys)
    for key in keys:
        i = infos[key]
        ours = names.get(key, "(fp8 block scales)")
        lines.append(f"  {key.ljust(width)}  {ours:<28} {str(list(i.shape)):<14} {i.dtype:<8} {i.file}")
    lines += ["", "derived DSAConfig:"]
    for part, values in asdict(cfg).items():
        lines.append(f"  {part}: " + ", ".join(f"{k}={v}" for k, v in values.items()))
    lines.append(f"  softmax_scale={cfg.mla.softmax_scale:.6g} (mscale {cfg.mla.mscale:.6g}), "
                 f"input norm eps={ckpt.config.get('rms_norm_eps', 1e-6)}")
    if not forward:
        return "\n".join(lines)

    ids = torch.arange(tokens) % int(ckpt.config.get("vocab_size", tokens))
    x = embed_tokens(path, ids, dtype=dtype)
    x = load_input_norm(path, layer, dtype=x.dtype)(x)  # [T, dim]
    shared = {}
    if not owns[layer]:  # run the source layer on the same normalised input to get its selection
        source = load_attention_layer(path, topk_source_layer(ckpt._config_file, layer), dtype=x.dtype,
                                      progress=progress)
        with torch.no_grad():
            shared["topk_indices"] = source(x).topk_indices
    module = load_attention_layer(path, layer, dtype=x.dtype, progress=progress)
    with torch.no_grad():
        out = module(x, **shared)
    o = out.output.float()
    lines += ["", f"forward on token ids 0..{tokens - 1} ({x.dtype}, embedding -> input norm -> layer {layer}):",
              f"  output {list(out.output.shape)}, rms {o.pow(2).mean().sqrt().item():.4g}, "
              f"finite {bool(torch.isfinite(o).all())}",
              f"  indexer loss {out.indexer_loss.item():.4g}" + ("" if owns[layer] else " (no indexer in this layer)"),
              f"  last token selects keys {[i for i in out.topk_indices[-1].tolist() if i >= 0]}"]
    return "\n".join(lines)
