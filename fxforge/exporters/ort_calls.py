"""How a call to an ONNX Runtime module meets the file it was exported for: the call's inputs put in the
exported form (positional or by name), whether it passes other inputs than the exported ones, and which dims
have varied so far (for an export that keeps them all dynamic).

Example:
    >>> io = IOSpec.for_tensors(["x"], 1)
    >>> other_structure(io, (torch.ones(2),), {}), other_structure(io, (), {"x": torch.ones(2)})
    (False, True)
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from fxforge.capture.dims import image_siblings
from fxforge.exporters.io_spec import IOSpec


def other_structure(io: IOSpec, args: tuple, kwargs: dict) -> bool:
    """Whether a call passes other inputs than the exported ones (how many positional, which keywords).

    Example:
        >>> other_structure(IOSpec.for_tensors(["a", "b"], 1), (torch.ones(1),), {})
        True
    """
    spec = io.in_spec
    if spec is None or spec.num_children != 2:
        return False
    keywords = spec.child(1).context or []
    return spec.child(0).num_children != len(args) or set(keywords) != set(kwargs)


def as_exported(io: IOSpec | None, original: nn.Module | None, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call's inputs in the form the model was exported with: a model exported from keyword inputs
    (``{"input_ids": ..., "attention_mask": ...}``) and called as ``model(ids, attention_mask=mask)`` gets its
    positional inputs bound to their names by the forward's signature (and the other way).

    Example:
        >>> class Masked(nn.Module):
        ...     def forward(self, input_ids, attention_mask=None):
        ...         return input_ids
        >>> io = IOSpec(pytree.tree_flatten(((), {"input_ids": 0, "attention_mask": 0}))[1],
        ...             (("tensor", "input_ids"), ("tensor", "attention_mask")), None, ())
        >>> args, kwargs = as_exported(io, Masked(), (torch.ones(1),), {"attention_mask": torch.zeros(1)})
        >>> args, sorted(kwargs)
        ((), ['attention_mask', 'input_ids'])
    """
    spec = io.in_spec if io is not None else None
    if spec is None or original is None or spec.num_children != 2:
        return args, kwargs
    positional = spec.child(0).num_children
    if positional == len(args):
        return args, kwargs
    signature = inspect.signature(original.forward)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return args, kwargs
    named = dict(bound.arguments)
    front = [named.pop(name) for name in list(signature.parameters)[:positional] if name in named]
    return tuple(front), named


def varied_inputs(input_meta: dict[str, Any], feeds: Sequence[tuple[str, torch.Tensor]], args: tuple,
                  kwargs: dict) -> Any:
    """Inputs (as meta tensors) that differ from this call in every dim that has varied so far: the file's
    dynamic dims (``input_meta``: the session's inputs by name), the dims where the call differs from the file,
    and an image's other spatial dims (a floating-point input of rank >= 4 whose H or W changed gets H and W
    dynamic together), so that an export made ``before=`` them keeps them all dynamic.

    Example:
        >>> from types import SimpleNamespace
        >>> x = torch.ones(2, 3, 8, 8)
        >>> meta = {"x": SimpleNamespace(shape=["batch", 3, 8, 6])}
        >>> varied_inputs(meta, [("x", x)], (x,), {})[0][0].shape
        torch.Size([3, 3, 9, 9])
    """
    varied: dict[int, set[int]] = {}
    for name, tensor in feeds:
        shape = list(input_meta[name].shape)
        axes = {axis for axis, (dim, size) in enumerate(zip(shape, tensor.shape))
                if not isinstance(dim, int) or dim != size}
        varied[id(tensor)] = image_siblings(tensor.shape, tensor.dtype, axes)

    def other(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        shape = [size + 1 if axis in varied.get(id(value), ()) else size for axis, size in enumerate(value.shape)]
        return torch.empty(shape, dtype=value.dtype, device="meta")

    return pytree.tree_map(other, (tuple(args), dict(kwargs)))
