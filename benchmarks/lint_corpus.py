"""``python -m benchmarks.lint_corpus``: ``fxforge.lint`` on the seeded-bug corpus (tests/lint/seeded.py: is each
seeded bug found by its rule at its marked line?) and on the clean models (tests/lint/clean.py, the example
models, the transformers corpus: findings above info per model), with lint's time beside one ``fxforge.capture``.
Writes the ``lint`` block of ``benchmarks/RESULTS.md`` (``--no-markdown``: print only).

Example:
    >>> row = clean_row("mlp", lambda: (torch.nn.Linear(4, 4), (torch.ones(2, 4),)))
    >>> row["above_info"], row["rules"]
    (0, '')
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time
import warnings
from datetime import datetime, timezone

import torch

import fxforge
from benchmarks.report import DEFAULT_MARKDOWN, write_block

SECTION = "lint"
COMMAND = "python -m benchmarks.lint_corpus"
REPEAT = 5
SLOWER = 1.5
"""Lint taking more than this times one capture's time is named in the summary."""


def seeded_rows() -> list[dict]:
    """One row per seeded bug: found by its rule, and at its marked line."""
    from tests.lint import seeded

    source = inspect.getsourcefile(seeded)
    with open(source) as file:
        lines = file.read().splitlines()
    rows = []
    for name, (factory, rule) in sorted(seeded.SEEDED.items()):
        model, inputs = factory()
        marked = {i for i, text in enumerate(lines, 1) if text.rstrip().endswith(f"# BUG: {rule}")}
        hits = [f for f in fxforge.lint(model, inputs) if f.rule == rule]
        at_line = any(os.path.abspath(f.file) == source and f.line in marked for f in hits)
        rows.append({"model": name, "rule": rule, "found": bool(hits), "at_line": at_line,
                     "where": ", ".join(f.where for f in hits) or "-"})
    return rows


def clean_row(name: str, factory, repeat: int = REPEAT) -> dict:
    """Findings above info (and their rules) on one clean model, lint's time and one capture's (best of ``repeat``).
    ``factory`` returns ``(model, inputs)``, or a user model case (``.model``, ``.inputs``, ``.kwargs``)."""
    made = factory()
    model, inputs = (made.model, (made.inputs, made.kwargs)) if hasattr(made, "model") else made
    _lint(model, inputs)  # warm
    _capture(model, inputs)
    lint_s = capture_s = float("inf")
    for _ in range(repeat):  # the best of ``repeat`` each, interleaved: the machine is shared
        start = time.perf_counter()
        findings = _lint(model, inputs)
        lint_s = min(lint_s, time.perf_counter() - start)
        start = time.perf_counter()
        _capture(model, inputs)
        capture_s = min(capture_s, time.perf_counter() - start)
    above = findings.above("info")
    return {"model": name, "above_info": len(above), "rules": ", ".join(f.rule for f in above),
            "info": len(findings) - len(above), "lint_s": lint_s, "capture_s": capture_s}


def _split(inputs) -> tuple:
    """``(inputs, kwargs)`` of a user model case, or plain example inputs with no keyword ones."""
    if isinstance(inputs, tuple) and len(inputs) == 2 and isinstance(inputs[1], dict) and isinstance(inputs[0], tuple):
        return inputs
    return inputs, {}


def _lint(model, inputs):
    args, kwargs = _split(inputs)
    return fxforge.lint(model, args, example_kwargs=kwargs)


def _capture(model, inputs) -> None:
    args, kwargs = _split(inputs)
    try:
        fxforge.capture(model, args, example_kwargs=kwargs)
    except fxforge.CaptureError:
        pass  # no single graph (a model with breaks): lint's time beside the failed capture's


def clean_models() -> dict:
    from tests.corpus.models import TRANSFORMERS
    from tests.lint.clean import CLEAN

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "user_models"))
    from hand_written import USER_MODELS
    from with_breaks import BREAK_MODELS

    return {**CLEAN, **{f"transformers/{name}": factory for name, factory in TRANSFORMERS.items()},
            **{f"user/{name}": factory for name, factory in USER_MODELS.items()},
            **{f"breaks/{name}": factory for name, factory in BREAK_MODELS.items()}}


def markdown(seeded: list[dict], clean: list[dict]) -> str:
    found = sum(r["found"] and r["at_line"] for r in seeded)
    over = [r for r in clean if r["above_info"] > 1]
    ratios = sorted(r["lint_s"] / r["capture_s"] for r in clean)
    slower = [r for r in clean if r["lint_s"] > SLOWER * r["capture_s"]]
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    slow = ", ".join(f"{r['model']} ({r['lint_s'] / r['capture_s']:.2f}x)" for r in slower) or "none"
    lines = [(f"## lint (issue 54, {when}): seeded bugs found {found}/{len(seeded)}; clean models: findings above info "
             "per model"), "",
             (f"`{COMMAND}` (CPU, torch {torch.__version__}). A seeded bug counts when its rule finds it at the line "
             "marked `# BUG: rule` in tests/lint/seeded.py. Clean models: tests/lint/clean.py, the example models and "
             f"the transformers corpus (tiny configs, random weights), tests/user_models (`user/`; `breaks/`: models "
             "TorchDynamo breaks, whose finding above info is their break where it reads a value); "
             f"{len(over)} of {len(clean)} with more than one finding above info. Lint's time over one "
             f"`fxforge.capture`'s (auto method, checked; best of {REPEAT} each, interleaved): median "
             f"{ratios[len(ratios) // 2]:.2f}x, over {SLOWER}x on {len(slower)}: {slow} (a model with breaks: capture "
             "fails before dynamo runs, lint runs it)."),
             "", "| seeded bug | rule | found at its line | where |", "|---|---|---|---|"]
    lines += [f"| {r['model']} | `{r['rule']}` | {'yes' if r['found'] and r['at_line'] else 'NO'} | {r['where']} |"
              for r in seeded]
    lines += ["", "| clean model | above info | their rules | info | lint s | capture s |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['above_info']} | {r['rules'] or '-'} | {r['info']} | {r['lint_s']:.2f} | "
              f"{r['capture_s']:.2f} |" for r in clean]
    return "\n".join(lines) + "\n"


def zoo_markdown(rows: list[dict], command: str) -> str:
    """The ``lint-zoo`` block: findings above info per zoo model (torchvision and timm, random weights)."""
    over = [r for r in rows if r.get("above_info", 0) > 1]
    failed = [r for r in rows if "error" in r]
    ratios = sorted(r["lint_s"] / r["capture_s"] for r in rows if "error" not in r)
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"## lint on the model zoo (issue 54, {when})", "",
             (f"`{command}` (torch {torch.__version__}; torchvision and timm with random weights, 1x3x224x224). "
              f"{len(over)} of {len(rows) - len(failed)} models with more than one finding above info"
              + (f"; {len(failed)} failed" if failed else "") + (f"; lint's time over one capture's: median "
              f"{ratios[len(ratios) // 2]:.2f}x, largest {ratios[-1]:.2f}x" if ratios else "") + "."),
             "", "| model | above info | their rules | info | lint s | capture s |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | failed: {r['error'][:150]} | | | | |")
        else:
            lines.append(f"| {r['model']} | {r['above_info']} | {r['rules'] or '-'} | {r['info']} | {r['lint_s']:.2f} | "
                         f"{r['capture_s']:.2f} |")
    return "\n".join(lines) + "\n"


def zoo_rows(repeat: int) -> list[dict]:
    """One row per zoo model (needs torchvision and timm: ``benchmarks.zoo``)."""
    from benchmarks import zoo

    rows = []
    for name in zoo.ZOO:
        try:
            rows.append(clean_row(name, lambda name=name: zoo.build(name), repeat))
        except Exception as error:  # noqa: BLE001 - one model's failure is its row
            rows.append({"model": name, "error": f"{type(error).__name__}: {error}".splitlines()[0]})
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", default=DEFAULT_MARKDOWN, help="the markdown file whose lint block is replaced")
    parser.add_argument("--no-markdown", action="store_true", help="print the block only")
    parser.add_argument("--zoo", action="store_true", help="lint the model zoo instead (torchvision and timm "
                        "installed: its block is lint-zoo)")
    parser.add_argument("--repeat", type=int, default=REPEAT, help=f"timings per model, the best kept (default {REPEAT})")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    if args.zoo:
        block = zoo_markdown(zoo_rows(args.repeat), f"{COMMAND} --zoo --repeat {args.repeat}")
        print(block)
        if not args.no_markdown:
            write_block(args.markdown, block, "lint-zoo")
        return 0
    seeded = seeded_rows()
    clean = [clean_row(name, factory) for name, factory in clean_models().items()]
    block = markdown(seeded, clean)
    print(block)
    if not args.no_markdown:
        write_block(args.markdown, block, SECTION)
    return 0 if all(r["found"] and r["at_line"] for r in seeded) else 1


if __name__ == "__main__":
    sys.exit(main())
