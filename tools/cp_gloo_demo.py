"""Run one DSA layer with allgather context parallelism on real gloo processes and check it.

Every rank builds the same tiny float64 layer and the same packed batch from a seed, runs its
zigzag shard through `dsa_ref.context_parallel.cp_dsa_forward`, back-propagates a fixed linear
"LM loss", and compares with the single-process run of the whole pack (which every rank also
computes: the layer is tiny). Rank 0 prints the largest differences; the exit status is 1 if any
exceeds the tolerance.

Two ways to start it (both give separate processes talking over gloo; the same code runs on NCCL):

    python tools/cp_gloo_demo.py --cp 2                                  # forks the ranks itself
    python -m torch.distributed.run --nproc-per-node 2 tools/cp_gloo_demo.py   # one process per rank

``--save FILE`` writes what a notebook needs to redo the comparison on its own: the layer's
weights, the inputs, and the CP results put back into global token order.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/: gloo_ranks
from gloo_ranks import run_ranks  # noqa: E402

try:
    import dsa_ref  # noqa: F401
except ImportError:  # run from a source checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsa_ref import DSAttention, tiny  # noqa: E402
from dsa_ref.context_parallel import (  # noqa: E402
    cp_dsa_forward,
    reduce_loss_for_logging,
    shard_tokens,
    unshard_tokens,
)
from dsa_ref.layout import cp_shard_index  # noqa: E402

TOLERANCE = 1e-10  # float64: CP only changes the order of the same sums


def build(lengths: list[int], stage: str, reduction: str, seed: int):
    """The layer and inputs every rank builds identically: (layer, cu_seqlens, x, w_out)."""
    torch.manual_seed(seed)
    cfg = tiny()
    layer = DSAttention(cfg, stage=stage, loss_reduction=reduction, dtype=torch.float64)
    with torch.no_grad():  # sharper main attention than the default init, so top-k matters
        for p in layer.mla.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    cu = torch.tensor([0] + lengths).cumsum(0)
    T = int(cu[-1])
    x = torch.randn(T, cfg.mla.dim, dtype=torch.float64)
    w_out = torch.randn(T, cfg.mla.dim, dtype=torch.float64)  # LM loss = sum(output * w_out)
    return layer, cu, x, w_out


def single_process(layer, cu, x, w_out):
    x = x.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    res = layer(x, cu)
    (res.output * w_out).sum().backward()
    return res, x.grad.clone(), {n: p.grad.clone() for n, p in layer.named_parameters()}


def worker(rank: int, world: int, args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    layer, cu, x, w_out = build(args.lengths, args.stage, args.reduction, args.seed)
    ref, ref_dx, ref_grads = single_process(layer, cu, x, w_out)

    # --- the CP run: this rank's tokens only ------------------------------------------------
    t0 = time.perf_counter()
    x_local = shard_tokens(x, cu, world, rank).clone().requires_grad_(True)  # [T / cp, dim]
    layer.zero_grad(set_to_none=True)
    res = cp_dsa_forward(layer, x_local, cu, cp_size=world)
    (res.output * shard_tokens(w_out, cu, world, rank)).sum().backward()
    seconds = time.perf_counter() - t0
    grads = {}
    for n, p in layer.named_parameters():  # replicated weights: the per-rank gradients add up
        g = p.grad.clone()
        dist.all_reduce(g)
        grads[n] = g

    # --- put the shards back together and compare with the single-process run ---------------
    output = unshard_tokens(res.output, cu)  # [T, dim] in global order
    dx = unshard_tokens(x_local.grad, cu)
    # indices are exact integers; gather them as float64 (exact below 2**53), then convert back
    topk = unshard_tokens(res.topk_indices.to(torch.float64), cu).to(torch.int64)
    loss = reduce_loss_for_logging(res.indexer_loss)
    share_list = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(share_list, res.indexer_loss.detach().reshape(1))
    errors = {
        "output": (output - ref.output.detach()).abs().max().item(),
        "x grad": (dx - ref_dx).abs().max().item(),
        "param grads": max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads),
        "indexer loss": (loss - ref.indexer_loss.detach()).abs().item(),
        "top-k indices differ": float((topk != ref.topk_indices).sum().item()),
    }
    ok = all(v <= TOLERANCE for v in errors.values())
    if rank == 0:
        print(f"cp={world} ranks over gloo, sequence lengths {args.lengths} (T={int(cu[-1])}), "
              f"stage={args.stage}, reduction={args.reduction}")
        for r in range(world):
            idx = cp_shard_index(cu, world, r)
            print(f"  rank {r}: {idx.numel()} tokens, loss share {share_list[r].item():.6f}")
        print(f"  sum of shares {loss.item():.6f} | single process {ref.indexer_loss.item():.6f}")
        print("  max |CP - single process|: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
        print(f"  CP forward+backward on rank 0: {seconds * 1e3:.0f} ms | " + ("OK" if ok else "MISMATCH"))
        if args.save:
            torch.save({
                "lengths": args.lengths, "stage": args.stage, "reduction": args.reduction, "cp": world,
                "state_dict": {k: v.clone() for k, v in layer.state_dict().items()},
                "cu_seqlens": cu, "x": x, "w_out": w_out,
                "output": output, "x_grad": dx, "param_grads": grads, "topk_indices": topk,
                "indexer_loss": loss, "loss_shares": torch.cat(share_list),
                "shard_index": [cp_shard_index(cu, world, r) for r in range(world)],
                "errors": errors,
            }, args.save)
    return 0 if ok else 1


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cp", type=int, default=2, help="ranks to fork (ignored under torch.distributed.run)")
    parser.add_argument("--lengths", type=lambda s: [int(v) for v in s.split(",")], default=[12, 4, 0, 32],
                        help="comma-separated sequence lengths, each divisible by 2 * cp (default 12,4,0,32)")
    parser.add_argument("--stage", choices=("dense_warmup", "sparse"), default="sparse")
    parser.add_argument("--reduction", choices=("mean", "sum"), default="mean")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", default=None, help="write the results to this file (torch.save)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_ranks(worker, args.cp, args)


if __name__ == "__main__":
    sys.exit(main())
