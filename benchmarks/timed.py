"""The timed sections: the model suite's entries, every contender, interleaved rounds, one table each.

``python -m benchmarks`` (the ``default`` section) builds the default entries of the suite
(:mod:`benchmarks.suite`), prepares every contender (:mod:`benchmarks.contenders`) on each, times them in
one run (:func:`benchmarks.rounds.run_model`) and writes ``benchmarks/out/results.json`` and the harness
block of ``benchmarks/RESULTS.md`` (:mod:`benchmarks.report`). The other timed sections (:data:`TIMED`)
run the entries tagged with their name, with their own contenders: ``results-NAME.json`` and their own
block (``<!-- harness:NAME:begin -->`` ... ``<!-- harness:NAME:end -->``), with summary lines under the
table.

Example::

    python -m benchmarks --models hf_bert,resnet_cnn --contenders eager,ort,fxforge --rounds 5 --reps 10
    python -m benchmarks --suite conv
    python -m benchmarks --suite attention --quick --no-markdown
    python -m benchmarks --suite onnx --list-models
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import torch

from benchmarks import contenders as contenders_mod
from benchmarks import (
    onnx_contenders,  # noqa: F401 - registers fxforge-ort and ort-transformers-optimizer
    optimize_time,
    report,
)
from benchmarks import suite as suite_mod
from benchmarks.log import log
from benchmarks.rounds import run_model
from benchmarks.section import Section, UsageError, csv_list

DEFAULT_CONTENDERS = ("eager", "torch.compile", "ort", "fxforge")

DEFAULTS = {"rounds": 5, "reps": 10, "warmup": 3}
QUICK = {"rounds": 1, "reps": 3, "warmup": 1}
BUSY_LOAD = 0.25  # per core: above this, the run warns that other work will show up in the timings


@dataclass(frozen=True)
class Timed:
    """A timed section: which entries, which contenders, which block of ``RESULTS.md``.

    Attributes:
        name: the ``--suite`` value; the suite tag of its models and the name of its block markers
            (``default``: the default entries, ``results.json`` and the main harness block).
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

    @property
    def block(self) -> str | None:
        """Its block of ``RESULTS.md`` (None: the main harness block)."""
        return None if self.name == "default" else self.name

    @property
    def tag(self) -> str | None:
        """The suite tag of its entries (None: the default entries)."""
        return self.block


TIMED: dict[str, Timed] = {
    "default": Timed(
        "default",
        "",  # the main block's heading is report.markdown_block's default
        DEFAULT_CONTENDERS,
    ),
    "conv": Timed(
        "conv",
        "Convolutional models, batch 1 and 8 (issue 3)",
        ("eager", "optimize_for_inference", "torch.compile", "fxforge"),
        report.conv_summary,
        cold_optimize="hf_resnet50",
    ),
    "attention": Timed(
        "attention",
        "Attention: BERT encoder at S = 512 / 1024 / 2048, LLaMA decoder at S = 2048 (issue 4)",
        ("eager", "torch.compile", "fxforge", "fxforge-attention"),
        report.attention_summary,
        memory=True,
    ),
    "onnx": Timed(
        "onnx",
        "ONNX Runtime: fxforge -> ORT against plain torch.onnx.export -> ORT and ORT's transformers optimizer (issue 6)",
        ("eager", "ort", "ort-transformers-optimizer", "fxforge-ort"),
        report.onnx_summary,
    ),
    "targets": Timed(
        "targets",
        "target='auto' against the best peer: eager, torch.compile (default and freezing), plain export -> ORT "
        "(issue 21; torchvision/timm rows in the zoo environment)",
        ("eager", "torch.compile", "torch.compile-inference", "ort", "fxforge-inductor", "fxforge-auto"),
        report.targets_summary,
    ),
}


def add_arguments(parser: argparse.ArgumentParser, timed: Timed) -> None:
    """The options of a timed section (the same for every one; the defaults are the section's)."""
    p = parser
    p.add_argument("--models", type=csv_list, default=None, help="comma-separated suite entries (default: the "
                   "section's; see --list-models)")
    p.add_argument("--contenders", type=csv_list, default=None,
                   help=f"comma-separated contenders (default: {','.join(timed.contenders)}); eager is always "
                   "added, the ratios are against it")
    p.add_argument("--rounds", type=int, default=None, help=f"timed rounds (default {DEFAULTS['rounds']})")
    p.add_argument("--reps", type=int, default=None,
                   help=f"calls per contender per round (default {DEFAULTS['reps']})")
    p.add_argument("--warmup", type=int, default=None,
                   help=f"warm-up calls per contender (default {DEFAULTS['warmup']})")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads and ORT intra-op threads "
                   "(default 2)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where models run (default cpu)")
    p.add_argument("--out", default=report.DEFAULT_OUT, help=f"directory for {json_name(timed)} (default "
                   "benchmarks/out/)")
    p.add_argument("--markdown", default=report.DEFAULT_MARKDOWN,
                   help="markdown file whose block of this section is replaced (default benchmarks/RESULTS.md)")
    p.add_argument("--no-markdown", action="store_true", help="do not write the markdown file")
    p.add_argument("--memory", action=argparse.BooleanOptionalAction, default=None,
                   help="measure each contender's peak memory in one extra call after the timed ones "
                   f"(default {'on' if timed.memory else 'off'} for this section)")
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK['rounds']} round, {QUICK['reps']} reps, {QUICK['warmup']} warm-up (smoke runs)")
    p.add_argument("--list-models", action="store_true",
                   help="list the suite's entries and the contenders, then exit")


def json_name(timed: Timed) -> str:
    return f"results-{timed.block}.json" if timed.block else "results.json"


def list_models(out=None) -> None:
    """The suite's entries (with the sections they belong to) and the contenders."""
    out = sys.stdout if out is None else out
    print("models:", file=out)
    for e in suite_mod.SUITE:
        suites = f" or with --suite {', '.join(e.tags)}" if e.tags else ""
        flag = "" if e.default else f"  (only when named{suites})"
        print(f"  {e.name:22s} [{e.group}] {e.description}{flag}", file=out)
    print("contenders:", file=out)
    for c in contenders_mod.CONTENDERS.values():
        print(f"  {c.name:22s} {c.description}", file=out)


def run(args: argparse.Namespace, timed: Timed) -> int:
    """Run ``timed`` with the parsed options; returns the exit status."""
    if args.list_models:
        list_models()
        return 0
    timing = dict(QUICK if args.quick else DEFAULTS)
    for key in timing:
        if getattr(args, key) is not None:
            timing[key] = getattr(args, key)
    if timing["rounds"] < 1 or timing["reps"] < 1 or timing["warmup"] < 0:
        raise UsageError("--rounds and --reps must be >= 1, --warmup >= 0")
    if args.threads < 1:
        raise UsageError("--threads must be >= 1")
    try:
        entries = suite_mod.select(args.models, tag=timed.tag)
    except KeyError as exc:
        raise UsageError(str(exc.args[0])) from None
    if not entries:
        raise UsageError(f"no suite entry is tagged {timed.tag!r}" if timed.tag else "no default suite entry")
    names = args.contenders or list(timed.contenders)
    unknown = [n for n in names if n not in contenders_mod.CONTENDERS]
    if unknown:
        raise UsageError(f"unknown contender(s) {', '.join(unknown)}; known: {', '.join(contenders_mod.CONTENDERS)}")
    if "eager" not in names:
        log("adding eager: the ratios are against it")
        names = ["eager", *names]
    selected = [contenders_mod.CONTENDERS[n] for n in dict.fromkeys(names)]
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device")
    # fxforge's "prepare s" is a cold optimize: autotune times everything afresh, as on a first use
    # (its on-disk cache would otherwise replay an earlier run's measurements).
    os.environ["FXFORGE_CACHE_DIR"] = cache_dir = tempfile.mkdtemp(prefix="fxforge-bench-autotune-")
    atexit.register(shutil.rmtree, cache_dir, True)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args, timed, entries, selected, timing, torch.device(args.device))
    finally:  # also called in-process (tests): leave torch's thread count as it was
        torch.set_num_threads(threads_before)


def _run(
    args: argparse.Namespace,
    timed: Timed,
    entries: list[suite_mod.SuiteEntry],
    selected: list[contenders_mod.Contender],
    timing: dict[str, int],
    device: torch.device,
) -> int:
    """The run proper, with the options checked and torch's threads set: every model, then the files."""
    result: dict[str, Any] = {
        "meta": {
            "suite": timed.block,
            "title": timed.title or None,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": args.command,
            "commit": report.git_commit(),
            "machine": report.machine_info(torch.get_num_threads()),
            "device": str(device),
            "timing": timing,
            "models": [e.name for e in entries],
            "contenders": {c.name: c.description for c in selected},
            "complete": False,
        },
        "rows": [],
    }
    json_path = os.path.join(args.out, json_name(timed))
    load = result["meta"]["machine"].get("loadavg_start")
    if load and load[0] >= BUSY_LOAD * (os.cpu_count() or 1):
        log(f"warning: load average {load[0]:.2f} on {os.cpu_count()} cores: other processes are running, "
            "timings will be noisy")
    log(f"benchmarks: {len(entries)} model(s) × {len(selected)} contender(s), "
        f"{timing['rounds']} round(s) × {timing['reps']} rep(s), {torch.get_num_threads()} thread(s)")
    memory = args.memory if args.memory is not None else timed.memory
    result["meta"]["memory"] = memory
    for entry in entries:
        result["rows"].extend(run_model(entry, selected, device=device, memory=memory, **timing))
        report.write_json(json_path, result)  # partial results survive a crash or ^C
    cold = timed.cold_optimize
    if cold in {e.name for e in entries} and any(c.name == "fxforge" for c in selected):
        log(f"[{cold}] timing fxforge's first-time optimize in new processes")
        result["rows"].append(optimize_time.cold_row(cold, threads=torch.get_num_threads()))
    result["meta"]["complete"] = True
    result["meta"]["loadavg_end"] = report.load_average()
    if timed.summary:
        result["summary"] = timed.summary(result["rows"])
    report.write_json(json_path, result)
    log(f"wrote {json_path}")
    if not args.no_markdown:
        report.write_markdown(args.markdown, result, timed.block)
        log(f"wrote {args.markdown}")
    print(report.markdown_table(result["rows"], report.table_columns(result["rows"], memory)))
    for line in result.get("summary", []):
        print(line)
    return 0


def section(name: str) -> Section:
    """The :class:`~benchmarks.section.Section` of the timed section ``name``; it reads :data:`TIMED` when it
    runs (so a test may swap a section's contenders)."""
    timed = TIMED[name]
    what = ("the default suite entries against " if name == "default" else f"{timed.title}: ") + ", ".join(
        timed.contenders)
    return Section(name, what, lambda parser: add_arguments(parser, TIMED[name]),
                   lambda args: run(args, TIMED[name]))


SECTIONS = [section(name) for name in TIMED]
