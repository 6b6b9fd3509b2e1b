"""Index sharing (GLM-5's IndexShare): a layer without an indexer attends over an earlier layer's top-k.

Checked against the plain computation: a shared layer's output equals `sparse_mla` over the given
indices with its own projections (sparse stage) and dense windowed attention (warm-up); its indexer
loss is 0 and no gradient reaches an indexer; packed sequences and context parallelism (gloo, 2 real
processes) give the single-process numbers; bad indices are clear errors.
"""

import pytest
import torch
import torch.distributed as dist

from dist_helpers import init_gloo, spawn
from dsa_ref import DSAttention, dense_mla_attention, key_windows, positions, sparse_mla, tiny
from dsa_ref.context_parallel import cp_dsa_forward, shard_tokens

CU = [0, 8, 24, 40]  # three packed sequences (lengths divisible by 2 * cp for the CP test)


def _pair(stage, seed=0):
    """An owner layer and a shared layer (different weights), float64, and packed inputs."""
    torch.manual_seed(seed)
    cfg = tiny()
    owner = DSAttention(cfg, stage=stage, dtype=torch.float64)
    shared = DSAttention(cfg, stage=stage, has_indexer=False, dtype=torch.float64)
    with torch.no_grad():
        for p in list(owner.parameters()) + list(shared.parameters()):
            if p.dim() == 2:
                p.mul_(3.0)
    cu = torch.tensor(CU)
    x = torch.randn(int(cu[-1]), cfg.mla.dim, dtype=torch.float64)
    return owner, shared, cu, x


def _plain(layer, x, cu, idx, stage):
    """The shared layer's output written out: its own projections, attention over idx (or the window)."""
    p = layer.mla.project(x, positions(cu))
    q, kv = layer.absorbed.absorbed_qkv(p)
    r = layer.config.mla.kv_lora_rank
    if stage == "sparse":
        o, _ = sparse_mla(q, kv, idx, sm_scale=layer.mla.softmax_scale, d_v=r)
    else:
        s, e = key_windows(cu)
        o, _ = dense_mla_attention(q, kv, sm_scale=layer.mla.softmax_scale, d_v=r, starts=s, ends=e)
    return layer.absorbed.output(o)


@pytest.mark.parametrize("stage", ["sparse", "dense_warmup"])
def test_shared_layer_equals_plain_computation(stage):
    owner, shared, cu, x = _pair(stage)
    first = owner(x, cu)
    h = first.output.detach()
    out = shared(h, cu, topk_indices=first.topk_indices)
    assert torch.equal(out.topk_indices, first.topk_indices)
    assert out.indexer_loss.item() == 0.0 and not out.indexer_loss.requires_grad
    torch.testing.assert_close(out.output, _plain(shared, h, cu, first.topk_indices, stage), rtol=1e-12, atol=1e-12)
    assert shared.trainable_parameters("dense_warmup") == []
    assert len(shared.trainable_parameters("sparse")) == len(list(shared.parameters()))


def test_indexer_loss_only_on_the_owning_layer():
    """One backward through owner -> shared: the owner's indexer gets its KL gradient, nothing else changes."""
    owner, shared, cu, x = _pair("sparse")
    w = torch.randn_like(x)
    first = owner(x, cu)
    out = shared(first.output, cu, topk_indices=first.topk_indices)
    (out.output * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in owner.indexer.named_parameters()}
    assert all(g.abs().sum() > 0 for g in grads.values())
    # the same gradient as the owner's indexer loss alone: the shared layer adds none
    owner.zero_grad()
    owner(x, cu).indexer_loss.backward()
    for n, p in owner.indexer.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-12, atol=1e-14)


def test_packed_equals_per_sequence():
    owner, shared, cu, x = _pair("sparse", seed=1)
    first = owner(x, cu)
    out = shared(first.output, cu, topk_indices=first.topk_indices).output
    for a, b in zip(CU[:-1], CU[1:]):
        one = torch.tensor([0, b - a])
        f1 = owner(x[a:b], one)
        torch.testing.assert_close(f1.topk_indices, torch.where(first.topk_indices[a:b] >= 0,
                                                                first.topk_indices[a:b] - a, -1))
        o1 = shared(f1.output, one, topk_indices=f1.topk_indices).output
        torch.testing.assert_close(o1, out[a:b], rtol=1e-12, atol=1e-12)


def test_bad_topk_indices():
    owner, shared, cu, x = _pair("sparse")
    idx = owner(x, cu).topk_indices
    with pytest.raises(ValueError, match="has no indexer .*pass topk_indices"):
        shared(x, cu)
    with pytest.raises(ValueError, match="only for a layer built with has_indexer=False"):
        owner(x, cu, topk_indices=idx)
    future = idx.clone()
    future[10, 0] = 11  # query 10 (sequence [8, 24)) may see keys 8..10 only
    with pytest.raises(ValueError, match=r"topk_indices\[10, 0\] = 11 lies outside query 10's key window \[8, 11\)"):
        shared(x, cu, topk_indices=future)
    with pytest.raises(TypeError, match="integer tensor"):
        shared(x, cu, topk_indices=idx.double())
    with pytest.raises(ValueError, match="one row per query token"):
        shared(x, cu, topk_indices=idx[:-1])
    with pytest.raises(TypeError, match="has_indexer must be a bool"):
        DSAttention(tiny(), has_indexer=0)


def _cp_rank(rank, world, init_file):
    init_gloo(rank, world, init_file)
    for stage in ("sparse", "dense_warmup"):
        owner, shared, cu, x = _pair(stage, seed=2)
        w = torch.randn_like(x)
        # single process
        first = owner(x, cu)
        ref = shared(first.output, cu, topk_indices=first.topk_indices)
        (ref.output * w).sum().backward()
        ref_grads = {n: p.grad.clone() for n, p in shared.named_parameters()}
        shared.zero_grad()
        owner.zero_grad()
        # context parallel: the owner's per-rank top-k feeds the shared layer on the same rank
        x_local = shard_tokens(x, cu, world, rank)
        f = cp_dsa_forward(owner, x_local, cu)
        out = cp_dsa_forward(shared, f.output, cu, topk_indices=f.topk_indices)
        torch.testing.assert_close(out.output, shard_tokens(ref.output, cu, world, rank), rtol=1e-12, atol=1e-12)
        assert out.indexer_loss.item() == 0.0
        (out.output * shard_tokens(w, cu, world, rank)).sum().backward()
        for n, p in shared.named_parameters():
            g = p.grad.clone()
            dist.all_reduce(g)  # per-rank gradients add up to the single-process ones
            torch.testing.assert_close(g, ref_grads[n], rtol=1e-10, atol=1e-12)
    dist.destroy_process_group()


@pytest.mark.slow
def test_context_parallel_index_sharing():
    spawn(_cp_rank, 2)
