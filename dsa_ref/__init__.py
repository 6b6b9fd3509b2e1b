"""dsa_ref: a readable reference implementation and correctness oracle for DeepSeek Sparse Attention.

The functional oracle API (names and semantics fixed; see the Conventions page):

* `sparse_mla`, `dense_mla_attention` -- absorbed-MLA attention over selected keys / over the window;
* `lightning_indexer`, `topk_indices` -- the indexer scores and the canonical top-k;
* `indexer_loss` -- the KL loss of both training stages;
* `key_windows`, `positions`, `cp_shard_index`, `window_mask` -- the token layout all masks come from.

The modules: `MLA`, `AbsorbedMLA`, `LightningIndexer`, `DSAttention`.

For kernel authors: `dsa_ref.oracle` (adapters for the common kernel conventions, `check_sparse_mla`
and friends), `dsa_ref.compare` (reports and tolerances), `dsa_ref.adversarial` (hard inputs),
`dsa_ref.fp8` (DeepSeek's fp8 indexer quantisation, simulated); ``dsa-ref verify`` on the command line.
Real checkpoints: `dsa_ref.checkpoints` (one layer of DeepSeek-V3.2 / GLM-5 from Hugging Face files).
"""

from . import adversarial, checkpoints, fp8, oracle
from .absorbed_mla import AbsorbedMLA
from .attention import dense_mla_attention
from .compare import TOLERANCES, Tolerance, attention_mass_recall, compare, compare_topk
from .config import DSAConfig, IndexerConfig, MLAConfig, RopeConfig, deepseek_v32, tiny
from .dsa import DSAOutput, DSAttention, IndexerLossAutoScaler, set_indexer_loss_scale
from .indexer import LightningIndexer, index_scores_at, lightning_indexer, topk_indices
from .indexer_loss import indexer_loss
from .layout import cp_shard_index, key_windows, positions, window_mask
from .mla import MLA
from .oracle import (
    CONVENTIONS,
    DSA_REF,
    FLASHMLA_SPARSE_PREFILL,
    MEGATRON_SBHD,
    MEGATRON_TILELANG_OPS,
    TILELANG_DEEPSEEK_V32,
    TILELANG_SPARSE_FINETUNE,
    Convention,
    check_indexer,
    check_sparse_mla,
    check_sparse_mla_backward,
    check_topk,
)
from .sparse_attention import attention_head_sum, sparse_mla

__version__ = "0.1.0"

__all__ = [
    "CONVENTIONS",
    "Convention",
    "DSA_REF",
    "FLASHMLA_SPARSE_PREFILL",
    "MEGATRON_SBHD",
    "MEGATRON_TILELANG_OPS",
    "TILELANG_DEEPSEEK_V32",
    "TILELANG_SPARSE_FINETUNE",
    "TOLERANCES",
    "Tolerance",
    "adversarial",
    "checkpoints",
    "attention_mass_recall",
    "check_indexer",
    "check_sparse_mla",
    "check_sparse_mla_backward",
    "check_topk",
    "compare",
    "compare_topk",
    "fp8",
    "oracle",
    "AbsorbedMLA",
    "DSAConfig",
    "DSAOutput",
    "DSAttention",
    "IndexerConfig",
    "IndexerLossAutoScaler",
    "LightningIndexer",
    "MLA",
    "MLAConfig",
    "RopeConfig",
    "cp_shard_index",
    "deepseek_v32",
    "dense_mla_attention",
    "indexer_loss",
    "key_windows",
    "lightning_indexer",
    "index_scores_at",
    "positions",
    "set_indexer_loss_scale",
    "sparse_mla",
    "attention_head_sum",
    "tiny",
    "topk_indices",
    "window_mask",
]
