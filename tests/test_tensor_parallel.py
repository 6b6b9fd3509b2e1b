"""Tensor parallelism (alone and as tp x cp) on real processes (gloo) must equal the single-process run.

Every rank builds the same full layer and inputs from a fixed seed, runs the single-process
reference itself, then its shard (`TensorParallelDSA.from_dense`), and asserts equality of the
outputs, the logged loss, the input gradients and every parameter gradient (split ones gathered
over TP, replicated ones after `sync_tensor_parallel_grads`). An assertion on any rank fails the
test with that rank's traceback. Few spawns, several scenarios per spawn: fork is cheap, gloo
start-up is not.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from dist_helpers import init_gloo, peaky_scenario, spawn
from dsa_ref import MLA, AbsorbedMLA, DSAttention, deepseek_v32, indexer_loss, tiny, topk_indices, window_mask
from dsa_ref.context_parallel import cp_dsa_forward, reduce_loss_for_logging, shard_tokens
from dsa_ref.indexer_loss import indexer_target
from dsa_ref.layout import cp_shard_index, key_windows
from dsa_ref.tensor_parallel import (
    LATENT_GRADS,
    SPLIT_DIMS,
    HeadParallelMLA,
    TensorParallelDSA,
    copy_to_tp,
    make_tp_cp_groups,
    parameter_kind,
    reduce_from_tp,
    sync_tensor_parallel_grads,
    tp_collective_bytes,
)

pytestmark = pytest.mark.slow

ATOL = 1e-10  # float64: TP only regroups the same sums


def _reference(layer, cu, x, w_out, row_mask=None):
    x = x.clone().requires_grad_(True)
    layer.zero_grad()
    res = layer(x, cu, loss_row_mask=row_mask)
    (res.output * w_out).sum().backward()
    return res, x.grad.clone(), {n: p.grad.clone() for n, p in layer.named_parameters()}


def _check_equivalence(layer, cu, x, w_out, *, tp_group, cp_group=None, cp_size=1, cp_rank=0,
                       latent_grads="activations", kl_target="all_reduce", row_mask=None, where=""):
    """Run the reference and this rank's TP (x CP) share, and compare everything."""
    ref, ref_dx, ref_grads = _reference(layer, cu, x, w_out, row_mask)
    tp = TensorParallelDSA.from_dense(layer, tp_group=tp_group, latent_grads=latent_grads, kl_target=kl_target)
    where = f"{where} rank {dist.get_rank()}: {cu.tolist()} {layer.stage} {layer.loss_reduction} " \
            f"{latent_grads} {kl_target}"
    # the shards put back together are the full layer's weights
    full = dict(layer.named_parameters())
    for n, t in tp.full_tensors().items():
        assert torch.equal(t, full[n]), f"{where}: weight {n}"

    idx = cp_shard_index(cu, cp_size, cp_rank)
    x_local = x[idx].clone().requires_grad_(True)
    mask_local = None if row_mask is None else row_mask[idx]
    if cp_group is None:
        res = tp(x_local, cu, loss_row_mask=mask_local)
    else:
        res = cp_dsa_forward(tp, x_local, cu, group=cp_group, cp_size=cp_size, loss_row_mask=mask_local)
    (res.output * w_out[idx]).sum().backward()

    assert torch.equal(res.topk_indices, ref.topk_indices[idx]), where
    torch.testing.assert_close(res.output, ref.output[idx], atol=ATOL, rtol=0, msg=where)
    torch.testing.assert_close(x_local.grad, ref_dx[idx], atol=ATOL, rtol=0, msg=f"{where}: dx")
    loss = res.indexer_loss if cp_group is None else reduce_loss_for_logging(res.indexer_loss, cp_group)
    if kl_target == "all_reduce":
        torch.testing.assert_close(loss, ref.indexer_loss.detach(), atol=ATOL, rtol=0, msg=f"{where}: loss")
    else:  # local targets: the mean of the ranks' losses bounds the true KL from above (convexity)
        mean = reduce_loss_for_logging(loss, tp_group) / dist.get_world_size(tp_group)
        assert mean >= ref.indexer_loss.detach() - ATOL, where

    if kl_target == "all_reduce" and latent_grads == "activations":
        # nothing reduced yet: every replicated gradient is already complete and bitwise equal over TP
        tp.check_replicated_parameters(grads=True)
    sync_tensor_parallel_grads(tp)
    tp.check_replicated_parameters(grads=True)
    if cp_group is not None:
        for p in tp.parameters():  # the CP ranks' gradients add up (replicated over CP)
            dist.all_reduce(p.grad, group=cp_group)
    grads = tp.full_tensors(grads=True)
    assert set(grads) == set(ref_grads)
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], atol=ATOL, rtol=0, msg=f"{where}: grad {n}")


def _worker_tp2(rank: int, world: int, init_file: str) -> None:
    init_gloo(rank, world, init_file)
    scenarios = [
        ([0, 32], "sparse", "mean", "activations", "all_reduce"),
        ([0, 8, 32, 48], "sparse", "mean", "parameters", "all_reduce"),  # uneven pack: 8, 24, 16
        ([0, 8, 32, 48], "dense_warmup", "mean", "activations", "all_reduce"),
        ([0, 16, 24, 48], "sparse", "sum", "activations", "local"),
        ([0, 8, 32, 48], "dense_warmup", "mean", "parameters", "local"),
    ]
    for i, (cu_list, stage, reduction, latent_grads, kl_target) in enumerate(scenarios):
        layer, cu, x, w_out = peaky_scenario(cu_list, stage, reduction, seed=200 + i)
        _check_equivalence(layer, cu, x, w_out, tp_group=None, latent_grads=latent_grads, kl_target=kl_target,
                           where="tp=2")
    # padding rows left out of the indexer loss (here: the last packed sequence)
    layer, cu, x, w_out = peaky_scenario([0, 8, 32, 48], "sparse", "mean", seed=210)
    _check_equivalence(layer, cu, x, w_out, tp_group=None, row_mask=torch.arange(48) < 32, where="tp=2")
    _mla_tp2()
    _errors_tp2(rank)
    dist.destroy_process_group()


def _mla_tp2() -> None:
    """The head-split MLA alone, dense and absorbed, equals the full one (forward and backward)."""
    torch.manual_seed(5)
    cfg = tiny().mla
    full = MLA(cfg, dtype=torch.float64)
    cu = torch.tensor([0, 8, 24])
    x = torch.randn(24, cfg.dim, dtype=torch.float64)
    w_out = torch.randn(24, cfg.dim, dtype=torch.float64)
    full_params = dict(full.named_parameters())
    for latent_grads in LATENT_GRADS:
        shard = HeadParallelMLA(cfg, group=None, tp_size=2, latent_grads=latent_grads, dtype=torch.float64)
        with torch.no_grad():
            for n, p in shard.named_parameters():
                dim = SPLIT_DIMS.get("mla." + n)
                p.copy_(full_params[n] if dim is None else full_params[n].chunk(2, dim)[dist.get_rank()])
        for ref_module, tp_module in ((full, shard), (AbsorbedMLA(full), AbsorbedMLA(shard))):
            where = f"{type(ref_module).__name__} {latent_grads}"
            out = []
            for module in (ref_module, tp_module):
                module.zero_grad()
                xi = x.clone().requires_grad_(True)
                y = module(xi, cu)
                (y * w_out).sum().backward()
                out.append((y.detach(), xi.grad))
            torch.testing.assert_close(out[1][0], out[0][0], atol=ATOL, rtol=0, msg=where)
            torch.testing.assert_close(out[1][1], out[0][1], atol=ATOL, rtol=0, msg=f"{where}: dx")
            for n, p in shard.named_parameters():
                g = p.grad.clone()
                dim = SPLIT_DIMS.get("mla." + n)
                if dim is not None:
                    g = full_params[n].grad.chunk(2, dim)[dist.get_rank()] - g
                else:
                    if latent_grads == "parameters":
                        dist.all_reduce(g)  # each rank holds its heads' share
                    g = full_params[n].grad - g
                assert g.abs().max() < ATOL, f"{where}: grad {n}"


def _errors_tp2(rank: int) -> None:
    layer, cu, x, _ = peaky_scenario([0, 8, 24], "sparse", "mean", seed=7)
    bad_heads = dataclasses.replace(tiny(), mla=dataclasses.replace(tiny().mla, n_heads=3))
    with pytest.raises(ValueError, match="n_heads=3 is not divisible by tp=2"):
        TensorParallelDSA(bad_heads)
    with pytest.raises(ValueError, match="tp_size=4 does not match the TP group's size 2"):
        TensorParallelDSA.from_dense(layer, tp_size=4)
    with pytest.raises(ValueError, match="latent_grads"):
        TensorParallelDSA(tiny(), latent_grads="weights")
    with pytest.raises(ValueError, match="kl_target"):
        TensorParallelDSA(tiny(), kl_target="sum")
    with pytest.raises(TypeError, match="full dsa_ref.DSAttention"):
        TensorParallelDSA.from_dense(TensorParallelDSA(tiny()))

    tp = TensorParallelDSA.from_dense(layer)
    # ranks given different tokens: every rank raises, none hangs
    with pytest.raises(ValueError, match="the layer inputs differ .*: x"):
        tp(x + rank, cu)
    # an indexer whose replicas drifted apart selects differently: caught after the forward
    drifted = TensorParallelDSA.from_dense(layer)
    with torch.no_grad():
        drifted.indexer.wk.weight[0].add_(rank * 10.0)
    with pytest.raises(ValueError, match="the replicated parameters differ .*indexer.wk.weight"):
        drifted.check_replicated_parameters()
    with pytest.raises(ValueError, match="the indexer's results differ .*topk_indices"):
        drifted(x, cu)
    # the checks can be switched off; the top-k then differ silently, which is what they guard against
    drifted.check_replicas = False
    res = drifted(x, cu)
    picked = [torch.empty_like(res.topk_indices) for _ in range(2)]
    dist.all_gather(picked, res.topk_indices)
    assert not torch.equal(picked[0], picked[1])
    # a head_sum_reduce of one's own is refused: the module brings the TP all-reduce
    with pytest.raises(ValueError, match="brings its own head_sum_reduce"):
        tp.attend(x, cu, torch.arange(x.shape[0]), gather=lambda t: t, head_sum_reduce=lambda s: s)

    # f and g: f is the identity forward and sums gradients backward; g the other way round
    v = torch.full((2, 3), float(rank + 1), dtype=torch.float64, requires_grad=True)
    (copy_to_tp(v) * (rank + 1)).sum().backward()
    torch.testing.assert_close(v.grad, torch.full((2, 3), 3.0, dtype=torch.float64))  # 1 + 2
    v.grad = None
    out = reduce_from_tp(v)
    torch.testing.assert_close(out, torch.full((2, 3), 3.0, dtype=torch.float64))
    (out * (rank + 1)).sum().backward()
    torch.testing.assert_close(v.grad, torch.full((2, 3), float(rank + 1), dtype=torch.float64))


def _worker_tp_cp(rank: int, world: int, init_file: str) -> None:
    init_gloo(rank, world, init_file)
    g = make_tp_cp_groups(2, 2)
    assert (g.tp_rank, g.cp_rank) == (rank % 2, rank // 2)
    scenarios = [
        ([0, 8, 32, 48], "sparse", "mean", "activations", "all_reduce"),
        ([0, 16, 24, 48], "dense_warmup", "mean", "parameters", "all_reduce"),
        ([0, 32], "sparse", "sum", "activations", "local"),
    ]
    for i, (cu_list, stage, reduction, latent_grads, kl_target) in enumerate(scenarios):
        layer, cu, x, w_out = peaky_scenario(cu_list, stage, reduction, seed=300 + i)
        _check_equivalence(layer, cu, x, w_out, tp_group=g.tp_group, cp_group=g.cp_group, cp_size=2,
                           cp_rank=g.cp_rank, latent_grads=latent_grads, kl_target=kl_target, where="tp x cp = 2 x 2")
    layer, cu, x, w_out = peaky_scenario([0, 8, 32, 48], "dense_warmup", "mean", seed=310)
    _check_equivalence(layer, cu, x, w_out, tp_group=g.tp_group, cp_group=g.cp_group, cp_size=2,
                       cp_rank=g.cp_rank, row_mask=torch.arange(48) >= 8, where="tp x cp = 2 x 2")
    # tp = 4 over the whole world: one head per rank
    layer, cu, x, w_out = peaky_scenario([0, 8, 32, 48], "sparse", "mean", seed=400)
    _check_equivalence(layer, cu, x, w_out, tp_group=None, where="tp=4")

    # groups mixed up: the layer runs TP over the CP group, while the tokens were sharded by the real
    # CP rank, so the TP "replicas" hold different tokens; every rank raises instead of training wrong
    layer, cu, x, _ = peaky_scenario([0, 8, 32, 48], "sparse", "mean", seed=7)
    crossed = TensorParallelDSA.from_dense(layer, tp_group=g.cp_group)
    with pytest.raises(ValueError, match="the layer inputs differ .*: x .*share one CP rank"):
        cp_dsa_forward(crossed, shard_tokens(x, cu, 2, g.cp_rank), cu, group=g.tp_group)
    with pytest.raises(ValueError, match="tp_size x cp_size = 3 x 2 = 6 ranks, but the world has 4"):
        make_tp_cp_groups(3, 2)
    with pytest.raises(ValueError, match="cp_size=4 does not match"):
        cp_dsa_forward(TensorParallelDSA.from_dense(layer, tp_group=g.tp_group), shard_tokens(x, cu, 2, g.cp_rank),
                       cu, group=g.cp_group, cp_size=4)
    dist.destroy_process_group()


def test_tp2_equals_single_process_and_errors():
    spawn(_worker_tp2, 2)


def test_tp_x_cp_equals_single_process():
    spawn(_worker_tp_cp, 4)


def test_tp_needs_process_group():
    if dist.is_initialized():  # pragma: no cover
        pytest.skip("a process group is already initialised")
    with pytest.raises(RuntimeError, match="process group"):
        TensorParallelDSA(tiny())
    with pytest.raises(RuntimeError, match="process group"):
        make_tp_cp_groups(1, 1)


def test_parameter_kinds():
    layer = DSAttention(tiny())
    kinds = {n: parameter_kind(n) for n, _ in layer.named_parameters()}
    assert {n for n, k in kinds.items() if k == "split"} == set(SPLIT_DIMS)
    assert {n for n, k in kinds.items() if k == "latent"} == {
        "mla.wq_a.weight", "mla.q_norm.weight", "mla.wkv_a.weight", "mla.kv_norm.weight"}
    assert all(k == "indexer" for n, k in kinds.items() if n.startswith("indexer."))


@pytest.mark.parametrize("stage", ["dense_warmup", "sparse"])
def test_head_sum_reduce_combines_head_groups(stage):
    """One process, two head groups: the target of group A plus group B's head sum is the full target."""
    torch.manual_seed(0)
    T, H, D = 12, 4, 10
    q = torch.randn(T, H, D, dtype=torch.float64) * 2
    kv = torch.randn(T, D, dtype=torch.float64)
    scores = torch.randn(T, T, dtype=torch.float64, requires_grad=True)
    starts, ends = key_windows(torch.tensor([0, 5, 12]))
    masked = scores.detach().masked_fill(~window_mask(starts, ends, T), float("-inf"))
    topk = None if stage == "dense_warmup" else topk_indices(masked, 3)  # -1 slots on short rows
    kw = dict(sm_scale=0.3, starts=starts, ends=ends, topk_indices=topk)
    full = indexer_loss(scores, q, kv, **kw)
    held = {}

    def keep(s):  # group B: remember its head sum
        held["b"] = s.clone()
        return s

    indexer_loss(scores, q[:, 2:], kv, **kw, head_sum_reduce=keep)
    split = indexer_loss(scores, q[:, :2], kv, **kw, head_sum_reduce=lambda s: s + held["b"])
    torch.testing.assert_close(split, full, atol=1e-12, rtol=0)
    # indexer_target is the dense [T, S] form (the sparse loss sums over [T, K] slots): its own head sum
    indexer_target(q[:, 2:], kv, **kw, head_sum_reduce=keep)
    target = indexer_target(q[:, :2], kv, **kw, head_sum_reduce=lambda s: s + held["b"])
    torch.testing.assert_close(target, indexer_target(q, kv, **kw), atol=1e-12, rtol=0)


def test_collective_bytes_match_the_chapter():
    """The byte counts quoted in docs/chapters/04_4_tensor_parallel.md (DeepSeek-V3.2, T = 4096)."""
    b = tp_collective_bytes(deepseek_v32(), 4096)
    assert b == {"output": 58_720_256, "target_dense": 67_108_864, "target_sparse": 33_554_432,
                 "latent_grads": 17_301_504, "input_grad": 58_720_256, "latent_param_grads": 60_563_456,
                 "indexer_param_grads": 55_837_696}
    assert tp_collective_bytes(deepseek_v32(), 4096, keys=131_072)["target_dense"] == 2 * 2**30
    # the parameter counts behind the per-step numbers are those of the real module
    layer = DSAttention(tiny())
    counts = tp_collective_bytes(tiny(), 1, grad_bytes=1)
    for kind, key in (("latent", "latent_param_grads"), ("indexer", "indexer_param_grads")):
        assert counts[key] == sum(p.numel() for n, p in layer.named_parameters() if parameter_kind(n) == kind)
