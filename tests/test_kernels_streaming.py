"""The streamed selection and the streamed dense-stage loss on the kernels (skipped without CUDA + tilelang).

* selection: `streamed_topk_indices` with `dsa_ref.kernels.chunk_selector` (indexer kernel + radix
  top-k per query chunk, keys limited to the chunk's range) equals the kernels on the whole
  ``[T, S]`` scores exactly, and on small-integer inputs (exact scores, ties everywhere) equals
  the readable ``topk_indices(lightning_indexer(...))`` exactly -- ties across chunk and range
  boundaries, rows with fewer keys than k, empty windows, packed and CP windows;
* loss: `streamed_indexer_loss` on the kernels' slot ops (many key tiles) against the readable
  streamed loss on the same bf16 values in float32: loss to 1e-3 relative, gradients to a
  relative L2 of 2e-2 (bf16 gradients of the index-score kernel, see test_kernels_indexer_bwd.py);
* `windowed_attention_on_slots` in query chunks on the kernels against `dense_mla_attention`;
* `DSAttention` with small stream budgets (many chunks and tiles) against the reference layer.
"""

import pytest
import torch

from dsa_ref import DSAttention, dense_mla_attention, key_windows, lightning_indexer, topk_indices
from dsa_ref import streaming, streaming_loss
from dsa_ref.kernels.shapes import DIM, DIM_V, SM_SCALE
from dsa_ref.layout import cp_shard_index
from dsa_ref.streaming import streamed_topk_indices
from dsa_ref.streaming_loss import streamed_indexer_loss, windowed_attention_on_slots
from gpu_helpers import rel_l2, requires_kernels

pytestmark = [requires_kernels, pytest.mark.gpu]

CUDA = "cuda"


def _windows(kind):
    if kind == "packed":
        cu = torch.tensor([0, 1, 300, 1000, 1536])
        return (*key_windows(cu), 1536)
    cu = torch.tensor([0, 512, 2048])  # CP rank 1 of 4 over every key
    return (*key_windows(cu, cp_shard_index(cu, 4, 1)), 2048)


def _indexer(T, S, *, H=64, D=128, seed=0, integer=False):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    if integer:
        q = torch.randint(-1, 2, (T, H, D), device=CUDA, generator=g).bfloat16()
        k = torch.randint(-1, 2, (S, D), device=CUDA, generator=g).bfloat16()
        w = torch.randint(-2, 3, (T, H), device=CUDA, generator=g).float()
        return q, k, w
    return (torch.randn(T, H, D, device=CUDA, generator=g).bfloat16(), torch.randn(S, D, device=CUDA, generator=g).bfloat16(),
            torch.randn(T, H, device=CUDA, generator=g) * (H * D) ** -0.5)


@pytest.mark.parametrize("kind", ["packed", "cp"])
@pytest.mark.parametrize("query_chunk", [None, 1, 100, 512])
def test_kernel_selection_equals_whole_row_kernels(kind, query_chunk):
    from dsa_ref.kernels import chunk_selector
    from dsa_ref.kernels.autograd import lightning_indexer_tilelang
    from dsa_ref.kernels.topk import topk_indices_tilelang

    starts, ends, S = _windows(kind)
    starts, ends = starts.to(CUDA), ends.to(CUDA)
    q, k, w = _indexer(starts.numel(), S)
    want = topk_indices_tilelang(lightning_indexer_tilelang(q, k, w, starts=starts, ends=ends), 128)
    got = streamed_topk_indices(q, k, w, 128, starts=starts, ends=ends, query_chunk=query_chunk,
                                chunk_selector=chunk_selector(q, k, w))
    assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["packed", "cp"])
@pytest.mark.parametrize("topk", [128, 2048])  # 2048: more than many windows hold (-1 padding)
def test_kernel_selection_ties_equal_the_readable_selection(kind, topk):
    from dsa_ref.kernels import chunk_selector

    starts, ends, S = _windows(kind)
    starts, ends = starts.to(CUDA), ends.to(CUDA)
    q, k, w = _indexer(starts.numel(), S, integer=True)
    want = topk_indices(lightning_indexer(q.double(), k.double(), w.double(), starts=starts, ends=ends), topk)
    got = streamed_topk_indices(q, k, w, topk, starts=starts, ends=ends, query_chunk=77,
                                chunk_selector=chunk_selector(q, k, w))
    assert torch.equal(got, want)
    empty = torch.zeros_like(starts)
    none = streamed_topk_indices(q, k, w, 16, starts=empty, ends=empty, chunk_selector=chunk_selector(q, k, w))
    assert (none == -1).all()


def _loss_inputs(kind, H=64, seed=1):
    starts, ends, S = _windows(kind)
    starts, ends = starts.to(CUDA), ends.to(CUDA)
    T = starts.numel()
    g = torch.Generator(device=CUDA).manual_seed(seed)
    q = torch.randn(T, H, DIM, device=CUDA, generator=g).bfloat16()
    kv = torch.randn(S, DIM, device=CUDA, generator=g).bfloat16()
    q_i, k_i, w_i = _indexer(T, S, seed=seed + 1)
    _, lse = dense_mla_attention(q, kv, sm_scale=SM_SCALE, d_v=DIM_V, starts=starts, ends=ends)
    return dict(q_i=q_i, k_i=k_i, w_i=w_i, q=q, kv=kv, lse=lse.float(), starts=starts, ends=ends)


@pytest.mark.parametrize("kind", ["packed", "cp"])
@pytest.mark.parametrize("key_tile", [None, 64, 200])
def test_kernel_streamed_loss_matches_readable(kind, key_tile):
    from dsa_ref import dispatch

    x = _loss_inputs(kind)
    ops = dispatch.slot_ops("tilelang", q=x["q"], kv=x["kv"], q_i=x["q_i"], k_i=x["k_i"], w_i=x["w_i"])
    results = []
    for use_ops, tile in ((None, 256), (ops, key_tile)):
        leaves = [x[n].clone().requires_grad_(True) for n in ("q_i", "k_i", "w_i")]
        mask = torch.arange(x["q"].shape[0], device=CUDA) % 7 != 3
        loss = streamed_indexer_loss(*leaves, x["q"], x["kv"], x["lse"], sm_scale=SM_SCALE, starts=x["starts"],
                                     ends=x["ends"], row_mask=mask, key_tile=tile, ops=use_ops)
        results.append((loss.detach(), torch.autograd.grad(loss, leaves)))
    (ref, ref_grads), (got, got_grads) = results
    assert abs(float(got) - float(ref)) < 1e-3 * abs(float(ref)) + 1e-5
    for a, b in zip(got_grads, ref_grads):
        assert rel_l2(a, b) < 2e-2


@pytest.mark.parametrize("kind", ["packed", "cp"])
@pytest.mark.parametrize("query_chunk", [None, 100])
def test_kernel_windowed_attention_matches_dense(kind, query_chunk):
    from dsa_ref import dispatch

    x = _loss_inputs(kind, H=128)
    ops = dispatch.slot_ops("tilelang", q=x["q"], kv=x["kv"], q_i=x["q_i"], k_i=x["k_i"], w_i=x["w_i"])
    d_out = torch.randn(x["q"].shape[0], 128, DIM_V, device=CUDA).bfloat16()
    results = []
    for fn in (lambda q, kv: dense_mla_attention(q, kv, sm_scale=SM_SCALE, d_v=DIM_V, starts=x["starts"], ends=x["ends"]),
               lambda q, kv: windowed_attention_on_slots(q, kv, sm_scale=SM_SCALE, d_v=DIM_V, starts=x["starts"],
                                                         ends=x["ends"], ops=ops, query_chunk=query_chunk)):
        q, kv = x["q"].clone().requires_grad_(True), x["kv"].clone().requires_grad_(True)
        out, lse = fn(q, kv)
        results.append((out, lse, *torch.autograd.grad(out, (q, kv), d_out)))
    for a, b in zip(results[1], results[0]):
        assert rel_l2(a, b) < 2e-2


@pytest.mark.parametrize("stage", ["dense_warmup", "sparse"])
def test_layer_with_small_stream_budgets_matches_reference(stage, monkeypatch):
    from test_kernels_dsa import REL, gpu_small

    monkeypatch.setattr(streaming, "KERNEL_SCORE_ELEMENTS", 1024 * 300)  # many chunks, tiles and blocks
    monkeypatch.setattr(streaming_loss, "KERNEL_SCORE_ELEMENTS", 1024 * 300)
    cfg = gpu_small()
    torch.manual_seed(0)
    ref = DSAttention(cfg, stage=stage, backend="reference", device=CUDA, dtype=torch.bfloat16)
    fast = DSAttention(cfg, stage=stage, backend="tilelang", device=CUDA, dtype=torch.bfloat16)
    fast.load_state_dict(ref.state_dict())
    cu = torch.tensor([0, 300, 1024], device=CUDA)
    x = torch.randn(1024, cfg.mla.dim, device=CUDA, dtype=torch.bfloat16)
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
