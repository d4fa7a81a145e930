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

from fxforge.core.sequence_dims import batch_and_sequence, has_tokens, sequence_axes


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


def family_of(signature: Hashable) -> Hashable:
    """A signature with its tensors' sizes and strides left out: calls of one family differ only in sizes
    (same structure, ranks, dtypes, devices, Python values and mode), so one shape-generic plan can serve them.

    Example:
        >>> a = input_signature((torch.ones(2, 3),), {}, training=False)
        >>> family_of(a) == family_of(input_signature((torch.ones(5, 7),), {}, training=False))
        True
    """
    structure, leaves, training = signature
    return (structure, tuple(("tensor", len(k[1]), *k[3:]) if k[0] == "tensor" else k for k in leaves), training)


def sizes_of(signature: Hashable) -> list[tuple[tuple, tuple] | None]:
    """Each input leaf's ``(shape, strides)`` in a signature (None for a leaf that is not a tensor).

    Example:
        >>> sizes_of(input_signature((torch.ones(2, 3), 1), {}, training=False))
        [((2, 3), (3, 1)), None]
    """
    return [(k[1], k[2]) if k[0] == "tensor" else None for k in signature[1]]


def differing_dims(a: Hashable, b: Hashable) -> set[tuple[int, int]]:
    """``(leaf, dim)`` of every size two signatures of one family disagree on.

    Example:
        >>> differing_dims(input_signature((torch.ones(2, 3),), {}, False), input_signature((torch.ones(2, 5),), {}, False))
        {(0, 1)}
    """
    dims = set()
    for leaf, (x, y) in enumerate(zip(sizes_of(a), sizes_of(b))):
        if x is not None and y is not None:
            dims.update((leaf, d) for d, (m, n) in enumerate(zip(x[0], y[0])) if m != n)
    return dims


def token_dims(signature: Hashable) -> set[tuple[int, int]]:
    """The batch and sequence dims ``(leaf, dim)`` of a call whose inputs hold tokens: integer or bool tensors
    of rank >= 2 (ids, attention masks, positions), whose lengths change from request to request. The dims
    are those an export with the batch and sequence dynamic keeps dynamic
    (:func:`~fxforge.core.sequence_dims.sequence_axes`). Empty for a call without token inputs (images,
    features).

    Example:
        >>> ids = torch.ones(2, 7, dtype=torch.long)
        >>> sorted(token_dims(input_signature((ids, torch.ones(2, 7, 4), torch.ones(3)), {}, False)))
        [(0, 0), (0, 1), (1, 0), (1, 1)]
        >>> token_dims(input_signature((torch.ones(2, 3, 8, 8),), {}, False))
        set()
    """
    leaves = [(key[1], key[3]) if key[0] == "tensor" else None for key in signature[1]]
    if not has_tokens(leaves):
        return set()
    batch, seq = batch_and_sequence(leaves)
    return {(leaf, axis) for leaf, entry in enumerate(leaves) if entry is not None
            for axis in sequence_axes(*entry, batch, seq)}
