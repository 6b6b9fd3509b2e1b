"""dsa_ref against transformers' own DeepseekV32 and GlmMoeDsa attention, from save_pretrained files.

A tiny random model of each type is saved with ``save_pretrained`` (safetensors) and one layer is
loaded back with `dsa_ref.checkpoints.load_attention_layer`. Both implementations then see the same
tokens (two sequences: a padded batch for transformers, packed for dsa_ref) and the same RoPE
angles. Compared: the index scores (transformers' scores are captured where its indexer ranks
them), the selected sets (tie-aware), the layer output and the input gradient given the same
selection.

transformers computes the index scores and the softmax in float32 even for a float64 model, so the
"float64" runs are checked with the float32 tolerances; bf16 runs compare both sides in bf16.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dsa_ref import compare, compare_topk, lightning_indexer  # noqa: E402
from dsa_ref.checkpoints import config_from_hf, indexer_layers, load_attention_layer  # noqa: E402
from dsa_ref.compare import TOLERANCES  # noqa: E402
from dsa_ref.layout import key_windows, positions  # noqa: E402
from dsa_ref.rope import rope_inv_freq  # noqa: E402

B, S = 2, 24  # two sequences of 24 tokens; top-k 8 drops keys in most rows

TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, n_group=1,
            topk_group=1, num_experts_per_tok=2, kv_lora_rank=64, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
            qk_nope_head_dim=16, index_topk=8, index_head_dim=16, index_n_heads=8, first_k_dense_replace=1,
            max_position_embeddings=1280,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                             "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0,
                             "mscale": 1.0, "mscale_all_dim": 1.0})


def _hf_model(model_type: str, dtype: torch.dtype, seed: int = 0):
    torch.manual_seed(seed)
    if model_type == "deepseek_v32":
        cfg = transformers.DeepseekV32Config(**TINY)
        model = transformers.DeepseekV32ForCausalLM(cfg)
    else:
        cfg = transformers.GlmMoeDsaConfig(**TINY, indexer_types=["full", "shared", "full"])
        model = transformers.GlmMoeDsaForCausalLM(cfg)
    cfg._attn_implementation = "eager"
    with torch.no_grad():  # larger weights: peakier attention, so the selection matters
        for name, p in model.named_parameters():
            if "self_attn" in name and p.dim() == 2:
                p.mul_(3.0)
    return model.to(dtype).eval()


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def saved(request, tmp_path_factory):
    """(model_type, directory, float64 HF model) with the model saved by save_pretrained."""
    model = _hf_model(request.param, torch.float64)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, str(path), model


def _angles(cfg, dtype):
    """HF's (cos, sin) [B, S, rope] built from dsa_ref's float64 frequencies (both halves equal)."""
    inv = rope_inv_freq(cfg.mla.qk_rope_head_dim, cfg.mla.rope)  # [rope/2] float64
    freqs = torch.arange(S, dtype=torch.float64)[:, None] * inv[None]  # [S, rope/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [S, rope]
    return emb.cos().to(dtype).expand(B, S, -1), emb.sin().to(dtype).expand(B, S, -1)


def _causal_mask(dtype):
    mask = torch.full((S, S), float("-inf"), dtype=dtype).triu(1)  # [S, S]
    return mask.expand(B, 1, S, S)


def _hf_forward(attn, x, angles, *, indices=None, prev=None):
    """HF attention on [B, S, dim]; ``indices`` [B*S, K] replaces its indexer's selection."""
    mask = _causal_mask(x.dtype)
    kwargs = {}
    if prev is not None:
        kwargs["prev_topk_indices"] = prev
    if indices is not None and attn.indexer is not None:
        saved_forward = attn.indexer.forward
        attn.indexer.forward = lambda *a, **k: indices
        try:
            out = attn(x, position_embeddings=angles, attention_mask=mask, **kwargs)
        finally:
            attn.indexer.forward = saved_forward
    else:
        out = attn(x, position_embeddings=angles, attention_mask=mask, **kwargs)
    return out[0]


def _hf_index_scores(attn, x, angles, monkeypatch):
    """The [B, S, S] scores transformers' indexer ranks, and its [B, S, K] selection."""
    seen = []
    original = torch.Tensor.topk

    def spy(self, *args, **kwargs):
        seen.append(self.detach().clone())
        return original(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "topk", spy)
        with torch.no_grad():
            q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
            idx = attn.indexer(x, q_resid, angles, _causal_mask(x.dtype)[:, 0], None)
    return seen[-1], idx


def _ours_index_scores(layer, x_packed, cu):
    pos = positions(cu)
    starts, ends = key_windows(cu)
    p = layer.mla.project(x_packed, pos)
    q, k, w = layer.indexer.project(x_packed, p.qr, pos)
    return lightning_indexer(q, k, w, starts=starts, ends=ends, relu=layer.config.indexer.use_relu)  # [T, T]


def _packed(hf_idx_or_scores):
    """[B, S, ...] in per-sequence key indices -> packed [B*S, ...] in global key indices."""
    return hf_idx_or_scores.reshape(B * S, *hf_idx_or_scores.shape[2:])


def _to_global(idx, fill=None):
    """HF [B, S, K] per-sequence indices -> [B*S, K] packed global indices."""
    offset = (torch.arange(B) * S)[:, None, None]
    return (idx.long() + offset).reshape(B * S, -1)


def _to_hf(idx):
    """Packed [B*S, K] global indices (-1 = unused) -> HF [B, S, K] per-sequence (unused -> slot 0's key)."""
    idx = torch.where(idx >= 0, idx, idx[:, :1])  # slot 0 is always valid (the diagonal is in every window)
    return (idx.reshape(B, S, -1) - (torch.arange(B) * S)[:, None, None]).to(torch.int32)


def _block_scores(ours, hf):
    """Our packed [T, T] scores restricted to the per-sequence blocks: [B, S, S]."""
    return torch.stack([ours[b * S:(b + 1) * S, b * S:(b + 1) * S] for b in range(B)])


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_layer_matches_transformers(saved, dtype, monkeypatch):
    model_type, path, hf64 = saved
    hf = hf64 if dtype == torch.float64 else _hf_model(model_type, dtype)
    cfg = config_from_hf(path)
    owns = indexer_layers(path)
    g = torch.Generator().manual_seed(1)
    x64 = torch.randn(B, S, cfg.mla.dim, generator=g, dtype=torch.float64)
    w64 = torch.randn(B, S, cfg.mla.dim, generator=g, dtype=torch.float64)
    x, w = x64.to(dtype), w64.to(dtype)
    angles = _angles(cfg, dtype)
    cu = torch.tensor([0, S, 2 * S])
    tol = TOLERANCES[torch.float32] if dtype == torch.float64 else TOLERANCES[torch.bfloat16].scaled(2.0)
    shared_from = None
    for L in range(len(owns)):
        layer = load_attention_layer(path, L, dtype=dtype)
        assert layer.has_indexer == owns[L]
        attn = hf.model.layers[L].self_attn
        assert (attn.indexer is not None) == owns[L]
        xp = x.reshape(B * S, -1)
        if owns[L]:
            # index scores: same numbers where finite, -inf at the same places (outside the windows)
            hf_scores, hf_idx = _hf_index_scores(attn, x, angles, monkeypatch)
            with torch.no_grad():
                ours = _ours_index_scores(layer, xp, cu)
            mine = _block_scores(ours, hf_scores)
            assert torch.equal(torch.isinf(mine), torch.isinf(hf_scores))
            fin = torch.isfinite(mine)
            score_tol = tol if dtype == torch.float64 else TOLERANCES[torch.bfloat16].scaled(3.0)
            compare(hf_scores[fin].double(), mine[fin], name=f"index scores L{L}", tol=score_tol).assert_ok()
            # selections: HF's (masked slots -> -1) against ours, tie-aware on our scores
            hf_sel = _to_global(hf_idx)
            picked = ours.gather(1, hf_sel)
            hf_sel = torch.where(torch.isinf(picked), torch.full_like(hf_sel, -1), hf_sel)
            tie_tol = 0.0 if dtype == torch.float64 else 0.05 * float(ours[torch.isfinite(ours)].abs().max())
            if dtype == torch.float64:
                tie_tol = 1e-5 * float(ours[torch.isfinite(ours)].abs().max())  # HF scores in float32
            rep = compare_topk(hf_sel, None, ours.double(), k=cfg.indexer.topk, tie_tol=tie_tol)
            assert rep.ok, str(rep)
        # the layer output and the input gradient, given the same selection
        xr = xp.detach().clone().requires_grad_(True)
        kwargs = {} if owns[L] else {"topk_indices": shared_from}
        out = layer(xr, cu, **kwargs)
        (out.output.float() * w.reshape(B * S, -1).float()).sum().backward()
        sel = out.topk_indices
        if owns[L]:
            shared_from = sel
        xh = x.detach().clone().requires_grad_(True)
        hf_out = _hf_forward(attn, xh, angles, indices=_to_hf(sel) if owns[L] else None,
                             prev=None if owns[L] else _to_hf(sel))
        (hf_out.float() * w.float()).sum().backward()
        compare(out.output, hf_out.reshape(B * S, -1), name=f"output L{L}", tol=tol).assert_ok()
        compare(xr.grad, xh.grad.reshape(B * S, -1), name=f"dx L{L}", tol=tol).assert_ok()


def test_rope_frequencies_match_transformers(saved):
    """transformers' YaRN frequencies (float32) and attention factor equal dsa_ref's for the same config."""
    model_type, path, hf = saved
    cfg = config_from_hf(path)
    rot = hf.model.rotary_emb
    ours = rope_inv_freq(cfg.mla.qk_rope_head_dim, cfg.mla.rope)
    torch.testing.assert_close(rot.inv_freq.double(), ours, rtol=1e-6, atol=0)
    assert rot.attention_scaling == 1.0
    assert hf.model.layers[0].self_attn.scaling == pytest.approx(cfg.mla.softmax_scale, rel=1e-12)


def test_config_fields(saved):
    model_type, path, hf = saved
    cfg = config_from_hf(path)
    glm = model_type == "glm_moe_dsa"
    assert cfg.indexer.rope_interleaved is glm and cfg.mla.rope_interleaved
    assert cfg.indexer.use_hadamard is not glm and cfg.indexer.use_relu
    assert (cfg.indexer.n_heads, cfg.indexer.head_dim, cfg.indexer.topk) == (8, 16, 8)
    assert cfg.mla.rope.factor == 40.0 and cfg.mla.rope.original_max_position == 32
    assert indexer_layers(path) == ([True, False, True] if glm else [True] * 3)
