"""Input validation shared by every public function.

Every public entry point of `dsa_ref` checks its inputs before doing any math, so that a wrong
shape, dtype or index range raises a clear ``ValueError``/``TypeError`` that names the argument,
what was seen and what was expected -- instead of an opaque index error deep inside a kernel or,
worse, a silently wrong answer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def check_tensor(name: str, x: object) -> torch.Tensor:
    """Raise TypeError unless ``x`` is a tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_float(name: str, x: torch.Tensor) -> torch.Tensor:
    """Raise TypeError unless ``x`` is a floating-point tensor."""
    check_tensor(name, x)
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating-point tensor (float16/bfloat16/float32/float64), got {x.dtype}")
    return x


def check_int(name: str, x: torch.Tensor) -> torch.Tensor:
    """Raise TypeError unless ``x`` is an integer tensor."""
    check_tensor(name, x)
    if x.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} must be an integer tensor (int32 or int64), got {x.dtype}")
    return x


def check_rank(name: str, x: torch.Tensor, ranks: int | Sequence[int], layout: str) -> torch.Tensor:
    """Raise ValueError unless ``x.dim()`` is one of ``ranks``; ``layout`` describes the expected shape."""
    allowed = (ranks,) if isinstance(ranks, int) else tuple(ranks)
    if x.dim() not in allowed:
        raise ValueError(f"{name} must have shape {layout}, got shape {tuple(x.shape)} ({x.dim()} dims)")
    return x


def check_dim(name: str, x: torch.Tensor, dim: int, expected: int, what: str) -> None:
    """Raise ValueError unless ``x.shape[dim] == expected``; ``what`` says where ``expected`` comes from."""
    if x.shape[dim] != expected:
        raise ValueError(
            f"{name} has size {x.shape[dim]} in dim {dim} (shape {tuple(x.shape)}), expected {expected} ({what})"
        )


def check_same_device(**tensors: torch.Tensor | None) -> None:
    """Raise ValueError when the given tensors live on different devices."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        seen = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"all tensors must be on one device, got {seen}")


def check_positive_int(name: str, value: object) -> int:
    """Raise TypeError/ValueError unless ``value`` is an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def check_nonnegative_int(name: str, value: object) -> int:
    """Raise TypeError/ValueError unless ``value`` is an int >= 0 (a bool is not an int here)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def check_scale(name: str, value: object) -> float:
    """Raise TypeError/ValueError unless ``value`` is a finite positive number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    if not (value > 0.0 and value < float("inf")):
        raise ValueError(f"{name} must be a finite positive number, got {value}")
    return value


def check_windows(
    starts: torch.Tensor | None, ends: torch.Tensor | None, num_queries: int, num_keys: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Validate a pair of key windows ``[starts[t], ends[t])`` for ``num_queries`` queries.

    Returns the windows as int64 tensors, or ``None`` when both are ``None`` (no mask).
    An empty window (``starts[t] >= ends[t]``) is allowed: that row attends to nothing.
    """
    if starts is None and ends is None:
        return None
    if starts is None or ends is None:
        raise ValueError("starts and ends must be given together (both None means no mask)")
    for name, w in (("starts", starts), ("ends", ends)):
        check_int(name, w)
        check_rank(name, w, 1, "[T]")
        check_dim(name, w, 0, num_queries, "one window per query")
    if num_queries > 0:
        low, high = torch.stack([starts.min().long(), ends.max().long()]).tolist()  # one read back to the host
        if low < 0:
            raise ValueError(f"starts must be >= 0, got min {low}")
        if high > num_keys:
            raise ValueError(f"ends must be <= num_keys={num_keys}, got max {high}")
    return starts.long(), ends.long()


def accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the reference accumulates in: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32
