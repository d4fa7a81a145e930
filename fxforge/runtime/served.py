"""The new sizes a model serves eagerly: what every target ``target="auto"`` may return must serve too.

The native target serves every size eager serves (it re-plans, or plans with the dims that change dynamic);
a target that runs a file exported for some sizes (ONNX Runtime) serves only the dims exported dynamic.
:func:`new_sizes` finds which input dims eager takes at another size, by calling the model with each of
them doubled (dims of the same size across the inputs together first, as a batch or a sequence length is
shared; one by one where that fails), and returns one set of inputs with all of them doubled at once: the
race exports the ONNX file with those dims dynamic and checks every such target on those inputs.

Example:
    >>> lin = torch.nn.Linear(4, 2)
    >>> served = new_sizes(lin, (torch.ones(3, 4),), {})
    >>> served.dims, served.text, served.args[0].shape
    ([(0, 0)], 'input 0 dim 0 3->6', torch.Size([6, 4]))
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from fxforge.core.verify import isolated, random_like


@dataclasses.dataclass
class Served:
    """Inputs of new sizes that the model serves eagerly.

    Attributes:
        dims: the ``(leaf, dim)`` pairs grown (leaves counted over the flattened ``(args, kwargs)``).
        args, kwargs: the inputs with every one of them doubled, drawn at random like the example's.
        text: which dims, as a reader would say it (``"input 0 dim 3 64->128"``).
        expected: eager's outputs on them.

    Example:
        >>> Served([], (), {}, "", None).dims
        []
    """

    dims: list[tuple[int, int]]
    args: tuple
    kwargs: dict
    text: str
    expected: Any = None


def _grown(args: tuple, kwargs: dict, dims: list[tuple[int, int]]) -> tuple[tuple, dict]:
    """The inputs with ``dims`` doubled (each tensor repeated along them: its values stay valid, such as token
    ids and masks)."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    for leaf, dim in dims:
        tensor = leaves[leaf]
        leaves[leaf] = torch.cat([tensor, tensor], dim=dim)
    grown_args, grown_kwargs = pytree.tree_unflatten(leaves, spec)
    return tuple(grown_args), dict(grown_kwargs)


def _eager_serves(model: nn.Module, inputs: tuple[tuple, dict], seed: int) -> Any:
    """Eager's outputs on ``inputs``, or None where the model raises on them."""
    try:
        with torch.no_grad(), isolated(model, seed=seed, inputs=inputs):
            return (model(*inputs[0], **inputs[1]),)
    except Exception:  # noqa: BLE001 - the model does not take these sizes: not a size it serves
        return None


def _names(args: tuple, kwargs: dict) -> list[str]:
    """A name per flattened leaf: ``input 0``, ``input 1.2``, ``mask``."""
    names = []
    for i, value in enumerate(args):
        count = len(pytree.tree_leaves(value))
        names += [f"input {i}" if count == 1 else f"input {i}.{j}" for j in range(count)]
    for key, value in kwargs.items():
        count = len(pytree.tree_leaves(value))
        names += [key if count == 1 else f"{key}.{j}" for j in range(count)]
    return names


def new_sizes(model: nn.Module, args: tuple, kwargs: dict, seed: int = 3) -> Served | None:
    """The dims eager serves at another size and inputs with all of them doubled (see the module docstring),
    or None where eager serves no other size of any dim.

    Example:
        >>> new_sizes(torch.nn.Linear(4, 2), (torch.ones(1, 4),), {}).text
        'input 0 dim 0 1->2'
    """
    leaves = pytree.tree_leaves((tuple(args), dict(kwargs)))
    groups: dict[int, list[tuple[int, int]]] = {}
    for leaf, value in enumerate(leaves):
        if isinstance(value, torch.Tensor):
            for dim, size in enumerate(value.shape):
                if size > 0:
                    groups.setdefault(size, []).append((leaf, dim))
    accepted: list[tuple[int, int]] = []
    for group in groups.values():
        if _eager_serves(model, _grown(args, kwargs, group), seed) is not None:
            accepted += group
        elif len(group) > 1:  # sizes that are equal by chance (a batch of 16 beside 16 features)
            accepted += [d for d in group if _eager_serves(model, _grown(args, kwargs, [d]), seed) is not None]
    if not accepted:
        return None
    accepted.sort()
    grown = random_like(_grown(args, kwargs, accepted), seed)
    expected = _eager_serves(model, grown, seed)
    if expected is None:  # each size served alone, not all of them together: no one set of inputs to check
        return None
    names = _names(tuple(args), dict(kwargs))
    text = ", ".join(f"{names[leaf]} dim {dim} {leaves[leaf].shape[dim]}->{2 * leaves[leaf].shape[dim]}"
                     for leaf, dim in accepted)
    return Served(accepted, grown[0], grown[1], text, expected[0])


def meta_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with every tensor a meta tensor of its shape and dtype (what an export for other
    sizes is told about them).

    Example:
        >>> meta_inputs((torch.ones(2),), {})[0][0].device.type
        'meta'
    """
    return pytree.tree_map(
        lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor) else t,
        (tuple(args), dict(kwargs)))
