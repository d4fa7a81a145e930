"""Batching independent requests: concatenate them along dim 0, run once, split the outputs back.

That is only right for a model that treats the rows of dim 0 as independent samples. :func:`batching_refusal`
proves it on the example before any batch is served: fresh random requests of the example's signature run one
by one and as one batch must give the same outputs (the tolerance of
:func:`~fxforge.core.verify.compare_outputs`), every tensor input must have dim 0 as its first dim and every
output tensor a dim 0 that adds up. A model that mixes samples (a mean over dim 0, batch norm in training mode)
or takes an input whose dim 0 is not a batch is refused, and the reason goes into the report.

Requests are grouped by signature (:func:`signature`): only requests of equal shapes, dtypes and non-tensor
values are concatenated.

Example:
    >>> reqs = [((torch.ones(1, 2),), {}), ((torch.zeros(1, 2),), {})]
    >>> args, kwargs, sizes = concatenated(reqs)
    >>> args[0].shape, sizes
    (torch.Size([2, 2]), [1, 1])
    >>> [o.tolist() for o in split_outputs(args[0] * 2, sizes)]
    [[[2.0, 2.0]], [[0.0, 0.0]]]
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from fxforge.core.verify import compare_outputs, random_like

# Fresh requests in the batch that proves batching on the example (2: the plan it builds serves batch 2 later).
PROOF_REQUESTS = 2

Request = tuple[tuple, dict]


def signature(request: Request) -> tuple:
    """What two requests must share to be batched: their structure, each tensor's shape, dtype and device,
    every other value.

    Example:
        >>> signature(((torch.ones(1, 2),), {})) == signature(((torch.zeros(1, 2),), {}))
        True
        >>> signature(((torch.ones(1, 2),), {})) == signature(((torch.ones(1, 3),), {}))
        False
    """
    leaves, spec = tree_flatten(request)
    return (str(spec), tuple((tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor)
                             else (type(x).__name__, repr(x)) for x in leaves))


def request_size(request: Request) -> int:
    """Dim 0 of the request's first tensor: how many samples it holds.

    Example:
        >>> request_size(((torch.ones(3, 2), 1.0), {}))
        3
    """
    leaves = [x for x in tree_flatten(request)[0] if isinstance(x, torch.Tensor)]
    return int(leaves[0].shape[0])


def concatenated(requests: list[Request]) -> tuple[tuple, dict, list[int]]:
    """One call's ``(args, kwargs)`` from requests of one signature (tensors concatenated along dim 0, other
    values taken from the first), and each request's size.

    Example:
        >>> args, kwargs, sizes = concatenated([((torch.ones(2, 3),), {"scale": 2}), ((torch.ones(1, 3),), {"scale": 2})])
        >>> args[0].shape, kwargs, sizes
        (torch.Size([3, 3]), {'scale': 2}, [2, 1])
    """
    flats = [tree_flatten(r)[0] for r in requests]
    spec = tree_flatten(requests[0])[1]
    leaves = [torch.cat(column) if isinstance(column[0], torch.Tensor) else column[0] for column in zip(*flats)]
    args, kwargs = tree_unflatten(leaves, spec)
    return args, kwargs, [request_size(r) for r in requests]


def split_outputs(outputs: Any, sizes: list[int]) -> list[Any]:
    """A batch's outputs split back into each request's (tensors split along dim 0; other values shared).

    Example:
        >>> [(o["y"].shape[0], o["n"]) for o in split_outputs({"y": torch.ones(3, 2), "n": 7}, [2, 1])]
        [(2, 7), (1, 7)]
    """
    leaves, spec = tree_flatten(outputs)
    parts = [torch.split(x, sizes) if isinstance(x, torch.Tensor) else [x] * len(sizes) for x in leaves]
    return [tree_unflatten([p[i] for p in parts], spec) for i in range(len(sizes))]


def _input_refusal(request: Request) -> str:
    tensors = [(i, x) for i, x in enumerate(tree_flatten(request)[0]) if isinstance(x, torch.Tensor)]
    if not tensors:
        return "the model takes no tensor input to batch"
    for i, x in tensors:
        if x.dim() == 0:
            return f"input leaf {i} is a 0-d tensor: it has no batch dim"
    first = tensors[0][1].shape[0]
    for i, x in tensors[1:]:
        if x.shape[0] != first:
            return (f"input leaf {i} has dim 0 of {x.shape[0]} where the first input has {first}: its dim 0 is not "
                    "a batch dim")
    return ""


def _output_refusal(outputs: Any, total: int) -> str:
    for i, x in enumerate(tree_flatten(outputs)[0]):
        if isinstance(x, torch.Tensor) and (x.dim() == 0 or x.shape[0] != total):
            size = "a 0-d tensor" if x.dim() == 0 else f"dim 0 of {x.shape[0]}"
            return f"output leaf {i} has {size} for a batch of {total} samples: its dim 0 is not a batch dim"
    return ""


def batching_refusal(call: Any, example: Request, model: torch.nn.Module | None = None) -> str:
    """Why requests like ``example`` may not be batched through ``call`` (``""``: batching is proven on fresh
    requests). ``model``'s buffers (batch norm's running statistics) are restored after the proof's calls.

    Example:
        >>> batching_refusal(torch.nn.Linear(3, 2), ((torch.ones(1, 3),), {}))
        ''
        >>> class Centre(torch.nn.Module):
        ...     def forward(self, x):
        ...         return x - x.mean(0)
        >>> batching_refusal(Centre(), ((torch.ones(1, 3),), {}))[:62]
        'a batch of 2 requests gives other outputs than each request al'
    """
    reason = _input_refusal(example)
    if reason:
        return reason
    saved = [b.detach().clone() for b in model.buffers()] if model is not None else []
    try:
        requests = [random_like(example, seed=seed) for seed in range(1, PROOF_REQUESTS + 1)]
        with torch.no_grad():
            alone = [call(*args, **kwargs) for args, kwargs in requests]
            args, kwargs, sizes = concatenated(requests)
            try:
                batched = call(*args, **kwargs)
            except Exception as error:  # noqa: BLE001 - the model's own refusal of a batch: the reason
                return f"a batch of {len(sizes)} requests raised {type(error).__name__}: {error}"
    finally:
        if model is not None:
            with torch.no_grad():
                for buffer, value in zip(model.buffers(), saved):
                    buffer.copy_(value)
    reason = _output_refusal(batched, sum(sizes))
    if reason:
        return reason
    for one, part in zip(alone, split_outputs(batched, sizes)):
        comparison = compare_outputs(one, part)
        if not comparison.ok:
            training = (" (the model is in training mode: batch norm normalizes with the batch's statistics, "
                        "dropout draws anew)") if model is not None and model.training else ""
            return (f"a batch of {len(sizes)} requests gives other outputs than each request alone "
                    f"({comparison.reason}): the model mixes samples along dim 0{training}")
    return ""
