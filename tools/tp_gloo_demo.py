"""Run one DSA layer with tensor parallelism on real gloo processes and check it.

Every rank builds the same tiny float64 layer and the same packed batch from a seed, takes its
share of the heads (`TensorParallelDSA.from_dense`), runs forward and backward of a fixed linear
"LM loss", reduces the gradients that need it (`sync_tensor_parallel_grads`), and compares with the
single-process run of the whole layer (which every rank also computes: the layer is tiny). Split
weights' gradients are gathered over TP first. Both training stages run in the same processes.
Rank 0 prints the largest differences; the exit status is 1 if any exceeds the tolerance.

Two ways to start it (both give separate processes talking over gloo; the same code runs on NCCL):

    python tools/tp_gloo_demo.py --tp 2                                  # forks the ranks itself
    python -m torch.distributed.run --nproc-per-node 2 tools/tp_gloo_demo.py   # one process per rank

``--save FILE`` writes what a notebook needs to redo the comparison on its own: per stage, the
layer's weights, the inputs and the TP results (chapter 4.4's notebook uses it).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/: gloo_ranks
from gloo_ranks import run_ranks  # noqa: E402

try:
    import dsa_ref  # noqa: F401
except ImportError:  # run from a source checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsa_ref import DSAttention, tiny  # noqa: E402
from dsa_ref.tensor_parallel import TensorParallelDSA, sync_tensor_parallel_grads  # noqa: E402

TOLERANCE = 1e-10  # float64: TP only regroups the same sums


def build(lengths: list[int], stage: str, seed: int):
    """The layer and inputs every rank builds identically: (layer, cu_seqlens, x, w_out)."""
    torch.manual_seed(seed)
    cfg = tiny()
    layer = DSAttention(cfg, stage=stage, dtype=torch.float64)
    with torch.no_grad():  # sharper main attention than the default init, so top-k matters
        for p in layer.mla.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    cu = torch.tensor([0] + lengths).cumsum(0)
    T = int(cu[-1])
    x = torch.randn(T, cfg.mla.dim, dtype=torch.float64)
    w_out = torch.randn(T, cfg.mla.dim, dtype=torch.float64)  # LM loss = sum(output * w_out)
    return layer, cu, x, w_out


def run_stage(rank: int, world: int, args: argparse.Namespace, stage: str) -> dict:
    """One stage: the single-process run, this rank's TP share, and their largest differences."""
    layer, cu, x, w_out = build(args.lengths, stage, args.seed)

    # --- the single-process run: every head on this rank --------------------------------------
    x_ref = x.clone().requires_grad_(True)
    ref = layer(x_ref, cu)
    (ref.output * w_out).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in layer.named_parameters()}

    # --- the TP run: this rank's heads, every token ---------------------------------------------
    t0 = time.perf_counter()
    tp = TensorParallelDSA.from_dense(layer, tp_size=world)  # the TP group is the world
    x_tp = x.clone().requires_grad_(True)
    res = tp(x_tp, cu)  # [T, dim]: the output after g's all-reduce, the same on every rank
    (res.output * w_out).sum().backward()
    sync_tensor_parallel_grads(tp)
    seconds = time.perf_counter() - t0
    grads = tp.full_tensors(grads=True)  # split gradients gathered over TP, replicated ones as held
    heads = tp.config.mla.n_heads

    errors = {
        "output": (res.output - ref.output).abs().max().item(),
        "x grad": (x_tp.grad - x_ref.grad).abs().max().item(),
        "param grads": max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads),
        "indexer loss": (res.indexer_loss - ref.indexer_loss).abs().item(),
        "top-k indices differ": float((res.topk_indices != ref.topk_indices).sum().item()),
    }
    return dict(stage=stage, layer=layer, cu=cu, x=x, w_out=w_out, output=res.output.detach(),
                x_grad=x_tp.grad, param_grads=grads, indexer_loss=res.indexer_loss.detach(),
                topk_indices=res.topk_indices, errors=errors, seconds=seconds, local_heads=heads,
                local_shapes={n: tuple(p.shape) for n, p in tp.named_parameters()})


def worker(rank: int, world: int, args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    results = [run_stage(rank, world, args, stage) for stage in args.stages]
    ok = all(v <= TOLERANCE for r in results for v in r["errors"].values())
    if rank == 0:
        print(f"tp={world} ranks over gloo, sequence lengths {args.lengths} (T={sum(args.lengths)})")
        for r in results:
            print(f"  {r['stage']}: {r['local_heads']} heads per rank, TP forward+backward on rank 0 "
                  f"{r['seconds'] * 1e3:.0f} ms")
            print("    max |TP - single process|: " + ", ".join(f"{k} {v:.1e}" for k, v in r["errors"].items()))
        print("  " + ("OK" if ok else "MISMATCH"))
        if args.save:
            torch.save({
                "tp": world, "lengths": args.lengths,
                "stages": {r["stage"]: {
                    "state_dict": {k: v.clone() for k, v in r["layer"].state_dict().items()},
                    "cu_seqlens": r["cu"], "x": r["x"], "w_out": r["w_out"], "output": r["output"],
                    "x_grad": r["x_grad"], "param_grads": r["param_grads"], "indexer_loss": r["indexer_loss"],
                    "topk_indices": r["topk_indices"], "errors": r["errors"], "local_shapes": r["local_shapes"],
                } for r in results},
            }, args.save)
    return 0 if ok else 1


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2, help="ranks to fork (ignored under torch.distributed.run); "
                                                          "must divide the tiny config's 4 heads")
    parser.add_argument("--lengths", type=lambda s: [int(v) for v in s.split(",")], default=[12, 20],
                        help="comma-separated sequence lengths (default 12,20)")
    parser.add_argument("--stages", type=lambda s: s.split(","), default=["dense_warmup", "sparse"],
                        help="comma-separated training stages (default dense_warmup,sparse)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", default=None, help="write the results to this file (torch.save)")
    args = parser.parse_args(argv)
    bad = [s for s in args.stages if s not in ("dense_warmup", "sparse")]
    if bad:
        parser.error(f"--stages: unknown stage(s) {bad}; expected dense_warmup and/or sparse")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_ranks(worker, args.tp, args)


if __name__ == "__main__":
    sys.exit(main())
