"""``objective="throughput"``: an optimized module served by the streams x threads x batch measured fastest.

:func:`serve_throughput` proves batching on the example (:func:`~fxforge.runtime.batching.batching_refusal`),
measures every configuration (:func:`~fxforge.runtime.throughput_search.search`) and returns a
:class:`ThroughputModule`: ``opt.map(requests)`` serves a list of independent requests on the chosen streams
(requests of one signature concatenated into batches where batching was proven), and ``opt(x)`` runs one
request on a free stream, so calls from many threads at once are served side by side. The report gets the
table of every configuration tried (``opt.report.throughput``; ``.frame()`` is a ``DataFrame``).

Example:
    >>> from fxforge.lowering.build import plan_builder
    >>> from fxforge.runtime.native import OptimizedModule
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval()
    >>> opt = serve_throughput(OptimizedModule(model, plan_builder(model)), (torch.ones(1, 4),), budget_s=0.1)
    >>> with torch.no_grad():
    ...     outs = opt.map([torch.ones(1, 4), (torch.zeros(1, 4),)])
    >>> [tuple(o.shape) for o in outs], opt.report.throughput.best.streams >= 1
    ([(1, 4), (1, 4)], True)
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from fxforge.capture import normalize_inputs
from fxforge.core.follows import FollowsTraining
from fxforge.core.memory import simulate_peak
from fxforge.core.report import Report
from fxforge.core.throughput import ThroughputTable
from fxforge.core.verify import random_like
from fxforge.runtime.batching import Request, batching_refusal, request_size, signature
from fxforge.runtime.streams import Streams, cores
from fxforge.runtime.throughput_search import BATCHES, SEARCH_BUDGET_S, search, serve_call


class ThroughputModule(nn.Module):
    """An optimized module served for throughput: ``map`` for a list of requests, calls safe from many threads.

    It shares the model's parameters, buffers and submodules (``state_dict`` is the model's), and looks up
    attributes it lacks on the optimized module it serves (``opt.cache``, ``opt.original``).

    Args:
        module: the optimized module (thread-safe: its plan cache is).
        table: the configurations measured; ``table.best`` is served.

    Attributes:
        served: the optimized module the streams call.
        original: the model.
        table: the :class:`~fxforge.core.throughput.ThroughputTable` (also ``report.throughput``).

    Example:
        >>> from fxforge.core.throughput import Configuration
        >>> table = ThroughputTable([Configuration(2, 1, 1, 1.0, 1.0, 1.0, 1.0, 1.0)], 0)
        >>> opt = ThroughputModule(fxforge.optimize(torch.nn.ReLU()), table)
        >>> opt(-torch.ones(2)).tolist(), opt.map([torch.ones(1), -torch.ones(1)])
        ([0.0, 0.0], [tensor([1.]), tensor([0.])])
    """

    training = FollowsTraining(lambda self: self.__dict__.get("original"))

    def __init__(self, module: nn.Module, table: ThroughputTable):
        super().__init__()
        for name in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
            self.__dict__[name] = module.__dict__[name]
        self.__dict__["served"] = module
        self.__dict__["original"] = getattr(module, "original", module)
        self.__dict__["table"] = table
        self.__dict__["_streams"] = None
        self.__dict__["_lock"] = threading.Lock()

    @property
    def streams(self) -> Streams:
        """The chosen configuration's streams (started on the first call)."""
        with self.__dict__["_lock"]:
            if self.__dict__["_streams"] is None:
                best = self.table.best
                self.__dict__["_streams"] = Streams(best.streams, best.threads)
            return self.__dict__["_streams"]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.streams.submit(lambda: self.served(*args, **kwargs)).result()

    def map(self, requests: list[Any]) -> list[Any]:
        """Every request's outputs, in order: each request is one call's inputs (a tensor, a tuple of positional
        inputs, or a dict of keyword inputs, as ``example_inputs``). Requests of one signature are concatenated
        into batches of the chosen size where batching was proven on the example; the batches run on the
        chosen streams, under the caller's grad mode (``torch.no_grad()`` for the inference plan).

        Example:
            >>> from fxforge.core.throughput import Configuration
            >>> table = ThroughputTable([Configuration(1, 1, 2, 1.0, 1.0, 1.0, 1.0, 1.0)], 0)
            >>> opt = ThroughputModule(fxforge.optimize(torch.nn.ReLU()), table)
            >>> [o.tolist() for o in opt.map([-torch.ones(1, 2), torch.ones(1, 2), torch.ones(1, 3)])]
            [[[0.0, 0.0]], [[1.0, 1.0]], [[1.0, 1.0, 1.0]]]
        """
        normalized = [normalize_inputs(r) for r in requests]
        batch = self.table.best.batch if not self.table.batching else 1
        groups: dict[tuple, list[int]] = {}
        for index, request in enumerate(normalized):
            groups.setdefault(signature(request) if batch > 1 else (index,), []).append(index)
        jobs: list[tuple[list[int], concurrent.futures.Future]] = []
        for indices in groups.values():
            for start in range(0, len(indices), batch):
                chunk = indices[start:start + batch]
                jobs.append((chunk, self.streams.submit(serve_call, self.served, [normalized[i] for i in chunk])))
        results: list[Any] = [None] * len(normalized)
        for chunk, future in jobs:
            for index, output in zip(chunk, future.result()[0]):
                results[index] = output
        return results

    @property
    def report(self) -> Report:
        """The optimized module's report (an empty one where it has none), with the throughput table
        (``report.throughput``)."""
        report = self.served.report
        report = report.copy() if report is not None else Report()
        report.throughput = self.table
        return report

    def close(self) -> None:
        """End the streams' threads (a later call starts them again)."""
        with self.__dict__["_lock"]:
            streams, self.__dict__["_streams"] = self.__dict__["_streams"], None
        if streams is not None:
            streams.close()

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            served = self.__dict__.get("served")
            if served is None:
                raise
            return getattr(served, name)

    def __reduce_ex__(self, protocol: int) -> tuple:
        """Copies serve a copy of the optimized module with the same choice (no threads are copied)."""
        return ThroughputModule, (self.served, self.table)

    def extra_repr(self) -> str:
        return f"model={type(self.original).__name__}, {self.table.best.label}"


def _request_bytes(module: nn.Module, example: Request, outputs: Any) -> int | None:
    """A request's memory: its plan's simulated activation peak where known, else its inputs and outputs."""
    captured = getattr(module, "captured", None)
    peak = None
    try:
        peak = simulate_peak(captured.graph_module).peak_bytes if captured is not None else None
    except Exception:  # noqa: BLE001 - a graph without shape metadata: the inputs and outputs instead
        peak = None
    if peak:
        return peak
    leaves = tree_flatten((example, outputs))[0]
    return sum(x.numel() * x.element_size() for x in leaves if isinstance(x, torch.Tensor)) or None


def serve_throughput(module: nn.Module, example_inputs: Any, *, budget_s: float = SEARCH_BUDGET_S,
                     cores_used: int | None = None) -> ThroughputModule:
    """``module`` (an optimized module, prepared for ``example_inputs``) served for throughput: batching proven or
    refused on the example, every configuration measured, the fastest kept (a few seconds on a small model:
    ``budget_s`` of timed slices, and one plan built per batch size). The model's buffers (batch norm's running
    statistics) are as they were before the measuring calls.

    Args:
        module: the optimized module.
        example_inputs: one request (a tensor, a tuple, or a dict of keyword inputs).
        budget_s: seconds of timing, roughly.
        cores_used: the cores to use (default: those this process may run on).

    Example:
        >>> opt = serve_throughput(fxforge.optimize(torch.nn.Linear(3, 1)), torch.ones(1, 3), budget_s=0.1)
        >>> opt.report.throughput.frame()["chosen"].sum()
        np.int64(1)
    """
    example = normalize_inputs(example_inputs)
    saved = [b.detach().clone() for b in module.buffers()]  # a model in training mode updates its statistics
    try:
        with torch.no_grad():
            outputs = module(*example[0], **example[1])
        refusal = batching_refusal(module, example, module)
        requests = [random_like(example, seed=seed) for seed in range(1, max(BATCHES) + 1)]
        samples = request_size(example) if not refusal else 1
        with torch.no_grad():
            table = search(module, requests, cores_used or cores(), batchable=not refusal,
                           request_bytes=_request_bytes(module, example, outputs), budget_s=budget_s,
                           samples_per_request=samples)
    finally:
        with torch.no_grad():
            for buffer, value in zip(module.buffers(), saved):
                buffer.copy_(value)
    table.batching = refusal
    return ThroughputModule(module, table)
