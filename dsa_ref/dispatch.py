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

from . import fp8 as _fp8
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


def _from_kernels(name: str, backend: str, device: torch.device, build: Callable[[Any], Any]) -> Any | None:
    """``build(kernels)`` when the kernels can run here and accept the call, else ``None``.

    ``None`` (``backend="reference"``, or ``"auto"`` where the kernels cannot run or decline) means:
    take the readable path; the reason is logged once, at debug level. ``backend="tilelang"``
    raises instead of returning ``None``.
    """
    check_backend(backend)
    if backend == "reference":
        return None
    ok, reason = (False, f"inputs are on {device}, not CUDA") if device.type != "cuda" else kernels_available()
    if ok:
        from . import kernels

        result = build(kernels)
        if result is not None:
            return result
        reason = f"the kernels of {name} declined these shapes"
    if backend == "tilelang":
        raise RuntimeError(f"backend='tilelang' was asked for {name}, but {reason}")
    if name + reason not in _said:
        _said.add(name + reason)
        _log.debug("dsa_ref: %s takes the readable path: %s", name, reason)
    return None


def _run(op: str, backend: str, reference: Callable[..., Any], args: tuple, kwargs: dict, device: torch.device):
    """``dsa_ref.kernels.<op>(*args, **kwargs)`` where the backend allows and the kernel accepts, else ``reference``."""
    result = _from_kernels(op, backend, device, lambda kernels: getattr(kernels, op)(*args, **kwargs))
    return reference(*args, **kwargs) if result is None else result


def sparse_mla(q, kv, indices, *, sm_scale, d_v=512, backend="reference", reference=None):
    """`dsa_ref.sparse_mla` through the chosen backend; ``reference`` replaces the readable function
    (`DSAttention` passes the chunked one of chapter 7, `dsa_ref.streaming_slots.chunked_sparse_mla`)."""
    return _run("sparse_mla", backend, reference or _sparse.sparse_mla, (q, kv, indices),
                dict(sm_scale=sm_scale, d_v=d_v), q.device)


def lightning_indexer(q, k, weights, *, starts=None, ends=None, relu=True, backend="reference"):
    """`dsa_ref.lightning_indexer` through the chosen backend."""
    return _run("lightning_indexer", backend, _indexer.lightning_indexer, (q, k, weights),
                dict(starts=starts, ends=ends, relu=relu), q.device)


def lightning_indexer_fp8(q, k, weights, *, starts=None, ends=None, relu=True, backend="reference"):
    """fp8 index scores (DeepSeek's e4m3 q and k, one scale per 128 channels) through the chosen backend.

    ``q`` and ``k`` come unquantised and already rotated (as `LightningIndexer.project` returns them).
    The reference is the simulation, `dsa_ref.fp8.fp8_indexer_scores` with ``hadamard=False``; the
    kernel is `dsa_ref.kernels.indexer_fwd_fp8`. No gradient on either path.
    """
    def reference(q, k, weights, *, starts, ends, relu):
        with torch.no_grad():
            return _fp8.fp8_indexer_scores(q, k, weights, hadamard=False, starts=starts, ends=ends, relu=relu,
                                           block_size=_fp8.selection_block_size(q.shape[-1]))

    return _run("lightning_indexer_fp8", backend, reference, (q, k, weights),
                dict(starts=starts, ends=ends, relu=relu), q.device)


def topk_indices(scores, topk, *, backend="reference"):
    """`dsa_ref.topk_indices` through the chosen backend (the kernel returns the same indices, same order)."""
    return _run("topk_indices", backend, _indexer.topk_indices, (scores, topk), {}, scores.device)


def slot_ops(backend: str, *, q, kv, q_i, k_i, w_i, validate: bool = True):
    """The kernels of the slot path (`dsa_ref.slot_path`) for `DSAttention`, or ``None``.

    ``None`` (``backend="reference"``, or ``"auto"`` where the kernels cannot run) means: take the
    readable steps of chapter 3. ``backend="tilelang"`` raises instead when they cannot run.
    ``validate=False`` drops the attention kernel's per-call index check (`dsa_ref.kernels.slot_ops`).
    """
    return _from_kernels("the layer's slot path", backend, q.device,
                         lambda kernels: kernels.slot_ops(q, kv, q_i, k_i, w_i, validate=validate))


def chunk_selector(backend: str, *, q_i, k_i, w_i, fp8: bool = False):
    """The kernels' chunk selector for `dsa_ref.streaming.streamed_topk_indices`, or ``None``.

    ``None`` (``backend="reference"``, or ``"auto"`` where the kernels cannot run) means the
    readable key-tiled selector -- with ``fp8``, run on `dsa_ref.fp8.fp8_selection_operands`;
    ``backend="tilelang"`` raises instead when the kernels cannot run. ``fp8`` selects by the
    fp8 kernel's scores (``IndexerConfig.fp8``).
    """
    name = "the fp8 top-k selection" if fp8 else "the top-k selection"
    return _from_kernels(name, backend, q_i.device,
                         lambda kernels: kernels.chunk_selector(q_i, k_i, w_i, fp8=fp8))
