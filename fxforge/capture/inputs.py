"""What users pass as example inputs, in one form: ``(args, kwargs)``.

Example:
    >>> normalize_inputs((1, 2))
    ((1, 2), {})
"""

from __future__ import annotations

from typing import Any


def normalize_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` from what users pass: a tuple/list of positional inputs, one tensor, or a dict
    of keyword inputs.

    Example:
        >>> normalize_inputs(torch.ones(1))[0][0].shape
        torch.Size([1])
        >>> normalize_inputs({"input_ids": 1})
        ((), {'input_ids': 1})
    """
    if example_inputs is None:
        return (), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}
