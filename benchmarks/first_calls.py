"""``python -m benchmarks --suite first-calls``: what a model's first call on a new size costs after optimize
(issue 48, item 2).

Per model, in a new process with an empty autotune cache and an empty Inductor cache (what a user's first
hour sees), under ``torch.inference_mode()``, the native target (``--target inductor``: that one; its block is
``first-calls-inductor``), ``dynamic=None``:

1. ``fxforge.optimize(model, example)`` on the example a user passes (the user models of
   ``tests/user_models/hand_written.py``: U-Net 1x3x64x64, LSTM 2x12, GRU 4x10x6, GPT 1x16; and a
   transformers ``BertModel`` with random weights, 2 layers, hidden 128, optimized on ``input_ids`` of
   (1, 64)); ``unet-sizes`` is the U-Net with three more image sizes after its own fresh ones (2x3x40x40,
   4x3x56x72, 2x3x80x64), to show what the sizes after the first ones cost;
2. for each new size in turn (the user models' ``fresh`` inputs; BERT (2, 210)): the first call's time, then
   the median of ``--reps`` steady calls of fxforge and of eager at that size, interleaved; the plans built so
   far (``plans_built``) and whether the output matched eager's (``allclose``, 1e-4);
3. ``bert-trace``: BERT optimized the same way in a process of its own, then a 40-call trace (seeded; batch
   uniform in 1..4, length uniform in 16..256) right away, each call run by fxforge and by eager one after the
   other, in an order that alternates, each timed on its own, first-time work (re-plans) included; the figure
   is the totals' ratio ``fxforge / eager``.

The figures are ratios taken in the same process (``first / steady`` per size; the trace's totals), so a
busy machine moves both sides; the load average is recorded with them. ``--against PATH`` runs the same
measurement on another checkout (e.g. ``git worktree add /tmp/parent HEAD~1``), in its own process with this
file's code and models and that checkout's ``fxforge``, and shows both side by side.

Writes ``benchmarks/out/results-first-calls.json`` and the block between
``<!-- harness:first-calls:begin -->`` and ``<!-- harness:first-calls:end -->`` of ``RESULTS.md``.

Example::

    python -m benchmarks --suite first-calls
    python -m benchmarks --suite first-calls --models unet,bert --against /tmp/parent_shapes --no-markdown
    python -m benchmarks --suite first-calls --target inductor --models unet-sizes --against /tmp/parent
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import report
from benchmarks.section import Section, csv_list

BLOCK = "first-calls"
MODELS = ["unet", "lstm", "gru", "gpt", "bert", "bert-trace"]
MORE_IMAGE_SIZES = [(2, 3, 40, 40), (4, 3, 56, 72), (2, 3, 80, 64)]
HERE = Path(__file__).resolve().parents[1]
OUT = HERE / "benchmarks" / "out" / "results-first-calls.json"


def _bert() -> tuple[Any, tuple, list[tuple]]:
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=2, intermediate_size=256,
                        attn_implementation="eager")
    model = BertModel(config).eval()
    return model, (torch.randint(0, 1000, (1, 64)),), [(torch.randint(0, 1000, (2, 210)),)]


def _case(name: str) -> tuple[Any, tuple, list[tuple]]:
    if name.startswith("bert"):
        model, example, fresh = _bert()
        return model, example, fresh if name == "bert" else []
    sys.path.insert(0, str(HERE / "tests" / "user_models"))
    import torch
    from hand_written import USER_MODELS

    case = USER_MODELS[name.removesuffix("-sizes")]()
    more = [(torch.randn(shape),) for shape in MORE_IMAGE_SIZES] if name == "unet-sizes" else []
    return case.model, case.inputs, case.fresh + more


def _first(out: Any) -> Any:
    return out[0] if isinstance(out, (tuple, list)) else getattr(out, "last_hidden_state", out)


def _timed(fn: Any, *args: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def measure(name: str, reps: int, trace_calls: int, target: str = "native") -> dict[str, Any]:
    """One model's row: set-up, then per new size the first call, the steady medians and the plans built."""
    import torch

    import fxforge

    model, example, fresh = _case(name)
    row: dict[str, Any] = {"model": name, "example": [list(t.shape) for t in example], "sizes": []}
    with torch.inference_mode():
        row["optimize_s"], opt = _timed(lambda: fxforge.optimize(model, example, target=target))
        for inputs in fresh:
            first, out = _timed(opt, *inputs)
            ok = torch.allclose(_first(out), _first(model(*inputs)), rtol=1e-4, atol=1e-4)
            fast, slow = [], []
            for rep in range(reps):
                for label in (("fxforge", "eager") if rep % 2 == 0 else ("eager", "fxforge")):
                    (fast if label == "fxforge" else slow).append(_timed(opt if label == "fxforge" else model, *inputs)[0])
            row["sizes"].append({"shape": [list(t.shape) for t in inputs], "first_s": first,
                                 "steady_s": statistics.median(fast), "eager_s": statistics.median(slow),
                                 "plans_built": opt.plans_built, "matches": bool(ok)})
        if name == "bert-trace" and trace_calls:
            rng = random.Random(0)
            totals = {"fxforge": 0.0, "eager": 0.0}
            for i in range(trace_calls):
                ids = torch.randint(0, 1000, (rng.randint(1, 4), rng.randint(16, 256)))
                for label in (("fxforge", "eager") if i % 2 == 0 else ("eager", "fxforge")):
                    totals[label] += _timed(opt if label == "fxforge" else model, ids)[0]
            row["trace"] = {"calls": trace_calls, **totals, "ratio": totals["fxforge"] / totals["eager"],
                            "plans_built": opt.plans_built}
    row["load"], row["fxforge"] = os.getloadavg()[0], str(Path(fxforge.__file__).parents[1])
    return row


def run_checkout(checkout: str, models: list[str], reps: int, trace_calls: int, target: str = "native") -> list[dict]:
    """Every model's row, measured in a new process with ``checkout``'s fxforge, an empty autotune cache and an
    empty Inductor cache."""
    rows = []
    for name in models:
        with tempfile.TemporaryDirectory(prefix="fxforge-first-calls-") as cache:
            env = dict(os.environ, FXFORGE_CACHE_DIR=cache, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
                       PYTHONPATH=os.pathsep.join([os.path.abspath(checkout), str(HERE)]))
            result = subprocess.run([sys.executable, "-W", "ignore", __file__, name, str(reps), str(trace_calls),
                                     target],
                                    env=env, capture_output=True, text=True, check=False)
        if result.returncode:
            rows.append({"model": name, "error": (result.stderr.strip().splitlines() or ["?"])[-1]})
        else:
            rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
        print(checkout, rows[-1], flush=True)
    return rows


def _cell(size: dict[str, Any]) -> str:
    mark = "" if size["matches"] else " **differs**"
    return (f"{size['first_s']:.2f} s = {size['first_s'] / size['steady_s']:.0f}x steady "
            f"({size['steady_s'] * 1e3:.1f} ms, eager {size['eager_s'] * 1e3:.1f} ms), plans {size['plans_built']}{mark}")


def markdown(runs: dict[str, list[dict]], command: str, target: str = "native") -> str:
    """The block: per checkout, model and new size the first call (and as a multiple of a steady call), the plans
    built so far; BERT's trace totals."""
    title = "" if target == "native" else f", target={target}"
    lines = [f"## First calls on new sizes (issue 48, item 2){title}", "",
             (f"`{command}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} cores. "
             f"`target={target!r}`, `dynamic=None`, inference mode, an empty autotune and Inductor cache per model "
             "(one process each). "
             "Timings on a shared machine: the ratios (first / steady, fxforge / eager) are taken in one process; "
             "`load` is the 1-minute load average at the end."), "",
             ("| checkout | model (example) | optimize s | each new size in turn: first call, steady, plans built | "
             "trace: fxforge / eager | load |"), "|---|---|---:|---|---|---:|"]
    for checkout, rows in runs.items():
        for row in rows:
            if "error" in row:
                lines.append(f"| {checkout} | {row['model']} | failed: {report.md_cell(row['error'])} | | | |")
                continue
            sizes = "; ".join(f"{'x'.join(map(str, s['shape'][0]))}: {_cell(s)}" for s in row["sizes"]) or "(the trace)"
            trace = row.get("trace")
            trace_text = (f"{trace['fxforge']:.2f} s / {trace['eager']:.2f} s = {trace['ratio']:.2f}x "
                          f"({trace['calls']} calls, plans {trace['plans_built']})") if trace else ""
            example = "x".join(map(str, row["example"][0]))
            total = sum(s["first_s"] for s in row["sizes"])
            sizes += f" (first calls {total:.2f} s in all)" if len(row["sizes"]) > 1 else ""
            lines.append(f"| {checkout} | {row['model']} ({example}) | {row['optimize_s']:.1f} | {sizes} | "
                         f"{trace_text} | {row['load']:.1f} |")
    lines += ["", ("- `plans` (captures made so far) does not depend on the machine's load; the seconds do. A steady median "
              "far from eager's at the same size is the load (5 calls each), not the plan."),
              ("- A first call at a new size that no capture serves runs eager twice and the plan twice (the check "
              "against eager on the call's inputs and random ones), so it includes eager's own first-time work at "
              "that size (oneDNN's RNN and convolution primitives).")]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``--suite first-calls``."""
    parser.add_argument("--models", type=csv_list, default=list(MODELS), help="comma-separated: " + ",".join(MODELS) + " (or unet-sizes)")
    parser.add_argument("--reps", type=int, default=5, help="steady calls per size and side")
    parser.add_argument("--trace-calls", type=int, default=40, help="BERT's trace length (0: none)")
    parser.add_argument("--against", default=None, help="another checkout to measure the same way (e.g. the parent)")
    parser.add_argument("--target", default="native", choices=["native", "inductor"],
                        help="the target optimized for (default native; inductor writes the first-calls-inductor block)")
    report.add_markdown_options(parser, BLOCK)


def run(args: argparse.Namespace) -> int:
    """Measure this checkout (and ``--against``), print and write the block."""
    runs = {"this": run_checkout(str(HERE), args.models, args.reps, args.trace_calls, args.target)}
    if args.against:
        runs[args.against] = run_checkout(args.against, args.models, args.reps, args.trace_calls, args.target)
    block = BLOCK if args.target == "native" else f"{BLOCK}-{args.target}"
    out = OUT if args.target == "native" else OUT.with_name(f"results-{block}.json")
    report.publish(args, block, out, runs, markdown(runs, args.command, args.target))
    return 0 if all("error" not in row for rows in runs.values() for row in rows) else 1


SECTION = Section("first-calls", "first call on each new size after optimize (U-Net, LSTM, GRU, GPT, BERT), "
                  "plans built, BERT's 40-call trace against eager (issue 48); --against PATH", add_arguments, run)

if __name__ == "__main__":  # one model in this process (run_checkout's child): its row as JSON
    print(json.dumps(measure(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:5])))
