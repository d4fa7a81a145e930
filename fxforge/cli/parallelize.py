"""``fxforge parallelize``: every way to spread a training step over N devices (data parallel, fully
sharded, tensor parallel, pipeline, and their meshes), priced, and the fastest that fits; with ``--run``
the chosen plan (or ``--mesh``) on N local processes, checked against the model in one.

::

    fxforge parallelize MODEL --input SHAPE[:DTYPE] ... --devices N [--memory-per-device 16GiB]
                        [--mesh tp=2,dp=2] [--optimizer adamw|sgd|none] [--run [--steps N]] [--train]

The model runs in eval mode unless ``--train`` (dropout would make the single-process check inexact);
gradients flow either way. ``--run`` uses gloo on CPU, NCCL when there is a GPU per device.

Example:
    >>> parse_mesh("tp=2,dp=2")
    {'tp': 2, 'dp': 2}
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.table import Table

from fxforge.cli.commands import _console, _model_and_inputs, collected_warnings
from fxforge.cli.partition import _positive, _size
from fxforge.cli.steps import Steps
from fxforge.cli.summary import format_bytes
from fxforge.parallel.strategy import AXES


def parse_mesh(text: str) -> dict[str, int]:
    """``"tp=2,dp=2"`` -> ``{"tp": 2, "dp": 2}``.

    Raises:
        argparse.ArgumentTypeError: an unknown axis or a size that is not a positive whole number.
    """
    mesh = {}
    for part in text.split(","):
        axis, _, size = part.strip().partition("=")
        if axis not in AXES:
            raise argparse.ArgumentTypeError(f"unknown mesh axis {axis!r} in {text!r}: the axes are {', '.join(AXES)}")
        if not size.isdigit() or int(size) < 1:
            raise argparse.ArgumentTypeError(f"mesh axis {axis} needs a positive whole size, as in {axis}=2")
        mesh[axis] = int(size)
    return mesh


def candidates_table(plan: Any, title: str) -> Table:
    """The plan's candidates as a ``rich`` table, the chosen first."""
    table = Table(title=title, title_justify="left")
    for column in ("mesh", "step", "compute", "collectives", "memory / device", "bytes sent", "fits"):
        table.add_column(column, justify="left" if column in ("mesh", "fits") else "right")
    for row in plan.candidates.itertuples():
        fits = "yes" if row.fits else f"no: {row.reason}"
        table.add_row(row.strategy, f"{row.step_s * 1e3:.2f} ms", f"{row.compute_s * 1e3:.2f} ms",
                      f"{row.comm_s * 1e3:.2f} ms", format_bytes(row.memory_per_device),
                      format_bytes(row.comm_bytes), fits)
    return table


def run_parallelize(args: argparse.Namespace) -> int:
    """``fxforge parallelize``: the candidates and the chosen plan, and with ``--run`` the plan run and checked
    (exit 1 if its outputs or gradients differ)."""
    from fxforge.cli.args import CommandError

    steps = Steps()
    console: Console = _console()
    notes: list[str] = []
    with collected_warnings(notes):
        model, inputs, _ = _model_and_inputs(args, steps, train=args.train)
        from fxforge.parallel.planner import parallelize

        with steps.step(f"plan {args.devices} devices") as step:
            try:
                plan = parallelize(model, inputs, args.devices, args.memory_per_device, optimizer=args.optimizer,
                                   mesh=args.mesh)
            except (ValueError, RuntimeError) as error:
                raise CommandError(" ".join(str(error).split())) from error
            step.note(plan.chosen.name)
        result = None
        if args.launch:
            from fxforge.parallel.mesh_run import run

            with steps.step(f"run {plan.devices} processes ({plan.chosen.name})") as step:
                try:
                    result = run(plan, inputs, steps=args.steps)
                except (RuntimeError, ValueError) as error:
                    raise CommandError(" ".join(str(error).split())) from error
                step.note(f"gradients max error {result.grad_error:.2e}")
    console.print(candidates_table(plan, f"{type(model).__name__} on {plan.devices} devices"))
    console.print(f"chosen: {plan.chosen.name}. {plan.why}", markup=False, highlight=False, soft_wrap=True)
    console.print(f"link: {plan.link.name} ({plan.link.source})", markup=False, highlight=False, soft_wrap=True)
    if plan.tp_plan:
        console.print("tensor-parallel plan:", markup=False)
        for name, style in plan.tp_plan.items():
            reason = plan.tp.reasons.get(name, "") if plan.tp is not None else ""
            console.print(f"  {name}: {style}{' (' + reason + ')' if reason else ''}", markup=False, highlight=False)
    for note in plan.notes + notes:
        console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    if result is not None:
        console.print(str(result), markup=False, highlight=False, soft_wrap=True)
        if not result.ok:
            raise CommandError(f"the plan's outputs or gradients differ from the single process's (max abs error "
                               f"{max(result.max_error, result.grad_error):.2e})")
    return 0


def add_parallelize_command(commands: Any, model_arguments: Any) -> argparse.ArgumentParser:
    """Register ``fxforge parallelize`` on the ``commands`` subparsers."""
    sub = commands.add_parser(
        "parallelize", help="plan data / fully sharded / tensor / pipeline parallelism (--run: run and check it)",
        description="Price every way to spread a training step over --devices devices (data parallel, FSDP2 fully "
                    "sharded, tensor parallel derived from the graph, pipeline stages, and their meshes): the "
                    "predicted step time, memory per device and bytes of every collective; choose the fastest that "
                    "fits --memory-per-device (fxforge.parallelize). With --run, start one local process per device "
                    "(gloo on CPU, NCCL on GPUs), run forward, backward and the optimizer, and check the outputs and "
                    "gradients against the model in one process.")
    model_arguments(sub)
    sub.add_argument("--devices", type=_positive, required=True, metavar="N", help="devices (processes)")
    sub.add_argument("--memory-per-device", type=_size, metavar="SIZE", help="the most a device may hold (16GiB)")
    sub.add_argument("--mesh", type=parse_mesh, metavar="AXES",
                     help="force a mesh instead of choosing: tp=2, dp=2,tp=2 (its product is the device count)")
    sub.add_argument("--optimizer", default="adamw", choices=("adamw", "adam", "sgd", "none"),
                     help="the optimizer whose state counts and which --run steps (default adamw)")
    sub.add_argument("--run", action="store_true", dest="launch", help="run the plan on N local processes and check it")
    sub.add_argument("--steps", type=_positive, default=1, metavar="N", help="measured steps with --run (default 1)")
    sub.add_argument("--train", action="store_true", help="train mode (dropout on: the --run check is then not exact)")
    sub.set_defaults(run=run_parallelize, parser=sub)
    return sub
