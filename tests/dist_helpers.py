"""Shared pieces of the multi-process tests (context and tensor parallelism on gloo).

Ranks are real processes. They are started with ``fork`` where available: a forked rank starts in
milliseconds, while ``spawn`` re-imports torch (seconds per rank on 2 cores). Every rank builds the
same layer and inputs from a seed, so it can run the single-process reference itself.
"""

import os
import tempfile

import torch
import torch.distributed as dist

# torch.testing.assert_close imports DTensor as soon as a process group exists: seconds per rank
# on a small CPU. Imported here, before the ranks fork, every rank inherits it.
import torch.distributed.tensor  # noqa: F401
import torch.multiprocessing as mp

from dsa_ref import DSAttention, tiny


def init_gloo(rank: int, world: int, init_file: str) -> None:
    """Join a gloo process group of ``world`` ranks through a file rendezvous; one thread per rank."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)


def spawn(fn, world: int) -> None:
    """Run ``fn(rank, world, init_file)`` on ``world`` processes; any rank's exception fails the caller."""
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    with tempfile.TemporaryDirectory() as d:
        init_file = os.path.join(d, "init")
        mp.start_processes(fn, args=(world, init_file), nprocs=world, join=True, start_method=method)


def peaky_scenario(cu_list, stage, reduction, seed, cfg=None):
    """A float64 `DSAttention` with weights x3 (peaky attention, so top-k matters), its packed
    inputs ``x`` and a fixed "LM loss" direction ``w_out``: ``(layer, cu, x, w_out)``."""
    torch.manual_seed(seed)
    cfg = cfg or tiny()
    layer = DSAttention(cfg, stage=stage, loss_reduction=reduction, dtype=torch.float64)
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    cu = torch.tensor(cu_list)
    T = int(cu[-1])
    x = torch.randn(T, cfg.mla.dim, dtype=torch.float64)
    w_out = torch.randn(T, cfg.mla.dim, dtype=torch.float64)
    return layer, cu, x, w_out
