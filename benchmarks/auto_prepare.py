"""``python -m benchmarks --suite auto-prepare``: what ``target="auto"`` costs a new user and what it returns
(issue 48, item 1).

Per user model of ``tests/user_models/hand_written.py`` (default U-Net, GPT, LSTM, siamese, custom_autograd),
in a new process with an empty autotune cache and ``FXFORGE_TARGET_CACHE=0`` (every race run, none
remembered): ``fxforge.optimize(model, example, target="auto")`` timed, then every fresh input of the model
(new batch sizes, image sizes, lengths) called and compared with eager (``allclose``, 1e-3). A row records the
prepare seconds, the winner, eager's and the winner's race latency, the contenders refused (with reasons),
whether each fresh input was served (``ok``, ``DIFF`` or the exception's name) and the load average.

``--against PATH`` runs the same on another checkout (e.g. ``git worktree add /tmp/parent HEAD~1``), each model
in its own process with that checkout's ``fxforge``, alternating checkouts model by model so the load falls on
both.

Writes ``benchmarks/out/results-auto-prepare.json`` and the block between ``<!-- harness:auto-prepare:begin -->``
and ``<!-- harness:auto-prepare:end -->`` of ``RESULTS.md``.

Example::

    python -m benchmarks --suite auto-prepare --models unet,gpt --against /tmp/parent --no-markdown
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from benchmarks import report
from benchmarks.section import Section, csv_list

BLOCK = "auto-prepare"
MODELS = ["unet", "gpt", "lstm", "siamese", "custom_autograd"]
HERE = Path(__file__).resolve().parents[1]
OUT = HERE / "benchmarks" / "out" / "results-auto-prepare.json"


def _race_row(race: Any) -> dict[str, Any]:
    """What the race says, read the same way from either checkout (older ones lack some attributes)."""
    if race is None:
        return {"winner": None, "eager_ms": None, "contenders": []}
    rows = []
    for c in getattr(race, "contenders", []):
        rows.append({"name": getattr(c, "target", None) or getattr(c, "name", "?"),
                     "latency_ms": getattr(c, "latency_ms", None),
                     "refused": getattr(c, "refused", None) or getattr(c, "error", None) or None})
    return {"winner": getattr(race, "winner", None), "eager_ms": getattr(race, "eager_ms", None), "contenders": rows}


def measure(name: str) -> dict[str, Any]:
    """One model: auto's prepare seconds, what it chose, and whether it serves the fresh inputs like eager."""
    import torch
    from torch.utils import _pytree as pytree

    import fxforge

    sys.path.insert(0, str(HERE / "tests" / "user_models"))
    from hand_written import USER_MODELS

    case = USER_MODELS[name]()
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = fxforge.optimize(case.model, case.inputs, target="auto")
    prepare = time.perf_counter() - start
    served = []
    for inputs in case.fresh:
        try:
            with torch.no_grad():
                got, want = opt(*inputs), case.model(*inputs)
            same = all(torch.allclose(a, b, atol=1e-3, rtol=1e-3)
                       for a, b in zip(pytree.tree_leaves(got), pytree.tree_leaves(want)))
            served.append("ok" if same else "DIFF")
        except Exception as error:  # noqa: BLE001 - what a user would see, recorded
            served.append(type(error).__name__)
    race = getattr(opt, "race", None) or getattr(getattr(opt, "report", None), "race", None)
    return {"model": name, "prepare_s": prepare, **_race_row(race), "served": served,
            "load": os.getloadavg()[0], "fxforge": str(Path(fxforge.__file__).parents[1])}


def _one(checkout: str, name: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="fxforge-auto-prepare-") as cache:
        env = dict(os.environ, FXFORGE_CACHE_DIR=cache, FXFORGE_TARGET_CACHE="0", FXFORGE_PROGRESS="0",
                   PYTHONPATH=os.pathsep.join([os.path.abspath(checkout), str(HERE)]))
        result = subprocess.run([sys.executable, "-W", "ignore", __file__, name], env=env, capture_output=True,
                                text=True, check=False)
    if result.returncode:
        return {"model": name, "error": (result.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def _cell(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"failed: {report.md_cell(row['error'])}"
    eager = row.get("eager_ms")
    won = next((c["latency_ms"] for c in row["contenders"] if c["name"] == row["winner"] and c["latency_ms"]), None)
    timing = f", {won:.2f} ms vs eager {eager:.2f} ms" if eager and won and row["winner"] != "eager" else ""
    served = sum(s == "ok" for s in row["served"])
    refused = sorted({c["name"] for c in row["contenders"] if c["refused"]})
    return (f"{row['prepare_s']:.1f} s → {row['winner']}{timing}; refused: {', '.join(refused) or 'none'}; "
            f"fresh inputs served {served}/{len(row['served'])}"
            + ("" if served == len(row["served"]) else f" ({', '.join(row['served'])})")
            + f"; load {row['load']:.1f}")


def markdown(runs: dict[str, list[dict]], command: str) -> str:
    """The block: per model, each checkout's prepare seconds, winner and fresh inputs served, side by side."""
    checkouts = list(runs)
    lines = ["## Auto's prepare time and what it returns (issue 48, item 1)", "",
             (f"`{command}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} cores. "
              "`target=\"auto\"` on each user model's example, a new process per model and checkout (alternating), "
              "empty caches, no remembered race; then every fresh input of the model (new sizes) against eager."), "",
             "| model | " + " | ".join(checkouts) + " |", "|---|" + "---|" * len(checkouts)]
    names = [row["model"] for row in runs[checkouts[0]]]
    for i, name in enumerate(names):
        lines.append(f"| {name} | " + " | ".join(_cell(runs[c][i]) for c in checkouts) + " |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``--suite auto-prepare``."""
    parser.add_argument("--models", type=csv_list, default=list(MODELS), help="comma-separated user models")
    parser.add_argument("--against", default=None, help="another checkout to measure the same way (e.g. the parent)")
    report.add_markdown_options(parser, BLOCK)


def run(args: argparse.Namespace) -> int:
    """Measure this checkout (and ``--against``), model by model alternating; print and write the block."""
    runs: dict[str, list[dict]] = {"this": []}
    if args.against:
        runs[args.against] = []
    for name in args.models:
        for checkout, rows in runs.items():
            rows.append(_one(str(HERE) if checkout == "this" else checkout, name))
            print(checkout, rows[-1], flush=True)
    report.publish(args, BLOCK, OUT, runs, markdown(runs, args.command))
    return 0 if all("error" not in row for row in runs["this"]) else 1


SECTION = Section("auto-prepare", "target='auto' on the user models: prepare seconds, winner, fresh inputs served "
                  "(issue 48); --against PATH", add_arguments, run)

if __name__ == "__main__":  # one model in this process (_one's child): its row as JSON
    print(json.dumps(measure(sys.argv[1])))
