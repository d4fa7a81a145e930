"""The model as ``torch.distributed.pipelining`` runs it: a new root sharing every parameter and buffer
with the model, where a few submodules are replaced by ones the engine can split.

- **A submodule whose ``forward`` is decorated with ``torch.no_grad()``** (the rotary embeddings of
  LLaMA, Mistral, Qwen... up to transformers 5.23) runs as :class:`GradFree`: the undecorated ``forward``, its
  outputs detached. The values are the same and no gradient flows through them either way, but
  ``torch.export`` records a ``no_grad`` region as a higher-order op with a submodule of its own, which
  the pipeline's splitter (torch 2.13) turns into a missing input of the first stage: no split of
  transformers' LLaMA could run.
- **A ``Linear`` layer heavier than a stage** is computed in column blocks
  (:mod:`fxforge.parallel.columns`), when the split planned asks for it.

Only the modules on the path to a replaced one are copied (shallowly): the model itself is left as it is.

Example:
    >>> class Positions(torch.nn.Module):
    ...     @torch.no_grad()
    ...     def forward(self, x):
    ...         return x * 2
    >>> model = torch.nn.Sequential(Positions(), torch.nn.Linear(4, 4))
    >>> ready = pipeline_ready(model)
    >>> type(ready[0]).__name__, type(model[0]).__name__, ready[1] is model[1]
    ('GradFree', 'Positions', True)
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from fxforge.parallel.columns import ColumnBlocks, splittable_linear


def no_grad_forward(module: nn.Module) -> Any:
    """The function under ``torch.no_grad()`` when ``type(module).forward`` is decorated with it, else None.

    Example:
        >>> class M(torch.nn.Module):
        ...     @torch.no_grad()
        ...     def forward(self, x):
        ...         return x
        >>> no_grad_forward(M()) is not None, no_grad_forward(torch.nn.ReLU())
        (True, None)
    """
    forward = type(module).forward
    inner = getattr(forward, "__wrapped__", None)
    if inner is None:
        return None
    for cell in getattr(forward, "__closure__", None) or ():
        try:
            owner = getattr(cell.cell_contents, "__self__", None)
        except ValueError:  # an empty cell
            continue
        if isinstance(owner, torch.no_grad):
            return inner
    return None


class GradFree(nn.Module):
    """Runs ``inner`` without its ``torch.no_grad()`` decorator and detaches what it returns: the same
    values, and, as under ``no_grad``, no gradient through them.

    Example:
        >>> class Scale(torch.nn.Module):
        ...     @torch.no_grad()
        ...     def forward(self, x):
        ...         return x * 3
        >>> out = GradFree(Scale())(torch.ones(2, requires_grad=True))
        >>> out.tolist(), out.requires_grad
        ([3.0, 3.0], False)
    """

    def __init__(self, inner: nn.Module):
        super().__init__()
        if no_grad_forward(inner) is None:
            raise TypeError(f"{type(inner).__name__}.forward is not decorated with torch.no_grad()")
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = no_grad_forward(self.inner)(self.inner, *args, **kwargs)
        return pytree.tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, out)


def no_grad_modules(model: nn.Module) -> list[str]:
    """The submodules whose ``forward`` runs under ``torch.no_grad()`` (the outermost of nested ones).

    Example:
        >>> no_grad_modules(torch.nn.Sequential(torch.nn.Linear(2, 2)))
        []
    """
    found: list[str] = []
    for name, module in model.named_modules():
        if name and not any(name.startswith(f"{outer}.") for outer in found) and no_grad_forward(module) is not None:
            found.append(name)
    return found


def replace_submodules(model: nn.Module, replacements: dict[str, nn.Module]) -> nn.Module:
    """A new root in which each named submodule is replaced; every other module, parameter and buffer is
    shared with ``model``, and only the modules on the paths to the replaced ones are (shallow) copies.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.ReLU()), torch.nn.Tanh())
        >>> new = replace_submodules(model, {"0.0": torch.nn.GELU()})
        >>> type(new[0][0]).__name__, type(model[0][0]).__name__, new[1] is model[1], new[0] is model[0]
        ('GELU', 'ReLU', True, False)
    """
    copies = {"": _shallow(model)}
    for name, replacement in replacements.items():
        if not name:
            raise ValueError("the root itself cannot be replaced")
        *path, leaf = name.split(".")
        prefix = ""
        for part in path:
            inner = f"{prefix}.{part}" if prefix else part
            if inner not in copies:
                parent = copies[prefix]
                if part not in parent._modules:
                    raise ValueError(f"{name!r} is not a submodule of {type(model).__name__}")
                copies[inner] = parent._modules[part] = _shallow(parent._modules[part])
            prefix = inner
        if leaf not in copies[prefix]._modules:
            raise ValueError(f"{name!r} is not a submodule of {type(model).__name__}")
        copies[prefix]._modules[leaf] = replacement
    return copies[""]


def _shallow(module: nn.Module) -> nn.Module:
    """A copy of ``module`` sharing everything but its table of submodules (which may then be changed)."""
    clone = copy.copy(module)
    clone.__dict__["_modules"] = OrderedDict(module._modules)
    return clone


def with_column_blocks(model: nn.Module, blocks: dict[str, int]) -> nn.Module:
    """``model`` with each ``Linear`` named in ``blocks`` computed as that many
    :class:`~fxforge.parallel.columns.ColumnBlocks` (a new root; ``model`` is left as it is).

    Raises:
        ValueError: a name that is not a layer :func:`~fxforge.parallel.columns.splittable_linear` accepts.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 256))
        >>> split = with_column_blocks(model, {"1": 4})
        >>> type(split[1]).__name__, type(model[1]).__name__, split[0] is model[0]
        ('ColumnBlocks', 'Linear', True)
        >>> x = torch.randn(2, 8)
        >>> torch.allclose(split(x), model(x), atol=1e-6), split[1].blocks[2].weight is model[1].weight
        (True, True)
    """
    return replace_submodules(model, _column_blocks(model, blocks))


def _column_blocks(model: nn.Module, blocks: dict[str, int]) -> dict[str, nn.Module]:
    found = {}
    for name, count in blocks.items():
        linear = splittable_linear(model, name)
        if linear is None:
            raise ValueError(f"{name!r} is not a Linear layer that can be split into column blocks")
        found[name] = ColumnBlocks(linear, count)
    return found


def pipeline_ready(model: nn.Module, column_blocks: dict[str, int] | None = None) -> nn.Module:
    """``model`` as the pipeline engine runs it (module docstring): its ``no_grad`` submodules as
    :class:`GradFree`, and each ``Linear`` layer in ``column_blocks`` computed in that many column blocks.
    ``model`` itself when there is nothing to replace.

    Raises:
        ValueError: a name in ``column_blocks`` that is not a splittable ``Linear`` layer.
    """
    replacements: dict[str, nn.Module] = {name: GradFree(model.get_submodule(name)) for name in no_grad_modules(model)}
    blocks = _column_blocks(model, column_blocks or {})
    inside = [name for name in blocks if any(name.startswith(f"{n}.") for n in replacements)]
    if inside:
        raise ValueError(f"{inside[0]!r} runs under torch.no_grad(): it cannot be split into column blocks")
    replacements.update(blocks)
    return replace_submodules(model, replacements) if replacements else model
