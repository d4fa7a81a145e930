"""``python -m benchmarks --suite optimize-time``: how long a first-time ``fxforge.optimize`` takes (issue 3).

Each repetition is a new Python process with an empty autotune cache (``FXFORGE_CACHE_DIR`` set to a new
folder), so nothing measured earlier is reused: it builds a suite entry (``benchmarks/suite.py``), calls
the model once (as the harness does before timing), then times ``fxforge.optimize(model, inputs)`` plus
the first call. ``--models`` takes several entries (ResNet-50 is ``hf_resnet50``, BERT-base ``hf_bert_base``),
timed one after the other. With ``--against PATH`` (another checkout of fxforge, e.g. a ``git worktree`` of the
previous commit) the two checkouts run alternately, and the per-pair ratios are printed, so a change is
compared with its parent on the same machine in the same minutes.

Example::

    python -m benchmarks --suite optimize-time --models hf_resnet50,hf_bert_base --reps 5
    git worktree add /tmp/before HEAD~1
    python -m benchmarks --suite optimize-time --models hf_resnet50 --reps 5 --against /tmp/before
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from benchmarks.report import COLD_CONTENDER
from benchmarks.section import Section, UsageError, csv_list

# Runs in the child process: the checkout under test is first on sys.path.
_CHILD = r"""
import json, os, sys, time
sys.path.insert(0, os.environ["FXFORGE_CHECKOUT"])
import torch
torch.set_num_threads(int(os.environ["FXFORGE_THREADS"]))
from benchmarks import suite
import fxforge
if not fxforge.__file__.startswith(os.environ["FXFORGE_CHECKOUT"]):
    sys.exit(f"imported fxforge from {fxforge.__file__}, not from {os.environ['FXFORGE_CHECKOUT']}")
entry = next(e for e in suite.SUITE if e.name == os.environ["FXFORGE_MODEL"])
model, args = suite.build(entry)
with torch.no_grad():
    model(*args)
    start = time.perf_counter()
    optimized = fxforge.optimize(model, args)
    prepared = time.perf_counter()
    optimized(*args)
    done = time.perf_counter()
print(json.dumps({"prepare": prepared - start, "first_call": done - prepared, "total": done - start,
                  "counts": optimized.report.counts}))
"""


def time_once(checkout: str, model: str, threads: int) -> dict:
    """One cold optimize of ``model`` with the fxforge in ``checkout``, in a new process.

    Example:
        >>> time_once(".", "resnet_cnn", 1)["total"] > 0  # doctest: +SKIP
        True
    """
    with tempfile.TemporaryDirectory(prefix="fxforge-cold-") as cache:
        env = dict(os.environ, FXFORGE_CACHE_DIR=cache, FXFORGE_CHECKOUT=os.path.abspath(checkout),
                   FXFORGE_MODEL=model, FXFORGE_THREADS=str(threads))
        result = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True,
                                cwd=os.path.abspath(checkout), check=False)
    if result.returncode:
        raise RuntimeError(f"{checkout}: {model} failed: {result.stderr.strip().splitlines()[-1:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cold_row(model: str, reps: int = 5, threads: int = 2) -> dict:
    """A results row for ``model``'s first-time optimize: the median of ``reps`` runs of :func:`time_once`
    (each a new process with an empty autotune cache) with this checkout, in ``prepare_s``.

    A suite run times each contender's prepare inside its own process, after the models and contenders
    before it (torch.compile's Inductor among them) have grown the heap and warmed or filled caches; this
    row is the figure a user sees optimizing the model for the first time.

    Example:
        >>> cold_row("tiny_conv_bn", reps=1)["contender"]  # doctest: +SKIP
        'fxforge (new process)'
    """
    runs = [time_once(REPO, model, threads) for _ in range(reps)]
    totals = sorted(run["total"] for run in runs)
    return {"model": model, "contender": COLD_CONTENDER, "status": "ok", "prepare_s": statistics.median(totals),
            "cold_runs_s": totals,
            "note": f"first-time optimize + first call, median of {reps} new processes with an empty autotune cache "
                    f"(min {totals[0]:.2f} s, max {totals[-1]:.2f} s)"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``--suite optimize-time``."""
    parser.add_argument("--models", "--model", type=csv_list, default=["hf_resnet50"],
                        help="comma-separated suite entries (default hf_resnet50; see --suite default --list-models)")
    parser.add_argument("--reps", type=int, default=5, help="new processes per model (and checkout; default 5)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--against", default=None, help="another fxforge checkout, run alternately")


def run(opts: argparse.Namespace) -> int:
    """Print each repetition and the medians, per model; returns the exit status."""
    from benchmarks import suite

    known = {e.name for e in suite.SUITE}
    unknown = [m for m in opts.models if m not in known]
    if unknown or opts.reps < 1:
        raise UsageError(f"unknown suite entr{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown)}"
                         if unknown else "--reps must be >= 1")
    checkouts = {"this": "."} | ({"against": opts.against} if opts.against else {})
    for model in opts.models:
        totals: dict[str, list[float]] = {name: [] for name in checkouts}
        for rep in range(opts.reps):
            for name, checkout in checkouts.items():
                result = time_once(checkout, model, opts.threads)
                totals[name].append(result["total"])
                print(f"{model} rep {rep} {name:7s}: optimize {result['prepare']:.2f} s + first call "
                      f"{result['first_call']:.2f} s = {result['total']:.2f} s  {result['counts']}", flush=True)
        for name, values in totals.items():
            print(f"{model} {name:7s}: median {statistics.median(values):.2f} s, min {min(values):.2f} s over "
                  f"{len(values)}")
        if opts.against:
            ratios = [a / b for a, b in zip(totals["this"], totals["against"])]
            print(f"{model} this / against per pair: median {statistics.median(ratios):.2f} "
                  f"({', '.join(f'{r:.2f}' for r in ratios)})")
    return 0


SECTION = Section("optimize-time", "a first-time fxforge.optimize of suite entries (default hf_resnet50), each in "
                  "new processes with an empty autotune cache; --against another checkout (issue 3)",
                  add_arguments, run)
