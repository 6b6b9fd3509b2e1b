"""`dsa_ref.model`: the small DSA language model equals a hand-written loop of its layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsa_ref.config import DSAConfig, IndexerConfig, MLAConfig, RopeConfig
from dsa_ref.model import MODES, DSALanguageModel, ModelConfig, count_parameters, sequence_groups


def small_config(token_shift: bool = False, n_layers: int = 2) -> ModelConfig:
    mla = MLAConfig(dim=32, n_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                    qk_rope_head_dim=4, v_head_dim=8, rope=RopeConfig())
    indexer = IndexerConfig(n_heads=2, head_dim=8, topk=4, rope_head_dim=4)
    return ModelConfig(vocab_size=20, n_layers=n_layers, attention=DSAConfig(mla=mla, indexer=indexer),
                       mlp_hidden=48, token_shift=token_shift)


def make_model(token_shift: bool = False) -> DSALanguageModel:
    torch.manual_seed(0)
    return DSALanguageModel(small_config(token_shift), attn_dtype=torch.float64).double()


def packed_tokens(lengths=(9, 13, 6), vocab=20, seed=1):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (sum(lengths),), generator=gen)  # [T]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])  # [n + 1]
    return tokens, cu


def hand_written(model: DSALanguageModel, tokens, cu, mode):
    """The model's forward written out, one sequence at a time."""
    logits = []
    for b in range(cu.numel() - 1):
        seq = tokens[cu[b]: cu[b + 1]]  # [L]
        x = model.embed(seq)  # [L, dim]
        if model.embed_prev is not None:
            prev = model.embed_prev(seq[:-1])  # [L - 1, dim]
            x = x + torch.cat([torch.zeros_like(x[:1]), prev])  # no predecessor at position 0
        for block in model.blocks:
            h = block.attn_norm(x)
            if mode == "dense":
                a = block.attn.mla(h)  # dense MLA of chapter 1
            else:
                a = block.attn(h, stage=mode).output  # DSAttention of chapter 3
            x = x + a
            x = x + block.mlp.w2(F.silu(block.mlp.w1(block.mlp_norm(x))) * block.mlp.w3(block.mlp_norm(x)))
        logits.append(model.lm_head(model.norm(x)))
    return torch.cat(logits)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("token_shift", [False, True])
def test_model_equals_hand_written_loop(mode, token_shift):
    model = make_model(token_shift)
    tokens, cu = packed_tokens()
    expected = hand_written(model, tokens, cu, mode)
    for seqs_per_call in (None, 1, 2):  # grouping sequences into attention calls changes nothing
        out = model(tokens, cu, mode=mode, seqs_per_call=seqs_per_call)
        torch.testing.assert_close(out.logits, expected.float(), rtol=1e-5, atol=1e-5)
        assert len(out.indexer_losses) == (0 if mode == "dense" else 2)


def test_topk_indices_are_in_packed_index_space():
    model = make_model()
    tokens, cu = packed_tokens()
    whole = model(tokens, cu, mode="sparse")
    grouped = model(tokens, cu, mode="sparse", seqs_per_call=1)
    for a, b in zip(whole.topk_indices, grouped.topk_indices):
        assert torch.equal(a, b)
        seq = torch.repeat_interleave(torch.arange(3), cu.diff())  # [T] sequence of each query
        valid = a >= 0
        assert bool((seq[a.clamp_min(0)] == seq[:, None])[valid].all())  # never another sequence's key


def test_dense_mode_gives_the_indexer_no_gradient():
    model = make_model()
    tokens, cu = packed_tokens()
    model(tokens, cu, mode="dense").logits.sum().backward()
    assert all(p.grad is None for p in model.indexer_parameters())
    assert all(p.grad is not None for p in model.main_parameters())


def test_parameter_count():
    cfg = small_config(token_shift=True)
    model = DSALanguageModel(cfg)
    m, i, d, V = cfg.attention.mla, cfg.attention.indexer, cfg.dim, cfg.vocab_size
    mla = (d * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * m.n_heads * m.qk_head_dim
           + d * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
           + m.kv_lora_rank * m.n_heads * (m.qk_nope_head_dim + m.v_head_dim) + m.n_heads * m.v_head_dim * d)
    indexer = m.q_lora_rank * i.n_heads * i.head_dim + d * i.head_dim + 2 * i.head_dim + d * i.n_heads
    block = 2 * d + mla + indexer + 3 * d * cfg.mlp_hidden
    expected = 2 * V * d + cfg.n_layers * block + d + V * d  # embed, embed_prev, blocks, norm, lm_head
    assert count_parameters(model) == expected
    assert count_parameters(model, exclude_embeddings=True) == expected - 2 * V * d
    assert sum(p.numel() for p in model.indexer_parameters()) == cfg.n_layers * indexer


def test_sequence_groups():
    cu = torch.tensor([0, 3, 5, 9])
    groups = sequence_groups(cu, 2)
    assert [(lo, hi, c.tolist()) for lo, hi, c in groups] == [(0, 5, [0, 3, 5]), (5, 9, [0, 4])]
    assert sequence_groups(cu, None)[0][:2] == (0, 9)
    with pytest.raises(ValueError, match="seqs_per_call"):
        sequence_groups(cu, 0)


def test_bad_inputs_name_the_argument():
    model = make_model()
    tokens, cu = packed_tokens()
    with pytest.raises(ValueError, match="mode"):
        model(tokens, cu, mode="fast")
    with pytest.raises(ValueError, match="tokens"):
        model(tokens + 100, cu)
    with pytest.raises(TypeError, match="tokens"):
        model(tokens.float(), cu)
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(tokens, cu[:-1])
    with pytest.raises(ValueError, match="vocab_size"):
        ModelConfig(vocab_size=0, n_layers=1, attention=small_config().attention, mlp_hidden=4)


def test_dense_mode_on_a_kernel_backend_equals_the_readable_dense_mla():
    """With backend "auto" (no CUDA here: the readable sparse_mla runs each chunk), the dense mode takes
    the window-slot path the kernels use; it must equal chapter 1's dense MLA, output and gradients."""
    tokens, cu = packed_tokens()
    results = []
    for backend in ("reference", "auto"):
        torch.manual_seed(0)
        model = DSALanguageModel(small_config(), backend=backend, attn_dtype=torch.float64).double()
        out = model(tokens, cu, mode="dense")
        out.logits.square().sum().backward()
        results.append((out.logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (ref_logits, ref_grads), (fast_logits, fast_grads) = results
    torch.testing.assert_close(fast_logits, ref_logits, rtol=1e-10, atol=1e-10)
    assert ref_grads.keys() == fast_grads.keys() and not any("indexer" in n for n in fast_grads)
    for name in ref_grads:
        torch.testing.assert_close(fast_grads[name], ref_grads[name], rtol=1e-9, atol=1e-10, msg=name)
