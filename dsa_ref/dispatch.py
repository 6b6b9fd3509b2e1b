"""The one place where readable code may hand work to a fast kernel.

`DSAttention` calls the operations below with a ``backend``:

* ``"reference"`` -- always the readable PyTorch functions of chapters 1-3;
* ``"tilelang"`` -- the TileLang kernels of `dsa_ref.kernels`; an error if they cannot run here;
* ``"auto"`` -- the kernels when CUDA, tilelang and the shapes allow, else the reference. The reason
  for a fallback is logged once, at debug level.

Kernels declare support per call: a kernel function returns ``None`` to decline a shape, and the
reference runs instead. The readable modules never import `dsa_ref.kernels` themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from . import indexer as _indexer
from . import sparse_attention as _sparse

BACKENDS = ("auto", "reference", "tilelang")
_log = logging.getLogger("dsa_ref.dispatch")
_said: set[str] = set()


def check_backend(backend: str) -> str:
    """Raise ValueError unless ``backend`` is one of `BACKENDS`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def kernels_available() -> tuple[bool, str]:
    """Whether the TileLang kernels can run here, and why not."""
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    try:
        from . import kernels
    except ImportError as err:  # pragma: no cover - depends on the machine
        return False, f"dsa_ref.kernels cannot be imported: {err}"
    return kernels.available()


def _run(op: str, backend: str, reference: Callable[..., Any], args: tuple, kwargs: dict, device: torch.device):
    check_backend(backend)
    if backend == "reference":
        return reference(*args, **kwargs)
    if device.type != "cuda":
        reason = f"inputs are on {device}, not CUDA"
        ok = False
    else:
        ok, reason = kernels_available()
    if ok:
        from . import kernels

        result = getattr(kernels, op)(*args, **kwargs)
        if result is not None:
            return result
        reason = f"the {op} kernel declined these shapes"
    if backend == "tilelang":
        raise RuntimeError(f"backend='tilelang' was asked for {op}, but {reason}")
    if op + reason not in _said:
        _said.add(op + reason)
        _log.debug("dsa_ref: %s falls back to the reference: %s", op, reason)
    return reference(*args, **kwargs)


def sparse_mla(q, kv, indices, *, sm_scale, d_v=512, backend="reference"):
    """`dsa_ref.sparse_mla` through the chosen backend."""
    return _run("sparse_mla", backend, _sparse.sparse_mla, (q, kv, indices),
                dict(sm_scale=sm_scale, d_v=d_v), q.device)


def lightning_indexer(q, k, weights, *, starts=None, ends=None, relu=True, backend="reference"):
    """`dsa_ref.lightning_indexer` through the chosen backend."""
    return _run("lightning_indexer", backend, _indexer.lightning_indexer, (q, k, weights),
                dict(starts=starts, ends=ends, relu=relu), q.device)


def topk_indices(scores, topk, *, backend="reference"):
    """`dsa_ref.topk_indices` through the chosen backend (the kernel returns the same indices, same order)."""
    return _run("topk_indices", backend, _indexer.topk_indices, (scores, topk), {}, scores.device)


def slot_ops(backend: str, *, q, kv, q_i, k_i, w_i):
    """The kernels of the slot path (`dsa_ref.slot_path`) for `DSAttention`, or ``None``.

    ``None`` (``backend="reference"``, or ``"auto"`` where the kernels cannot run) means: take the
    readable steps of chapter 3. ``backend="tilelang"`` raises instead when they cannot run.
    """
    check_backend(backend)
    if backend == "reference":
        return None
    if q.device.type != "cuda":
        ok, reason = False, f"inputs are on {q.device}, not CUDA"
    else:
        ok, reason = kernels_available()
    if ok:
        from . import kernels

        ops = kernels.slot_ops(q, kv, q_i, k_i, w_i)
        if ops is not None:
            return ops
        reason = "the slot-path kernels declined these shapes"
    if backend == "tilelang":
        raise RuntimeError(f"backend='tilelang' was asked for the layer's kernels, but {reason}")
    if "slot_ops" + reason not in _said:
        _said.add("slot_ops" + reason)
        _log.debug("dsa_ref: DSAttention takes the readable path: %s", reason)
    return None


def chunk_selector(backend: str, *, q_i, k_i, w_i):
    """The kernels' chunk selector for `dsa_ref.streaming.streamed_topk_indices`, or ``None``.

    ``None`` (``backend="reference"``, or ``"auto"`` where the kernels cannot run) means the
    readable key-tiled selector; ``backend="tilelang"`` raises instead when the kernels cannot run.
    """
    check_backend(backend)
    if backend == "reference":
        return None
    if q_i.device.type != "cuda":
        ok, reason = False, f"inputs are on {q_i.device}, not CUDA"
    else:
        ok, reason = kernels_available()
    if ok:
        from . import kernels

        select = kernels.chunk_selector(q_i, k_i, w_i)
        if select is not None:
            return select
        reason = "the indexer kernel declined these shapes"
    if backend == "tilelang":
        raise RuntimeError(f"backend='tilelang' was asked for the top-k selection, but {reason}")
    if "chunk_selector" + reason not in _said:
        _said.add("chunk_selector" + reason)
        _log.debug("dsa_ref: the top-k selection takes the readable path: %s", reason)
    return None
