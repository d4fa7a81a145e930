"""``python -m benchmarks --suite against PATH``: this checkout against another (e.g. its parent), alternating new processes.

For a change that must not move performance (a restructure), two figures per model, each measured in a new
Python process with an empty autotune cache, the two checkouts alternating (this, other, this, other...):

- ``optimize s``: a first-time ``fxforge.optimize(model, inputs, target=...)`` (``--target``, default
  native) plus its first call;
- ``speedup``: eager latency / optimized latency in that same process (batch as the suite entry has it;
  interleaved calls, medians), so machine load moves both sides of the ratio together.

Per model it prints the medians per checkout and two ratios, both "this / other" in speed: optimize speed
(other's time / this time) and model speed (this speedup / other's speedup). Below 0.97 is a regression.

Example::

    git worktree add /tmp/parent HEAD~1
    python -m benchmarks --suite against /tmp/parent --models hf_resnet50 --reps 3
    python -m benchmarks --suite against /tmp/parent --tag conv --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from benchmarks.section import Section, UsageError, csv_list

REGRESSION = 0.97

# Runs in the child process: the checkout under test is first on sys.path.
_CHILD = r"""
import json, os, statistics, sys, time
sys.path.insert(0, os.environ["FXFORGE_CHECKOUT"])
import torch
torch.set_num_threads(int(os.environ["FXFORGE_THREADS"]))
from benchmarks import suite
import fxforge
if not fxforge.__file__.startswith(os.environ["FXFORGE_CHECKOUT"]):
    sys.exit(f"imported fxforge from {fxforge.__file__}, not from {os.environ['FXFORGE_CHECKOUT']}")
rows = []
for name in os.environ["FXFORGE_MODELS"].split(","):
    entry = next(e for e in suite.SUITE if e.name == name)
    model, args = suite.build(entry)
    with torch.no_grad():
        model(*args)
        start = time.perf_counter()
        optimized = fxforge.optimize(model, args, target=os.environ["FXFORGE_TARGET"])
        optimized(*args)
        cold = time.perf_counter() - start
        samples = {"eager": [], "fxforge": []}
        for _ in range(int(os.environ["FXFORGE_ROUNDS"])):
            for label, run in (("eager", model), ("fxforge", optimized)):
                begin = time.perf_counter()
                run(*args)
                samples[label].append(time.perf_counter() - begin)
    eager, fast = (statistics.median(samples[k]) for k in ("eager", "fxforge"))
    rows.append({"model": name, "optimize_s": cold, "eager_ms": eager * 1e3, "fxforge_ms": fast * 1e3,
                 "speedup": eager / fast})
print(json.dumps(rows))
"""


def run_checkout(checkout: str, models: list[str], threads: int, rounds: int, target: str = "native") -> list[dict]:
    """One new process with the fxforge in ``checkout`` and an empty autotune cache: a row per model, optimized
    for ``target``.

    Example:
        >>> run_checkout(".", ["tiny_conv_bn"], 1, 5)[0]["speedup"] > 0  # doctest: +SKIP
        True
    """
    with tempfile.TemporaryDirectory(prefix="fxforge-against-") as cache:
        env = dict(os.environ, FXFORGE_CACHE_DIR=cache, FXFORGE_CHECKOUT=os.path.abspath(checkout),
                   FXFORGE_MODELS=",".join(models), FXFORGE_THREADS=str(threads), FXFORGE_ROUNDS=str(rounds),
                   FXFORGE_TARGET=target)
        result = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True,
                                cwd=os.path.abspath(checkout), check=False)
    if result.returncode:
        raise RuntimeError(f"{checkout}: failed: {result.stderr.strip().splitlines()[-1:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def compare(runs: dict[str, list[list[dict]]], models: list[str]) -> list[dict]:
    """Per model: each checkout's medians and the two speed ratios (this / other).

    Example:
        >>> row = {"model": "m", "optimize_s": 2.0, "speedup": 1.5}
        >>> compare({"this": [[row]], "other": [[dict(row, optimize_s=4.0)]]}, ["m"])[0]["optimize_ratio"]
        2.0
    """
    table = []
    for i, model in enumerate(models):
        medians = {name: {key: statistics.median(rep[i][key] for rep in reps) for key in ("optimize_s", "speedup")}
                   for name, reps in runs.items()}
        this, other = medians["this"], medians["other"]
        table.append({"model": model, "this": this, "other": other,
                      "optimize_ratio": other["optimize_s"] / this["optimize_s"],
                      "speed_ratio": this["speedup"] / other["speedup"]})
    return table


def markdown(table: list[dict], command: str, reps: int) -> str:
    """The comparison as a markdown table, with the command and the verdict.

    Example:
        >>> t = [{"model": "m", "this": {"optimize_s": 2.0, "speedup": 1.5}, "other": {"optimize_s": 2.0,
        ...       "speedup": 1.5}, "optimize_ratio": 1.0, "speed_ratio": 1.0}]
        >>> "| m | 2.00 | 2.00 | 1.00 |" in markdown(t, "cmd", 3)
        True
    """
    header = (f"`{command}` ({reps} alternating pairs of new processes, empty autotune cache each; ratios are "
              f"this / other in speed, below {REGRESSION} is a regression)")
    columns = ("| model | optimize s (this) | optimize s (other) | optimize ratio | speedup vs eager (this) | "
               "speedup vs eager (other) | speed ratio |")
    lines = [header, "", columns, "|---|---:|---:|---:|---:|---:|---:|"]
    for row in table:
        lines.append(f"| {row['model']} | {row['this']['optimize_s']:.2f} | {row['other']['optimize_s']:.2f} | "
                     f"{row['optimize_ratio']:.2f} | {row['this']['speedup']:.2f}x | {row['other']['speedup']:.2f}x | "
                     f"{row['speed_ratio']:.2f} |")
    worst = min(min(r["optimize_ratio"], r["speed_ratio"]) for r in table)
    lines += ["", f"Lowest ratio {worst:.2f}: " + ("no regression." if worst >= REGRESSION else "REGRESSION.")]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``--suite against``."""
    parser.add_argument("other", help="the other fxforge checkout (e.g. a git worktree of the parent commit)")
    parser.add_argument("--models", type=csv_list, default=None, help="comma-separated suite entries")
    parser.add_argument("--tag", default="conv", help="without --models: the suite entries of this section "
                        "(default conv)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=30, help="interleaved eager/fxforge calls per process")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--target", default="native", help="the fxforge.optimize target both checkouts build "
                        "(default native; onnxruntime compares the exported files' speed)")


def run(opts: argparse.Namespace) -> int:
    """Alternate the two checkouts, print each repetition and the comparison; returns the exit status."""
    from benchmarks import suite

    try:
        models = [e.name for e in suite.select(opts.models, tag=opts.tag)]
    except KeyError as exc:
        raise UsageError(str(exc.args[0])) from None
    if not models or opts.reps < 1 or opts.rounds < 1:
        raise UsageError(f"no suite entry is tagged {opts.tag!r}" if not models else "--reps, --rounds must be >= 1")
    checkouts = {"this": ".", "other": opts.other}
    runs: dict[str, list[list[dict]]] = {name: [] for name in checkouts}
    for rep in range(opts.reps):
        order = list(checkouts.items()) if rep % 2 == 0 else list(reversed(checkouts.items()))
        for name, checkout in order:
            rows = run_checkout(checkout, models, opts.threads, opts.rounds, opts.target)
            runs[name].append(rows)
            print(f"rep {rep} {name:5s}: " + ", ".join(f"{r['model']} {r['optimize_s']:.2f} s {r['speedup']:.2f}x"
                                                       for r in rows), flush=True)
    print(markdown(compare(runs, models), opts.command, opts.reps))
    return 0


SECTION = Section("against", "this checkout against another (e.g. the parent commit), alternating new processes: "
                  "first-time optimize seconds and speedup over eager per model (a restructure's no-regression check)",
                  add_arguments, run)
