"""The warnings an optimized module gives when it runs the model eagerly or without its inference rewrites.

Both are ``UserWarning``: they tell the user about their model (a capture the tracers refuse, a call that
records gradients), once per reason; tests pin them with ``pytest.warns``.

Example:
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warnings.warn("fxforge: running Net eagerly", FallbackWarning)
    >>> caught[0].category.__name__, issubclass(GradientsWarning, UserWarning)
    ('FallbackWarning', True)
"""

from __future__ import annotations

import re
import sys
from typing import Any

from fxforge.capture.model import CaptureError
from fxforge.core.breaks import BRANCH_FIXES
from fxforge.lowering.inductor import CompileRefused

MODEL_LIMITS = (CaptureError, CompileRefused)
"""What a model (or the compiler a target hands it to) cannot do: a plan build failing so runs the model eagerly,
with a :class:`FallbackWarning`. Any other exception inside a build is fxforge's own failure, a bug: it is raised
to the caller as it is, never hidden behind a fallback."""


class FallbackWarning(UserWarning):
    """fxforge could not capture a model for some inputs and runs it eagerly instead.

    Example:
        >>> issubclass(FallbackWarning, UserWarning)
        True
    """


class GradientsWarning(UserWarning):
    """A call recorded gradients, so it runs a plan without the rewrites that would stop them (folding
    parameters, fused kernels): slower than the inference plan, as exact as eager.

    Example:
        >>> issubclass(GradientsWarning, UserWarning)
        True
    """


def _fusion_at(node_name: str, graph_module: Any) -> str:
    """The name of the fusion rule of ``conv_activation`` that matches at ``node_name`` in ``graph_module``
    (``relu(linear)``, ``conv2d``...), or ""."""
    from fxforge.rewrites.conv_activation import FUSIONS

    node = next((n for n in graph_module.graph.nodes if n.name == node_name), None)
    if node is None:
        return ""
    return next((rule.name for rule in FUSIONS if next(rule.pattern_graph.matches(node, graph_module), None)), "")


def gradients_cause(near_misses: list, graph_module: Any = None, shown: int = 3) -> str:
    """What the gradients cost, named: each refused rewrite with what it would have done and where
    (``conv_activation: relu(linear) at fc1 (model.py:12)``), the first ``shown`` places per rewrite.

    Args:
        near_misses: the plan's near misses refused for calls that record gradients.
        graph_module: the plan's graph, to name the fusion a ``conv_activation`` near miss refused.

    Example:
        >>> from fxforge.core.report import NearMiss
        >>> gradients_cause([NearMiss("conv_bn_fold", "conv", "folds parameters", "m.py:4: y = self.bn(self.conv(x))")])
        'conv_bn_fold: at conv (m.py:4)'
    """
    by_rule: dict[str, list[str]] = {}
    for miss in near_misses:
        fusion = _fusion_at(miss.node, graph_module) if miss.rule == "conv_activation" and graph_module is not None \
            else ""
        where = miss.source.split(": ", 1)[0] if miss.source else ""
        place = (f"{fusion} " if fusion else "") + f"at {miss.node}" + (f" ({where})" if where else "")
        places = by_rule.setdefault(miss.rule, [])
        if place not in places:
            places.append(place)
    parts = []
    for rule, places in by_rule.items():
        more = f" and {len(places) - shown} more" if len(places) > shown else ""
        parts.append(f"{rule}: " + ", ".join(places[:shown]) + more)
    return "; ".join(parts)


def caller_stacklevel() -> int:
    """The ``stacklevel`` of :func:`warnings.warn`, called right here, that points at the first frame outside
    fxforge and torch: the user's line that called the module.

    Example:
        >>> caller_stacklevel() >= 1
        True
    """
    import os

    import torch

    skipped = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
               os.path.dirname(os.path.abspath(torch.__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(skipped):
        frame, level = frame.f_back, level + 1
    return level


_DATA_DEPENDENT = ("cannot be used as inputs to control flow", "data-dependent", "GuardOnDataDependent",
                   "data dependent", "branches on a tensor's value")
# The capture's "at file.py:12: code" (up to the next method's reason), or this module's "at file.py:12 (code),".
_WHERE = re.compile(r" at (\S+?\.py:\d+)(?:: (.*?)(?:; \w+: |$)| \((.*?)\),)")


def data_branch(reasons: dict[str, str] | list[str]) -> tuple[str, str] | None:
    """``(file:line, the line's code)`` of a branch on a tensor's value the capture's reasons point to, or
    None when they name another cause.

    Example:
        >>> data_branch({"export": "GuardOnDataDependentSymNode: Could not guard at m.py:7: if x.max() > 1:"})
        ('m.py:7', 'if x.max() > 1:')
        >>> data_branch({"fx": "TypeError: bad at m.py:3: y = f(x)"}) is None
        True
        >>> data_branch([fallback_reason(CaptureFailed({"fx": "TraceError: x cannot be used as inputs to control flow "
        ...                                                   "at m.py:5: if x.sum():"}))])
        ('m.py:5', 'if x.sum():')
        >>> data_branch(["cannot capture Net: fx: TraceError: ... inputs to control flow at m.py:5: if h.sum() > 0:; "
        ...              "export: GuardOnDataDependentSymNode: ... at m.py:5: if h.sum() > 0:"])
        ('m.py:5', 'if h.sum() > 0:')
    """
    texts = list(reasons.values()) if isinstance(reasons, dict) else list(reasons)
    for text in texts:
        if any(marker in text for marker in _DATA_DEPENDENT):
            found = _WHERE.search(" ".join(text.split()))
            if found:
                return found.group(1), (found.group(2) or found.group(3) or "").strip()
    return None


class CaptureFailed(Exception):
    """An error with the capture's ``reasons`` by method (as :class:`fxforge.capture.CaptureError`), for the
    examples here.

    Example:
        >>> CaptureFailed({"fx": "bad"}).reasons
        {'fx': 'bad'}
    """

    def __init__(self, reasons: dict[str, str]):
        super().__init__("; ".join(f"{k}: {v}" for k, v in reasons.items()))
        self.reasons = reasons


def fallback_reason(error: BaseException, breaks: bool = True) -> str:
    """Why a model runs eagerly, for its :class:`FallbackWarning`: a branch on a tensor's value named by its
    line, with what to do; else the capture's reasons (or the error's first line), and where TorchDynamo would
    break the model (a run of dynamo over it, found on first use) unless ``breaks`` is False (a caller that hands
    the model to dynamo, which finds its breaks itself).

    Example:
        >>> fallback_reason(ValueError("bad\\nmore"))
        'ValueError: bad'
    """
    from fxforge.core.source import first_line

    reasons = getattr(error, "reasons", None)
    branch = data_branch(reasons) if reasons else None
    if branch is not None:
        where, code = branch
        return (f"its forward branches on a tensor's value at {where}" + (f" ({code})" if code else "")
                + f", which one graph cannot hold; {BRANCH_FIXES}")
    message = getattr(error, "message_without_breaks", None) if not breaks else None
    if message is not None:
        return message
    return str(error) if str(error).startswith("cannot capture") else first_line(error)
