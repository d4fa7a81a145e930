"""``fxforge bench``: latency, throughput and scalability of a model, eagerly and through each target.

::

    fxforge bench MODEL --input SHAPE[:DTYPE] ... [--targets eager,native,onnxruntime,inductor] [--cores 1,2]
                  [--reps N]

For eager and each target, one row: the median latency of one call at the inputs' batch (every core; calls
interleaved with the other contenders' in blocks, :func:`~fxforge.lowering.timing.time_in_blocks`), the
throughput in samples/s (native and onnxruntime: ``fxforge.optimize(..., objective="throughput")``, its chosen
streams x threads x batch; the others: back-to-back calls), and the scalability: samples/s of back-to-back calls with 1, 2, ...
cores (``torch.set_num_threads`` of this thread, put back after; ONNX Runtime: a session per core count). The
largest output difference from eager is shown beside. Samples are dim 0 of the first input. A target that cannot
run the model (its capture or export fails) gets a row saying why, and the others run (``--debug`` raises it).

Example:
    >>> parse_cores("1,2"), parse_targets("native, eager")
    ([1, 2], ['eager', 'native'])
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from rich.table import Table

from fxforge.api import THROUGHPUT_TARGETS
from fxforge.cli.args import call_model, format_input
from fxforge.cli.commands import _console, _model_and_inputs, collected_warnings
from fxforge.cli.steps import Steps
from fxforge.cli.throughput_table import throughput_table
from fxforge.core.verify import compare_outputs
from fxforge.lowering.timing import time_in_blocks
from fxforge.runtime.streams import cores

CONTENDERS = ("eager", "native", "onnxruntime", "inductor")


def parse_targets(text: str) -> list[str]:
    """``--targets``: a comma-separated subset of :data:`CONTENDERS`, in that order (eager always first).

    Example:
        >>> parse_targets("onnxruntime,native")
        ['eager', 'native', 'onnxruntime']
    """
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"--targets {text!r}: expected names among {', '.join(CONTENDERS)}")
    return [n for n in CONTENDERS if n in names or n == "eager"]


def parse_cores(text: str) -> list[int]:
    """``--cores``: comma-separated core counts, each at least 1 and at most the cores this process may use.

    Example:
        >>> parse_cores("1, 1")
        [1]
    """
    try:
        counts = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--cores {text!r}: expected comma-separated numbers of cores") from None
    if not counts or counts[0] < 1 or counts[-1] > cores():
        raise argparse.ArgumentTypeError(f"--cores {text!r}: each must be between 1 and {cores()} (the cores this "
                                         "process may use)")
    return counts


def default_cores() -> list[int]:
    """1, 2, 4... and every core.

    Example:
        >>> default_cores()[0], default_cores()[-1] == cores()
        (1, True)
    """
    n = cores()
    return sorted({2 ** k for k in range(n.bit_length()) if 2 ** k <= n} | {n})


def _samples(inputs: tuple | dict) -> int:
    first = next((x for x in (inputs.values() if isinstance(inputs, dict) else inputs)
                  if isinstance(x, torch.Tensor) and x.dim() > 0), None)
    return int(first.shape[0]) if first is not None else 1


def _built(name: str, model: Any, inputs: tuple | dict, threads: int | None = None) -> Any:
    import fxforge

    if name == "eager":
        return model
    options: dict[str, Any] = {"dynamic": False}
    if name == "onnxruntime" and threads is not None:
        options["intra_op_num_threads"] = threads
    return fxforge.optimize(model, inputs, target=name, **options)


def _timed(calls: dict[str, Callable[[], Any]], reps: int) -> dict[str, float]:
    with torch.no_grad():
        return time_in_blocks(calls, rounds=max(1, reps), reps=3)


def run_bench(args: argparse.Namespace) -> int:
    """``fxforge bench``: the table of latency, throughput and scalability per contender."""
    import fxforge

    steps = Steps()
    console = _console()
    notes: list[str] = []
    counts = args.cores or default_cores()
    main_threads = torch.get_num_threads()
    with collected_warnings(notes):
        model, inputs, reference = _model_and_inputs(args, steps)
        samples = _samples(inputs)
        built: dict[str, Any] = {}
        errors: dict[str, float] = {}
        failed: dict[str, str] = {}
        for name in args.targets:
            with steps.step(f"build {name}") as step:
                try:
                    built[name] = _built(name, model, inputs)
                    with torch.no_grad():
                        errors[name] = compare_outputs(reference, call_model(built[name], inputs)).max_abs_err
                except Exception as error:
                    if name == "eager" or args.debug:
                        raise
                    built.pop(name, None)  # a target that cannot run this model: its row says why, the rest run
                    failed[name] = f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"
                    step.note(f"failed: {failed[name]}")
                    continue
                step.note(f"max abs error {errors[name]:.3g}")
        with steps.step(f"latency ({args.reps} interleaved rounds)"):
            latency = _timed({n: (lambda m=m: call_model(m, inputs)) for n, m in built.items()}, args.reps)
        scaling: dict[str, dict[int, float]] = {n: {} for n in built}
        try:
            for k in counts:
                with steps.step(f"{k} core{'s' if k > 1 else ''}"):
                    torch.set_num_threads(k)
                    runners = {n: (_built(n, model, inputs, threads=k) if n == "onnxruntime" else m)
                               for n, m in built.items()}
                    for n, ms in _timed({n: (lambda m=m: call_model(m, inputs)) for n, m in runners.items()},
                                        args.reps).items():
                        scaling[n][k] = samples * 1e3 / ms
        finally:
            torch.set_num_threads(main_threads)
        served: dict[str, Any] = {}
        for name in [n for n in THROUGHPUT_TARGETS if n in built]:
            with steps.step(f"{name}, objective=throughput (streams x threads x batch, measured)") as step:
                served[name] = fxforge.optimize(model, inputs, target=name, objective="throughput")
                step.note(served[name].table.best.label)
    table = Table(title=f"{type(model).__name__} ({' '.join(format_input(*s) for s in args.input)}; {samples} "
                        f"sample{'s' if samples > 1 else ''} per call)", title_justify="left")
    for column in ("", "latency ms", "samples/s", "throughput as", *(f"{k} core{'s' if k > 1 else ''}" for k in counts),
                   f"scaling {counts[-1]}/{counts[0]}", "max abs error"):
        table.add_column(column, justify="left" if column in ("", "throughput as") else "right")
    for name in built:
        if name in served:
            rate, how = served[name].table.best.samples_per_s, f"throughput objective: {served[name].table.best.label}"
        else:
            rate, how = samples * 1e3 / latency[name], "back-to-back calls"
        ratio = scaling[name][counts[-1]] / scaling[name][counts[0]]
        table.add_row(name, f"{latency[name]:.3g}", f"{rate:.3g}", how,
                      *(f"{scaling[name][k]:.3g}" for k in counts), f"{ratio:.2f}", f"{errors[name]:.2g}")
    for name, why in failed.items():
        table.add_row(name, "failed", "", why, *("" for _ in counts), "", "")
    console.print(table)
    for name, module in served.items():
        console.print(throughput_table(module.table, f"{name}, objective=throughput: every configuration tried"))
        module.close()
    for note in notes:
        console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    return 0


def add_bench_command(commands: Any, model_arguments: Any) -> argparse.ArgumentParser:
    """Register ``fxforge bench`` on the ``commands`` subparsers."""
    sub = commands.add_parser(
        "bench", help="latency, throughput and scalability (1, 2, ... cores), eagerly and per target",
        description="Time a model eagerly and through each target: latency (median ms at the inputs' batch), "
                    "throughput (samples/s: native's and onnxruntime's objective=throughput choice, back-to-back "
                    "calls for the others) and scalability (samples/s with 1, 2, ... cores), interleaved repetitions, medians.")
    model_arguments(sub)
    sub.add_argument("--targets", type=parse_targets, default=["eager", "native", "onnxruntime"], metavar="A,B",
                     help=f"among {', '.join(CONTENDERS)} (default eager,native,onnxruntime; eager always runs)")
    sub.add_argument("--cores", type=parse_cores, default=None, metavar="1,2",
                     help="core counts for the scalability columns (default 1, 2, 4... and every core)")
    sub.add_argument("--reps", type=_positive, default=5, metavar="N", help="interleaved rounds of each timing "
                                                                           "(default 5)")
    sub.set_defaults(run=run_bench, parser=sub)
    return sub


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of 1 or more, got {text!r}")
    return value
