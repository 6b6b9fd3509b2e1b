"""Allgather context parallelism on NCCL: DSAttention forward + backward per rank.

    torchrun --nproc-per-node N benchmarks/bench_cp.py [--tokens 32768,65536] [--backends reference,tilelang]

Every rank builds the same DeepSeek-V3.2 layer (128 heads, top-k 2048, indexer 64 x 128) from one
seed, takes its zigzag shard of one causal sequence and runs `cp_dsa_forward` + backward in bf16.
It reports per-rank step time (CUDA events, median), peak memory, the bytes and time of the two
all-gathers (latent KV 576 + indexer key 128 per token); scaling efficiency is the N = 1 step
time over N times the N-rank step time, from runs with different N. Correctness: at a small size in float32 each rank compares
its CP outputs, input gradients and the summed parameter gradients with a single-process run of
the whole sequence; the check is printed and fails the run if it does not hold.

Keep NVLink multicast off (``NCCL_NVLS_ENABLE=0``), as the device machines require.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dsa_ref import DSAttention, deepseek_v32  # noqa: E402
from dsa_ref.context_parallel import (  # noqa: E402
    all_gather_with_grad,
    cp_dsa_forward,
    reduce_loss_for_logging,
    shard_tokens,
)
from bench_kernels import cuda_time_ms  # noqa: E402  (benchmarks/ is the script folder)
from dsa_ref.layout import one_sequence  # noqa: E402


def median_ms(fn, reps: int) -> float:
    """Median step time over ``reps`` runs after one warm-up, the ranks lined up by a barrier each time."""
    return cuda_time_ms(fn, warmup=1, reps=reps, before_each=dist.barrier)


def check_small(rank: int, world: int) -> dict:
    """CP == single process at a small float32 size (both stages)."""
    from dsa_ref import tiny

    worst = {}
    for stage in ("dense_warmup", "sparse"):
        torch.manual_seed(0)
        cfg = tiny()
        layer = DSAttention(cfg, stage=stage, device="cuda", dtype=torch.float32)
        T = 64 * world
        cu = torch.tensor([0, 16 * world, T], device="cuda")
        x = torch.randn(T, cfg.mla.dim, device="cuda")
        w = torch.randn_like(x)
        xr = x.clone().requires_grad_(True)
        ref = layer(xr, cu)
        (ref.output * w).sum().backward()
        ref_grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
        layer.zero_grad()
        xl = shard_tokens(x, cu, world, rank).clone().requires_grad_(True)
        res = cp_dsa_forward(layer, xl, cu)
        (res.output * shard_tokens(w, cu, world, rank)).sum().backward()
        errs = [float((res.output - shard_tokens(ref.output, cu, world, rank)).abs().max()),
                float((xl.grad - shard_tokens(xr.grad, cu, world, rank)).abs().max()),
                abs(float(reduce_loss_for_logging(res.indexer_loss)) - float(ref.indexer_loss))]
        for n, p in layer.named_parameters():
            g = p.grad.clone()
            dist.all_reduce(g)
            errs.append(float((g - ref_grads[n]).abs().max()))
        worst[stage] = max(errs)
    return worst


def bench(tokens: int, backend: str, rank: int, world: int, reps: int) -> dict:
    cfg = deepseek_v32()
    torch.manual_seed(0)
    layer = DSAttention(cfg, stage="sparse", backend=backend, device="cuda", dtype=torch.bfloat16)
    cu = one_sequence(tokens, device="cuda")
    x = torch.randn(tokens, cfg.mla.dim, device="cuda", dtype=torch.bfloat16)
    xl = shard_tokens(x, cu, world, rank).clone().requires_grad_(True)
    del x
    row = {"tokens": tokens, "backend": backend, "cp": world, "rank": rank}
    for stage in ("dense_warmup", "sparse"):
        def step():
            res = cp_dsa_forward(layer, xl, cu, stage=stage, check_inputs=False)
            res.output.float().square().mean().backward()

        torch.cuda.reset_peak_memory_stats()
        row[f"{stage}_ms"] = median_ms(step, reps)
        row[f"{stage}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    # the two all-gathers of one layer (latent KV and indexer keys), bf16
    kv = torch.randn(tokens // world, 576, device="cuda", dtype=torch.bfloat16)
    ik = torch.randn(tokens // world, 128, device="cuda", dtype=torch.bfloat16)
    row["allgather_ms"] = median_ms(lambda: (all_gather_with_grad(kv), all_gather_with_grad(ik)), reps)
    row["allgather_bytes_received"] = (world - 1) * (tokens // world) * (576 + 128) * 2
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="32768")
    parser.add_argument("--backends", default="reference,tilelang")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="bench_cp.json")
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    worst = check_small(rank, world)
    ok = all(v < 1e-4 for v in worst.values())
    if rank == 0:
        print(f"CP == single process (float32, tiny config): worst abs error {worst} -> {'ok' if ok else 'FAILED'}",
              flush=True)
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        for backend in args.backends.split(","):
            row = bench(tokens, backend, rank, world, args.reps)
            gathered = [None] * world
            dist.all_gather_object(gathered, row)
            if rank == 0:
                rows.append(gathered)
                print(json.dumps(gathered), flush=True)
    if rank == 0:
        meta = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "world": world,
                "torch": torch.__version__, "cuda": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                "check": worst}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
