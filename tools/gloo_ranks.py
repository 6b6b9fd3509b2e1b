"""Start the ranks of a gloo process group for the demos in tools/ (context and tensor parallelism).

`run_ranks(worker, world, args)` calls ``worker(rank, world, args)`` on every rank and returns 0 when
all of them return 0: in this process when it was started by ``torch.distributed.run`` (one process
per rank, ``RANK``/``WORLD_SIZE`` set), otherwise in ``world`` forked processes that meet through a
file in a temporary folder.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def _forked(rank: int, worker: Callable, world: int, init_file: str, args) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        status = worker(rank, world, args)
    finally:
        dist.destroy_process_group()
    if status:
        raise SystemExit(status)


def run_ranks(worker: Callable, world: int, args) -> int:
    """Run ``worker(rank, world, args)`` on ``world`` gloo ranks; the exit status (0: every rank passed)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torch.distributed.run
        dist.init_process_group("gloo")
        try:
            return worker(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
    # fork starts a rank in milliseconds; spawn would re-import torch in every rank
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    with tempfile.TemporaryDirectory() as d:
        try:
            mp.start_processes(_forked, args=(worker, world, os.path.join(d, "init"), args), nprocs=world,
                               join=True, start_method=method)
        except mp.ProcessExitedException as e:
            print(f"a rank failed: {e}", file=sys.stderr)
            return 1
    return 0
