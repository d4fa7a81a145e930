"""``python -m benchmarks --suite throughput``: samples/s serving a stream of batch-1 requests (issue 53, part 2).

Per model (:mod:`benchmarks.throughput_models`: MobileNetV3-small, EfficientNet-B0, BERT-tiny), ``--requests``
fresh random batch-1 requests, served by each contender in turn; each round serves them once with every
contender (the order rotated), the wall time of the whole list giving samples/s; medians over ``--rounds``, and
each contender's ratio against eager's in the same run:

- ``eager``: the model, calls back to back (every core: the latency configuration);
- ``eager, 1 thread``: the same with ``torch.set_num_threads(1)`` (put back after): how much of a gain is one
  thread per call rather than several copies of the model at once;
- ``fxforge latency``: ``fxforge.optimize(model, x)``, calls back to back;
- ``fxforge throughput``: ``fxforge.optimize(model, x, objective="throughput")``, ``opt.map(requests)``;
- ``fxforge ORT throughput``: the same with ``target="onnxruntime"`` (each stream on a session of its threads);
- ONNX Runtime on the file :func:`fxforge.export_onnx` writes, one session per setting: ``ORT_SEQUENTIAL`` with
  ``intra_op_num_threads`` = cores; ``ORT_PARALLEL`` with ``inter_op_num_threads`` = cores and 1 intra-op
  thread (and, from 4 cores, 2 inter-op x cores/2 intra-op), calls back to back; and ``ORT streams``:
  ``ORT_SEQUENTIAL`` with 1 intra-op thread, one session called from one thread per core at once.

Every contender's outputs are checked against eager's per request (max abs error shown). The target: fxforge's
throughput mode at least 1.3x the samples/s of its latency configuration. The block goes between
``<!-- harness:throughput:begin -->`` and ``<!-- harness:throughput:end -->`` of ``RESULTS.md``.

Example::

    python -m benchmarks --suite throughput
    python -m benchmarks --suite throughput --models bert_tiny --rounds 3 --requests 16 --no-markdown
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

import fxforge
from benchmarks import report
from benchmarks.section import Section, csv_list
from benchmarks.throughput_models import MODELS
from fxforge.core.verify import compare_outputs, random_like

BLOCK = "throughput"
TARGET = 1.3  # throughput mode's samples/s over the latency configuration's


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def _ort_sessions(model: torch.nn.Module, x: torch.Tensor, folder: str) -> dict[str, Any]:
    """One ONNX Runtime session per setting, on the file fxforge.export_onnx writes."""
    import onnxruntime as ort

    path = os.path.join(folder, "model.onnx")
    fxforge.export_onnx(model, path, (x,))
    n = _cores()

    def session(mode: Any, inter: int, intra: int) -> Any:
        options = ort.SessionOptions()
        options.execution_mode, options.inter_op_num_threads, options.intra_op_num_threads = mode, inter, intra
        return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])

    sessions = {f"ORT sequential, intra {n}": (session(ort.ExecutionMode.ORT_SEQUENTIAL, 1, n), 1),
                f"ORT parallel, inter {n} x intra 1": (session(ort.ExecutionMode.ORT_PARALLEL, n, 1), 1)}
    if n >= 4:
        sessions[f"ORT parallel, inter 2 x intra {n // 2}"] = (session(ort.ExecutionMode.ORT_PARALLEL, 2, n // 2), 1)
    sessions[f"ORT streams, {n} threads x intra 1"] = (session(ort.ExecutionMode.ORT_SEQUENTIAL, 1, 1), n)
    return sessions


def _ort_server(session: Any, threads: int) -> Callable[[list], list]:
    name = session.get_inputs()[0].name

    def run(request: torch.Tensor) -> Any:
        return [torch.from_numpy(a) for a in session.run(None, {name: request.numpy()})]

    if threads == 1:
        return lambda requests: [run(r) for r in requests]
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads)
    return lambda requests: list(pool.map(run, requests))


def _leaves(output: Any) -> list[torch.Tensor]:
    return list(output) if isinstance(output, (tuple, list)) else [output]


def measure(name: str, rounds: int, count: int) -> dict[str, Any]:
    """Samples/s of every contender on one model (medians of ``rounds``), its errors and the throughput choice."""
    load = [os.getloadavg()[0]]
    model, (x,) = MODELS[name]()
    requests = [random_like(x, seed) for seed in range(1, count + 1)]  # fresh values (token ids in the example's range)
    with torch.no_grad():
        expected = [_leaves(model(r)) for r in requests]
        latency = fxforge.optimize(model, (x,))
        began = time.perf_counter()
        served = fxforge.optimize(model, (x,), objective="throughput")
        choose_s = time.perf_counter() - began
        ort_served = fxforge.optimize(model, (x,), target="onnxruntime", objective="throughput")
    def one_thread(rs: list) -> list:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return [model(r) for r in rs]
        finally:
            torch.set_num_threads(threads)

    servers: dict[str, Callable[[list], list]] = {
        "eager": lambda rs: [model(r) for r in rs],
        "eager, 1 thread": one_thread,
        "fxforge latency": lambda rs: [latency(r) for r in rs],
        "fxforge throughput": served.map,
        "fxforge ORT throughput": ort_served.map,
    }
    with tempfile.TemporaryDirectory() as folder:
        try:
            for label, (session, threads) in _ort_sessions(model, x, folder).items():
                servers[label] = _ort_server(session, threads)
        except Exception as error:  # noqa: BLE001 - the row says why ORT is missing
            print(f"{name}: ONNX Runtime not run: {type(error).__name__}: {error}", flush=True)
        errors: dict[str, float] = {}
        rates: dict[str, list[float]] = {label: [] for label in servers}
        with torch.no_grad():
            for label, serve in servers.items():  # warm-up, and the check against eager
                outputs = serve(requests)
                errors[label] = max(compare_outputs(e, _leaves(o)[:len(e)]).max_abs_err
                                    for e, o in zip(expected, outputs))
            order = list(servers)
            for r in range(rounds):
                for label in order[r % len(order):] + order[:r % len(order)]:
                    start = time.perf_counter()
                    servers[label](requests)
                    rates[label].append(count / (time.perf_counter() - start))
    medians = {label: statistics.median(values) for label, values in rates.items()}
    load.append(os.getloadavg()[0])
    table = served.report.throughput
    ort_choice = ort_served.report.throughput.best.label
    served.close()
    ort_served.close()
    return {"model": name, "samples_per_s": medians, "errors": errors, "choice": table.best.label,
            "ort_choice": ort_choice,
            "choose_s": choose_s, "configurations": len(table.rows), "batching": table.batching,
            "notes": table.notes, "load": load, "rows": [dict(vars(r), chosen=i == table.chosen) for i, r in enumerate(table.rows)]}


def markdown(rows: list[dict[str, Any]], command: str, load: tuple[float, float]) -> str:
    """The block: samples/s of eager, ratios of every contender against it, the choice, the verdict."""
    labels = list(rows[0]["samples_per_s"]) if rows else []
    title = ("## Throughput: a stream of batch-1 requests, fxforge's latency and throughput modes against ONNX "
             "Runtime's execution modes (issue 53, part 2)")
    lines = [title, "",
             (f"`{command}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.processor() or 'CPU'}, "
              f"{_cores()} cores, torch {torch.__version__}; load average {load[0]:.2f} before, {load[1]:.2f} after "
              "(other work shares the cores; each row's load column: the 1-minute load average when its model began "
              "and ended). Each round serves the same fresh batch-1 requests once per contender "
              "(order rotated); samples/s are medians over the rounds; ratios against eager in the same run."), "",
             "| model | eager samples/s | " + " | ".join(f"{label} (x eager)" for label in labels[1:])
             + " | throughput choice | max abs error | load |",
             "|---|---:|" + "---:|" * (len(labels) - 1) + "---|---:|---|"]
    for row in rows:
        eager = row["samples_per_s"]["eager"]
        ratios = " | ".join(f"{row['samples_per_s'][label] / eager:.2f}" for label in labels[1:])
        lines.append(f"| {row['model']} | {eager:.1f} | {ratios} | {row['choice']} (of {row['configurations']}, "
                     f"chosen in {row['choose_s']:.0f} s) | {max(row['errors'].values()):.1e} | "
                     + " -> ".join(f"{v:.1f}" for v in row.get("load", [])) + " |")
    lines.append("")
    for row in rows:
        gain = row["samples_per_s"]["fxforge throughput"] / row["samples_per_s"]["fxforge latency"]
        met = "met" if gain >= TARGET else "**not met**"
        extra = f"; batching refused: {row['batching']}" if row["batching"] else ""
        rates = row["samples_per_s"]
        ort = (f"; with target=\"onnxruntime\" {rates['fxforge ORT throughput'] / rates['eager']:.2f}x eager "
               f"({row['ort_choice']})") if "fxforge ORT throughput" in rates else ""
        lines.append(f"- {row['model']}: throughput mode {gain:.2f}x fxforge's latency configuration (target "
                     f"{TARGET}x: {met}){ort}{extra}" + "".join(f"; {note}" for note in row["notes"]) + ".")
    for row in rows:
        if not row.get("rows"):
            continue
        lines += ["", f"{row['model']}: the configurations `objective=\"throughput\"` tried (`opt.report.throughput`)",
                  "", "| streams x threads | batch | samples/s | p50 ms | p90 ms | p99 ms | utilization |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {'**' if c['chosen'] else ''}{c['streams']} x {c['threads']}{'** (chosen)' if c['chosen'] else ''} "
                  f"| {c['batch']} | {c['samples_per_s']:.1f} | {c['p50_ms']:.1f} | {c['p90_ms']:.1f} | "
                  f"{c['p99_ms']:.1f} | {c['utilization']:.0%} |" for c in row["rows"]]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``--suite throughput``."""
    parser.add_argument("--models", type=csv_list, default=list(MODELS), help="among " + ", ".join(MODELS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=32, help="batch-1 requests served per round")
    report.add_markdown_options(parser, BLOCK)


def run(args: argparse.Namespace) -> int:
    """Measure every model, print each row and the block; write the block unless ``--no-markdown``."""
    before = os.getloadavg()[0]
    rows = []
    for name in args.models:
        row = measure(name, args.rounds, args.requests)
        print(row, flush=True)
        rows.append(row)
    block = markdown(rows, args.command, (before, os.getloadavg()[0]))
    print(block)
    if not args.no_markdown:
        report.write_block(args.markdown, block, BLOCK)
    return 0


SECTION = Section("throughput", "samples/s of a stream of batch-1 requests: eager, fxforge latency and throughput "
                  "modes, ONNX Runtime sequential / parallel / streams (issue 53, part 2; target 1.3x)",
                  add_arguments, run)
