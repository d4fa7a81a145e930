"""One line for a model that cannot be one graph, naming the user's line and what to do.

The commonest cause is a branch on a tensor's value (``if x.sum() > 0:``): neither ``torch.fx`` nor
``torch.export`` can put a Python ``if`` on data into one graph. The line names the branch and the ways
out (``torch.where``, ``torch.cond``, the branch moved out of ``forward``); other causes keep the capture's
own reasons.

Example:
    >>> from fxforge.capture import CaptureError
    >>> error = CaptureError("Net", {"fx": "TraceError: symbolically traced variables cannot be used as inputs "
    ...                                    "to control flow at net.py:12: if h.sum() > 0:"})
    >>> print(capture_failure("Net", error))  # doctest: +NORMALIZE_WHITESPACE
    Net cannot be captured as one graph: its forward branches on a tensor's value at net.py:12 (if h.sum() > 0:);
    compute both sides and pick with torch.where(cond, a, b), or use torch.cond(pred, true_fn, false_fn, operands),
    or move the branch out of forward
"""

from __future__ import annotations

import re

_DATA_DEPENDENT = ("cannot be used as inputs to control flow", "data-dependent", "GuardOnDataDependent",
                   "data dependent")
_WHERE = re.compile(r" at (\S+?\.py:\d+)(?:: (.*?))?(?:; \w+: |$)")


def data_branch(reasons: dict[str, str] | list[str]) -> tuple[str, str] | None:
    """``(file:line, the line's code)`` of a branch on a tensor's value the capture's reasons point to, or
    None when they name another cause.

    Example:
        >>> data_branch({"export": "GuardOnDataDependentSymNode: Could not guard at m.py:7: if x.max() > 1:"})
        ('m.py:7', 'if x.max() > 1:')
        >>> data_branch({"fx": "TypeError: bad at m.py:3: y = f(x)"}) is None
        True
        >>> data_branch(["running Net eagerly: cannot capture Net: fx: TraceError: ... inputs to control flow at "
        ...              "m.py:5: if h.sum() > 0:; export: GuardOnDataDependentSymNode: ... at m.py:5: if h.sum() > 0:"])
        ('m.py:5', 'if h.sum() > 0:')
    """
    texts = list(reasons.values()) if isinstance(reasons, dict) else list(reasons)
    for text in texts:
        if any(marker in text for marker in _DATA_DEPENDENT):
            found = _WHERE.search(" ".join(text.split()))
            if found:
                return found.group(1), (found.group(2) or "").strip()
    return None


def capture_failure(model_name: str, error: BaseException | str) -> str:
    """One line for a model that cannot be captured: the data-dependent branch and what to do, else the
    capture's own message.

    Example:
        >>> capture_failure("Net", "cannot capture Net: fx: TypeError: bad at m.py:3")
        'cannot capture Net: fx: TypeError: bad at m.py:3'
    """
    reasons = getattr(error, "reasons", None) or [str(error)]
    branch = data_branch(reasons)
    if branch is None:
        return " ".join(str(error).split())
    where, code = branch
    return (f"{model_name} cannot be captured as one graph: its forward branches on a tensor's value at {where}"
            + (f" ({code})" if code else "") + "; compute both sides and pick with torch.where(cond, a, b), or use "
            "torch.cond(pred, true_fn, false_fn, operands), or move the branch out of forward")
