"""``fxforge profile`` of a model that cannot be one graph: eager's time per module, from forward hooks.

Each leaf module (one without children, or a module whose forward ran no child) is timed from its forward
pre-hook to its forward hook, over ``repeat`` runs after ``warmup``; the table holds the median time per run,
the calls per run and the share of the whole forward. What runs outside any leaf (the model's own
arithmetic, the branch itself) is the row ``(outside modules)``.

Example:
    >>> table, total = module_times(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()),
    ...                             (torch.ones(2, 4),), warmup=0, repeat=2)
    >>> sorted(zip(table["module"], table["type"])), total > 0     # rows slowest first: timing decides
    ([('(outside modules)', ''), ('0', 'Linear'), ('1', 'ReLU')], True)
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import pandas as pd
import torch
from torch import nn


def module_times(model: nn.Module, inputs: tuple | dict, *, warmup: int = 2,
                 repeat: int = 5) -> tuple[pd.DataFrame, float]:
    """``(table, total_ms)``: per leaf module its median milliseconds per run, calls per run and share of
    the forward's median, slowest first, ``(outside modules)`` last; the forward's median milliseconds.

    Args:
        model: run as it is (its mode kept), under ``torch.no_grad()``.
        inputs: a tuple of positional inputs or a dict of keyword inputs.
        warmup, repeat: untimed runs, then timed runs (at least one).
    """
    leaves = {name: module for name, module in model.named_modules() if name and not any(module.children())}
    spent: dict[str, float] = {}
    calls: dict[str, int] = {}
    started: dict[str, list[float]] = {}

    def before(name: str):
        def hook(module: nn.Module, args: Any) -> None:
            started.setdefault(name, []).append(time.perf_counter())
        return hook

    def after(name: str):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - started[name].pop()
            calls[name] = calls.get(name, 0) + 1
        return hook

    handles = [h for name, m in leaves.items()
               for h in (m.register_forward_pre_hook(before(name)), m.register_forward_hook(after(name)))]
    per_run: list[dict[str, float]] = []
    totals: list[float] = []
    counts: dict[str, int] = {}
    try:
        with torch.no_grad():
            for run in range(warmup + max(1, repeat)):
                spent.clear()
                calls.clear()
                start = time.perf_counter()
                model(**inputs) if isinstance(inputs, dict) else model(*inputs)
                if run >= warmup:
                    totals.append((time.perf_counter() - start) * 1e3)
                    per_run.append({k: v * 1e3 for k, v in spent.items()})
                    counts = dict(calls)
    finally:
        for handle in handles:
            handle.remove()
    total = statistics.median(totals)
    rows = []
    for name in counts:
        ms = statistics.median(run.get(name, 0.0) for run in per_run)
        rows.append({"module": name, "type": type(leaves[name]).__name__, "calls": counts[name], "time_ms": ms,
                     "share": ms / total if total > 0 else 0.0})
    rows.sort(key=lambda row: -row["time_ms"])
    outside = max(0.0, total - sum(row["time_ms"] for row in rows))
    rows.append({"module": "(outside modules)", "type": "", "calls": 1, "time_ms": outside,
                 "share": outside / total if total > 0 else 0.0})
    return pd.DataFrame(rows, columns=["module", "type", "calls", "time_ms", "share"]), total
