"""DDP's bucket all-reduces behind the backward: when each bucket's gradients are ready, and what its all-reduce
adds to a step.

``DistributedDataParallel`` starts a bucket's all-reduce as soon as the backward has produced every gradient in
it, and waits for them all only after the backward; the link's :attr:`~fxforge.core.links.Link.overlap` says how
much of such a collective's time the ranks' compute hides (on a CPU the communication threads share the cores:
measured, not assumed). Pricing the buckets as blocking over-predicted DDP's steps by up to 17 % on gloo
(``benchmarks/RESULTS.md``, issue 52).

- :func:`gradient_ready_times`: one timed backward (after a warm-up), each trainable parameter's gradient's
  ready time as a share of the backward, and the backward's share of forward + backward
  (:func:`gradient_ready_order`: the order alone, from one backward);
- :func:`bucket_ready_shares`: DDP's rebuilt buckets (cut along the ready order, as
  :func:`~fxforge.parallel.collectives.data_parallel_collectives` cuts them) and the share of the backward done
  when each is ready: its last gradient's;
- :func:`ddp_communication`: a DDP step's collectives priced on a link: the forward's buffer broadcasts
  blocking, the buckets' all-reduces behind the backward (:meth:`~fxforge.core.links.Link.behind`), and the
  ranks' meeting waits (:meth:`~fxforge.core.links.Link.synced`) for the blocking ones and the final wait.

Example:
    >>> model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    >>> ready, backward_share = gradient_ready_times(model, (torch.randn(64, 256),))
    >>> [name for name, _ in ready][:2], all(0 <= share <= 1 for _, share in ready), 0 < backward_share < 1
    (['2.bias', '2.weight'], True, True)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from fxforge.capture.inputs import normalize_inputs
from fxforge.core.links import Link
from fxforge.core.memory import tensor_leaves
from fxforge.parallel.collectives import (
    DDP_BUCKET_MB,
    DDP_FIRST_BUCKET_BYTES,
    Collective,
    _ddp_buckets,
    _params,
)


def gradient_ready_times(model: torch.nn.Module, example_inputs: Any,
                         loss: Callable[[Any], torch.Tensor] | None = None, *, steps: int = 2
                         ) -> tuple[list[tuple[str, float]], float]:
    """``([(name, share of the backward done when its gradient is ready), ...], backward share)``: the trainable
    parameters in the order their gradients become ready in one backward (``loss(output)``, default the sum of
    the floating-point outputs), timed on the last of ``steps`` steps, and that backward's share of the step's
    forward + backward time. The gradients are put back."""
    args, kwargs = normalize_inputs(example_inputs)
    params = [(n, p) for n, p in _params(model) if p.requires_grad]
    saved = [p.grad for _, p in params]
    ready: dict[str, float] = {}

    def hook(name: str) -> Callable[[torch.Tensor], None]:
        def record(_: torch.Tensor) -> None:
            ready.setdefault(name, time.perf_counter())
        return record

    handles = [p.register_post_accumulate_grad_hook(hook(n)) for n, p in params]
    try:
        for _ in range(steps):
            ready.clear()
            start = time.perf_counter()
            out = model(*args, **kwargs)
            value = loss(out) if loss else sum(t.sum() for t in tensor_leaves(out) if t.is_floating_point())
            middle = time.perf_counter()
            value.backward()
            end = time.perf_counter()
            for _, p in params:
                p.grad = None
    finally:
        for handle in handles:
            handle.remove()
        for (_, p), grad in zip(params, saved):
            p.grad = grad
    backward = max(end - middle, 1e-9)
    order = sorted(ready.items(), key=lambda item: item[1])
    return ([(name, min(1.0, max(0.0, (when - middle) / backward))) for name, when in order],
            backward / max(end - start, 1e-9))


def gradient_ready_order(model: torch.nn.Module, example_inputs: Any,
                         loss: Callable[[Any], torch.Tensor] | None = None) -> list[str]:
    """The names of ``model``'s trainable parameters in the order their gradients become ready in one
    backward (DDP rebuilds its buckets in this order after the first step; :func:`gradient_ready_times` of one
    step). The gradients are put back.

    Example:
        >>> gradient_ready_order(torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.ones(1, 2))
        ['0.bias', '0.weight']
    """
    return [name for name, _ in gradient_ready_times(model, example_inputs, loss, steps=1)[0]]


def bucket_ready_shares(model: torch.nn.Module, ready: list[tuple[str, float]]) -> list[float]:
    """The share of the backward done when each of DDP's rebuilt buckets (default caps; in the order their
    all-reduces are issued) has all its gradients.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(1024, 512), torch.nn.Linear(512, 512))
        >>> bucket_ready_shares(model, [("1.bias", 0.1), ("1.weight", 0.3), ("0.bias", 0.6), ("0.weight", 0.9)])
        [0.3, 0.9]
    """
    by_name = {n: p for n, p in _params(model) if p.requires_grad}
    ordered = [(name, by_name[name]) for name, _ in ready if name in by_name]
    shares = dict(ready)
    buckets = _ddp_buckets(ordered, [DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_MB * 1024 * 1024])
    return [max(shares[ordered[i][0]] for i in bucket) for bucket in buckets]


def ddp_communication(link: Link, collectives: list[Collective], bucket_shares: list[float], backward_s: float,
                      compute_s: float) -> float:
    """The seconds a DDP step's ``collectives`` add on ``link``: the backward's all-reduces (one per bucket, ready
    at ``bucket_shares`` of a backward ``backward_s`` long) behind it, the rest blocking, and the ranks' waits for
    each other (:meth:`~fxforge.core.links.Link.synced` over ``compute_s``) at each blocking one and at the final
    wait for the buckets.

    Example:
        >>> link = Link("x", 1e-4, 1.0, "made up", overlap=1.0)
        >>> reduces = [Collective("all_reduce", 10**6, 2, "dp", "backward")] * 2
        >>> round(ddp_communication(link, reduces, [0.2, 0.996], 0.1, 0.15) * 1e3, 3)  # 1.2 ms each: the last
        0.8
    """
    buckets, blocking = [], []
    for c in collectives:
        (buckets if c.kind == "all_reduce" and c.phase == "backward" else blocking).append(c)
    if len(buckets) != len(bucket_shares):
        raise ValueError(f"{len(buckets)} bucket all-reduces but {len(bucket_shares)} ready shares")
    durations = [link.seconds(c.kind, c.nbytes, c.ranks) for c in buckets]
    behind = link.behind(durations, [share * backward_s for share in bucket_shares], backward_s)
    meetings = len(blocking) + (1 if buckets else 0)
    return sum(link.seconds(c.kind, c.nbytes, c.ranks) for c in blocking) + behind + link.synced(meetings, compute_s)
