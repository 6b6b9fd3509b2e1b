r"""Comparison helpers that report, not just assert.

``torch.testing.assert_close`` answers one question -- did every element pass? -- and on failure prints
a few numbers. A kernel author needs more: *how* wrong, *where*, whether the error is rounding
noise spread evenly or one broken head, and whether there are NaNs. `compare` computes all of it at
once and returns a `Comparison` that prints as a short report and can still ``assert_ok()``.

Metrics of ``compare(actual, expected)`` (all computed in float64):

* **relative L2** $\lVert a - e\rVert_2 / \lVert e\rVert_2$ -- the headline number; rounding noise of
  a dtype with unit roundoff $u$ gives a few $u$;
* **max abs** $\max |a - e|$ with its **location** (an index tuple into the tensor);
* **cosine** $\langle a, e\rangle / (\lVert a\rVert\,\lVert e\rVert)$; $1 - \cos \approx \tfrac12
  \text{rel\_l2}^2$ when the error is uncorrelated with the signal, so a cosine far below that
  means a *systematic* error such as a wrong scale;
* **non-finite** counts: NaN/inf in ``actual``, and positions where ``actual`` and ``expected`` disagree
  on finiteness (equal infinities, e.g. ``lse = -inf`` on empty rows, count as exact matches);
* **elementwise** violations of $|a - e| \le \text{atol}\cdot\operatorname{rms}(e) + \text{rtol}\,|e|$,
  or, when the caller passes the ``magnitude`` $m$ of a sum (its terms' absolute values summed),
  of $|a - e| \le \text{atol}\cdot\operatorname{rms}(e) + \text{rtol}\,m$ (see `compare`);
* **per-head worst rows**: for every head, the row with the largest error (a bug in one head or one
  head block shows up as one head standing out).

Tolerances come from `TOLERANCES` by the dtype of ``actual`` (see `Tolerance` for the reasoning).
Top-k selections are compared by `compare_topk`, which accepts any tie-breaking rule, and
approximate top-k kernels are scored by `attention_mass_recall`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ._checks import check_float, check_int, check_rank, check_tensor

__all__ = [
    "Tolerance",
    "TOLERANCES",
    "LSE_TOLERANCE",
    "tolerance_for",
    "Comparison",
    "WorstRow",
    "compare",
    "TopkComparison",
    "compare_topk",
    "attention_mass_recall",
]


# --8<-- [start:tolerance]
@dataclass(frozen=True)
class Tolerance:
    r"""How close a kernel's output must be to the exact reference.

    A comparison passes when all four hold (and the non-finite positions agree):

    * ``rel_l2``: $\lVert a - e\rVert_2 / \lVert e\rVert_2 \le$ ``rel_l2``;
    * elementwise: $|a - e| \le$ ``atol`` $\cdot \operatorname{rms}(e) +$ ``rtol`` $\cdot |e|$;
    * cosine similarity $\ge$ ``min_cosine``.

    ``atol`` is in units of the RMS of the expected tensor when ``atol_scaled`` is true (the default),
    so a preset does not depend on the scale of your data; with ``atol_scaled=False`` it is absolute
    (used for log-sum-exps, whose errors are absolute).

    The presets assume the reference is computed *exactly* (float64) from the very inputs the kernel
    saw, so the only error left is the kernel's own rounding: for a dtype with unit roundoff $u$
    (half an ulp at 1: $2^{-8}$ for bfloat16), rounding the output once gives a relative error of at
    most $u$ per element and about $u/\sqrt{3}$ in relative L2; a kernel that also rounds its softmax
    probabilities to that dtype before the second GEMM (FlashAttention-style kernels do) adds about
    as much again. Each preset allows about 2.5 times that, plus a few $u$ elementwise.

    Attributes:
        rel_l2: bound on the relative L2 error.
        atol: elementwise absolute term (times ``rms(expected)`` when ``atol_scaled``).
        rtol: elementwise relative term.
        min_cosine: lower bound on the cosine similarity.
        reason: one line saying where the numbers come from.
        atol_scaled: whether ``atol`` is relative to ``rms(expected)``.
    """

    rel_l2: float
    atol: float
    rtol: float
    min_cosine: float
    reason: str = ""
    atol_scaled: bool = True

    def __post_init__(self) -> None:
        for name in ("rel_l2", "atol", "rtol"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"Tolerance.{name} must be a number >= 0, got {value!r}")
        if not (isinstance(self.min_cosine, (int, float)) and -1.0 <= self.min_cosine <= 1.0):
            raise ValueError(f"Tolerance.min_cosine must lie in [-1, 1], got {self.min_cosine!r}")

    def scaled(self, factor: float) -> "Tolerance":
        """A copy with ``rel_l2``, ``atol`` and ``rtol`` multiplied by ``factor`` (and the cosine bound adjusted)."""
        gap = 1.0 - self.min_cosine
        return Tolerance(self.rel_l2 * factor, self.atol * factor, self.rtol * factor,
                         max(-1.0, 1.0 - gap * factor * factor), f"{self.reason} (x{factor:g})", self.atol_scaled)


#: Tolerance presets by the dtype of the kernel's output. Keys are torch dtypes, plus
#: ``"float8_e4m3"`` for outputs computed from fp8-quantised inputs and compared with the exact
#: (unquantised) reference.
TOLERANCES: dict = {
    torch.float64: Tolerance(
        rel_l2=1e-12, atol=1e-12, rtol=1e-10, min_cosine=1 - 1e-12,
        reason="float64, u = 2^-53: only summation order differs (sqrt(n) u ~ 1e-14 for n ~ 1e4 terms)"),
    torch.float32: Tolerance(
        rel_l2=1e-5, atol=1e-4, rtol=1e-4, min_cosine=1 - 1e-9,
        reason="float32, u = 2^-24 = 6e-8: blocked accumulation over ~1e4 terms gives ~sqrt(n) u = 6e-6"),
    torch.float16: Tolerance(
        rel_l2=2e-3, atol=4e-3, rtol=2e-3, min_cosine=1 - 1e-5,
        reason="float16, u = 2^-11 = 4.9e-4: output rounding plus probability rounding ~ 1.6u rel. L2; 4u allowed"),
    torch.bfloat16: Tolerance(
        rel_l2=1e-2, atol=3e-2, rtol=1.6e-2, min_cosine=1 - 1e-4,
        reason="bfloat16, u = 2^-8 = 3.9e-3: output rounding plus probability rounding ~ 1.3u rel. L2; 2.5u allowed"),
    "float8_e4m3": Tolerance(
        rel_l2=1.5e-1, atol=5e-1, rtol=2.5e-1, min_cosine=0.98,
        reason="fp8 e4m3 inputs, u = 2^-4: each product carries ~u rel. error; against the unquantised reference"),
}

#: Log-sum-exps: an absolute error bound in natural-log units, and nothing relative (an LSE can
#: be close to 0, which makes relative measures meaningless). The backward pass recomputes
#: ``P = exp(s - lse)``, so an LSE error ``d`` scales every probability by ``exp(-d) ~ 1 - d``;
#: 1e-4 is ~1/40 of a bfloat16 ulp of P, far below what the output shows, yet a wrong base (x1.44),
#: a wrong scale or a missing key moves the LSE by much more.
LSE_TOLERANCE = Tolerance(
    rel_l2=math.inf, atol=1e-4, rtol=1e-5, min_cosine=-1.0, atol_scaled=False,
    reason="LSE in float32 from exact scores: |error| <= 1e-4 + 1e-5 |lse| (P = exp(s - lse) is then off by < 1e-4)")
# --8<-- [end:tolerance]


def tolerance_for(dtype) -> Tolerance:
    """The `TOLERANCES` preset for a dtype (a ``torch.dtype`` or ``"float8_e4m3"``).

    Raises:
        KeyError: for a dtype without a preset (integers, complex): pass a `Tolerance` yourself.
    """
    fp8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz") if hasattr(torch, n)}
    if dtype in fp8:
        dtype = "float8_e4m3"
    if dtype not in TOLERANCES:
        raise KeyError(f"no tolerance preset for {dtype}; presets exist for "
                       f"{[str(k) for k in TOLERANCES]}; pass tol=Tolerance(...)")
    return TOLERANCES[dtype]


@dataclass(frozen=True)
class WorstRow:
    """The worst row of one head: where its largest absolute error is.

    Attributes:
        head: the head index.
        row: index tuple of the row (all dims except the head dim and, if present, the feature dim).
        max_abs: the largest ``|actual - expected|`` in that row.
        rel_l2: relative L2 error of that row.
    """

    head: int
    row: tuple
    max_abs: float
    rel_l2: float


@dataclass
class Comparison:
    """The result of `compare`: every metric, whether it passes, and a readable ``str``.

    Attributes:
        name: what was compared (shows in reports).
        shape: the compared shape.
        dtype: dtype of ``actual``.
        tol: the `Tolerance` applied.
        rel_l2: relative L2 error over the positions where both are finite.
        max_abs: largest absolute error (over finite positions; ``inf`` if finiteness disagrees somewhere).
        max_abs_index: index tuple of ``max_abs`` (``None`` for empty tensors).
        max_abs_actual: ``actual`` at that index.
        max_abs_expected: ``expected`` at that index.
        allowed_at_max: the elementwise bound at that index.
        worst_ratio: largest ``|a - e| / bound`` over all elements (> 1 means an elementwise violation).
        cosine: cosine similarity (over finite positions).
        nonfinite_actual: number of NaN/inf elements in ``actual``.
        nonfinite_mismatch: positions where ``actual`` and ``expected`` disagree on NaN/inf (equal
            infinities match).
        violations: elements outside the elementwise bound.
        numel: number of elements.
        worst_rows: per head, the row with the largest error (empty when there is no head dim).
        failures: human-readable reasons for failing (empty when ``ok``).
        magnitude_based: whether the elementwise relative term was ``rtol * magnitude`` (a
            ``magnitude`` was passed to `compare`) rather than ``rtol * |expected|``.
    """

    name: str
    shape: tuple
    dtype: torch.dtype
    tol: Tolerance
    rel_l2: float
    max_abs: float
    max_abs_index: tuple | None
    max_abs_actual: float
    max_abs_expected: float
    allowed_at_max: float
    worst_ratio: float
    cosine: float
    nonfinite_actual: int
    nonfinite_mismatch: int
    violations: int
    numel: int
    worst_rows: list[WorstRow] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    magnitude_based: bool = False

    @property
    def ok(self) -> bool:
        """Whether every criterion of the tolerance holds."""
        return not self.failures

    def assert_ok(self) -> "Comparison":
        """Raise ``AssertionError`` with the full report unless `ok`; return ``self`` otherwise."""
        if not self.ok:
            raise AssertionError(str(self))
        return self

    def summary(self) -> str:
        """One line: name, verdict and the headline numbers."""
        where = "" if self.max_abs_index is None else f" at {self.max_abs_index}"
        rel_tol = "not checked" if math.isinf(self.tol.rel_l2) else f"tol {self.tol.rel_l2:.1e}"
        nonfinite = f"non-finite {self.nonfinite_actual}"
        if self.nonfinite_actual or self.nonfinite_mismatch:
            nonfinite += f" ({self.nonfinite_mismatch} mismatched)"
        return (f"{self.name} {list(self.shape)} {_dtype_name(self.dtype)}: {'ok' if self.ok else 'FAIL'}  "
                f"rel_l2 {self.rel_l2:.2e} ({rel_tol})  max_abs {self.max_abs:.2e}{where}  "
                f"cos {self.cosine:.9f}  {nonfinite}")

    def __str__(self) -> str:
        lines = [self.summary()]
        if self.max_abs_index is not None and math.isfinite(self.max_abs):
            lines.append(f"  at {self.max_abs_index}: actual {self.max_abs_actual:.6g}, expected "
                         f"{self.max_abs_expected:.6g}, allowed |err| {self.allowed_at_max:.3g}")
        unit = "rms" if self.tol.atol_scaled else "1"
        lines.append(f"  elementwise: {self.violations} of {self.numel} outside atol*{unit} + {self._relative_term()} "
                     f"(atol {self.tol.atol:.1e}, rtol {self.tol.rtol:.1e}); worst ratio {self.worst_ratio:.3g}")
        if self.nonfinite_mismatch:
            lines.append(f"  non-finite mismatch at {self.nonfinite_mismatch} positions")
        if self.worst_rows:
            ranked = sorted(self.worst_rows, key=lambda w: -w.max_abs if math.isfinite(w.max_abs) else -math.inf)
            shown = ", ".join(f"h{w.head} row {w.row}: {w.max_abs:.2e}" for w in ranked[:4])
            more = f" (+{len(ranked) - 4} heads)" if len(ranked) > 4 else ""
            lines.append(f"  worst row per head: {shown}{more}")
        for failure in self.failures:
            lines.append(f"  FAIL: {failure}")
        return "\n".join(lines)

    def _relative_term(self) -> str:
        return "rtol*magnitude" if self.magnitude_based else "rtol*|e|"

    def as_dict(self) -> dict:
        """The metrics as plain Python values (for JSON)."""
        return {
            "name": self.name, "shape": list(self.shape), "dtype": _dtype_name(self.dtype), "ok": self.ok,
            "rel_l2": self.rel_l2, "max_abs": self.max_abs,
            "max_abs_index": None if self.max_abs_index is None else list(self.max_abs_index),
            "allowed_at_max": self.allowed_at_max, "worst_ratio": self.worst_ratio, "cosine": self.cosine,
            "nonfinite_actual": self.nonfinite_actual, "nonfinite_mismatch": self.nonfinite_mismatch,
            "violations": self.violations, "failures": list(self.failures), "magnitude_based": self.magnitude_based,
            "tolerance": {"rel_l2": self.tol.rel_l2, "atol": self.tol.atol, "rtol": self.tol.rtol,
                          "min_cosine": self.tol.min_cosine, "atol_scaled": self.tol.atol_scaled},
        }


def compare(actual: torch.Tensor, expected: torch.Tensor, *, name: str = "tensor", tol: Tolerance | None = None,
            head_dim: int | None = -1, magnitude: torch.Tensor | None = None,
            allowance: torch.Tensor | None = None) -> Comparison:
    r"""Compare a kernel's tensor with the reference and report every metric (see the module docs).

    **Magnitude-based elementwise bound.** When ``expected`` is a sum $e = \sum_i x_i$ (a gradient
    accumulated over many contributions), the rounding error of any computed sum is bounded by the
    sum of the terms' absolute values, not by $|e|$: with per-term errors $|\hat x_i - x_i| \le
    c\,u\,|x_i|$ and an accumulation of $n$ terms, $|\hat e - e| \le (c\,u + \gamma_n)\,m$ with
    $m = \sum_i |x_i|$ (Higham, *Accuracy and Stability of Numerical Algorithms*, sec. 4.2). Where the
    terms cancel, $|e| \ll m$ and a bound relative to $|e|$ cannot tell rounding from a bug. Passing
    ``magnitude`` $= m$ makes the elementwise test

    $$ |a - e| \le \text{atol}\cdot\operatorname{rms}(e) + \text{rtol}\cdot m $$

    instead of $\ldots + \text{rtol}\,|e|$. For a given ``rtol``, $m \ge |e|$ means this only loosens
    the bound, and by much only where the terms cancel; relative L2 and cosine are unchanged. The
    caller picks the ``tol.rtol`` that bounds its errors relative to $m$ (for sparse-MLA gradients:
    `dsa_ref.oracle.accumulation_rtol`).

    Args:
        actual: the kernel's output, any float dtype and shape.
        expected: the reference, same shape (any float dtype; float64 is best).
        name: label for the report.
        tol: the `Tolerance`; default ``tolerance_for(actual.dtype)``.
        head_dim: the dim that indexes heads, for the per-head worst rows; ``-1`` (default) picks
            dim ``ndim - 2`` for tensors of 3 or more dims (``[T, H, D]``, ``[B, S, H, D]``) and none
            otherwise; ``None`` disables the per-head report. For a ``[T, H]`` LSE pass ``head_dim=1``.
        magnitude: optional float tensor shaped like ``expected``, finite and ``>= 0``: the
            magnitude $m$ of each expected element (the sum of its terms' absolute values, so
            $m \ge |e|$). When given, the elementwise relative term is ``rtol * magnitude``; ``None``
            (default) keeps ``rtol * |expected|``.
        allowance: optional float tensor shaped like ``expected``, finite and ``>= 0``: an absolute
            error each element may carry on top of the two terms, for an error the caller bounds
            separately (`dsa_ref.oracle.check_sparse_mla_backward`: what a kernel's $\delta$ brings in).
            The elementwise bound becomes ``atol * rms + rtol * (magnitude or |expected|) + allowance``.

    Returns:
        A `Comparison` (``magnitude_based`` says which relative term was used).

    Raises:
        ValueError: shapes differ, or ``magnitude`` has the wrong shape or a negative or non-finite entry.
    """
    check_float("actual", actual)
    check_float("expected", expected)
    if actual.shape != expected.shape:
        raise ValueError(f"{name}: actual has shape {tuple(actual.shape)} but expected has shape "
                         f"{tuple(expected.shape)}; convert the layout first (dsa_ref.oracle has converters)")
    if tol is None:
        tol = tolerance_for(actual.dtype)
    if not isinstance(tol, Tolerance):
        raise TypeError(f"tol must be a dsa_ref.compare.Tolerance, got {type(tol).__name__}")
    if head_dim == -1:
        head_dim = actual.dim() - 2 if actual.dim() >= 3 else None
    if head_dim is not None and not (isinstance(head_dim, int) and 0 <= head_dim < actual.dim()):
        raise ValueError(f"head_dim must be None, -1 or a dim index in [0, {actual.dim()}), got {head_dim!r}")
    if magnitude is not None:
        _check_magnitude(magnitude, expected, name)
    if allowance is not None:
        _check_magnitude(allowance, expected, name, what="allowance")

    # float64 on actual's device (a GPU comparison of [4096, 128, 512] outputs stays on the GPU)
    a = actual.detach().to(dtype=torch.float64)
    e = expected.detach().to(device=a.device, dtype=torch.float64)
    numel = a.numel()
    fin_a, fin_e = torch.isfinite(a), torch.isfinite(e)
    same_inf = (~fin_a) & (~fin_e) & (a == e)  # equal infinities (NaN != NaN)
    mismatch = (fin_a != fin_e) | ((~fin_a) & (~fin_e) & ~same_inf)  # [..]
    both = fin_a & fin_e
    diff = torch.where(both, (a - e).abs(), torch.zeros_like(a))
    diff_all = torch.where(mismatch, torch.full_like(a, math.inf), diff)  # a mismatch is an infinite error
    ez = torch.where(both, e, torch.zeros_like(e))
    az = torch.where(both, a, torch.zeros_like(a))

    err_norm = float(diff.square().sum().sqrt())
    ref_norm = float(ez.square().sum().sqrt())
    act_norm = float(az.square().sum().sqrt())
    rel_l2 = err_norm / ref_norm if ref_norm > 0 else (0.0 if err_norm == 0 else math.inf)
    if ref_norm > 0 and act_norm > 0:
        cosine = float((az * ez).sum()) / (act_norm * ref_norm)
    else:
        cosine = 1.0 if ref_norm == act_norm else 0.0
    n_fin = int(fin_e.sum())
    rms = ref_norm / math.sqrt(n_fin) if n_fin else 0.0
    if magnitude is None:
        relative = ez.abs()  # [..]
    else:
        m = magnitude.detach().to(device=a.device, dtype=torch.float64)  # [..]
        relative = torch.where(both, m, torch.zeros_like(m))  # [..]
    bound = tol.atol * (rms if tol.atol_scaled else 1.0) + tol.rtol * relative  # [..]
    if allowance is not None:
        bound = bound + torch.where(both, allowance.detach().to(device=a.device, dtype=torch.float64), 0.0)  # [..]
    ratio = torch.where(diff_all > 0, diff_all / bound.clamp_min(torch.finfo(torch.float64).tiny),
                        torch.zeros_like(diff_all))
    violations = int((diff_all > bound).sum())

    if numel:
        flat = int(diff_all.reshape(-1).argmax())
        index = tuple(int(i) for i in _unravel(flat, tuple(a.shape)))
        max_abs = float(diff_all.reshape(-1)[flat])
        at_a, at_e = float(a.reshape(-1)[flat]), float(e.reshape(-1)[flat])
        allowed = float(bound.reshape(-1)[flat])
        worst_ratio = float(ratio.max())
    else:
        index, max_abs, at_a, at_e, allowed, worst_ratio = None, 0.0, 0.0, 0.0, 0.0, 0.0

    worst_rows = _worst_rows(diff_all, e, head_dim) if head_dim is not None and numel else []

    failures = []
    n_mismatch = int(mismatch.sum())
    if n_mismatch:
        failures.append(f"{n_mismatch} positions disagree on NaN/inf (actual has {int((~fin_a).sum())} non-finite, "
                        f"expected {int((~fin_e).sum())})")
    if not rel_l2 <= tol.rel_l2:
        failures.append(f"relative L2 error {rel_l2:.3e} > {tol.rel_l2:.1e}")
    if violations:
        # name the element furthest over its bound (err / bound), which need not hold the largest |err|
        over = int(ratio.reshape(-1).argmax())
        over_index = tuple(int(i) for i in _unravel(over, tuple(a.shape)))
        over_err, over_bound = float(diff_all.reshape(-1)[over]), float(bound.reshape(-1)[over])
        relative_term = "rtol*magnitude" if magnitude is not None else "rtol*|e|"
        relative_term += " + allowance" if allowance is not None else ""
        failures.append(f"{violations} elements exceed atol*{'rms' if tol.atol_scaled else '1'} + {relative_term} "
                        f"(furthest over at {over_index}: |err| {over_err:.3e} > {over_bound:.3e}, actual "
                        f"{float(a.reshape(-1)[over]):.6g}, expected {float(e.reshape(-1)[over]):.6g})")
    if not cosine >= tol.min_cosine:
        failures.append(f"cosine similarity {cosine:.9f} < {tol.min_cosine:.9f}")
    return Comparison(name=name, shape=tuple(actual.shape), dtype=actual.dtype, tol=tol, rel_l2=rel_l2,
                      max_abs=max_abs, max_abs_index=index, max_abs_actual=at_a, max_abs_expected=at_e,
                      allowed_at_max=allowed, worst_ratio=worst_ratio, cosine=cosine,
                      nonfinite_actual=int((~fin_a).sum()), nonfinite_mismatch=n_mismatch, violations=violations,
                      numel=numel, worst_rows=worst_rows, failures=failures,
                      magnitude_based=magnitude is not None)


def _check_magnitude(magnitude, expected: torch.Tensor, name: str, what: str = "magnitude") -> None:
    """Raise ``ValueError`` (naming ``what``: ``magnitude`` or ``allowance``) unless it is a finite,
    non-negative float tensor shaped like ``expected``."""
    if not isinstance(magnitude, torch.Tensor):
        raise ValueError(f"{name}: {what} must be a torch.Tensor or None, got {type(magnitude).__name__}")
    if not magnitude.is_floating_point():
        raise ValueError(f"{name}: {what} must be a float tensor, got dtype {magnitude.dtype}")
    if magnitude.shape != expected.shape:
        raise ValueError(f"{name}: {what} has shape {tuple(magnitude.shape)} but expected has shape "
                         f"{tuple(expected.shape)}")
    m = magnitude.detach()
    if not bool(torch.isfinite(m).all()):
        raise ValueError(f"{name}: {what} has {int((~torch.isfinite(m)).sum())} non-finite entries; "
                         "it must be finite and >= 0")
    if bool((m < 0).any()):
        raise ValueError(f"{name}: {what} has {int((m < 0).sum())} negative entries; it must be >= 0")


def _worst_rows(diff: torch.Tensor, expected: torch.Tensor, head_dim: int) -> list[WorstRow]:
    """Per head: the row (index over the other non-feature dims) with the largest error."""
    nd = diff.dim()
    feature = nd - 1 if head_dim != nd - 1 else None  # the last dim is the feature dim unless it is the head dim
    d = diff.movedim(head_dim, 0)  # [H, ...]
    e = torch.where(torch.isfinite(expected), expected, torch.zeros_like(expected)).movedim(head_dim, 0)
    if feature is not None:
        row_max = d.amax(dim=-1)  # [H, rows...]
        row_err = torch.where(torch.isfinite(d), d, torch.zeros_like(d)).square().sum(-1).sqrt()
        row_ref = e.square().sum(-1).sqrt()
    else:
        row_max, row_err, row_ref = d, torch.where(torch.isfinite(d), d, torch.zeros_like(d)), e.abs()
    H = row_max.shape[0]
    row_shape = row_max.shape[1:]
    flat_max = row_max.reshape(H, -1)
    if flat_max.shape[1] == 0:
        return []
    best = flat_max.argmax(dim=1, keepdim=True)  # [H, 1]
    m = flat_max.gather(1, best).squeeze(1).cpu().tolist()
    err = row_err.reshape(H, -1).gather(1, best).squeeze(1).cpu().tolist()
    ref = row_ref.reshape(H, -1).gather(1, best).squeeze(1).cpu().tolist()
    out = []
    for h, j in enumerate(best.squeeze(1).cpu().tolist()):
        row = tuple(int(i) for i in _unravel(j, tuple(row_shape))) if len(row_shape) else ()
        rel = err[h] / ref[h] if ref[h] > 0 else (0.0 if err[h] == 0 else math.inf)
        out.append(WorstRow(head=h, row=row, max_abs=m[h], rel_l2=rel if math.isfinite(m[h]) else math.inf))
    return out


# ----------------------------------------------------------------------------------------- top-k


@dataclass
class TopkComparison:
    """The result of `compare_topk`.

    Attributes:
        rows: number of rows compared.
        k: slots per row.
        tie_tol: the tie tolerance used.
        rows_exact: rows whose selected *set* equals the reference's.
        rows_tie_equivalent: rows that differ from the reference only among keys tied at the
            k-th boundary (acceptable).
        rows_wrong: rows that are neither.
        mean_recall: mean over rows with at least one valid reference slot of
            ``|actual ∩ reference| / |reference|``.
        min_recall: the smallest such recall.
        wrong: up to 8 wrong rows, each a dict with ``row``, ``reasons``, ``missing`` and ``extra``
            (lists of ``(key, score)``) and ``boundary`` (the k-th score).
    """

    rows: int
    k: int
    tie_tol: float
    rows_exact: int
    rows_tie_equivalent: int
    rows_wrong: int
    mean_recall: float
    min_recall: float
    wrong: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether every row is exact or tie-equivalent."""
        return self.rows_wrong == 0

    def assert_ok(self) -> "TopkComparison":
        """Raise ``AssertionError`` with the report unless `ok`; return ``self`` otherwise."""
        if not self.ok:
            raise AssertionError(str(self))
        return self

    def __str__(self) -> str:
        lines = [f"top-k {self.rows} rows x k={self.k} (tie_tol {self.tie_tol:g}): {'ok' if self.ok else 'FAIL'}  "
                 f"exact {self.rows_exact}, tie-equivalent {self.rows_tie_equivalent}, wrong {self.rows_wrong}  "
                 f"recall mean {self.mean_recall:.4f} min {self.min_recall:.4f}"]
        for w in self.wrong:
            miss = ", ".join(f"{i} ({s:.6g})" for i, s in w["missing"][:4])
            extra = ", ".join(f"{i} ({s:.6g})" for i, s in w["extra"][:4])
            lines.append(f"  row {w['row']}: {'; '.join(w['reasons'])}; boundary score {w['boundary']:.6g}; "
                         f"missing [{miss}] extra [{extra}]")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        """The metrics as plain Python values (for JSON)."""
        return {"rows": self.rows, "k": self.k, "tie_tol": self.tie_tol, "ok": self.ok,
                "rows_exact": self.rows_exact, "rows_tie_equivalent": self.rows_tie_equivalent,
                "rows_wrong": self.rows_wrong, "mean_recall": self.mean_recall, "min_recall": self.min_recall,
                "wrong": self.wrong}


# --8<-- [start:compare_topk]
def compare_topk(actual_idx: torch.Tensor, expected_idx: torch.Tensor | None, scores: torch.Tensor,
                 k: int | None = None, *, tie_tol: float = 0.0) -> TopkComparison:
    r"""Tie-aware comparison of a kernel's top-k selection with the reference's.

    Two selections of a row are **equivalent** when they differ only among keys whose scores tie,
    within ``tie_tol``, at the k-th boundary. With $b$ the k-th largest score of the row (the
    smallest score the reference selected) and $k_\text{eff}$ the number of valid reference slots,
    a selection $A$ (its ``-1`` slots dropped) is accepted iff

    * it has $k_\text{eff}$ entries, all distinct, all in range, none scored $-\infty$;
    * every key with score $> b + \text{tie\_tol}$ is in $A$;
    * every key in $A$ has score $\ge b - \text{tie\_tol}$.

    The order of the slots within a row never matters.

    Args:
        actual_idx: int ``[T, K]``, the kernel's selection with ``-1`` for unused slots (convert other
            sentinels first: `dsa_ref.oracle.to_reference_indices`).
        expected_idx: int ``[T, K']`` reference selection, or ``None`` to compute it with
            `dsa_ref.topk_indices` from ``scores``.
        scores: float ``[T, S]``, the scores both selections are meant to be the top-k of (``-inf`` =
            not selectable); pass the exact scores (float32/float64).
        k: the top-k budget; default ``actual_idx.shape[1]``.
        tie_tol: scores within ``tie_tol`` of the boundary count as tied (0: exact ties only; a kernel
            that scores in lower precision than ``scores`` needs about its rounding error here).

    Returns:
        A `TopkComparison`.
    """
    check_int("actual_idx", actual_idx)
    check_rank("actual_idx", actual_idx, 2, "[T, K]")
    check_float("scores", scores)
    check_rank("scores", scores, 2, "[T, S]")
    T, S = scores.shape
    if actual_idx.shape[0] != T:
        raise ValueError(f"actual_idx has {actual_idx.shape[0]} rows, scores has {T}")
    if k is None:
        k = actual_idx.shape[1]
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    if not (isinstance(tie_tol, (int, float)) and tie_tol >= 0):
        raise ValueError(f"tie_tol must be a number >= 0, got {tie_tol!r}")
    if bool(torch.isnan(scores).any()):
        raise ValueError("scores contain NaN; mark unselectable keys with -inf")
    s = scores.detach().to("cpu", torch.float64)
    if expected_idx is None:
        from .indexer import topk_indices

        expected_idx = topk_indices(s, k)
    check_int("expected_idx", expected_idx)
    check_rank("expected_idx", expected_idx, 2, "[T, K]")
    if expected_idx.shape[0] != T:
        raise ValueError(f"expected_idx has {expected_idx.shape[0]} rows, scores has {T}")
    act = actual_idx.detach().to("cpu", torch.int64)
    exp = expected_idx.detach().to("cpu", torch.int64)
    if bool(((exp < -1) | (exp >= S)).any()):
        raise ValueError(f"expected_idx values must be -1 or in [0, S={S})")

    # reference: its set, k_eff and boundary score b
    e_valid = exp >= 0
    e_set = _index_set(exp, S)  # [T, S] bool
    k_eff = e_valid.sum(1)  # [T]
    e_scores = torch.where(e_valid, s.gather(1, exp.clamp_min(0)), torch.full(exp.shape, math.inf, dtype=s.dtype))
    boundary = e_scores.amin(dim=1) if exp.shape[1] else torch.full((T,), math.inf, dtype=s.dtype)  # [T]

    # kernel: validity of each slot
    in_range = (act >= 0) & (act < S)
    bad_value = (act < -1) | (act >= S)  # [T, K]
    counts = torch.zeros(T, S + 1, dtype=torch.int64)
    counts.scatter_add_(1, torch.where(in_range, act, torch.full_like(act, S)), torch.ones_like(act))
    counts = counts[:, :S]  # [T, S]
    a_set = counts > 0
    dup = (counts > 1).sum(1)  # keys selected more than once
    a_count = in_range.sum(1)  # [T]

    must = s > (boundary + tie_tol)[:, None]  # [T, S]
    allowed = (s >= (boundary - tie_tol)[:, None]) & (s > -math.inf)
    missing_required = (must & ~a_set).sum(1)
    selected_disallowed = (a_set & ~allowed).sum(1)
    exact = (a_set == e_set).all(1) & (dup == 0) & (bad_value.sum(1) == 0) & (a_count == k_eff)
    accepted = ((a_count == k_eff) & (dup == 0) & (bad_value.sum(1) == 0)
                & (missing_required == 0) & (selected_disallowed == 0))
    wrong_rows = (~accepted).nonzero().flatten().tolist()

    inter = (a_set & e_set).sum(1).double()
    has = k_eff > 0
    recall = torch.where(has, inter / k_eff.clamp_min(1).double(), torch.ones(T, dtype=torch.float64))
    wrong = []
    for r in wrong_rows[:8]:
        reasons = []
        if int(bad_value[r].sum()):
            reasons.append(f"{int(bad_value[r].sum())} slots out of range [-1, {S})")
        if int(dup[r]):
            reasons.append(f"{int(dup[r])} keys selected twice")
        if int(a_count[r]) != int(k_eff[r]):
            reasons.append(f"{int(a_count[r])} valid slots, expected {int(k_eff[r])}")
        if int(missing_required[r]):
            reasons.append(f"{int(missing_required[r])} keys above the boundary missing")
        if int(selected_disallowed[r]):
            reasons.append(f"{int(selected_disallowed[r])} selected keys below the boundary or masked")
        miss = (e_set[r] & ~a_set[r]).nonzero().flatten().tolist()
        extra = (a_set[r] & ~e_set[r]).nonzero().flatten().tolist()
        wrong.append({"row": r, "reasons": reasons, "boundary": float(boundary[r]),
                      "missing": [(i, float(s[r, i])) for i in miss[:16]],
                      "extra": [(i, float(s[r, i])) for i in extra[:16]]})
    rec = recall[has]
    return TopkComparison(rows=T, k=k, tie_tol=float(tie_tol), rows_exact=int(exact.sum()),
                          rows_tie_equivalent=int((accepted & ~exact).sum()), rows_wrong=len(wrong_rows),
                          mean_recall=float(rec.mean()) if rec.numel() else 1.0,
                          min_recall=float(rec.min()) if rec.numel() else 1.0, wrong=wrong)
# --8<-- [end:compare_topk]


def _index_set(idx: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Bool ``[T, S]``: which keys a ``[T, K]`` index tensor selects (``-1`` and out-of-range select nothing)."""
    ok = (idx >= 0) & (idx < num_keys)
    out = torch.zeros(idx.shape[0], num_keys + 1, dtype=torch.bool, device=idx.device)
    out.scatter_(1, torch.where(ok, idx, torch.full_like(idx, num_keys)), True)
    return out[:, :num_keys]


def attention_mass_recall(indices: torch.Tensor, target_p: torch.Tensor, *,
                          relative_to: torch.Tensor | None = None) -> torch.Tensor:
    r"""How much of the attention mass a selection covers, per row: $\sum_{s \in A_t} p_{t,s} / \sum_s p_{t,s}$.

    The metric for *approximate* top-k kernels (and for fp8 indexers): a kernel that swaps a
    selected key for one with almost the same attention weight loses almost nothing, and this
    number says so, where index recall would not. A key selected twice counts once (it is a set).

    Args:
        indices: int ``[T, K]``, ``-1`` for unused slots.
        target_p: float ``[T, S]``, non-negative attention mass per key (e.g.
            `dsa_ref.indexer_loss.indexer_target`, or the main attention probabilities summed over heads).
        relative_to: optional int ``[T, K']``, a reference selection (the exact top-k); the result is
            then ``mass(indices) / mass(relative_to)`` -- 1.0 means as good as exact.

    Returns:
        float64 ``[T]``; rows whose denominator is 0 get 1.0 (nothing to recall).
    """
    check_int("indices", indices)
    check_rank("indices", indices, 2, "[T, K]")
    check_float("target_p", target_p)
    check_rank("target_p", target_p, 2, "[T, S]")
    if indices.shape[0] != target_p.shape[0]:
        raise ValueError(f"indices has {indices.shape[0]} rows, target_p has {target_p.shape[0]}")
    p = target_p.detach().to("cpu", torch.float64)
    if bool((p < 0).any()) or not bool(torch.isfinite(p).all()):
        raise ValueError("target_p must be finite and non-negative")
    S = p.shape[1]
    idx = indices.detach().to("cpu", torch.int64)
    if bool(((idx < -1) | (idx >= S)).any()):
        raise ValueError(f"indices values must be -1 or in [0, S={S})")
    got = (p * _index_set(idx, S)).sum(1)
    if relative_to is None:
        denom = p.sum(1)
    else:
        check_tensor("relative_to", relative_to)
        check_int("relative_to", relative_to)
        ref = relative_to.detach().to("cpu", torch.int64)
        if ref.dim() != 2 or ref.shape[0] != idx.shape[0]:
            raise ValueError(f"relative_to must be [T={idx.shape[0]}, K], got {tuple(ref.shape)}")
        denom = (p * _index_set(ref, S)).sum(1)
    return torch.where(denom > 0, got / denom.clamp_min(torch.finfo(torch.float64).tiny), torch.ones_like(got))


def _unravel(flat: int, shape: tuple) -> tuple:
    """The index tuple of flat position ``flat`` in a C-ordered tensor of ``shape``."""
    out = []
    for size in reversed(shape):
        flat, i = divmod(flat, size) if size else (flat, 0)
        out.append(i)
    return tuple(reversed(out))


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")
