"""Context parallelism for one DeepSeek-V3.2 DSA layer at 128K tokens, on paper.

    python tools/plots/cp_scale.py            # prints the tables of docs/chapters/04_3_cp_at_scale.md
                                              # and writes docs/assets/cp_scale.svg
    python tools/plots/cp_scale.py --no-plot  # tables only (no matplotlib needed)

Everything is arithmetic on the layer's shapes (taken from `dsa_ref.deepseek_v32()`); nothing is
measured. Assumptions, all stated on the docs page:

* one causal sequence of N = 131072 tokens, zigzag-split over cp ranks (N divides by 2 cp for
  cp = 1, 2, 4, 8, 16: that is why only powers of two appear);
* training activations in bf16 (2 bytes); variant: the indexer key in fp8 with one fp32 scale;
* forward pass only; FLOPs count the tensor-core products (2 per multiply-add);
* times use 790 TFLOP/s (bf16 matmul measured on an H200, see the notes) and 450 GB/s per
  direction per GPU (NVLink 4 spec, 900 GB/s both directions) -- order-of-magnitude guides only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dsa_ref import deepseek_v32  # noqa: E402

N = 128 * 1024
CPS = [1, 2, 4, 8, 16]
BF16 = 2
FLOPS = 790e12         # bf16 dense matmul, measured on an H200
LINK = 450e9           # bytes/s per direction per GPU, NVLink 4 (spec)
MiB, GiB = 2 ** 20, 2 ** 30

cfg = deepseek_v32()
H = cfg.mla.n_heads                                   # 128
D_LAT = cfg.mla.latent_dim                            # 576 = 512 + 64
D_V = cfg.mla.kv_lora_rank                            # 512
H_I, D_I = cfg.indexer.n_heads, cfg.indexer.head_dim  # 64, 128
K = cfg.indexer.topk                                  # 2048

AG_VALUES = D_LAT + D_I                                # 704 values per token
AG_BYTES = AG_VALUES * BF16                            # 1408
AG_BYTES_FP8 = D_LAT * BF16 + D_I * 1 + 4              # 1284: indexer key fp8 + one fp32 scale
RING_VALUES = H * (cfg.mla.qk_head_dim + cfg.mla.v_head_dim)  # 128 * (192 + 128) = 40960
RING_BYTES = RING_VALUES * BF16                        # 81920

INDEXER_PER_PAIR = 2 * H_I * D_I                       # 16384 FLOP per causal (query, key) pair
SPARSE_PER_SLOT = 2 * H * (D_LAT + D_V)                # 278528 FLOP per selected key of a query
SPARSE_PER_QUERY = SPARSE_PER_SLOT * K                 # 570,425,344 for a full top-k row


def pairs_zigzag(cp: int) -> int:
    """Causal pairs of every rank under zigzag: N (N + 1) / (2 cp), the same for all ranks."""
    c = N // (2 * cp)
    return (2 * cp - 1) * c * c + c * (c + 1)


def pairs_contiguous(cp: int, r: int) -> int:
    """Causal pairs of rank r under the contiguous split (queries r N/cp ... (r+1) N/cp - 1)."""
    m = N // cp
    return r * m * m + m * (m + 1) // 2


def slots(lo: int, hi: int) -> int:
    """Selected-key slots of queries lo..hi-1 of one sequence: sum of min(t + 1, K)."""
    def upto(n):  # sum_{t < n} min(t + 1, K)
        if n <= K:
            return n * (n + 1) // 2
        return K * (K + 1) // 2 + (n - K) * K
    return upto(hi) - upto(lo)


def slots_zigzag(cp: int, r: int) -> int:
    c = N // (2 * cp)
    return slots(r * c, (r + 1) * c) + slots((2 * cp - 1 - r) * c, (2 * cp - r) * c)


def rows() -> list[dict]:
    out = []
    for cp in CPS:
        share = (cp - 1) / cp
        ring_mem = N * RING_BYTES if cp == 1 else 2 * (N // cp) * RING_BYTES
        con = [pairs_contiguous(cp, r) for r in range(cp)]
        sparse = [slots_zigzag(cp, r) * SPARSE_PER_SLOT for r in range(cp)]
        out.append(dict(
            cp=cp, tokens=N // cp,
            ag_recv=share * N * AG_BYTES, ag_recv_fp8=share * N * AG_BYTES_FP8, ag_mem=N * AG_BYTES,
            ring_recv=share * N * RING_BYTES, ring_mem=ring_mem,
            idx_flop=pairs_zigzag(cp) * INDEXER_PER_PAIR, idx_flop_con_max=max(con) * INDEXER_PER_PAIR,
            con_ratio=max(con) / (sum(con) / cp), sparse_flop_max=max(sparse), sparse_flop_min=min(sparse),
        ))
    return out


def tables(data: list[dict]) -> str:
    lines = ["Per token: all-gather %d values = %d B (bf16), %d B with an fp8 indexer key; "
             "ring K+V %d values = %d B; ratio %.2f" % (AG_VALUES, AG_BYTES, AG_BYTES_FP8, RING_VALUES,
                                                        RING_BYTES, RING_BYTES / AG_BYTES), ""]
    lines += ["| cp | tokens / rank | all-gather received / rank | (fp8 indexer key) | gathered keys held / rank "
              "| ring received / rank | ring K/V held / rank | all-gather time | ring time |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for d in data:
        lines.append("| %d | %s | %.1f MiB | %.1f MiB | %.0f MiB | %.3f GiB | %.2f GiB | %.2f ms | %.1f ms |" % (
            d["cp"], f"{d['tokens']:,}", d["ag_recv"] / MiB, d["ag_recv_fp8"] / MiB, d["ag_mem"] / MiB,
            d["ring_recv"] / GiB, d["ring_mem"] / GiB, d["ag_recv"] / LINK * 1e3, d["ring_recv"] / LINK * 1e3))
    lines += ["", "| cp | indexer pairs / rank (zigzag) | indexer TFLOP / rank | contiguous: busiest rank TFLOP "
              "| contiguous: busiest / mean | sparse attention TFLOP / rank (max, min) | compute time / rank |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    for d in data:
        total = d["idx_flop"] + d["sparse_flop_max"]
        lines.append("| %d | %s | %.2f | %.2f | %.4f | %.2f, %.2f | %.1f ms |" % (
            d["cp"], f"{d['idx_flop'] // INDEXER_PER_PAIR:,}", d["idx_flop"] / 1e12, d["idx_flop_con_max"] / 1e12,
            d["con_ratio"], d["sparse_flop_max"] / 1e12, d["sparse_flop_min"] / 1e12, total / FLOPS * 1e3))
    return "\n".join(lines)


def plot(data: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matplotlib.rcParams.update({"svg.hashsalt": "dsa_ref-cp-scale", "svg.fonttype": "path", "font.size": 9})
    cps = [d["cp"] for d in data]
    fig, axes = plt.subplots(2, 2, figsize=(10.5, 7.2))

    ax = axes[0, 0]  # cp = 1 communicates nothing: start at cp = 2
    multi = data[1:]
    ax.plot(cps[1:], [d["ring_recv"] / MiB for d in multi], "o-", color="#c62828", label="ring: 128 heads of K and V")
    ax.plot(cps[1:], [d["ag_recv"] / MiB for d in multi], "s-", color="#283593", label="all-gather: latent + indexer key (bf16)")
    ax.plot(cps[1:], [d["ag_recv_fp8"] / MiB for d in multi], "s:", color="#5c6bc0", label="all-gather, fp8 indexer key")
    ax.set_yscale("log")
    ax.set_ylim(10, 3e4)
    ax.set_ylabel("MiB received per rank, per layer (forward)")
    ax.set_title("communication", fontsize=10)
    ax.legend(fontsize=7.5, loc="lower right")

    ax = axes[0, 1]
    ax.plot(cps, [d["ring_mem"] / MiB for d in data], "o-", color="#c62828", label="ring: own K/V block + one in flight")
    ax.plot(cps, [d["ag_mem"] / MiB for d in data], "s-", color="#283593", label="all-gather: every token's keys")
    ax.set_yscale("log")
    ax.set_ylim(50, 3e4)
    ax.set_ylabel("MiB of keys held per rank, per layer")
    ax.set_title("memory for keys", fontsize=10)
    ax.legend(fontsize=7.5, loc="lower left")

    ax = axes[1, 0]
    ax.plot(cps, [d["idx_flop_con_max"] / 1e12 for d in data], "o--", color="#9e9e9e", label="indexer, contiguous (busiest rank)")
    ax.plot(cps, [d["idx_flop"] / 1e12 for d in data], "s-", color="#2e7d32", label="indexer, zigzag (every rank)")
    ax.plot(cps, [d["sparse_flop_max"] / 1e12 for d in data], "^-", color="#ef6c00", label="sparse attention (busiest rank)")
    ax.set_yscale("log")
    ax.set_ylabel("TFLOP per rank, per layer (forward)")
    ax.set_title("compute", fontsize=10)
    ax.legend(fontsize=7.5, loc="lower left")

    ax = axes[1, 1]
    ax.plot(cps, [(d["idx_flop"] + d["sparse_flop_max"]) / FLOPS * 1e3 for d in data], "^-", color="#2e7d32",
            label="compute at 790 TFLOP/s")
    ax.plot(cps[1:], [d["ring_recv"] / LINK * 1e3 for d in multi], "o-", color="#c62828", label="ring transfer at 450 GB/s")
    ax.plot(cps[1:], [d["ag_recv"] / LINK * 1e3 for d in multi], "s-", color="#283593", label="all-gather at 450 GB/s")
    ax.set_yscale("log")
    ax.set_ylabel("ms per rank, per layer (forward)")
    ax.set_title("time, order of magnitude", fontsize=10)
    ax.legend(fontsize=7.5, loc="upper right")

    for ax in axes.flat:
        ax.set_xscale("log", base=2)
        ax.set_xticks(cps, [str(c) for c in cps])
        ax.set_xlabel("cp (ranks)")
        ax.grid(True, which="major", alpha=0.3)
    fig.suptitle("One DeepSeek-V3.2 DSA layer, 128K tokens, context parallel over cp ranks", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, format="svg", metadata={"Date": None, "Creator": None})
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-plot", action="store_true", help="print the tables only")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "assets" / "cp_scale.svg")
    args = parser.parse_args()
    data = rows()
    print(tables(data))
    if not args.no_plot:
        plot(data, args.out)
        print(f"\nwrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
