"""How close a reduced-precision result is to the float32 one: the measures, and the tolerance they are held to.

Per output tensor: the **relative error**, ``max |candidate - reference| / max |reference|`` (normwise: an element
near zero does not blow it up), and the **cosine** of the two flattened; for an output that reads as class scores
(floating point, ``[batch, classes]`` with several classes, and either unnamed or named as scores: ``logits``,
``scores``, ``probs``..., as transformers' classifiers name theirs; a named ``pooler_output`` or ``embeddings`` is
features) the **top-1 agreement**, the share of rows whose highest score is the same class, and the top-1
agreement **expected from the score margins**. An :class:`Agreement` holds the worst of each over every output
and call; :class:`Tolerance` says what is accepted.

The expected agreement is there because a few dozen rows cannot show a 1 % flip rate: with 40 rows checked and
none flipped, a rate of 3 % goes unseen one time in three. So each row's gaps between its top score and the others
(``reference``) are set against the changes the candidate made to such gaps, pooled over every row and class
checked (``candidate - reference`` of each class less that of the row's top class): a row is expected to flip
with the chance that one of its gaps is crossed by a change drawn from that pool. The mean over the rows is the
flip rate to expect on rows not checked, read at a resolution of rows times classes rather than rows.

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
from collections.abc import Callable, Sequence
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
        metric: the worst of the user's metric over the calls, or None (no metric).
        top1_expected: the smallest top-1 agreement expected from the score margins (see the module docstring),
            or None.
    """

    relative_error: float
    cosine: float
    top1: float | None = None
    metric: float | None = None
    top1_expected: float | None = None

    def describe(self) -> str:
        """One line.

        Example:
            >>> Agreement(0.0123, 0.99991, 1.0).describe()
            'relative error 0.0123, cosine 0.99991, top-1 agreement 100.0%'
        """
        top1 = f", top-1 agreement {self.top1:.1%}" if self.top1 is not None else ""
        top1 += f" ({self.top1_expected:.1%} expected from the margins)" if self.top1_expected is not None else ""
        metric = f", the user's metric {self.metric:.4g}" if self.metric is not None else ""
        return f"relative error {self.relative_error:.3g}, cosine {self.cosine:.5f}{top1}{metric}"


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """What a reduced-precision result must keep: a relative error at most, a cosine at least, for class scores a
    top-1 agreement at least (99 % by default; None: not held), and where the user gives one, their own
    ``metric`` at least ``metric_at_least``. ``metric(reference, candidate)`` gets one call's outputs (float32's
    and the candidate's, as the graph returns them) and returns a number, higher is better; the worst over the
    calls is held. Give a metric and ``top1=None`` where a 2-d output is features rather than class scores.

    Example:
        >>> Tolerance.of(0.01)
        Tolerance(relative_error=0.01, cosine=0.999, top1=0.99, metric=None, metric_at_least=0.0)
        >>> Tolerance.of({"relative_error": 0.1, "top1": None}).top1 is None
        True
    """

    relative_error: float = 0.05
    cosine: float = 0.999
    top1: float | None = 0.99
    metric: Callable[[Any, Any], float] | None = None
    metric_at_least: float = 0.0

    @classmethod
    def of(cls, tolerance: Any) -> Tolerance:
        """A :class:`Tolerance` from what a caller passes: None (the defaults), a number (the relative error), a
        dict of the fields, or a Tolerance."""
        if tolerance is None:
            return cls()
        if isinstance(tolerance, Tolerance):
            return tolerance
        if isinstance(tolerance, dict) and set(tolerance) <= {f.name for f in dataclasses.fields(cls)}:
            return cls(**tolerance)
        if isinstance(tolerance, (int, float)) and not isinstance(tolerance, bool) and tolerance > 0:
            return cls(relative_error=float(tolerance))
        raise ValueError(f"tolerance={tolerance!r}: expected a positive number (the largest relative error "
                         "accepted), a dict of relative_error, cosine, top1, metric, metric_at_least, a fxforge "
                         "Tolerance, or None")

    def describe(self) -> str:
        """One line.

        Example:
            >>> Tolerance().describe()
            'relative error 0.05, cosine 0.999, top-1 99%'
        """
        parts = [f"relative error {self.relative_error:.3g}", f"cosine {self.cosine}"]
        parts += [f"top-1 {self.top1:.0%}"] if self.top1 is not None else []
        parts += [f"the user's metric at least {self.metric_at_least}"] if self.metric is not None else []
        return ", ".join(parts)

    def refusal(self, found: Agreement) -> str | None:
        """Why ``found`` breaks the tolerance, or None."""
        if not found.relative_error <= self.relative_error:  # (NaN breaks it too)
            return f"relative error {found.relative_error:.3g} above the tolerance {self.relative_error:.3g}"
        if not found.cosine >= self.cosine:
            return f"cosine {found.cosine:.5f} below {self.cosine}"
        if self.top1 is not None and found.top1 is not None and found.top1 < self.top1:
            return f"top-1 agreement {found.top1:.1%} below {self.top1:.0%}"
        if self.top1 is not None and found.top1_expected is not None and found.top1_expected < self.top1:
            return (f"top-1 agreement expected from the score margins {found.top1_expected:.1%} below "
                    f"{self.top1:.0%}")
        if self.metric is not None and not (found.metric is not None and found.metric >= self.metric_at_least):
            return f"the user's metric {found.metric} below {self.metric_at_least}"
        return None


_SCORE_NAMES = ("logit", "score", "prob", "class")


def _named(path: tuple) -> str | None:
    """The name the output's structure gives it (its innermost dict key or attribute), or None."""
    for key in reversed(path):
        name = getattr(key, "key", getattr(key, "name", None))
        if isinstance(name, str):
            return name
    return None


def _scores(t: torch.Tensor, name: str | None = None) -> bool:
    shaped = t.is_floating_point() and t.dim() == 2 and t.shape[0] > 0 and t.shape[1] > 1
    return shaped and (name is None or any(word in name.lower() for word in _SCORE_NAMES))


def _gaps_and_changes(reference: torch.Tensor, candidate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the gaps between the reference's top score and each other class's, and the changes the
    candidate made to such gaps (each class's change less the top class's), both flattened, rows with NaN left
    out."""
    r, c = reference.detach().double(), candidate.detach().double()
    rows = ~(r.isnan().any(1) | c.isnan().any(1))
    r, c = r[rows], c[rows]
    top = r.argmax(1, keepdim=True)
    others = torch.ones_like(r, dtype=torch.bool).scatter_(1, top, False)
    gaps = (r.gather(1, top) - r)[others]
    change = c - r
    return gaps, (change - change.gather(1, top))[others]


def expected_top1(gaps: torch.Tensor, changes: torch.Tensor, classes: int) -> float:
    """The top-1 agreement to expect from the reference's ``gaps`` (``classes - 1`` per row) and the pooled
    ``changes`` (see the module docstring): one less the mean over rows of the chance that a change drawn from
    the pool exceeds one of the row's gaps.

    Example:
        >>> gaps = torch.tensor([5.0, 0.5, 3.0, 4.0])   # two rows of three classes: row 2 is near a tie
        >>> expected_top1(gaps, torch.tensor([0.2, -0.1, 0.6, 0.0]), 3)   # one change in four crosses 0.5
        0.875
    """
    if gaps.numel() == 0:
        return 1.0
    pool = changes.sort().values
    crossed = 1.0 - torch.searchsorted(pool, gaps, right=True).double() / pool.numel()  # P(change > gap)
    flips = 1.0 - (1.0 - crossed).view(-1, classes - 1).prod(1)
    return float(1.0 - flips.mean())


def _measures(reference: torch.Tensor, candidate: torch.Tensor, name: str | None = None
              ) -> tuple[float, float, float | None]:
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
    if _scores(reference, name):
        top1 = float((reference.argmax(1) == candidate.argmax(1)).double().mean())
    return relative, cosine, top1


def agreement(references: Sequence[Any], candidates: Sequence[Any],
              metric: Callable[[Any, Any], float] | None = None) -> Agreement:
    """The worst agreement over pairs of outputs (each a tensor or a pytree of them, of one call each), with the
    worst of ``metric`` over the pairs where one is given.

    Example:
        >>> agreement([torch.ones(3)], [torch.ones(3)])
        Agreement(relative_error=0.0, cosine=1.0, top1=None, metric=None, top1_expected=None)
        >>> scores = torch.tensor([[1.0, 2.0], [2.0, 1.0]])
        >>> flipped = scores.flip(1)
        >>> agreement([{"logits": scores}], [{"logits": flipped}]).top1, agreement([scores], [flipped]).top1
        (0.0, 0.0)
        >>> agreement([{"pooler_output": scores}], [{"pooler_output": flipped}]).top1 is None   # features
        True
        >>> agreement([torch.ones(3)], [torch.ones(3) * 2], lambda r, c: -float((r - c).abs().sum())).metric
        -3.0
    """
    found = _worst(references, candidates)
    if metric is None:
        return found
    scores = [float(metric(r, c)) for r, c in zip(references, candidates, strict=True)]
    worst = math.nan if any(math.isnan(x) for x in scores) else min(scores, default=math.inf)
    return dataclasses.replace(found, metric=worst)


def _worst(references: Sequence[Any], candidates: Sequence[Any]) -> Agreement:
    worst_error, worst_cosine, worst_top1 = 0.0, 1.0, None
    scores: dict[int, tuple[int, list, list]] = {}  # output position -> (classes, gaps, changes) over the calls
    for reference, candidate in zip(references, candidates, strict=True):
        for position, ((path, r), c) in enumerate(zip(pytree.tree_flatten_with_path(reference)[0],
                                                      pytree.tree_leaves(candidate), strict=True)):
            if not isinstance(r, torch.Tensor) or not r.is_floating_point():
                continue
            relative, cosine, top1 = _measures(r, c, _named(path))
            worst_error = relative if math.isnan(relative) else max(worst_error, relative)
            worst_cosine = cosine if math.isnan(cosine) else min(worst_cosine, cosine)
            if top1 is not None:
                worst_top1 = top1 if worst_top1 is None else min(worst_top1, top1)
                gaps, changes = _gaps_and_changes(r, c)
                entry = scores.setdefault(position, (r.shape[1], [], []))
                entry[1].append(gaps)
                entry[2].append(changes)
            if math.isnan(worst_error):
                return Agreement(math.nan, math.nan, worst_top1)
    expected = [expected_top1(torch.cat(gaps), torch.cat(changes), classes)
                for classes, gaps, changes in scores.values()]
    return Agreement(worst_error, worst_cosine, worst_top1, top1_expected=min(expected, default=None))
