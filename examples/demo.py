"""`make demo`: optimize a bundled example model with fxforge and print a short summary of what it did.

Run: python examples/demo.py [inception|resnet_cnn|densenet|unet|transformer_encoder]

The summary groups the report's entries: one line per rewrite, change and source line, with how many times
it applied (``conv_bn_fold x20 ... inception_block.py:32``); ``print(opt.report)`` has every entry.
"""

from __future__ import annotations

import re
import sys
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fxforge
from examples.models import EXAMPLES
from fxforge.cli.summary import compare_latency
from fxforge.core.disk_cache import BUSY_LOAD, machine_load
from fxforge.core.verify import compare_outputs

REPS = 30
NUMBER = re.compile(r"\b\d+(\.\d+)?\b")
PARENTHESES = re.compile(r"\s+\([^)]*\)")


def _where(source: str | None) -> str:
    """``file.py:LINE`` of a report entry's source line (``path/to/file.py:LINE: code``)."""
    if not source:
        return "(no source line)"
    location = source.split(": ", 1)[0]
    return Path(location).name


def _label(text: str) -> str:
    """A report entry's change without its figures: before any colon, no parenthesized aside, numbers as N."""
    return NUMBER.sub("N", PARENTHESES.sub("", text.split(":")[0])).strip()


def grouped(entries, label) -> list[tuple[int, str, str, str]]:
    """Report entries collapsed by rule, change (numbers left out) and source line: (count, rule, what, where),
    most frequent first.

    Example:
        >>> from fxforge.core.report import Applied
        >>> a = [Applied("fold", f"conv {i} folded", [f"c{i}"], "m.py:3: y = f(x)") for i in range(3)]
        >>> grouped(a, lambda e: e.what)
        [(3, 'fold', 'conv N folded', 'm.py:3')]
    """
    counts = Counter((e.rule, _label(label(e)), _where(e.source)) for e in entries)
    return [(n, rule, what, where) for (rule, what, where), n in counts.most_common()]


def summary_lines(name: str, model: torch.nn.Module, inputs: tuple, optimized, seconds: float) -> list[str]:
    """The demo's summary of ``optimized.report``, one string a line."""
    report = optimized.report
    shapes = ", ".join("x".join(map(str, t.shape)) for t in inputs)
    lines = [(f"fxforge demo: {name}, {type(model).__name__} ({sum(p.numel() for p in model.parameters()):,} "
             f"parameters) on {shapes}"),
             (f"optimized in {seconds:.1f} s: captured with {report.method}, {report.nodes_before} -> "
             f"{report.nodes_after} nodes"), "", "rewrites applied (times, change, your source line):"]
    applied = grouped(report.matches, lambda e: e.what)
    for count, rule, what, where in applied[:8]:
        lines.append(f"  {rule:16} x{count:<3} {what[:44]:44} {where}")
    if len(applied) > 8:
        lines.append(f"  ... {len(applied) - 8} more kinds of change (print(opt.report) lists them)")
    refused = grouped(report.near_misses, lambda e: e.reason)
    lines.append(f"refused: {len(report.near_misses) or 'none'}" + "".join(
        f"; {rule} x{n} at {where}: {why[:50]}" for n, rule, why, where in refused[:2]))
    if report.rolled_back:
        lines.append(f"rolled back (changed results): {', '.join(r.rule for r in report.rolled_back)}")
    kernels = Counter(t.choice for t in report.tuning if t.kind == "autotune" and t.subject not in ("layout", "graph"))
    chosen = {t.subject: t.choice for t in report.tuning if t.kind == "autotune" and t.subject in ("layout", "graph")}
    if kernels or chosen:
        parts = [", ".join(f"{k} x{n}" for k, n in kernels.most_common())] if kernels else []
        parts += [f"{subject} {choice}" for subject, choice in chosen.items()]
        lines.append(f"chosen by timing: {'; '.join(parts)}")
    return lines


def main(name: str = "inception") -> None:
    if name not in EXAMPLES:
        raise SystemExit(f"unknown example {name!r}; examples: {', '.join(EXAMPLES)}")
    model, inputs = EXAMPLES[name]()
    model.eval()
    start = time.perf_counter()
    optimized = fxforge.optimize(model, inputs)
    seconds = time.perf_counter() - start
    lines = summary_lines(name, model, inputs, optimized, seconds)
    with torch.inference_mode():
        check = compare_outputs(model(*inputs), optimized(*inputs))
    lines.append(f"max abs error vs eager: {check.max_abs_err:.3g} ({'ok' if check.ok else check.reason})")
    eager_ms, fx_ms = compare_latency(model, optimized, inputs, reps=REPS, warmup=3)
    load = machine_load()
    lines.append(f"latency (median of {REPS}, interleaved): eager {eager_ms:.3g} ms, fxforge {fx_ms:.3g} ms: "
                 f"{eager_ms / fx_ms:.2f}x")
    if load > BUSY_LOAD:
        lines.append(f"  (the machine was busy: load {load:.2f} per core beside this run, so that ratio is disturbed)")
    lines += ["", "every entry: print(opt.report); the docs: docs/index.md",
              "next, your own model from the shell (MODEL is file.py:Class; --input one per input):",
              ("  .venv/bin/fxforge optimize examples/models/resnet_cnn.py:ResNetCNN --input 2x3x32x32 "
              "-o resnet.pt2 --report report.html")]
    print("\n".join(lines))


if __name__ == "__main__":
    main(*sys.argv[1:2])
