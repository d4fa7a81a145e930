"""How close a reduced-precision result is to the float32 one: the measures, and the tolerance they are held to.

Per output tensor: the **relative error**, ``max |candidate - reference| / max |reference|`` (normwise: an element
near zero does not blow it up), and the **cosine** of the two flattened; for an output that reads as class scores
(floating point, ``[batch, classes]`` with several classes) the **top-1 agreement**, the share of rows whose
highest score is the same class. An :class:`Agreement` holds the worst of each over every output and call;
:class:`Tolerance` says what is accepted.

Example:
    >>> reference = torch.tensor([[1.0, 2.0, 3.0], [3.0, 1.0, 0.0]])
    >>> found = agreement([reference], [reference + 0.03])
    >>> round(found.relative_error, 3), found.top1
    (0.01, 1.0)
    >>> Tolerance(relative_error=0.005).refusal(found)
    'relative error 0.01 above the tolerance 0.005'
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree


@dataclasses.dataclass(frozen=True)
class Agreement:
    """The worst agreement of candidate outputs with reference outputs (see the module docstring).

    Attributes:
        relative_error: the largest relative error of any output (NaN where the two differ in NaN positions).
        cosine: the smallest cosine of any output.
        top1: the smallest top-1 agreement of the outputs that read as class scores, or None (none does).
    """

    relative_error: float
    cosine: float
    top1: float | None = None

    def describe(self) -> str:
        """One line.

        Example:
            >>> Agreement(0.0123, 0.99991, 1.0).describe()
            'relative error 0.0123, cosine 0.99991, top-1 agreement 100.0%'
        """
        top1 = f", top-1 agreement {self.top1:.1%}" if self.top1 is not None else ""
        return f"relative error {self.relative_error:.3g}, cosine {self.cosine:.5f}{top1}"


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """What a reduced-precision result must keep: a relative error at most, a cosine at least, and for class
    scores a top-1 agreement at least (the issue's 99 % by default).

    Example:
        >>> Tolerance.of(0.01)
        Tolerance(relative_error=0.01, cosine=0.999, top1=0.99)
    """

    relative_error: float = 0.05
    cosine: float = 0.999
    top1: float = 0.99

    @classmethod
    def of(cls, tolerance: Any) -> Tolerance:
        """A :class:`Tolerance` from what a caller passes: None (the defaults), a number (the relative error), or
        a Tolerance."""
        if tolerance is None:
            return cls()
        if isinstance(tolerance, Tolerance):
            return tolerance
        if isinstance(tolerance, (int, float)) and not isinstance(tolerance, bool) and tolerance > 0:
            return cls(relative_error=float(tolerance))
        raise ValueError(f"tolerance={tolerance!r}: expected a positive number (the largest relative error "
                         "accepted), a fxforge Tolerance, or None")

    def refusal(self, found: Agreement) -> str | None:
        """Why ``found`` breaks the tolerance, or None."""
        if not found.relative_error <= self.relative_error:  # (NaN breaks it too)
            return f"relative error {found.relative_error:.3g} above the tolerance {self.relative_error:.3g}"
        if not found.cosine >= self.cosine:
            return f"cosine {found.cosine:.5f} below {self.cosine}"
        if found.top1 is not None and found.top1 < self.top1:
            return f"top-1 agreement {found.top1:.1%} below {self.top1:.0%}"
        return None


def _scores(t: torch.Tensor) -> bool:
    return t.is_floating_point() and t.dim() == 2 and t.shape[0] > 0 and t.shape[1] > 1


def _measures(reference: torch.Tensor, candidate: torch.Tensor) -> tuple[float, float, float | None]:
    r, c = reference.detach().double().flatten(), candidate.detach().double().flatten()
    if r.numel() == 0:
        return 0.0, 1.0, None
    if not torch.equal(r.isnan(), c.isnan()):
        return math.nan, math.nan, None
    finite = ~r.isnan()
    r, c = r[finite], c[finite]
    scale = float(r.abs().max()) if r.numel() else 0.0
    error = float((r - c).abs().max()) if r.numel() else 0.0
    relative = error / scale if scale > 0 else (0.0 if error == 0 else math.inf)
    norms = float(r.norm() * c.norm())
    cosine = float(r @ c) / norms if norms > 0 else (1.0 if error == 0 else 0.0)
    top1 = None
    if _scores(reference):
        top1 = float((reference.argmax(1) == candidate.argmax(1)).double().mean())
    return relative, cosine, top1


def agreement(references: Sequence[Any], candidates: Sequence[Any]) -> Agreement:
    """The worst agreement over pairs of outputs (each a tensor or a pytree of them, of one call each).

    Example:
        >>> agreement([torch.ones(3)], [torch.ones(3)])
        Agreement(relative_error=0.0, cosine=1.0, top1=None)
    """
    worst_error, worst_cosine, worst_top1 = 0.0, 1.0, None
    for reference, candidate in zip(references, candidates, strict=True):
        for r, c in zip(pytree.tree_leaves(reference), pytree.tree_leaves(candidate), strict=True):
            if not isinstance(r, torch.Tensor) or not r.is_floating_point():
                continue
            relative, cosine, top1 = _measures(r, c)
            worst_error = relative if math.isnan(relative) else max(worst_error, relative)
            worst_cosine = cosine if math.isnan(cosine) else min(worst_cosine, cosine)
            if top1 is not None:
                worst_top1 = top1 if worst_top1 is None else min(worst_top1, top1)
            if math.isnan(worst_error):
                return Agreement(math.nan, math.nan, worst_top1)
    return Agreement(worst_error, worst_cosine, worst_top1)
