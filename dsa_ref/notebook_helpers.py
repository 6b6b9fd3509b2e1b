"""Small helpers the chapter notebooks share, so that no notebook copies another's code.

They are teaching aids, not part of the oracle: a sharpened toy layer and its inputs (chapters 3.1
and 3.2), a look at what a layer computes before attention, and the float64 agreement check of
chapters 1 and 2.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from .config import DSAConfig
from .dsa import DSAttention
from .indexer import lightning_indexer
from .indexer_loss import indexer_target
from .layout import key_windows, positions

__all__ = ["check_close", "sharpened_layer", "toy_tokens", "look_inside", "indexer_scores", "mass_covered",
           "run_gloo_demo"]


def check_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-12) -> float:
    """Fail unless ``actual`` is within ``atol`` of ``expected`` everywhere; return the largest difference."""
    err = (actual - expected).abs().max().item()
    assert err <= atol, f"max |difference| = {err:.3e} > {atol:.0e}"
    return err


def sharpened_layer(cfg: DSAConfig, *, seed: int = 0, sharpen: float = 3.0, device=None) -> DSAttention:
    """A DSA layer in the dense warm-up whose main attention is sharpened.

    A freshly initialised MLA spreads its attention almost evenly over the window, which a trained
    model does not do; scaling the query and key up-projections (``wq_b``, ``wkv_b``) by
    ``sharpen`` gives the indexer something worth predicting.
    """
    torch.manual_seed(seed)
    layer = DSAttention(cfg, stage="dense_warmup").to(device)
    with torch.no_grad():
        layer.mla.wq_b.weight.mul_(sharpen)
        layer.mla.wkv_b.weight.mul_(sharpen)
    return layer


def toy_tokens(vocab: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` hidden states ``[n, dim]``: rows of ``vocab [V, dim]`` (a toy vocabulary) picked at random."""
    picks = torch.randint(0, vocab.shape[0], (n,), generator=generator)  # [n], on the generator's device
    return vocab[picks.to(vocab.device)]


def look_inside(layer: DSAttention, x: torch.Tensor, cu_seqlens: torch.Tensor) -> dict:
    """What the layer computes before attention: main ``q``/``kv``, the indexer's ``q_i``/``k_i``/``w_i``,
    the windows and the KL target ``p`` of the dense warm-up (no gradient)."""
    pos = positions(cu_seqlens)
    starts, ends = key_windows(cu_seqlens)
    with torch.no_grad():
        p = layer.mla.project(x, pos)
        q, kv = layer.absorbed.absorbed_qkv(p)  # [T, H, r + d_r], [T, r + d_r]
        q_i, k_i, w_i = layer.indexer.project(x, p.qr, pos)  # [T, H_I, D_I], [T, D_I], [T, H_I]
        target = indexer_target(q, kv, sm_scale=layer.mla.softmax_scale, starts=starts, ends=ends)  # [T, T]
    return dict(x=x, pos=pos, qr=p.qr, q=q, kv=kv, q_i=q_i, k_i=k_i, w_i=w_i, starts=starts, ends=ends,
                target=target)


def indexer_scores(indexer, view: dict) -> torch.Tensor:
    """An indexer's current scores ``[T, S]`` for a batch seen by `look_inside` (no gradient)."""
    with torch.no_grad():
        q_i, k_i, w_i = indexer.project(view["x"], view["qr"], view["pos"])
        return lightning_indexer(q_i, k_i, w_i, starts=view["starts"], ends=view["ends"])


def mass_covered(p: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Per query ``[T]``: the part of the target ``p [T, S]`` the selected keys ``idx [T, K]`` cover;
    ``-1`` slots cover nothing (selected out with ``where``)."""
    picked = p.gather(1, torch.where(idx >= 0, idx, torch.zeros_like(idx)))  # [T, K]
    return torch.where(idx >= 0, picked, torch.zeros_like(picked)).sum(dim=1)


def run_gloo_demo(script: str, *args: str) -> Path:
    """Run ``tools/<script>`` (a demo that forks its gloo ranks) with ``--save``; return the saved file.

    Prints the demo's output and the wall time; raises ``RuntimeError`` with the end of its error
    output if a rank fails. The demos live in the source checkout, not in the installed package.
    """
    root = Path(__file__).resolve().parents[1]
    path = root / "tools" / script
    assert path.is_file(), f"{path} not found: run this notebook from a source checkout of dsa_ref"
    saved = Path(tempfile.mkdtemp()) / "run.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(path), *args, "--save", str(saved)], env=env, capture_output=True,
                          text=True, timeout=600)
    print(proc.stdout)
    if proc.returncode != 0:
        raise RuntimeError(f"{script} exited with status {proc.returncode}:\n{proc.stderr[-3000:]}")
    print(f"{time.perf_counter() - t0:.1f} s including process start-up")
    return saved
