"""One line for a model that cannot be one graph, naming the user's line and what to do.

The commonest cause is a branch on a tensor's value (``if x.sum() > 0:``): neither ``torch.fx`` nor
``torch.export`` can put a Python ``if`` on data into one graph. The line names the branch and the ways
out (``torch.where``, ``torch.cond``, the branch moved out of ``forward``); other causes keep the capture's
own reasons.

Example:
    >>> from fxforge.capture import CaptureError
    >>> data_branch({"export": "GuardOnDataDependentSymNode: Could not guard at m.py:7: if x.max() > 1:"})
    ('m.py:7', 'if x.max() > 1:')
    >>> error = CaptureError("Net", {"fx": "TraceError: symbolically traced variables cannot be used as inputs "
    ...                                    "to control flow at net.py:12: if h.sum() > 0:"})
    >>> print(capture_failure("Net", error))  # doctest: +NORMALIZE_WHITESPACE
    Net cannot be captured as one graph: its forward branches on a tensor's value at net.py:12 (if h.sum() > 0:);
    compute both sides and pick with torch.where(cond, a, b), or use torch.cond(pred, true_fn, false_fn, operands),
    or move the branch out of forward
"""

from __future__ import annotations

from fxforge.runtime.fallbacks import BRANCH_FIXES, data_branch


def capture_failure(model_name: str, error: BaseException | str) -> str:
    """One line for a model that cannot be captured: the data-dependent branch and what to do, else the
    capture's own message.

    Example:
        >>> capture_failure("Net", "cannot capture Net: fx: TypeError: bad at m.py:3")
        'cannot capture Net: fx: TypeError: bad at m.py:3'
    """
    breaks = getattr(error, "breaks", None)
    if breaks:
        return (f"{model_name} cannot be captured as one graph: TorchDynamo breaks it at "
                + "; ".join(str(item) for item in breaks))
    reasons = getattr(error, "reasons", None) or [str(error)]
    branch = data_branch(reasons)
    if branch is None:
        return " ".join(str(error).split())
    where, code = branch
    return (f"{model_name} cannot be captured as one graph: its forward branches on a tensor's value at {where}"
            + (f" ({code})" if code else "") + f"; {BRANCH_FIXES}")
