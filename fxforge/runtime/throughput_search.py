"""The choice of ``objective="throughput"``: streams x threads per stream x batch, by measurement.

Every configuration (:func:`configurations`: one stream with every core, which is the latency configuration;
one stream per core; the powers of two between; each at batch sizes 1, 2, 4, 8 where batching is proven,
memory allows and the batch size below gained) serves a stream of independent requests (the example's
signature, fresh values) in short slices, the configurations interleaved over :data:`ROUNDS` rounds (each
slice after one untimed call per stream); a configuration's samples/s is the median of its rounds, its
latencies (p50/p90/p99 of the call that served each request) pooled, its utilization the process's CPU time
over wall time x the cores it uses. The highest samples/s is chosen. The search is bounded: about
``budget_s`` seconds of slices (a few seconds on a small model), and one plan built per batch size tried
(a few seconds each for a CNN of 100 operators, with autotune).

Example:
    >>> configurations(4, (1, 2))
    [(1, 4, 1), (1, 4, 2), (2, 2, 1), (2, 2, 2), (4, 1, 1), (4, 1, 2)]
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from fxforge.core.disk_cache import BUSY_LOAD, machine_load
from fxforge.core.throughput import Configuration, ThroughputTable
from fxforge.runtime.batching import Request, concatenated, split_outputs
from fxforge.runtime.streams import Streams

# Batch sizes tried (where batching is proven on the example).
BATCHES = (1, 2, 4, 8)
# Rounds over every configuration; seconds of timed slices in all, roughly.
ROUNDS = 3
SEARCH_BUDGET_S = 3.0
# A batch size is tried only where the one below it gained more than this over the one below that.
BATCH_GAIN = 0.10
# Calls per stream in a slice, at least.
MIN_CALLS = 2
# The share of available memory the batches served at once may take (streams x batch x a request's peak).
MEMORY_SHARE = 0.25


def configurations(cores: int, batches: tuple[int, ...] = BATCHES) -> list[tuple[int, int, int]]:
    """``(streams, threads, batch)`` to try on ``cores``: streams of 1, 2, 4... and ``cores``, threads the cores
    each stream gets (``streams x threads <= cores``), every batch size; the latency configuration first.

    Example:
        >>> configurations(6, (1,))
        [(1, 6, 1), (2, 3, 1), (4, 1, 1), (6, 1, 1)]
    """
    counts = sorted({2 ** k for k in range(int(math.log2(max(cores, 1))) + 1)} | {cores})
    return [(s, max(1, cores // s), b) for s in counts for b in batches]


def available_memory() -> int | None:
    """Bytes of memory available now (None where the system does not say).

    Example:
        >>> available_memory() is None or available_memory() > 0
        True
    """
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def largest_batch(request_bytes: int | None, streams: int, available: int | None) -> int | None:
    """The largest batch ``streams`` streams may serve at once within :data:`MEMORY_SHARE` of ``available``
    (None: no cap known).

    Example:
        >>> largest_batch(2**20, 2, 64 * 2**20)
        8
    """
    if not request_bytes or not available:
        return None
    return max(1, int(available * MEMORY_SHARE // (request_bytes * streams)))


def serve_call(call: Callable[..., Any], requests: list[Request]) -> tuple[list[Any], list[float]]:
    """Serve ``requests`` (of one signature) with one call: concatenated when more than one, outputs split
    back; returns each request's output and the call's start and end (``perf_counter``).

    Example:
        >>> outputs, (start, end) = serve_call(torch.nn.ReLU(), [((-torch.ones(1, 2),), {}), ((torch.ones(1, 2),), {})])
        >>> [o.tolist() for o in outputs], end >= start
        ([[[0.0, 0.0]], [[1.0, 1.0]]], True)
    """
    start = time.perf_counter()
    if len(requests) == 1:
        args, kwargs = requests[0]
        outputs = [call(*args, **kwargs)]
    else:
        args, kwargs, sizes = concatenated(requests)
        outputs = split_outputs(call(*args, **kwargs), sizes)
    return outputs, [start, time.perf_counter()]


def _slice(call: Callable[..., Any], streams: Streams, batch: list[Request], seconds: float,
           per_call_s: float) -> tuple[float, float, float, list[float]]:
    """One timed slice: enough calls to fill ``seconds`` on every stream; returns (requests served, wall s, CPU s,
    the calls' latencies in ms)."""
    for future in [streams.submit(serve_call, call, batch) for _ in range(streams.streams)]:
        future.result()  # untimed: wakes every stream's threads
    calls = max(MIN_CALLS * streams.streams, math.ceil(seconds / max(per_call_s, 1e-6)) * streams.streams)
    cpu = time.process_time()
    futures = [streams.submit(serve_call, call, batch) for _ in range(calls)]
    spans = [future.result()[1] for future in futures]
    cpu = time.process_time() - cpu
    wall = max(end for _, end in spans) - min(start for start, _ in spans)
    return calls * len(batch), wall, cpu, [(end - start) * 1e3 for start, end in spans]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class _Measured:
    """The samples gathered so far, per configuration, and the slices that gather them."""

    def __init__(self, call: Callable[..., Any], requests: list[Request], seconds: float, samples: int):
        self.call, self.requests, self.seconds, self.samples = call, requests, seconds, samples
        self.pools: dict[tuple[int, int], Streams] = {}
        self.rates: dict[tuple, list[float]] = {}
        self.cpu: dict[tuple, list[float]] = {}
        self.latencies: dict[tuple, list[float]] = {}
        self.per_call: dict[tuple, float] = {}

    def first_call(self, batch: int) -> float:
        """One call at ``batch`` in the caller's thread (which builds its plan); seconds."""
        _, (start, end) = serve_call(self.call, self.requests[:batch])
        return end - start

    def slice(self, config: tuple[int, int, int], first_s: float | None = None) -> None:
        streams, threads, batch = config
        pool = self.pools.get((streams, threads))
        if pool is None:
            pool = self.pools[(streams, threads)] = Streams(streams, threads)
        if first_s is not None:
            self.per_call[config] = first_s
        served, wall, cpu, ms = _slice(self.call, pool, self.requests[:batch], self.seconds, self.per_call[config])
        self.per_call[config] = statistics.median(ms) / 1e3
        self.rates.setdefault(config, []).append(served * self.samples / wall)
        self.cpu.setdefault(config, []).append(cpu / (wall * streams * threads))
        self.latencies.setdefault(config, []).extend(ms)

    def best_rate(self, configs: list[tuple]) -> float:
        return max((statistics.median(self.rates[c]) for c in configs), default=0.0)

    def row(self, config: tuple[int, int, int]) -> Configuration:
        ms = self.latencies[config]
        return Configuration(*config, statistics.median(self.rates[config]), _percentile(ms, 0.5),
                             _percentile(ms, 0.9), _percentile(ms, 0.99), min(1.0, statistics.median(self.cpu[config])))

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()


def search(call: Callable[..., Any], requests: list[Request], cores: int, *, batchable: bool,
           request_bytes: int | None = None, budget_s: float = SEARCH_BUDGET_S,
           samples_per_request: int = 1) -> ThroughputTable:
    """Measure every configuration serving ``requests`` (at least 8 of one signature) through ``call`` and choose
    the highest samples/s (see the module docstring).

    The first round goes up the batch sizes: each is tried (its plan built first, in the caller's threads) only
    where the one below gained more than :data:`BATCH_GAIN` over the one below it, so that a model that batching
    does not help costs no plan per batch size. The other rounds time every configuration tried, interleaved.

    Args:
        call: what serves a request (the optimized module), safe to call from many threads.
        requests: ``(args, kwargs)`` each, one signature.
        cores: the cores to use.
        batchable: batching was proven on the example (else only batch 1 is tried).
        request_bytes: a request's memory peak, which caps the batch (None: no cap).
        budget_s: seconds of timed slices, roughly.
        samples_per_request: samples in one request (its dim 0), for samples/s.

    Example:
        >>> reqs = [((torch.ones(1, 4),), {})] * 8
        >>> table = search(torch.nn.Linear(4, 4), reqs, 1, batchable=False, budget_s=0.05)
        >>> [(r.streams, r.threads, r.batch) for r in table.rows]
        [(1, 1, 1)]
    """
    notes: list[str] = []
    available = available_memory()
    every = configurations(cores, BATCHES if batchable else (1,))
    measured = _Measured(call, requests, budget_s / (ROUNDS * len(every)), samples_per_request)
    tried: list[tuple[int, int, int]] = []
    load = machine_load()
    try:
        previous: list[tuple] = []
        for batch in BATCHES if batchable else (1,):
            configs = [c for c in every if c[2] == batch]
            allowed = [c for c in configs if (largest_batch(request_bytes, c[0], available) or batch) >= batch]
            if len(allowed) < len(configs):
                notes.append(f"batch {batch} not tried with {', '.join(str(c[0]) for c in configs if c not in allowed)}"
                             f" streams: the batches served at once would take over {MEMORY_SHARE:.0%} of the "
                             "memory available")
            if not allowed:
                break
            first = measured.first_call(batch)
            for config in allowed:
                measured.slice(config, first_s=first)
            tried += allowed
            if previous and measured.best_rate(allowed) <= (1 + BATCH_GAIN) * measured.best_rate(previous):
                if batch < max(BATCHES):
                    notes.append(f"batches over {batch} not tried: batch {batch} gained {BATCH_GAIN:.0%} or less "
                                 f"over batch {previous[0][2]}")
                break
            previous = allowed
        began = time.perf_counter()
        for round_ in range(1, ROUNDS):
            if round_ > 1 and time.perf_counter() - began > budget_s:
                notes.append(f"the search's budget ({budget_s:g} s) was spent after {round_} of {ROUNDS} rounds")
                break
            for config in tried[round_ % len(tried):] + tried[:round_ % len(tried)]:
                measured.slice(config)
        load = max(load, machine_load())
    finally:
        measured.close()
    rows = [measured.row(c) for c in tried]
    chosen = max(range(len(rows)), key=lambda i: rows[i].samples_per_s)
    if load > BUSY_LOAD:
        notes.append(f"the machine was busy while measuring (load {load:.2f} per core): on a quiet machine the "
                     "choice may differ")
    return ThroughputTable(rows, chosen, notes=notes)
