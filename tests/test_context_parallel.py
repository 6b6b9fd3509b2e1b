"""Allgather context parallelism on real processes (gloo) must equal the single-process run.

Each test spawns ``cp`` processes with ``torch.multiprocessing``; every rank builds the same layer
and inputs from a fixed seed, runs the single-process reference itself, then its CP share, and
asserts equality (an assertion on any rank fails the test with that rank's traceback).
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from dist_helpers import init_gloo, peaky_scenario, spawn
from dsa_ref.context_parallel import (
    all_gather_with_grad,
    cp_dsa_forward,
    reduce_loss_for_logging,
    shard_tokens,
    unshard_tokens,
)
from dsa_ref.layout import cp_shard_index

pytestmark = pytest.mark.slow

ATOL = 1e-10  # float64: CP only reorders the same sums


def _reference(layer, cu, x, w_out):
    x = x.clone().requires_grad_(True)
    layer.zero_grad()
    res = layer(x, cu)
    (res.output * w_out).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    return res, x.grad.clone(), grads


def _cp_run(layer, cu, x, w_out, rank, world):
    x_local = shard_tokens(x, cu, world, rank).clone().requires_grad_(True)
    layer.zero_grad()
    res = cp_dsa_forward(layer, x_local, cu, cp_size=world)
    (res.output * shard_tokens(w_out, cu, world, rank)).sum().backward()
    grads = {}
    for n, p in layer.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)  # replicated weights: the per-rank gradients add up
        grads[n] = g
    return res, x_local.grad.clone(), grads


def _worker_equivalence(rank: int, world: int, init_file: str) -> None:
    init_gloo(rank, world, init_file)
    scenarios = [
        ([0, 32], "sparse", "mean"),
        ([0, 8, 32, 48], "sparse", "mean"),  # uneven pack: lengths 8, 24, 16
        ([0, 8, 32, 48], "dense_warmup", "mean"),
        ([0, 16, 24, 48], "sparse", "sum"),
    ]
    for i, (cu_list, stage, reduction) in enumerate(scenarios):
        layer, cu, x, w_out = peaky_scenario(cu_list, stage, reduction, seed=100 + i)
        ref, ref_dx, ref_grads = _reference(layer, cu, x, w_out)
        res, dx_local, grads = _cp_run(layer, cu, x, w_out, rank, world)
        idx = cp_shard_index(cu, world, rank)
        where = f"rank {rank}/{world}, scenario {cu_list} {stage} {reduction}"
        assert torch.equal(res.topk_indices, ref.topk_indices[idx]), where
        torch.testing.assert_close(res.output, ref.output[idx], atol=ATOL, rtol=0, msg=where)
        torch.testing.assert_close(reduce_loss_for_logging(res.indexer_loss), ref.indexer_loss.detach(),
                                   atol=ATOL, rtol=0, msg=where)
        torch.testing.assert_close(dx_local, ref_dx[idx], atol=ATOL, rtol=0, msg=where)
        for n in ref_grads:
            torch.testing.assert_close(grads[n], ref_grads[n], atol=ATOL, rtol=0, msg=f"{where}: grad {n}")
        # the full output can be put back together from the shards
        torch.testing.assert_close(unshard_tokens(res.output, cu), ref.output.detach(), atol=ATOL, rtol=0)
    # padding packed as its own sequence and masked out of the loss: CP divides by the global real rows
    layer, cu, x, w_out = peaky_scenario([0, 8, 32, 48], "sparse", "mean", seed=50)
    mask = torch.arange(48) < 32
    ref = layer(x, cu, loss_row_mask=mask)
    res = cp_dsa_forward(layer, shard_tokens(x, cu, world, rank), cu,
                         loss_row_mask=shard_tokens(mask, cu, world, rank))
    torch.testing.assert_close(reduce_loss_for_logging(res.indexer_loss), ref.indexer_loss.detach(),
                               atol=ATOL, rtol=0)
    dist.destroy_process_group()


def _worker_errors(rank: int, world: int, init_file: str) -> None:
    init_gloo(rank, world, init_file)
    layer, cu, x, _ = peaky_scenario([0, 8, 32, 48], "sparse", "mean", seed=7)
    x_local = shard_tokens(x, cu, world, rank)
    with pytest.raises(ValueError, match="cp_size=3 does not match"):
        cp_dsa_forward(layer, x_local, cu, cp_size=3)
    with pytest.raises(ValueError, match="divisible by 2 \\* cp_size"):
        cp_dsa_forward(layer, x_local, torch.tensor([0, 6, 48]))
    with pytest.raises(ValueError, match="x_local has"):
        cp_dsa_forward(layer, x_local[:-1], cu)
    # ranks disagree on cu_seqlens (same total, different boundaries): every rank must raise
    mine = torch.tensor([0, 8, 32, 48]) if rank == 0 else torch.tensor([0, 16, 24, 48])
    with pytest.raises(ValueError, match="different cu_seqlens"):
        cp_dsa_forward(layer, x_local, mine)
    # the autograd all-gather: backward is a reduce-scatter (sum over ranks of the gradient slices)
    v = torch.full((2, 3), float(rank + 1), dtype=torch.float64, requires_grad=True)
    g = all_gather_with_grad(v)
    assert g.shape == (2 * world, 3)
    (g * torch.arange(1, 2 * world + 1, dtype=torch.float64)[:, None]).sum().backward()
    expected = world * torch.arange(2 * rank + 1, 2 * rank + 3, dtype=torch.float64)[:, None].expand(2, 3)
    torch.testing.assert_close(v.grad, expected)
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_cp_equals_single_process(world):
    spawn(_worker_equivalence, world)


def test_cp_errors_and_all_gather():
    spawn(_worker_errors, 2)


def test_cp_forward_needs_process_group():
    layer, cu, x, _ = peaky_scenario([0, 8], "sparse", "mean", seed=0)
    if dist.is_initialized():  # pragma: no cover
        pytest.skip("a process group is already initialised")
    with pytest.raises(RuntimeError, match="process group"):
        cp_dsa_forward(layer, x, cu)
