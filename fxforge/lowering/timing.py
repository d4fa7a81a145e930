"""Timing calls against each other: interleaved rounds, medians, and early stops when the winner is clear;
the on-disk cache the timings are remembered in.

Example:
    >>> sorted(time_interleaved({"a": lambda: None, "b": lambda: None}, 0.001))
    ['a', 'b']
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from fxforge.core.disk_cache import TuningCache, open_cache

# Repetitions at least / at most.
MIN_REPS, MAX_REPS = 3, 25
# Seconds of timing spent per measurement of one fused op's kernels, at most (autotune's, and per shape bucket).
NODE_BUDGET_S = 0.004
# Timing stops early when every sample of one call beats every sample of the other by this.
DECISIVE = 0.05
# A fused op's kernels, each warmed up before its first sample, are not timed again when their first samples
# differ by more than this (about half of ResNet-50's convolutions; a wrong pick here costs that op little,
# and the whole graph is still timed against the graph before).
DECISIVE_FIRST = 0.25
# What the report adds to a choice read back from the cache instead of timed.
NOTE = "measured earlier on this machine (autotune cache)"


def time_interleaved(calls: dict[str, Callable[[], Any]], budget_s: float, *, warmed: tuple[str, ...] = (),
                     decisive: float | None = None, decisive_first: float | None = None,
                     limit_s: float | None = None) -> dict[str, float]:
    """Median milliseconds per call of each callable, calls interleaved, after one warm-up each.

    Args:
        calls: name -> callable to time.
        budget_s: seconds to spend in total, roughly (at least ``MIN_REPS`` rounds, at most ``MAX_REPS``).
        warmed: names already run once (their warm-up is skipped).
        decisive: with two calls, stop after two rounds when every sample of one is below every sample of
            the other by this fraction (more rounds would not change the choice).
        decisive_first: with two calls, stop after the first round already when its two samples differ by
            this fraction (for calls whose warm-up ran: a cold first sample must not decide).
        limit_s: no round starts once this many seconds went by since the first call (warm-ups included), so
            a caller that times inside a user's call is not held up by large inputs (at least one round runs).

    Example:
        >>> sorted(time_interleaved({"a": lambda: None, "b": lambda: None}, 0.001))
        ['a', 'b']
    """
    began = time.perf_counter()
    samples: dict[str, list[float]] = {}
    for name, call in calls.items():
        if name not in warmed:
            call()  # warm-up: packing, allocator, caches
        start = time.perf_counter()
        call()
        samples[name] = [time.perf_counter() - start]
    total = sum(s[0] for s in samples.values()) or 1e-6
    if decisive_first is not None and len(samples) == 2 and _separated(*samples.values(), decisive_first):
        return _medians_ms(samples)
    reps = max(MIN_REPS, min(MAX_REPS, int(budget_s / total)))
    for rep in range(1, reps):
        if limit_s is not None and time.perf_counter() - began > limit_s:
            break
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            samples[name].append(time.perf_counter() - start)
        if decisive is not None and rep >= 1 and len(samples) == 2 and _separated(*samples.values(), decisive):
            break
    return _medians_ms(samples)


def time_in_blocks(calls: dict[str, Callable[[], Any]], rounds: int | None = None, reps: int = 3, *,
                   budget_s: float = 1.0, min_rounds: int = MIN_REPS, max_rounds: int = 10,
                   discard_first: bool = True, samples: dict[str, list[float]] | None = None) -> dict[str, float]:
    """Median milliseconds per call of each callable, timed in blocks: every round runs each callable ``reps``
    times back to back (the order rotated from round to round), each call timed on its own.

    Where :func:`time_interleaved` alternates single calls (right for kernels, which share one thread pool),
    blocks measure what a caller of one runtime sees: the runtime that runs after another pays for the
    switch (PyTorch's OpenMP threads still spinning, caches holding the other's weights) on its first call
    only, and with ``discard_first`` that call of each block is run but not timed.

    Args:
        calls: name -> callable to time.
        rounds: rounds to run; None: as many as fit in ``budget_s`` (judged from the warm-up calls), between
            ``min_rounds`` and ``max_rounds``.
        reps: timed calls per callable per round.
        discard_first: run one untimed call at the start of each block.
        samples: filled with every call's samples in milliseconds, when given.

    Example:
        >>> sorted(time_in_blocks({"a": lambda: None, "b": lambda: None}, rounds=2, reps=1))
        ['a', 'b']
    """
    samples = {} if samples is None else samples
    samples.clear()
    names = list(calls)
    start = time.perf_counter()
    for call in calls.values():
        call()  # warm-up: packing, allocator, caches
    per_round = (time.perf_counter() - start) * (reps + discard_first)
    if rounds is None:
        rounds = max(min_rounds, min(max_rounds, int(budget_s / max(per_round, 1e-6))))
    for name in names:
        samples[name] = []
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            call = calls[name]
            if discard_first:
                call()
            for _ in range(reps):
                begin = time.perf_counter()
                call()
                samples[name].append(time.perf_counter() - begin)
    return _medians_ms(samples)


def _medians_ms(samples: dict[str, list[float]]) -> dict[str, float]:
    """Medians in milliseconds; the samples themselves turned into milliseconds in place."""
    for values in samples.values():
        values[:] = [v * 1e3 for v in values]
    return {name: statistics.median(values) for name, values in samples.items()}


def _separated(a: list[float], b: list[float], fraction: float) -> bool:
    return max(a) < min(b) * (1 - fraction) or max(b) < min(a) * (1 - fraction)


def autotune_cache() -> TuningCache | None:
    """The on-disk cache of autotune's timings (``$FXFORGE_CACHE_DIR/autotune.json``); None when
    ``FXFORGE_AUTOTUNE_CACHE=0``.

    Example:
        >>> cache = autotune_cache()
        >>> cache is None or cache.path.name == "autotune.json"
        True
    """
    return None if os.environ.get("FXFORGE_AUTOTUNE_CACHE", "1") == "0" else open_cache("autotune.json")
