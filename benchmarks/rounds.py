"""One model, every contender, timed in interleaved rounds: the measurement of the timed sections.

Per model (:func:`run_model`), in one process:

1. build the model (seeded, eval mode) and compute eager's outputs once, as the reference;
2. for each contender: ``prepare`` (on its own deep copy of the model) and make the first call; the time
   of both is "prepare s"; the first call's outputs give "max abs err" against the reference;
3. warm every contender up, then ``rounds`` rounds; in round ``r`` the contenders run in a rotated order
   (starting with the ``r``-th), each ``reps`` calls back to back, each call timed on its own
   (:func:`time_interleaved`);
4. median over all timed calls of a contender, and ``eager ms / contender ms`` (> 1 is faster);
5. with ``memory``: one more call per contender, apart from the timed ones, under
   :func:`benchmarks.memory.peak_memory`: its peak memory.

A contender that raises (while preparing, on its first call, or while being timed) becomes a failed row
with the error text; the run goes on. All calls run under ``torch.no_grad()``. The sections that run
this over the model suite, and their command line, are :mod:`benchmarks.timed`.

Example:
    >>> times, failures = time_interleaved({"a": lambda x: x + 1, "b": lambda x: x * 2}, (torch.ones(2),),
    ...                                    warmup=1, rounds=2, reps=3)
    >>> [len(r) for r in times["a"]], failures
    ([3, 3], {})
"""

from __future__ import annotations

import copy
import gc
import importlib
import math
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from benchmarks import contenders as contenders_mod
from benchmarks import memory as memory_mod
from benchmarks import report
from benchmarks import suite as suite_mod
from benchmarks.log import error_text, log

# --------------------------------------------------------------------------------------------------
# helpers


def short_traceback(exc: BaseException, lines: int = 30) -> str:
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return "\n".join(tb.rstrip().splitlines()[-lines:])


class OutputMismatch(Exception):
    """The contender's outputs do not line up with eager's (count or shapes)."""


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """The tensors of an output pytree (transformers' ModelOutput is a pytree), in pytree order."""
    return [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]


def max_abs_error(reference: Any, output: Any) -> float:
    """Largest ``|eager - contender|`` over all output tensors, compared position by position."""
    ref, out = tensor_leaves(reference), tensor_leaves(output)
    if len(ref) != len(out):
        raise OutputMismatch(f"{len(out)} output tensors, eager has {len(ref)}")
    worst = 0.0
    for i, (a, b) in enumerate(zip(ref, out)):
        if tuple(a.shape) != tuple(b.shape):
            raise OutputMismatch(f"output {i}: shape {tuple(b.shape)}, eager has {tuple(a.shape)}")
        if a.numel() == 0:
            continue
        a64 = a.detach().to("cpu", torch.float64)
        b64 = b.detach().to("cpu", torch.float64)
        diff = (a64 - b64).abs()
        # NaN where eager has NaN too counts as equal; any other NaN is an infinite error.
        both_nan = torch.isnan(a64) & torch.isnan(b64)
        diff = torch.where(both_nan, torch.zeros_like(diff), diff)
        value = float(diff.max()) if not torch.isnan(diff).any() else math.inf
        worst = max(worst, value)
    return worst


def to_device(tree: Any, device: torch.device) -> Any:
    return tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, tree)


def make_sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


# --------------------------------------------------------------------------------------------------
# timing


def time_interleaved(
    fns: dict[str, Callable[..., Any]],
    args: tuple,
    *,
    warmup: int,
    rounds: int,
    reps: int,
    sync: Callable[[], None] = lambda: None,
    copies: Callable[[tuple], tuple] | None = None,
) -> tuple[dict[str, list[list[float]]], dict[str, BaseException]]:
    """Time ``fns`` on ``args``: warm-up, then ``rounds`` rounds in a rotating order, ``reps`` calls each.
    ``copies``: each contender is called on its own ``copies(args)`` (made once), so that one that writes into
    its inputs does not change the others'.

    Returns:
        ``(times, failures)``: ``times[name][round]`` is the list of per-call milliseconds of that
        contender in that round; ``failures[name]`` the exception that stopped a contender (it is then
        left out of the remaining rounds).
    """
    names = list(fns)
    given = {n: copies(args) if copies is not None else args for n in names}
    times: dict[str, list[list[float]]] = {n: [] for n in names}
    failures: dict[str, BaseException] = {}
    with torch.no_grad():
        for name in names:
            try:
                for _ in range(warmup):
                    fns[name](*given[name])
                sync()
            except Exception as exc:  # noqa: BLE001 - any error fails this contender, not the run
                failures[name] = exc
        alive = [n for n in names if n not in failures]
        gc.collect()
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            for r in range(rounds):
                k = r % len(alive) if alive else 0
                for name in alive[k:] + alive[:k]:
                    if name in failures:
                        continue
                    fn, inputs = fns[name], given[name]
                    per_call: list[float] = []
                    try:
                        for _ in range(reps):
                            t0 = time.perf_counter_ns()
                            fn(*inputs)
                            sync()
                            per_call.append((time.perf_counter_ns() - t0) / 1e6)
                    except Exception as exc:  # noqa: BLE001 - any error fails this contender
                        failures[name] = exc
                        continue
                    times[name].append(per_call)
        finally:
            if gc_was_enabled:
                gc.enable()
    return times, failures


def measure_memory(
    fns: dict[str, Callable[..., Any]], args: tuple, device: torch.device
) -> tuple[dict[str, memory_mod.PeakMemory], dict[str, BaseException]]:
    """One call per contender, apart from the timed ones, with every allocation recorded: its peak memory.

    Returns ``(peaks, failures)`` by contender name; a contender that raises here only loses its memory
    figure.
    """
    peaks: dict[str, memory_mod.PeakMemory] = {}
    failures: dict[str, BaseException] = {}
    with torch.no_grad():
        for name, fn in fns.items():
            try:
                peaks[name] = memory_mod.peak_memory(fn, *args, device=device)
            except Exception as exc:  # noqa: BLE001 - a failed measurement loses one figure, not the row
                failures[name] = exc
    return peaks, failures


# --------------------------------------------------------------------------------------------------
# one model


def new_row(model: str, contender: str) -> dict[str, Any]:
    return {
        "model": model,
        "contender": contender,
        "status": "ok",
        "median_ms": None,
        "ratio_vs_eager": None,
        "prepare_s": None,
        "max_abs_err": None,
        "note": "",
        "error": None,
        "stage": None,
        "info": {},
    }


def fail(row: dict[str, Any], stage: str, exc: BaseException) -> None:
    row.update(status="failed", stage=stage, error=error_text(exc), traceback=short_traceback(exc))


def run_model(
    entry: suite_mod.SuiteEntry,
    selected: list[contenders_mod.Contender],
    *,
    warmup: int,
    rounds: int,
    reps: int,
    device: torch.device,
    memory: bool = False,
) -> list[dict[str, Any]]:
    """All rows of one model (one per contender, in ``selected`` order).

    With ``memory``, each contender that was timed without failing is then called once more under
    :func:`benchmarks.memory.peak_memory`: ``peak_bytes`` in its row (``info["memory_error"]`` if that
    call failed).
    """
    rows = {c.name: new_row(entry.name, c.name) for c in selected}
    sync = make_sync(device)

    t0 = time.perf_counter()
    try:
        model, args = suite_mod.build(entry)
        model = model.to(device)
        args = to_device(args, device)
        with torch.no_grad():
            reference = model(*args)
        sync()
    except Exception as exc:  # noqa: BLE001 - a model that does not build fails its rows, not the run
        log(f"[{entry.name}] build failed: {error_text(exc, 300)}")
        for row in rows.values():
            fail(row, "build", exc)
        return list(rows.values())
    log(f"[{entry.name}] built in {time.perf_counter() - t0:.1f} s")

    if any(c.name == "torch.compile" for c in selected):
        # A fresh compile cache per model (and no cache growth over the suite).
        importlib.import_module("torch._dynamo").reset()

    fns: dict[str, Callable[..., Any]] = {}
    for c in selected:
        row = rows[c.name]
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                target = copy.deepcopy(model) if c.copy_model else model
                prepared = contenders_mod.as_prepared(c.prepare(target, args))
                out = prepared.fn(*args)
                sync()
        except Exception as exc:  # noqa: BLE001 - any error fails this contender, not the run
            fail(row, "prepare", exc)
            log(f"[{entry.name}] {c.name}: failed to prepare: {error_text(exc, 300)}")
            continue
        row["prepare_s"] = time.perf_counter() - t0
        row["note"] = prepared.note
        row["info"] = dict(prepared.info)
        if prepared.describe is not None:  # after the prepare time: what it measures is not the contender's work
            try:
                row["info"].update(prepared.describe())
            except Exception as exc:  # noqa: BLE001 - a description is extra; the row stands without it
                log(f"[{entry.name}] {c.name}: could not describe: {error_text(exc, 200)}")
        try:
            row["max_abs_err"] = max_abs_error(reference, out)
        except OutputMismatch as exc:
            row["status"] = "mismatch"
            row["note"] = f"**output mismatch**: {exc}" + (f"; {row['note']}" if row["note"] else "")
        fns[c.name] = prepared.fn
        log(
            f"[{entry.name}] {c.name}: prepared in {row['prepare_s']:.2f} s, "
            f"max abs err {report.fmt_err(row['max_abs_err'])}"
        )
        del out

    times, failures = time_interleaved(fns, args, warmup=warmup, rounds=rounds, reps=reps, sync=sync)
    for name, exc in failures.items():
        fail(rows[name], "run", exc)
        log(f"[{entry.name}] {name}: failed while timed: {error_text(exc, 300)}")
    for name, per_round in times.items():
        row = rows[name]
        if name in failures or not per_round:
            continue
        flat = [t for rnd in per_round for t in rnd]
        q = statistics.quantiles(flat, n=4) if len(flat) >= 2 else [flat[0]] * 3
        row.update(
            median_ms=statistics.median(flat),
            min_ms=min(flat),
            iqr_ms=q[2] - q[0],
            n_calls=len(flat),
            round_medians_ms=[statistics.median(rnd) for rnd in per_round],
            times_ms=[round(t, 4) for t in flat],
        )
    if memory:
        alive = {n: fn for n, fn in fns.items() if n not in failures and times.get(n)}
        peaks, memory_failures = measure_memory(alive, args, device)
        for name, peak in peaks.items():
            rows[name].update(peak_bytes=peak.peak_bytes, allocated_bytes=peak.allocated_bytes,
                              allocations=peak.allocations)
        for name, exc in memory_failures.items():
            rows[name]["info"]["memory_error"] = error_text(exc)
            log(f"[{entry.name}] {name}: memory measurement failed: {error_text(exc, 300)}")
        if peaks:
            log(f"[{entry.name}] peak memory: " + ", ".join(
                f"{n} {p.peak_mib:.1f} MiB" for n, p in peaks.items()))
    eager_ms = rows["eager"]["median_ms"] if "eager" in rows else None
    for row in rows.values():
        if eager_ms and row["median_ms"]:
            row["ratio_vs_eager"] = eager_ms / row["median_ms"]
    summary = ", ".join(
        f"{n} {report.fmt_float(r['median_ms'], 3)} ms" if r["median_ms"] is not None else f"{n} failed"
        for n, r in rows.items()
    )
    log(f"[{entry.name}] {summary}")
    del fns, model, args, reference
    gc.collect()
    return list(rows.values())
