"""The key under which a captured graph is reused: what about a call a graph was specialised to.

Example:
    >>> import torch
    >>> a = input_signature((torch.ones(2, 3),), {}, training=False)
    >>> a == input_signature((torch.zeros(2, 3),), {}, training=False)
    True
    >>> a == input_signature((torch.ones(4, 3),), {}, training=False)
    False
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
from torch.utils import _pytree as pytree


def _leaf_key(value: Any) -> Hashable:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), tuple(value.stride()), value.dtype, value.device.type,
                value.device.index)
    if isinstance(value, (int, float, bool, str, type(None), torch.dtype, torch.device)):
        return (type(value).__name__, value)
    return ("object", type(value).__qualname__, id(value))


def input_signature(args: tuple, kwargs: dict, training: bool) -> Hashable:
    """A hashable key for a call: the input structure, each tensor's shape, strides, dtype and device,
    each Python value, and the train/eval mode.

    Example:
        >>> input_signature((1,), {}, True) != input_signature((2,), {}, True)
        True
    """
    if all(type(v) is torch.Tensor for v in args) and all(type(v) is torch.Tensor for v in kwargs.values()):
        # tensors only, no nesting (most calls): the structure is the count and the keywords, no pytree walk
        structure: Hashable = (len(args), tuple(kwargs))
        return (structure, tuple(_leaf_key(v) for v in (*args, *kwargs.values())), bool(training))
    leaves, spec = pytree.tree_flatten((args, kwargs))
    return (str(spec), tuple(_leaf_key(v) for v in leaves), bool(training))


def describe_signature(args: tuple, kwargs: dict) -> str:
    """A short human description of a call's inputs, for warnings: ``(f32[2, 3], i64[2, 16])``.

    Example:
        >>> describe_signature((torch.ones(2, 3),), {})
        '(float32[2, 3])'
    """
    parts = []
    for value in pytree.tree_leaves((args, kwargs)):
        if isinstance(value, torch.Tensor):
            dtype = str(value.dtype).removeprefix("torch.")
            parts.append(f"{dtype}[{', '.join(map(str, value.shape))}]")
        else:
            parts.append(repr(value))
    return "(" + ", ".join(parts) + ")"
