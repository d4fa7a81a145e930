"""Capture with torch.export and dynamic dims, and the batch-dim helpers that go with it.

A graph captured with static shapes holds the example's sizes; exporting it (ONNX, ``.pt2``) with a
dynamic batch needs a graph that computes them. :func:`capture_dynamic` captures with the dims dynamic:
the user's ``dynamic_shapes``, or dim 0 of every input whose dim 0 is the batch size (torch.export
specialises a size-1 dim, so a batch of 1 is traced as a batch of 2 made from the example rows).

Example:
    >>> cap = capture_dynamic(torch.nn.Linear(2, 3), (torch.ones(4, 2),), {})
    >>> cap.method, cap.graph_module(torch.ones(5, 2)).shape
    ('export', torch.Size([5, 3]))
"""

from __future__ import annotations

import collections
import inspect
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from fxforge.capture.export import export_graph_module
from fxforge.capture.model import CaptureError, captured_from, check_graph
from fxforge.core.captured import Captured
from fxforge.core.source import first_line, user_frame_of
from fxforge.core.verify import isolated


def capture_dynamic(model: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any = None, *,
                    reference: Any = None) -> Captured:
    """Capture ``model`` with ``torch.export`` and dynamic dims: ``dynamic_shapes``, or (None) dim 0 of
    every input whose dim 0 is the batch size.

    The graph is checked against the model on the example inputs, like :func:`fxforge.capture`'s.
    ``reference`` is the model's output on them, when already computed.

    Raises:
        CaptureError: torch.export cannot keep those dims dynamic (the message names the line that
            specialised them, where torch.export says), or the graph differs from the model.

    Example:
        >>> cap = capture_dynamic(torch.nn.Linear(2, 3), (torch.ones(1, 2),), {})
        >>> cap.graph_module(torch.ones(7, 2)).shape
        torch.Size([7, 3])
    """
    trace_args, trace_kwargs = tuple(args), dict(kwargs)
    if dynamic_shapes is None:
        batch = batch_size(args, kwargs)
        if batch == 1:  # torch.export specialises a size-1 dim: trace on a batch of 2 made from the example rows
            trace_args, trace_kwargs = with_batch(args, kwargs, 1, 2)
            batch = 2
        dynamic_shapes = batch_dynamic_shapes(model, trace_args, trace_kwargs, batch)
    name = type(model).__name__
    try:
        with torch.no_grad():
            graph_module = export_graph_module(model, trace_args, trace_kwargs, dynamic_shapes)
    except Exception as error:
        where = user_frame_of(error)
        raise CaptureError(name, {"export": "torch.export cannot keep the requested dims dynamic "
                                            f"({first_line(error)})" + (f" at {where}" if where else "")}) from error
    if reference is None:
        with isolated(model, inputs=(args, kwargs)), torch.no_grad():
            reference = model(*args, **kwargs)
    try:
        check_graph(model, graph_module, args, kwargs, reference)
    except Exception as error:
        raise CaptureError(name, {"export": first_line(error)}) from error
    return captured_from(model, graph_module, "export", [], args, kwargs,
                         ["captured with torch.export and dynamic dims"], reference=reference)


def batch_size(args: tuple, kwargs: dict) -> int | None:
    """The batch size: the most common dim 0 among the input tensors (None without any).

    Example:
        >>> batch_size((torch.ones(4, 3), torch.ones(4)), {"mask": torch.ones(1, 9)})
        4
    """
    sizes = [t.shape[0] for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim() > 0]
    return collections.Counter(sizes).most_common(1)[0][0] if sizes else None


def with_batch(args: tuple, kwargs: dict, batch: int, new: int) -> tuple[tuple, dict]:
    """The inputs with batch size ``new``, built from the example rows (in reverse order, repeated), so
    token ids, masks and image statistics stay those of real inputs.

    Example:
        >>> (x,), _ = with_batch((torch.tensor([[1], [2]]),), {}, 2, 3)
        >>> x.flatten().tolist()
        [2, 1, 2]
    """
    index = torch.tensor([(batch - 1 - i) % batch for i in range(new)])

    def grow(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch:
            return t.index_select(0, index.to(t.device)).contiguous()
        return t

    return pytree.tree_map(grow, (tuple(args), dict(kwargs)))


def batch_dynamic_shapes(gm: nn.Module, args: tuple, kwargs: dict, batch: int) -> dict[str, Any]:
    """``dynamic_shapes`` for ``torch.export``: dim 0 of every input whose dim 0 is ``batch`` is one
    shared ``Dim("batch")``; everything else static. Keyed by the graph's argument names.

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
        >>> batch_dynamic_shapes(gm, (torch.ones(3, 2),), {}, 3)
        {'input': {0: Dim('batch', min=1)}}
    """
    dim = torch.export.Dim("batch", min=1)
    bound = inspect.signature(gm.forward).bind(*args, **kwargs)

    def spec(t: Any) -> Any:
        return {0: dim} if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch else None

    return {name: pytree.tree_map(spec, value) for name, value in bound.arguments.items()}
