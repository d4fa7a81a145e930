"""The harness: prepare every contender on every model, time them interleaved, write the results.

Per model, in one process and one run:

1. build the model (seeded, eval mode) and compute eager's outputs once, as the reference;
2. for each contender: ``prepare`` (on its own deep copy of the model) and make the first call; the time
   of both is "prepare s"; the first call's outputs give "max abs err" against the reference;
3. warm every contender up, then ``rounds`` rounds; in round ``r`` the contenders run in a rotated order
   (starting with the ``r``-th), each ``reps`` calls back to back, each call timed on its own;
4. median over all timed calls of a contender, and ``eager ms / contender ms`` (> 1 is faster);
5. with ``--memory`` (on by default for sections that ask for it, such as ``attention``): one more call
   per contender, apart from the timed ones, under :func:`benchmarks.memory.peak_memory`: its peak memory.

A contender that raises (while preparing, on its first call, or while being timed) becomes a failed row
with the error text; the run goes on. All calls run under ``torch.no_grad()``.

A section (``--suite NAME``, see :data:`SECTIONS`) runs the suite entries tagged ``NAME`` with its own
contenders, writes ``results-NAME.json`` and its own block of ``RESULTS.md``
(``<!-- harness:NAME:begin -->`` ... ``<!-- harness:NAME:end -->``), with summary lines under the table.

Example:
    python -m benchmarks --models hf_bert,resnet_cnn --contenders eager,ort,fxforge --rounds 5 --reps 10
    python -m benchmarks --suite conv
    python -m benchmarks --suite attention
    python -m benchmarks --suite dynamic    # a runner of its own, :mod:`benchmarks.dynamic` (RUNNER_SECTIONS)
    python -m benchmarks --suite training   # the same: :mod:`benchmarks.training`
    python -m benchmarks --suite pipeline   # the same: :mod:`benchmarks.pipeline`
"""

from __future__ import annotations

import argparse
import atexit
import copy
import gc
import importlib
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from benchmarks import contenders as contenders_mod
from benchmarks import memory as memory_mod
from benchmarks import (
    onnx_contenders,  # noqa: F401 - registers fxforge-ort and ort-transformers-optimizer
    optimize_time,
    report,
)
from benchmarks import suite as suite_mod

DEFAULT_CONTENDERS = ["eager", "torch.compile", "ort", "fxforge"]

DEFAULTS = {"rounds": 5, "reps": 10, "warmup": 3}
QUICK = {"rounds": 1, "reps": 3, "warmup": 1}
BUSY_LOAD = 0.25  # per core: above this, the run warns that other work will show up in the timings


@dataclass(frozen=True)
class Section:
    """A named part of the benchmarks with its own models, contenders and block of ``RESULTS.md``.

    Attributes:
        name: the ``--suite`` value; also the suite tag of its models and the name of its block markers.
        title: the heading of its block.
        contenders: its default contenders, in run order.
        summary: ``summary(rows) -> markdown lines`` written under its table (and into the JSON).
        memory: also measure each contender's peak memory (:mod:`benchmarks.memory`), in one call of its
            own after the timed rounds; the table gets a "peak MiB" column.
        cold_optimize: a model whose first-time ``fxforge.optimize`` is also timed in new processes after
            the run (:func:`benchmarks.optimize_time.cold_row`), when it and fxforge are in the run.
    """

    name: str
    title: str
    contenders: tuple[str, ...]
    summary: Callable[[list[dict[str, Any]]], list[str]] | None = None
    memory: bool = False
    cold_optimize: str | None = None


SECTIONS: dict[str, Section] = {
    "conv": Section(
        "conv",
        "Convolutional models, batch 1 and 8 (issue 3)",
        ("eager", "optimize_for_inference", "torch.compile", "fxforge"),
        report.conv_summary,
        cold_optimize="hf_resnet50",
    ),
    "attention": Section(
        "attention",
        "Attention: BERT encoder at S = 512 / 1024 / 2048, LLaMA decoder at S = 2048 (issue 4)",
        ("eager", "torch.compile", "fxforge", "fxforge-attention"),
        report.attention_summary,
        memory=True,
    ),
    "onnx": Section(
        "onnx",
        "ONNX Runtime: fxforge -> ORT against plain torch.onnx.export -> ORT and ORT's transformers optimizer (issue 6)",
        ("eager", "ort", "ort-transformers-optimizer", "fxforge-ort"),
        report.onnx_summary,
    ),
    "targets": Section(
        "targets",
        "target='auto' against the best peer: eager, torch.compile (default and freezing), plain export -> ORT "
        "(issue 21; torchvision/timm rows in the zoo environment)",
        ("eager", "torch.compile", "torch.compile-inference", "ort", "fxforge-inductor", "fxforge-auto"),
        report.targets_summary,
    ),
}


# Sections with a runner of their own (not the suite's entries timed in rounds): ``--suite NAME`` hands the
# other arguments to ``main(argv, prog=...)`` of the module, which writes its own block of ``RESULTS.md``.
RUNNER_SECTIONS: dict[str, tuple[str, str]] = {
    "dynamic": ("benchmarks.dynamic", ("a 200-request trace of changing batch and sequence length on BERT, "
                "GPT-2 and LLaMA, every call timed, first-time work included (issue 19; --calls, --models, "
                "--contenders: see python -m benchmarks.dynamic --help)")),
    "training": ("benchmarks.training", ("a training step's memory: fxforge's prediction against a measured step, "
                 "then fxforge's checkpointing under budgets against per-block checkpointing and Inductor's "
                 "activation memory budget, whole-step peak and step time, on GPT-2, BERT, LLaMA, ResNet-50 and "
                 "ViT-S (issue 22; --models, --fractions, --quick: see python -m benchmarks.training --help)")),
    "pipeline": ("benchmarks.pipeline", ("pipeline stages of GPT-2, LLaMA, ResNet-50 and ViT-S at 2/4/8 stages: "
                 "fxforge's split against the even-by-layer and parameter-size splits (bottleneck ratio, simulated "
                 "1F1B/GPipe throughput), and 2 stages measured on gloo (issue 23; see python -m benchmarks.pipeline "
                 "--help)")),
}


def runner_section(argv: list[str]) -> tuple[str, list[str]] | None:
    """``(name, the other arguments)`` when ``argv`` asks for ``--suite NAME`` of :data:`RUNNER_SECTIONS`."""
    for i, arg in enumerate(argv):
        if arg == "--suite" and i + 1 < len(argv):
            name, rest = argv[i + 1], argv[:i] + argv[i + 2:]
        elif arg.startswith("--suite="):
            name, rest = arg.partition("=")[2], argv[:i] + argv[i + 1:]
        else:
            continue
        return (name, rest) if name in RUNNER_SECTIONS else None
    return None


# --------------------------------------------------------------------------------------------------
# helpers


def error_text(exc: BaseException, limit: int = 2000) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= limit else text[: limit - 1] + "…"


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


def git_commit() -> str | None:
    """``git describe``-like short commit of the repository (read-only), or None."""
    root = report.REPO_ROOT
    try:
        sha = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{sha}{' (dirty)' if dirty else ''}" if sha else None


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


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
) -> tuple[dict[str, list[list[float]]], dict[str, BaseException]]:
    """Time ``fns`` on ``args``: warm-up, then ``rounds`` rounds in a rotating order, ``reps`` calls each.

    Returns:
        ``(times, failures)``: ``times[name][round]`` is the list of per-call milliseconds of that
        contender in that round; ``failures[name]`` the exception that stopped a contender (it is then
        left out of the remaining rounds).
    """
    names = list(fns)
    times: dict[str, list[list[float]]] = {n: [] for n in names}
    failures: dict[str, BaseException] = {}
    with torch.no_grad():
        for name in names:
            try:
                for _ in range(warmup):
                    fns[name](*args)
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
                    fn = fns[name]
                    per_call: list[float] = []
                    try:
                        for _ in range(reps):
                            t0 = time.perf_counter_ns()
                            fn(*args)
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


# --------------------------------------------------------------------------------------------------
# CLI


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Compare eager, torch.compile, ONNX Runtime and fxforge on the model suite, "
        "interleaved, in one run.",
    )
    p.add_argument("--suite", choices=[*SECTIONS, *RUNNER_SECTIONS], default=None,
                   help="run a section: its tagged models, its contenders, its own block of the markdown "
                   "file and results-SUITE.json (" + "; ".join(
                       f"{s.name}: {s.title}, contenders {','.join(s.contenders)}" for s in SECTIONS.values()
                   ) + "; " + "; ".join(f"{n}: {what}" for n, (_, what) in RUNNER_SECTIONS.items()) + ")")
    p.add_argument("--models", type=_csv, default=None, help="comma-separated suite entries (default: all "
                   "default entries, or the section's with --suite; see --list)")
    p.add_argument("--contenders", type=_csv, default=None,
                   help=f"comma-separated contenders (default: {','.join(DEFAULT_CONTENDERS)}, or the "
                   "section's with --suite); eager is always added, the ratios are against it")
    p.add_argument("--rounds", type=int, default=None, help=f"timed rounds (default {DEFAULTS['rounds']})")
    p.add_argument("--reps", type=int, default=None,
                   help=f"calls per contender per round (default {DEFAULTS['reps']})")
    p.add_argument("--warmup", type=int, default=None,
                   help=f"warm-up calls per contender (default {DEFAULTS['warmup']})")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads and ORT intra-op threads "
                   "(default 2)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where models run (default cpu)")
    p.add_argument("--out", default=report.DEFAULT_OUT, help="directory for results.json (results-SUITE.json with "
                   "--suite; default benchmarks/out/)")
    p.add_argument("--markdown", default=report.DEFAULT_MARKDOWN,
                   help="markdown file whose harness block (or the section's) is replaced (default "
                   "benchmarks/RESULTS.md)")
    p.add_argument("--no-markdown", action="store_true", help="do not write the markdown file")
    p.add_argument("--memory", action=argparse.BooleanOptionalAction, default=None,
                   help="measure each contender's peak memory in one extra call after the timed ones "
                   "(default: on for sections that ask for it, such as attention; off otherwise)")
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK['rounds']} round, {QUICK['reps']} reps, {QUICK['warmup']} warm-up (smoke runs)")
    p.add_argument("--list", action="store_true", help="list the suite and the contenders, then exit")
    return p


def _list(suite: list[suite_mod.SuiteEntry] | None = None, out=sys.stdout) -> None:
    print("models:", file=out)
    for e in suite_mod.SUITE if suite is None else suite:
        suites = f" or with --suite {', '.join(e.tags)}" if e.tags else ""
        flag = "" if e.default else f"  (only when named{suites})"
        print(f"  {e.name:22s} [{e.group}] {e.description}{flag}", file=out)
    print("contenders:", file=out)
    for c in contenders_mod.CONTENDERS.values():
        print(f"  {c.name:22s} {c.description}", file=out)


def main(argv: list[str] | None = None, *, suite: list[suite_mod.SuiteEntry] | None = None) -> int:
    """Run the harness; returns the exit status (0 done, 2 usage).

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).
        suite: the entries to choose from (default :data:`benchmarks.suite.SUITE`); tests pass their own.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    runner = runner_section(argv)
    if runner is not None:
        name, rest = runner
        module = importlib.import_module(RUNNER_SECTIONS[name][0])
        return module.main(rest, prog=f"python -m benchmarks --suite {name}")
    parser = build_parser()
    opts = parser.parse_args(argv)
    if opts.list:
        _list(suite)
        return 0

    timing = dict(QUICK if opts.quick else DEFAULTS)
    for key in timing:
        if getattr(opts, key) is not None:
            timing[key] = getattr(opts, key)
    if timing["rounds"] < 1 or timing["reps"] < 1 or timing["warmup"] < 0:
        parser.error("--rounds and --reps must be >= 1, --warmup >= 0")
    if opts.threads < 1:
        parser.error("--threads must be >= 1")
    # fxforge's "prepare s" is a cold optimize: autotune times everything afresh, as on a first use
    # (its on-disk cache would otherwise replay an earlier run's measurements).
    os.environ["FXFORGE_CACHE_DIR"] = cache_dir = tempfile.mkdtemp(prefix="fxforge-bench-autotune-")
    atexit.register(shutil.rmtree, cache_dir, True)

    section = SECTIONS[opts.suite] if opts.suite else None
    try:
        entries = suite_mod.select(opts.models, suite, tag=section.name if section else None)
    except KeyError as exc:
        parser.error(str(exc.args[0]))
    if not entries:
        parser.error(f"no suite entry is tagged {opts.suite!r}" if section else "no default suite entry")
    names = opts.contenders or list(section.contenders if section else DEFAULT_CONTENDERS)
    unknown = [n for n in names if n not in contenders_mod.CONTENDERS]
    if unknown:
        parser.error(f"unknown contender(s) {', '.join(unknown)}; known: "
                     f"{', '.join(contenders_mod.CONTENDERS)}")
    if "eager" not in names:
        log("adding eager: the ratios are against it")
        names = ["eager", *names]
    names = list(dict.fromkeys(names))
    selected = [contenders_mod.CONTENDERS[n] for n in names]

    if opts.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    device = torch.device(opts.device)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(opts.threads)
    try:
        return _run(opts, argv, entries, selected, timing, device, section)
    finally:  # main() is also called in-process (tests): leave torch's thread count as it was
        torch.set_num_threads(threads_before)


def _run(
    opts: argparse.Namespace,
    argv: list[str],
    entries: list[suite_mod.SuiteEntry],
    selected: list[contenders_mod.Contender],
    timing: dict[str, int],
    device: torch.device,
    section: Section | None = None,
) -> int:
    """The run proper, with the options checked and torch's threads set: every model, then the files."""
    result: dict[str, Any] = {
        "meta": {
            "suite": section.name if section else None,
            "title": section.title if section else None,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python -m benchmarks" + (f" {shlex.join(argv)}" if argv else ""),
            "commit": git_commit(),
            "machine": report.machine_info(torch.get_num_threads()),
            "device": str(device),
            "timing": timing,
            "models": [e.name for e in entries],
            "contenders": {c.name: c.description for c in selected},
            "complete": False,
        },
        "rows": [],
    }
    json_path = os.path.join(opts.out, f"results-{section.name}.json" if section else "results.json")
    load = result["meta"]["machine"].get("loadavg_start")
    if load and load[0] >= BUSY_LOAD * (os.cpu_count() or 1):
        log(f"warning: load average {load[0]:.2f} on {os.cpu_count()} cores: other processes are running, "
            "timings will be noisy")
    log(f"benchmarks: {len(entries)} model(s) × {len(selected)} contender(s), "
        f"{timing['rounds']} round(s) × {timing['reps']} rep(s), {torch.get_num_threads()} thread(s)")
    memory = opts.memory if opts.memory is not None else bool(section and section.memory)
    result["meta"]["memory"] = memory
    for entry in entries:
        result["rows"].extend(run_model(entry, selected, device=device, memory=memory, **timing))
        report.write_json(json_path, result)  # partial results survive a crash or ^C
    cold = section.cold_optimize if section else None
    if cold in {e.name for e in entries} and any(c.name == "fxforge" for c in selected):
        log(f"[{cold}] timing fxforge's first-time optimize in new processes")
        result["rows"].append(optimize_time.cold_row(cold, threads=torch.get_num_threads()))
    result["meta"]["complete"] = True
    result["meta"]["loadavg_end"] = report.load_average()
    if section and section.summary:
        result["summary"] = section.summary(result["rows"])
    report.write_json(json_path, result)
    log(f"wrote {json_path}")
    if not opts.no_markdown:
        report.write_markdown(opts.markdown, result, section.name if section else None)
        log(f"wrote {opts.markdown}")
    print(report.markdown_table(result["rows"], report.table_columns(result["rows"], memory)))
    for line in result.get("summary", []):
        print(line)
    return 0
