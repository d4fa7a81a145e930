"""``fxforge partition``: cost-balanced pipeline stages for ``torch.distributed.pipelining``, and with
``--run`` the pipeline itself, one local process per stage, checked against the model in one process.

::

    fxforge partition MODEL --input SHAPE[:DTYPE] ... --stages K [--microbatches M] [--schedule 1F1B|GPipe]
                      [--memory-per-stage 2GiB] [--link-gbs 12.5] [--costs roofline|measured] [--compare]
                      [--run [--steps N]] [--train]

The model runs in eval mode unless ``--train`` (dropout would make the single-process check inexact);
gradients flow either way. A model TorchDynamo cuts into graphs (a branch on a tensor's value, ``.item()``) has no
stages: its graphs and breaks are printed, and one line says that stages need one graph (exit 1). ``--run`` uses gloo on CPU, NCCL when there is a GPU per stage.

Example:
    >>> policy_rows({"fxforge": None})
    [('fxforge', '-', '-', '-', 'no split')]
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.table import Table

from fxforge.cli.args import CommandError, format_input
from fxforge.cli.breaks import breaks_of_error, print_graphs, stages_refused
from fxforge.cli.commands import _console, _model_and_inputs, collected_warnings
from fxforge.cli.steps import Steps
from fxforge.cli.summary import format_bytes


def stage_table(part: Any, title: str) -> Table:
    """The partition's stages as a ``rich`` table."""
    table = Table(title=title, title_justify="left")
    for column in ("stage", "begins at", "forward", "backward", "cost", "memory", "sends on"):
        table.add_column(column, justify="left" if column == "begins at" else "right")
    for row in part.table().itertuples():
        sends = format_bytes(round(row.sends_mib * 2**20)) if row.stage < part.stages - 1 else "-"
        table.add_row(str(row.stage), row.begins_at, f"{row.forward_ms:.3f} ms", f"{row.backward_ms:.3f} ms",
                      f"{row.cost_ms:.3f} ms", format_bytes(round(row.memory_mib * 2**20)), sends)
    return table


def policy_rows(found: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """One row per policy: bottleneck ratio, simulated 1F1B and GPipe throughput, split points."""
    rows = []
    for name, part in found.items():
        if part is None:
            rows.append((name, "-", "-", "-", "no split"))
            continue
        rows.append((name, f"{part.bottleneck_ratio:.3f}", f"{part.throughput['1F1B']:.1f}",
                     f"{part.throughput['GPipe']:.1f}", ", ".join(part.split_points)))
    return rows


def _partition(model: Any, inputs: tuple, args: argparse.Namespace, compare: bool) -> tuple[Any, dict[str, Any]]:
    from fxforge.parallel.partition import compare_policies, partition

    options = {"microbatches": args.microbatches, "schedule": args.schedule, "link_gbs": args.link_gbs,
               "costs": args.costs}
    try:
        if compare:
            found = compare_policies(model, inputs, args.stages, memory_per_stage=args.memory_per_stage, **options)
            return found["fxforge"], found
        return partition(model, inputs, args.stages, memory_per_stage=args.memory_per_stage, **options), {}
    except ValueError as error:
        raise CommandError(" ".join(str(error).split())) from error
    except RuntimeError as error:
        raise CommandError(" ".join(str(error).split())) from error


def run_partition(args: argparse.Namespace) -> int:
    """``fxforge partition``: the plan (per stage, and against the peers' splits with ``--compare``), and with
    ``--run`` the pipeline on ``torch.distributed`` checked against one process (exit 1 if it differs)."""
    steps = Steps()
    console: Console = _console()
    notes: list[str] = []
    with collected_warnings(notes):
        model, inputs, _ = _model_and_inputs(args, steps, train=args.train)
        try:
            with steps.step(f"partition into {args.stages} stages") as step:
                part, found = _partition(model, inputs, args, args.compare)
                step.note(f"bottleneck ratio {part.bottleneck_ratio:.3f}")
        except CommandError as error:
            breaks = breaks_of_error(error)
            if not breaks:
                raise
            print_graphs(console, model, inputs, breaks)
            raise CommandError(stages_refused(type(model).__name__, breaks)) from error
        run = None
        if args.launch:
            from fxforge.parallel.launch import run_pipeline

            with steps.step(f"run {args.stages} processes ({part.schedule})") as step:
                try:
                    run = run_pipeline(part, inputs, steps=args.steps)
                except (RuntimeError, ValueError) as error:
                    raise CommandError(" ".join(str(error).split())) from error
                step.note("outputs and gradients match" if run.ok else "outputs or gradients DIFFER")
    shapes = " ".join(format_input(*spec) for spec in args.input)
    title = (f"{type(model).__name__} ({shapes}): {part.stages} stages, {part.microbatches} microbatches, "
             f"{part.schedule}, {'train' if args.train else 'eval'} mode")
    console.print(stage_table(part, title))
    for line in str(part).splitlines()[1 + part.stages:]:
        console.print(line.strip(), markup=False, highlight=False)
    console.print(f"bottleneck ratio (slowest / mean stage): {part.bottleneck_ratio:.3f}", markup=False)
    console.print("split_spec: {" + ", ".join(f"{n!r}: SplitPoint.BEGINNING" for n in part.split_points) + "}",
                  markup=False, highlight=False, soft_wrap=True)
    if part.column_blocks:
        console.print(f"  (the split points name fxforge.parallel.restructure.pipeline_ready(model, {part.column_blocks!r}),"
                      " which shares the model's parameters: Partition.pipeline_model)", markup=False,
                      highlight=False, soft_wrap=True)
    if found:
        table = Table(title="against the peers' splits (same cost model)", title_justify="left")
        for column in ("policy", "bottleneck", "1F1B samples/s", "GPipe samples/s", "split points"):
            table.add_column(column, justify="left" if column in ("policy", "split points") else "right")
        for row in policy_rows(found):
            table.add_row(*row)
        console.print(table)
    if run is not None:
        console.print(str(run), markup=False, highlight=False, soft_wrap=True)
    for note in notes:
        console.print(f"note: {note}", markup=False, highlight=False)
    if run is not None and not run.ok:
        raise CommandError(f"the pipeline's {'outputs' if not run.outputs_match else 'gradients'} differ from the "
                           f"single process's (max abs error {max(run.output_error, run.gradient_error):.2e})")
    return 0


def add_partition_command(commands: Any, model_arguments: Any) -> argparse.ArgumentParser:
    """Register ``fxforge partition`` on the ``commands`` subparsers."""
    sub = commands.add_parser(
        "partition", help="cost-balanced pipeline stages for torch.distributed.pipelining (--run: run them)",
        description="Split the model into pipeline stages that balance forward + backward time (estimated from "
                    "the traced training step) and fit --memory-per-stage, and print the stages, the split_spec "
                    "torch.distributed.pipelining.pipeline() takes, and the simulated 1F1B and GPipe steps "
                    "(fxforge.partition). With --run, start one local process per stage (gloo on CPU, NCCL on "
                    "GPUs), run forward + backward with the schedule, and check the outputs and gradients against "
                    "the model in one process. The model runs in eval mode unless --train.")
    model_arguments(sub)
    sub.add_argument("--stages", type=_positive, required=True, metavar="K", help="pipeline stages")
    sub.add_argument("--microbatches", type=_positive, metavar="M",
                     help="microbatches per step; the batch (dim 0 of every input) must divide (default: K)")
    sub.add_argument("--schedule", choices=("1F1B", "GPipe"), default="1F1B", help="pipeline schedule (default 1F1B)")
    sub.add_argument("--memory-per-stage", type=_size, metavar="SIZE",
                     help="the most a stage may hold: weights, gradients, activations in flight (2GiB, 512MiB)")
    sub.add_argument("--link-gbs", type=float, default=12.5, metavar="GB/s",
                     help="bandwidth between stages for sending activations and gradients (default 12.5)")
    sub.add_argument("--costs", choices=("roofline", "measured"), default="roofline",
                     help="each op's time: the roofline estimate (default) or timed on one microbatch")
    sub.add_argument("--compare", action="store_true",
                     help="also show the even-by-layer and the parameter-size splits under the same cost model")
    sub.add_argument("--run", action="store_true", dest="launch",
                     help="run the pipeline in K local processes and check it")
    sub.add_argument("--steps", type=_positive, default=1, metavar="N", help="steps to run with --run (default 1)")
    sub.add_argument("--train", action="store_true",
                     help="train mode (dropout on: the --run check is then not exact)")
    sub.set_defaults(run=run_partition, parser=sub)
    return sub


def _size(text: str) -> int:
    from fxforge.cli.args import parse_budget

    value = parse_budget(text)
    if isinstance(value, str):
        raise argparse.ArgumentTypeError(f"{text}: give a size (2GiB, 512MiB, bytes), not a percentage")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
