"""``python -m benchmarks --suite guard-overhead``: what the per-call guards of an optimized module cost (issue 18).

Every call of an optimized module first checks everything its plan assumed (the model's state epoch and
hooks, the call's signature, every module's training flag, grad mode and autocast, and the sources of
folded and prepacked weights: :meth:`fxforge.runtime.plans.PlanCache.checked_plan`), then runs the plan.
Per model at batch 1, in one process, interleaved (each round runs the three in a rotated order, ``reps``
calls each, every call timed on its own; medians over all rounds), under ``torch.no_grad()``:

- ``call``: ``opt(*inputs)``, what a user times;
- ``guards``: ``opt.cache.checked_plan(inputs, {})`` alone;
- ``plan``: the plan's executable alone, the call without guards.

The figure is ``guards / call`` (the target: at most 2 %); ``call / plan - 1`` is shown beside it, a
difference of two noisy medians (it also holds ``nn.Module.__call__``'s own cost). The block goes between
``<!-- harness:guards:begin -->`` and ``<!-- harness:guards:end -->`` of ``RESULTS.md``.

Example::

    python -m benchmarks --suite guard-overhead          # the conv and attention suites at batch 1
    python -m benchmarks --suite guard-overhead --models tiny_mlp --rounds 3 --reps 50 --no-markdown
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import fxforge
from benchmarks import report, suite
from benchmarks.section import Section, csv_list

# The suites' batch-1 models (the conv section's and the attention section's), then two tiny ones, whose
# latency is a few microseconds: there the guards are a visible share, shown for what they are.
DEFAULT_MODELS = ["densenet_b1", "inception_b1", "unet_b1", "hf_resnet50", "hf_mobilenet_v2_224", "bert_s512",
                  "bert_s1024", "llama_s2048", "hf_bert", "tiny_conv_bn", "tiny_mlp"]
TARGET = 0.02  # guards at most 2 % of a call
BLOCK = "guards"  # its block of RESULTS.md


def _timed(fn: Callable[[], Any], reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def measure(name: str, rounds: int, reps: int) -> dict[str, Any]:
    """The three medians (seconds) of one suite entry, and the guards' share of a call."""
    entry = next(e for e in suite.SUITE if e.name == name)
    model, args = suite.build(entry)
    args = args if isinstance(args, tuple) else (args,)
    opt = fxforge.optimize(model, args)
    with torch.no_grad():
        opt(*args)
        plan = opt.cache.checked_plan(args, {})
        if plan is None:
            return {"model": name, "error": "no plan: the model runs eagerly"}
        runs = {"call": lambda: opt(*args), "guards": lambda: opt.cache.checked_plan(args, {}),
                "plan": lambda: plan.executable(*args)}
        for fn in runs.values():  # warm-up
            _timed(fn, 2)
        times: dict[str, list[float]] = {key: [] for key in runs}
        order = list(runs)
        for r in range(rounds):
            for key in order[r % 3:] + order[:r % 3]:
                times[key] += _timed(runs[key], reps)
    medians = {key: statistics.median(values) for key, values in times.items()}
    return {"model": name, **medians, "share": medians["guards"] / medians["call"],
            "difference": medians["call"] / medians["plan"] - 1.0,
            "derived": len(plan.derived.values) if hasattr(plan.derived, "values") else None}


def markdown(rows: list[dict[str, Any]], command: str) -> str:
    """The block: a table (guards in microseconds, the share of a call) and the verdict."""
    lines = ["## Per-call guard cost (issue 18)", "",
             (f"`{command}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.processor() or 'CPU'}, "
             f"{os.cpu_count()} cores, {torch.get_num_threads()} threads, torch {torch.__version__}. "
             "Batch 1, `torch.no_grad()`, interleaved rounds, medians."), "",
             "| model | guards (µs) | guards / call | call / plan − 1 |", "|---|---:|---:|---:|"]
    suites = [r for r in rows if "error" not in r and not r["model"].startswith("tiny_")]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['model']} | failed: {row['error']} | | |")
            continue
        lines.append(f"| {row['model']} | {row['guards'] * 1e6:.1f} | {row['share'] * 100:.2f} % | "
                     f"{row['difference'] * 100:+.1f} % |")
    worst = max(suites, key=lambda r: r["share"]) if suites else None
    if worst is not None:
        met = "met" if worst["share"] <= TARGET else "**not met**"
        lines += ["", (f"- Target (guards ≤ {TARGET:.0%} of a call at batch 1, conv and attention suites): {met}; "
                      f"the largest share is {worst['share'] * 100:.2f} % ({worst['model']}).")]
    tiny = [r for r in rows if "error" not in r and r["model"].startswith("tiny_")]
    if tiny:
        lines.append("- The tiny models (" + ", ".join(r["model"] for r in tiny) + ") take microseconds per call: "
                     "there the guards are a fixed cost of " + ", ".join(f"{r['guards'] * 1e6:.0f} µs" for r in tiny)
                     + ", shown for what it is, not part of the target.")
    lines.append("- `call / plan − 1` is the difference of two noisy medians and also holds `nn.Module.__call__`'s "
                 "own cost; `guards / call` times the guards alone.")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``--suite guard-overhead``."""
    parser.add_argument("--models", type=csv_list, default=list(DEFAULT_MODELS), help="suite entries, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20)
    report.add_markdown_options(parser, BLOCK)


def run(args: argparse.Namespace) -> int:
    """Measure every model, print each row and the block; write the block unless ``--no-markdown``."""
    rows = []
    for name in args.models:
        row = measure(name, args.rounds, args.reps)
        print(row, flush=True)
        rows.append(row)
    block = markdown(rows, args.command)
    print(block)
    if not args.no_markdown:
        report.write_block(args.markdown, block, BLOCK)
    return 0


SECTION = Section("guard-overhead", "what the per-call guards of an optimized module cost against the call, per "
                  "model at batch 1 (issue 18; target at most 2 %)", add_arguments, run)
