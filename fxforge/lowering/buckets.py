"""Kernel choices per shape bucket, for graphs that serve many sizes.

A shape-generic plan runs one graph at every size in its range, but which kernel runs a fused op fastest
depends on the size: oneDNN's prepacked linear wins at 8 x 512 rows and may lose at 1 x 16. Autotune times
the kernels at the example's sizes; lowering a graph with symbolic sizes then emits, for each fused op, a
:class:`BucketedKernel`: it rounds the product of the op's input sizes in its dynamic dims (the rows
of a linear layer) up to a power of two (the bucket), runs the kernel chosen for that bucket, and chooses on the first call in a bucket it has not seen
by timing the kernels on that call's own inputs, for at most about :data:`BUCKET_LIMIT_S` seconds.

Fused ops of one graph with the same configuration (op, weight shape, activation, input shape outside
the dynamic dims) share one :class:`BucketTable`, so a choice is timed once for all of them. Timings are
remembered on disk per machine like autotune's, so a bucket measured in an earlier process costs nothing;
every bucket's choice is listed in the plan's report as it is made.

Example:
    >>> from torch import nn
    >>> table = BucketTable("linear_pointwise", (0,), (None, 4), "linear_pointwise_default", "composite")
    >>> table.describe(bucket_key((3, 4), (0,)))
    '[*, 4] with * in 3..4'
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fxforge.core.disk_cache import machine_key
from fxforge.core.report import Report, Tuning
from fxforge.lowering.timing import (
    DECISIVE,
    DECISIVE_FIRST,
    NODE_BUDGET_S,
    NOTE,
    autotune_cache,
    time_interleaved,
)

# Seconds a call that opens a new bucket spends timing one op configuration's kernels, about (one round of
# every kernel runs whatever its time; no further round starts past this).
BUCKET_LIMIT_S = 0.1


def bucket_key(shape: Sequence[int], dims: Sequence[int]) -> int:
    """The bucket of an input shape: the product of its dynamic dims' sizes rounded up to a power of two, as
    the exponent (a fused op's speed follows the rows it runs, B x S for a linear layer, not each dim).

    Example:
        >>> bucket_key((8, 300, 256), (0, 1)), bucket_key((1, 1, 256), (0, 1))
        (12, 0)
    """
    rows = 1
    for d in dims:
        rows *= int(shape[d])
    return (rows - 1).bit_length() if rows > 1 else 0


class BucketTable:
    """The kernel chosen per bucket for one fused-op configuration (shared by the graph's ops that have it).

    Attributes:
        op: ``"conv_pointwise"`` or ``"linear_pointwise"``.
        dims: the input's dynamic dims (a bucket is the power of two at or above their sizes' product).
        shape: the input's sizes, None in the dynamic dims (for the report and the disk cache's key).
        subject: the first op's node name (the report's subject).
        default: autotune's choice at the example's sizes, whose bucket starts with it.
        choices: bucket -> kernel.
        report: the plan's report, which each new choice is added to (set by ``make_plan``).
    """

    def __init__(self, op: str, dims: tuple[int, ...], shape: tuple, subject: str, default: str,
                 config: str = ""):
        self.op, self.dims, self.shape, self.subject, self.default = op, dims, shape, subject, default
        self.config = config
        self.choices: dict[int, str] = {}
        self.report: Report | None = None
        self.users = 0
        self._lock = threading.Lock()

    def describe(self, key: int) -> str:
        """A bucket as sizes: ``[*, *, 256] with * x * in 257..512`` (the dynamic dims as ``*``).

        Example:
            >>> BucketTable("linear_pointwise", (0,), (None, 8), "x", "mkldnn").describe(9)
            '[*, 8] with * in 257..512'
        """
        shape = ", ".join("*" if size is None else str(size) for size in self.shape)
        rows = "0..1" if key == 0 else f"{(1 << (key - 1)) + 1}..{1 << key}"
        return f"[{shape}] with {' x '.join(['*'] * len(self.dims))} in {rows}"

    def seed(self, key: int, kernel: str) -> None:
        """The example's bucket: autotune already chose it there."""
        self.choices.setdefault(key, kernel)

    def choose(self, key: int, calls: dict[str, Callable[[], Any]], device: torch.device) -> str:
        """The kernel for a bucket not seen yet: read from the disk cache, or timed on the call's inputs
        (``calls``: kernel -> a call of it on them), and added to the report."""
        with self._lock:
            if key in self.choices:
                return self.choices[key]
            cache = autotune_cache()
            cache_key = f"{machine_key(device)} | bucket {self.op} {self.config} {self.describe(key)}"
            timings = cache.get(cache_key) if cache is not None else None
            note = NOTE if timings is not None else ""
            if timings is None or set(timings) != set(calls):
                with torch.no_grad():
                    timings = time_interleaved(calls, NODE_BUDGET_S, decisive=DECISIVE,
                                               decisive_first=DECISIVE_FIRST, limit_s=BUCKET_LIMIT_S)
                note = "timed on the first call in this bucket"
                if cache is not None:
                    cache.put(cache_key, timings)
                    cache.save()
            kernel = min(timings, key=timings.__getitem__)
            self.choices[key] = kernel
            if self.report is not None:
                users = f" and {self.users - 1} more ops like it" if self.users > 1 else ""
                self.report.tuning.append(Tuning("conv_activation", f"{self.subject}{users} bucket {self.describe(key)}",
                                                 kernel, dict(timings), note))
            return kernel


class BucketedKernel:
    """A fused op in a graph with symbolic sizes: the kernel its input's bucket chose (see the module).

    Called with the op's input, then each candidate kernel's arguments one after the other (the graph passes
    prepacked weights in as buffers, so refreshing them after a weight changes works as for a plain
    kernel call).

    Args:
        table: the choices, shared with the graph's other ops of this configuration.
        calls: kernel -> (function, where its arguments start, where they end) among the arguments after the
            input.
    """

    def __init__(self, table: BucketTable, calls: dict[str, tuple[Callable, int, int]], op: str):
        self.table, self.calls = table, calls
        self.__name__ = f"bucketed_{op}"
        self.fxforge_op = f"fxforge.{op}"  # what a profile calls this node
        table.users += 1

    def __call__(self, input: torch.Tensor, *args: Any) -> torch.Tensor:
        key = bucket_key(input.shape, self.table.dims)
        kernel = self.table.choices.get(key)
        if kernel is None:
            kernel = self.table.choose(key, {k: (lambda fn=fn, lo=lo, hi=hi: fn(*args[lo:hi]))
                                              for k, (fn, lo, hi) in self.calls.items()}, input.device)
        fn, lo, hi = self.calls[kernel]
        return fn(*args[lo:hi])

    def __deepcopy__(self, memo: dict) -> BucketedKernel:
        return self  # (a copied graph shares the choices: the same kernels, the same weights' sizes)

    def __repr__(self) -> str:
        return f"BucketedKernel({self.table.subject}: {self.table.choices})"


def tables_of(graph_module: torch.fx.GraphModule) -> list[BucketTable]:
    """The bucket tables of a lowered graph's :class:`BucketedKernel` nodes (each once).

    Example:
        >>> tables_of(torch.fx.symbolic_trace(torch.nn.ReLU()))
        []
    """
    tables: dict[int, BucketTable] = {}
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, BucketedKernel):
            tables.setdefault(id(node.target.table), node.target.table)
    return list(tables.values())
