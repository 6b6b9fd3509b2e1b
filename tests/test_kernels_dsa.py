"""DSAttention with ``backend="tilelang"`` against ``backend="reference"`` (skipped without CUDA + tilelang).

Both layers hold the same bf16 weights. The kernel path changes only the rounding of the indexer
scores (fp32 sums in another order) and of the sparse attention (see test_kernels_sparse_mla.py), so:
outputs and gradients agree to a relative L2 of ``REL = 3e-2`` (bf16 through several projections),
the indexer loss to 2e-2 relative, and the top-k selections of at least 99% of the rows are
identical (a row can differ only where two scores tie to fp32 rounding).
"""

import pytest
import torch

from dsa_ref import DSAConfig, DSAttention, IndexerConfig, MLAConfig, RopeConfig
from dsa_ref.kernels.shapes import SM_SCALE, TEST_TOPK
from gpu_helpers import rel_l2, requires_kernels

pytestmark = [requires_kernels, pytest.mark.gpu]

REL = 3e-2


def gpu_small() -> DSAConfig:
    """DeepSeek-V3.2's head widths (so the kernels apply) with 16 heads and a small hidden size."""
    rope = RopeConfig(factor=40.0, original_max_position=4096)
    mla = MLAConfig(dim=512, n_heads=16, q_lora_rank=256, kv_lora_rank=512, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, v_head_dim=128, rope=rope)
    return DSAConfig(mla=mla, indexer=IndexerConfig(n_heads=16, head_dim=128, topk=TEST_TOPK, rope_head_dim=64))


@pytest.mark.parametrize("stage", ["dense_warmup", "sparse"])
def test_dsattention_tilelang_matches_reference(stage):
    cfg = gpu_small()
    assert abs(cfg.mla.softmax_scale - SM_SCALE) < 1e-12
    torch.manual_seed(0)
    ref = DSAttention(cfg, stage=stage, backend="reference", device="cuda", dtype=torch.bfloat16)
    fast = DSAttention(cfg, stage=stage, backend="tilelang", device="cuda", dtype=torch.bfloat16)
    fast.load_state_dict(ref.state_dict())
    cu = torch.tensor([0, 300, 1024], device="cuda")
    x = torch.randn(1024, cfg.mla.dim, device="cuda", dtype=torch.bfloat16)
    w = torch.randn_like(x)
    results = []
    for layer in (ref, fast):
        xx = x.clone().requires_grad_(True)
        res = layer(xx, cu)
        (res.output.float() * w.float()).sum().backward()
        results.append((res, xx.grad, {n: p.grad for n, p in layer.named_parameters()}))
    (r_ref, dx_ref, g_ref), (r_fast, dx_fast, g_fast) = results
    same_rows = (r_ref.topk_indices.sort(dim=1).values == r_fast.topk_indices.sort(dim=1).values).all(dim=1)
    assert same_rows.float().mean() >= 0.99
    assert rel_l2(r_fast.output, r_ref.output) < REL
    assert abs(float(r_fast.indexer_loss) - float(r_ref.indexer_loss)) < 2e-2 * abs(float(r_ref.indexer_loss))
    assert rel_l2(dx_fast, dx_ref) < REL
    for name in g_ref:
        assert rel_l2(g_fast[name], g_ref[name]) < REL, name


def test_dsattention_tilelang_takes_the_slot_path_and_the_topk_kernel(monkeypatch):
    """The fast layer must really run the kernels: count the calls of each slot-path kernel."""
    from dsa_ref import dispatch, kernels

    cfg = gpu_small()
    layer = DSAttention(cfg, stage="sparse", backend="tilelang", device="cuda", dtype=torch.bfloat16)
    x = torch.randn(512, cfg.mla.dim, device="cuda", dtype=torch.bfloat16)
    ops = dispatch.slot_ops("tilelang", q=torch.zeros(4, 16, 576, device="cuda", dtype=torch.bfloat16),
                            kv=torch.zeros(8, 576, device="cuda", dtype=torch.bfloat16),
                            q_i=torch.zeros(4, 16, 128, device="cuda", dtype=torch.bfloat16),
                            k_i=torch.zeros(8, 128, device="cuda", dtype=torch.bfloat16),
                            w_i=torch.zeros(4, 16, device="cuda"))
    assert ops is not None and ops.sparse_mla.func.__module__.startswith("dsa_ref.kernels")
    # the layer's own slots skip the index checks (and their syncs); the default keeps them
    from dsa_ref.kernels.attention_target import attention_head_sum_tilelang
    from dsa_ref.kernels.autograd import sparse_mla_tilelang
    from dsa_ref.kernels.indexer_bwd import index_scores_at_tilelang

    unchecked = dispatch.slot_ops("tilelang", q=torch.zeros(4, 16, 576, device="cuda", dtype=torch.bfloat16),
                                  kv=torch.zeros(8, 576, device="cuda", dtype=torch.bfloat16),
                                  q_i=torch.zeros(4, 16, 128, device="cuda", dtype=torch.bfloat16),
                                  k_i=torch.zeros(8, 128, device="cuda", dtype=torch.bfloat16),
                                  w_i=torch.zeros(4, 16, device="cuda"), validate=False)
    for name, fn in (("sparse_mla", sparse_mla_tilelang), ("attention_head_sum", attention_head_sum_tilelang),
                     ("index_scores_at", index_scores_at_tilelang)):
        assert getattr(ops, name).func is fn and getattr(ops, name).keywords == {"validate": True}
        assert getattr(unchecked, name).func is fn and getattr(unchecked, name).keywords == {"validate": False}
    calls = []
    real_topk = kernels.topk_indices
    monkeypatch.setattr(kernels, "topk_indices", lambda *a, **k: calls.append("topk") or real_topk(*a, **k))
    res = layer(x)
    assert calls == ["topk"]
    assert torch.isfinite(res.output).all() and torch.isfinite(res.indexer_loss)
    # float32 layers are not supported by the kernels: auto falls back to the readable path
    assert dispatch.slot_ops("auto", q=torch.zeros(4, 16, 576, device="cuda"), kv=torch.zeros(8, 576, device="cuda"),
                             q_i=torch.zeros(4, 16, 128, device="cuda"), k_i=torch.zeros(8, 128, device="cuda"),
                             w_i=torch.zeros(4, 16, device="cuda")) is None
