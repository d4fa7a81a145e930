"""``python -m benchmarks --suite interop``: independent branches run at the same time (issue 53, part 1).

Per model at batch 1, in one process, under ``torch.no_grad()``, timed in blocks (each round runs every
contender ``reps`` times back to back after one untimed call, the order rotated from round to round; medians
over all rounds):

- ``eager``: the model;
- ``sequential``: ``fxforge.optimize(model, x, inter_op=False)``, one node after another;
- ``fxforge``: ``fxforge.optimize(model, x)``: regions of independent branches concurrent where that measured
  faster when the plan was built (its choice and schedule read from the report);
- ``forced``: ``inter_op="always"``: every region concurrent, untimed (what the choice protects against);
- ``sequential_1t``: the sequential plan on one intra-op thread (what each of two branches gets on two cores:
  ``1 thread / 2 threads`` is how well the plan's own kernels use the second core);
- ORT: the model exported once (``fxforge.export_onnx``), run by ONNX Runtime with ``ORT_SEQUENTIAL``
  (intra-op threads = the cores) and with ``ORT_PARALLEL`` (inter-op threads = the cores, one intra-op
  thread each).

The figures are ratios in the same run: ``sequential / fxforge`` (at least 1: never slower; the issue asks
1.1 where two or more branches of comparable cost exist), ``sequential / forced`` and
``ORT_SEQUENTIAL / ORT_PARALLEL``. The block goes between ``<!-- harness:interop:begin -->`` and
``<!-- harness:interop:end -->`` of ``RESULTS.md``.

Example::

    python -m benchmarks --suite interop
    python -m benchmarks --suite interop --models wide_inception@96 --rounds 3 --no-markdown
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import torch

import fxforge
from benchmarks import report, suite
from benchmarks.section import Section, csv_list
from examples.models.branchy import BRANCHY
from fxforge.core.disk_cache import machine_load
from fxforge.lowering.timing import time_in_blocks

# name[@size]: a BRANCHY factory (its input resized to size x size) or a suite entry.
DEFAULT_MODELS = ["inception@64", "wide_inception@64", "wide_inception@128", "randwire_n16@64", "randwire_n32@64",
                  "darts_cells@64", "nasnet_cells@64", "inception_b1", "densenet_b1", "unet_b1", "hf_resnet50",
                  "hf_mobilenet_v2_224", "hf_bert", "transformer_encoder"]
BLOCK = "interop"
TARGET = 1.1


def build(name: str) -> tuple[torch.nn.Module, tuple]:
    """The model and its batch-1 inputs, BatchNorm statistics set by train-mode passes."""
    base, _, size = name.partition("@")
    if base in BRANCHY:
        model, args = BRANCHY[base]()
        if size:
            args = tuple(torch.randn(1, a.shape[1], int(size), int(size)) if a.dim() == 4 else a for a in args)
        if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()):
            model.train()
            with torch.no_grad():
                for _ in range(3):
                    model(*(torch.randn_like(a) if a.is_floating_point() else a for a in args))
        return model.eval(), args
    entry = next(e for e in suite.SUITE if e.name == name)
    model, args = suite.build(entry)
    return model.eval(), args if isinstance(args, tuple) else (args,)


def _ort_sessions(model: torch.nn.Module, args: tuple, threads: int) -> dict[str, Any]:
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.onnx")
        fxforge.export_onnx(model, path, args)
        sessions = {}
        for mode in ("sequential", "parallel"):
            options = ort.SessionOptions()
            if mode == "parallel":
                options.execution_mode = ort.ExecutionMode.ORT_PARALLEL
                options.inter_op_num_threads, options.intra_op_num_threads = threads, 1
            else:
                options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
                options.intra_op_num_threads = threads
            sessions[mode] = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    names = [i.name for i in sessions["sequential"].get_inputs()]
    feed = {n: a.numpy() for n, a in zip(names, args)}
    return {f"ort_{mode}": (lambda s=s: s.run(None, feed)) for mode, s in sessions.items()}


def measure(name: str, rounds: int, reps: int, ort: bool) -> dict[str, Any]:
    """One model's medians (ms), the choice fxforge made, its schedule, and the ratios."""
    model, args = build(name)
    threads = torch.get_num_threads()
    row: dict[str, Any] = {"model": name, "threads": threads}
    built = {}
    for key, option in (("sequential", False), ("fxforge", True), ("forced", "always")):
        start = time.perf_counter()
        built[key] = fxforge.optimize(model, args, inter_op=option)
        row[f"build_{key}_s"] = time.perf_counter() - start
    entry = next((t for t in reversed(built["fxforge"].report.tuning) if t.rule == "inter_op"), None)
    row["choice"] = entry.choice if entry else "no region"
    row["schedule"] = entry.note if entry else ""
    calls = {"eager": lambda: model(*args), **{k: (lambda m=m: m(*args)) for k, m in built.items()}}

    def one_thread() -> Any:  # the sequential plan on one intra-op thread: what each branch gets when two share 2 cores
        torch.set_num_threads(1)
        try:
            return built["sequential"](*args)
        finally:
            torch.set_num_threads(threads)

    calls["sequential_1t"] = one_thread
    if ort:
        try:
            calls.update(_ort_sessions(model, args, threads))
        except Exception as error:  # noqa: BLE001 - a model ORT cannot take is reported, the rest is measured
            row["ort_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
    load = machine_load()
    samples: dict[str, list[float]] = {}
    with torch.no_grad():
        medians = time_in_blocks(calls, rounds=rounds, reps=reps, samples=samples)
    row["load"] = max(load, machine_load())
    row.update({f"{k}_ms": v for k, v in medians.items()})
    row["spread"] = {k: statistics.pstdev(v) / statistics.median(v) for k, v in samples.items()}
    row["ratio"] = medians["sequential"] / medians["fxforge"]
    row["forced_ratio"] = medians["sequential"] / medians["forced"]
    row["intra_scaling"] = medians["sequential_1t"] / medians["sequential"]
    if "ort_parallel" in medians:
        row["ort_ratio"] = medians["ort_sequential"] / medians["ort_parallel"]
    return row


def markdown(rows: list[dict[str, Any]], command: str) -> str:
    """The block: one row per model and the verdicts."""
    threads = rows[0]["threads"] if rows else torch.get_num_threads()
    lines = ["## Inter-operator parallelism (issue 53)", "",
             (f"`{command}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} cores, "
              f"{threads} intra-op threads, torch {torch.__version__}. Batch 1, `torch.no_grad()`, blocks of calls "
              "in rotated order, medians. `seq / fxforge` > 1 is faster than running the plan's nodes one after "
              "another."), "",
             ("| model | eager ms | sequential ms | fxforge ms | choice | seq / fxforge | seq / forced | "
              "1 thread / 2 threads | ORT seq / ORT_PARALLEL | load |"), "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['model']} | failed: {report.md_cell(row['error'])} | | | | | | | | |")
            continue
        ort = f"{row['ort_ratio']:.2f}" if "ort_ratio" in row else ("failed" if "ort_error" in row else "")
        lines.append(f"| {row['model']} | {row['eager_ms']:.2f} | {row['sequential_ms']:.2f} | {row['fxforge_ms']:.2f} "
                     f"| {row['choice']} | {row['ratio']:.2f} | {row['forced_ratio']:.2f} | {row['intra_scaling']:.2f} "
                     f"| {ort} | {row['load']:.2f} |")
    ok = [r for r in rows if "error" not in r]
    if ok:
        slowest = min(ok, key=lambda r: r["ratio"])
        lines += ["", (f"- Never slower than sequential: the lowest `seq / fxforge` is {slowest['ratio']:.2f} "
                  f"({slowest['model']}; {'within noise' if slowest['ratio'] >= 0.97 else '**slower**'}).")]
        chosen = [r for r in ok if r["choice"] == "concurrent"]
        if chosen:
            best = max(chosen, key=lambda r: r["ratio"])
            met = sum(r["ratio"] >= TARGET for r in chosen)
            lines.append(f"- Concurrent regions kept on {len(chosen)} of {len(ok)} models; {met} of them at least "
                         f"{TARGET}x; the best {best['ratio']:.2f}x ({best['model']}).")
        else:
            lines.append("- No model kept a concurrent region: every region measured no faster than sequential here.")
        lines.append("- Schedules: " + "; ".join(f"**{r['model']}**: {report.md_cell(r['schedule'], 300)}"
                                                 for r in ok if r["schedule"]))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``--suite interop``."""
    parser.add_argument("--models", type=csv_list, default=list(DEFAULT_MODELS),
                        help="BRANCHY names (name@size resizes the image) or suite entries, comma-separated")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--no-ort", action="store_true", help="leave ONNX Runtime out")
    report.add_markdown_options(parser, BLOCK)


def run(args: argparse.Namespace) -> int:
    """Measure every model, print each row and the block; write the block unless ``--no-markdown``."""
    rows = []
    for name in args.models:
        try:
            row = measure(name, args.rounds, args.reps, not args.no_ort)
        except Exception as error:  # noqa: BLE001 - one model's failure is its row, the others still run
            row = {"model": name, "error": f"{type(error).__name__}: {error}"}
        print({k: v for k, v in row.items() if k != "schedule"}, flush=True)
        rows.append(row)
    block = markdown(rows, args.command)
    print(block)
    if not args.no_markdown:
        report.write_block(args.markdown, block, BLOCK)
    return 0


SECTION = Section("interop", "independent branches run at the same time against the plan run node after node, and "
                  "ORT_PARALLEL against ORT_SEQUENTIAL, per model at batch 1 (issue 53)", add_arguments, run)
