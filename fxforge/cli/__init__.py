"""The ``fxforge`` command: optimize and export a model in one line, profile it, look at its graph.

::

    fxforge optimize MODEL --input [NAME=]SHAPE[:DTYPE] [--input ...] [--inputs FILE.py:FACTORY]
                     [--target auto|native|inductor|onnxruntime] [--rewrites a,b] [--no-verify]
                     [--dynamic auto|none|batch|batch,length|0,1] [-o OUT.pt2|OUT.onnx] [--report r.html]
                     [--objective latency|throughput]
    fxforge export   MODEL --input ... -o OUT.onnx          (no rewrites)
    fxforge profile  MODEL --input ... [--csv table.csv]    (time, FLOPs, bytes per node)
    fxforge show     MODEL --input ... [-o graph.svg|graph.html]
    fxforge memory   MODEL --input ... [--optimizer adamw] [--measure] [--budget 60%|2GiB]
                                                             (one training step's memory; checkpointing plan)
    fxforge partition MODEL --input ... --stages K [--microbatches M] [--memory-per-stage 2GiB] [--run]
                                                             (pipeline stages; --run: run and check them)
    fxforge parallelize MODEL --input ... --devices N [--memory-per-device 16GiB] [--mesh tp=2] [--run]
                                                             (data / sharded / tensor / pipeline plans)
    fxforge lint     MODEL --input ... [--rules a,b]        (silent tensor bugs; exit 1 on an error finding)
    fxforge bench    MODEL --input ... [--targets eager,native,onnxruntime,inductor] [--cores 1,2] [--reps N]
                                                             (latency, throughput, scalability per target)
    fxforge rewrites                                         (the built-in rewrites)

MODEL is ``path/to/file.py:Name`` or ``package.module:Name``: an ``nn.Module`` class or a factory,
called with no arguments or with ``--model-args '{"width": 8}'``; ``--weights file.pt`` loads a state
dict. Inputs: ``--input 2x3x224x224`` (positional), ``--input text=2x8:int64`` (by name),
``--input batch.image=2x3x16x16`` (into a dict argument), or ``--inputs inputs.py:make_inputs`` (a factory;
``--input`` then reshapes its tensors); see :mod:`fxforge.cli.inputs`. A model TorchDynamo breaks into graphs works
graph by graph in ``optimize`` (without ``-o``), ``show``, ``profile`` and ``memory``; ``-o`` files, ``export``,
``memory --budget`` and ``partition`` need one whole graph and refuse, naming each break (:mod:`fxforge.cli.breaks`). Exit codes: 0 done, 1 failed (one line saying why; ``--debug`` for the traceback), 2 usage.

Example:
    >>> main(["rewrites"])  # doctest: +ELLIPSIS
    cleanup  ...
    0
"""

from __future__ import annotations

import argparse
import logging
import sys
import textwrap
import warnings

from fxforge.api import THROUGHPUT_TARGETS
from fxforge.capture import CaptureError
from fxforge.cli.args import (
    CommandError,
    check_output_suffix,
    load_model,
    parse_budget,
    parse_dynamic,
    parse_input,
    parse_model_args,
    parse_rewrites,
)
from fxforge.cli.bench import add_bench_command
from fxforge.cli.breaks import WHOLE_GRAPH
from fxforge.cli.commands import check_target, run_export, run_optimize, run_rewrites, run_show
from fxforge.cli.dynamic import check_dynamic
from fxforge.cli.failures import capture_failure
from fxforge.cli.inputs import InputError
from fxforge.cli.lint import add_lint_command
from fxforge.cli.memory import AUTOCAST, add_memory_options, run_memory
from fxforge.cli.parallelize import add_parallelize_command
from fxforge.cli.partition import add_partition_command
from fxforge.cli.profile import run_profile
from fxforge.targets import TARGETS
from fxforge.training.optimizer_memory import OPTIMIZERS

__all__ = ["CommandError", "build_parser", "load_model", "main", "parse_input"]

_EXAMPLES = """\
examples:
  fxforge optimize examples/models/resnet_cnn.py:ResNetCNN --input 2x3x32x32 -o resnet.pt2 --report report.html
  fxforge optimize my_model.py:build --input 1x128:int64 --model-args '{"width": 8}' -o model.onnx
  fxforge optimize bert.py:Bert --input input_ids=2x128:int64 --input attention_mask=2x128:int64 -o bert.onnx
  fxforge optimize towers.py:TwoTower --input batch.image=2x3x64x64 --input batch.tokens=2x16:int64
  fxforge export my_model.py:Net --inputs my_model.py:make_inputs --input 8x3x224x224 -o net.onnx --dynamic none
  fxforge show examples/models/resnet_cnn.py:ResNetCNN --input 1x3x32x32 -o graph.html
  fxforge memory examples/models/transformer_encoder.py:example --input 8x64:int64 --measure --budget 60%
  fxforge partition examples/models/transformer_encoder.py:example --input 8x64:int64 --stages 2 --run
  fxforge lint examples/models/resnet_cnn.py:ResNetCNN --input 2x3x32x32
"""


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL",
                        help="path/to/file.py:Name or package.module:Name (an nn.Module class or a factory)")
    parser.add_argument("--input", action="append", type=parse_input, metavar="[NAME=]SHAPE[:DTYPE]",
                        help="one per model input, in forward's order: 2x3x224x224, 1x128:int64 (default dtype "
                             "float32; integers are 0 or 1). NAME= passes it by name: attention_mask=2x128:int64; "
                             "a dotted or bracketed NAME goes into a dict (or list) argument: batch.image=2x3x16x16 "
                             "batch.tokens=2x6:int64 call forward(batch={'image': ..., 'tokens': ...}), "
                             "pair[0]=4x12 pair[1]=4x12 call forward(pair=(..., ...)). With --inputs it gives one "
                             "of the factory's tensors another shape (or dtype)")
    parser.add_argument("--inputs", metavar="FILE.py:FACTORY",
                        help="a function returning example inputs: a tuple of positional inputs, one tensor, a "
                             "dict of keyword inputs, or (args, kwargs); --input then reshapes its tensors")
    parser.add_argument("--model-args", type=parse_model_args, default={}, metavar="JSON",
                        help='keyword arguments for Name, e.g. \'{"width": 8}\'')
    parser.add_argument("--weights", metavar="FILE.pt", help="a state dict to load into the model")


def _rewrite_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rewrites", type=parse_rewrites, default="default", metavar="A,B",
                        help="comma-separated rewrite names, 'default' or 'none' (see `fxforge rewrites`)")
    parser.add_argument("--no-verify", action="store_true", help="skip the numerical check of each rewrite")


def _write_arguments(parser: argparse.ArgumentParser, *, output_required: bool) -> None:
    parser.add_argument("-o", "--output", metavar="OUT", required=output_required,
                        help="OUT.pt2 (torch.export program, load with fxforge.load) or OUT.onnx "
                             "(checked and validated in ONNX Runtime)")
    writers = ", ".join(f"{t.contract.artifact}: {t.name}" for t in TARGETS.values() if t.contract.artifact)
    raced = ", ".join(t.name for t in TARGETS["auto"].raced())
    parser.add_argument("--target", choices=tuple(TARGETS), default="auto",
                        help=f"what the model runs in; auto (the default) races {raced} and keeps the fastest "
                             f"that agrees with eager; with -o, auto is the target that writes the file's suffix "
                             f"({writers})")
    parser.add_argument("--dynamic", type=parse_dynamic, default="auto", metavar="DIMS",
                        help="dims of -o's file that take any size: auto (the default: for .onnx the batch, and "
                             "the sequence length of token inputs, as fxforge.export_onnx(dynamic=True); for "
                             ".pt2 the batch), none (a static file), batch, batch,length, or dim numbers (0,1: "
                             "those dims of every input that has them)")
    parser.add_argument("--dynamic-batch", action="store_const", const=("batch",), dest="dynamic",
                        help=argparse.SUPPRESS)  # the older spelling of --dynamic batch
    parser.add_argument("--report", metavar="REPORT.html", help="write a self-contained HTML report")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (also what ``--help`` prints).

    Example:
        >>> build_parser().parse_args(["optimize", "m.py:Net", "--input", "2x8"]).input
        [InputSpec(shape=(2, 8), dtype=None, path=())]
    """
    description = "Capture, rewrite, export and profile PyTorch models.\n\n" + textwrap.fill(WHOLE_GRAPH, 100)
    parser = argparse.ArgumentParser(prog="fxforge", description=description,
                                     epilog=_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show tracebacks and warnings")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    opt = commands.add_parser("optimize", help="rewrite a model; write .pt2 or .onnx; summary and report",
                              description="Capture and rewrite a model, write it as a native .pt2 or an ONNX file, "
                                          "and print what changed, with memory and latency before and after.")
    _model_arguments(opt)
    _rewrite_arguments(opt)
    _write_arguments(opt, output_required=False)
    opt.add_argument("--precision", choices=("float32", "bf16", "fp16", "int8", "auto"), default="float32",
                     help="run matrix products and convolutions in this precision where the outputs keep "
                          "--tolerance and the plan measures faster (with --target native or auto; auto: the "
                          "fastest of bf16 and int8, bf16 and fp16 on CUDA; int8 also with --target onnxruntime, "
                          "where -o writes the int8 ONNX file, and with --target inductor)")
    opt.add_argument("--tolerance", type=float, default=None, metavar="R",
                     help="the largest relative error against float32 accepted with --precision (default 0.05)")
    opt.add_argument("--objective", choices=("latency", "throughput"), default="latency",
                     help="latency (the default: one call at a time) or throughput (many independent requests: "
                          "streams x threads x batch chosen by measurement, with --target native; its table is "
                          "printed)")
    opt.add_argument("--no-bench", action="store_true", help="do not time eager against optimized")
    opt.add_argument("--bench-reps", type=int, default=10, metavar="N", help="timed repetitions of each (default 10)")
    opt.set_defaults(run=run_optimize, parser=opt)

    exp = commands.add_parser("export", help="write a model as .onnx (or .pt2) without rewrites",
                              description="Capture a model and write it as an ONNX file (or .pt2), without rewrites.")
    _model_arguments(exp)
    _write_arguments(exp, output_required=True)
    exp.add_argument("--no-verify", action="store_true", help=argparse.SUPPRESS)
    exp.add_argument("--bench", action="store_true", help="time eager against the exported model")
    exp.add_argument("--bench-reps", type=int, default=10, metavar="N", help="timed repetitions (default 10)")
    exp.set_defaults(run=run_export, rewrites=[], parser=exp)

    prof = commands.add_parser("profile", help="per-node time, FLOPs, bytes, compute/memory bound",
                               description="Profile a model node by node (fxforge.profile).")
    _model_arguments(prof)
    prof.add_argument("--csv", metavar="TABLE.csv", help="save the full table")
    prof.add_argument("--top", type=int, default=15, metavar="N", help="rows to print (default 15)")
    prof.add_argument("--by-op", action="store_true", help="also print the time per op type")
    prof.add_argument("--optimized", action="store_true",
                      help="profile the graph fxforge.optimize runs (rewritten, fused ops lowered) instead of the captured one")
    prof.add_argument("--warmup", type=int, default=2, metavar="N", help="untimed runs first (default 2)")
    prof.add_argument("--repeat", type=int, default=5, metavar="N", help="timed runs (default 5)")
    prof.set_defaults(run=run_profile, parser=prof)

    show = commands.add_parser("show", help="the graph before and after the rewrites",
                               description="Show the captured and rewritten graphs, rewritten nodes marked: as text, "
                                           "or drawn with -o graph.svg (rewritten) / graph.html (both, and the report).")
    _model_arguments(show)
    _rewrite_arguments(show)
    show.add_argument("-o", "--output", metavar="OUT", help="graph.svg or graph.html")
    show.set_defaults(run=run_show, parser=show)

    mem = commands.add_parser(
        "memory", help="one training step's memory: weights, gradients, optimizer state, activations",
        description="Predict the memory of one training step (forward, backward, optimizer step) from its graphs, "
                    "before it runs: weights + gradients + optimizer state + activations saved for the backward, "
                    "each phase's peak, and per module (fxforge.training_memory). The model is put in train mode "
                    "(model.train()): dropout and batch norm run as in training. The loss is the sum of the "
                    "model's floating-point outputs. With --budget, also the activation checkpointing plan that "
                    "fits the budget with the least recomputation.")
    _model_arguments(mem)
    mem.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adamw",
                     help="the optimizer whose state and step are counted (default adamw; sgd has momentum 0.9)")
    mem.add_argument("--autocast", choices=tuple(AUTOCAST),
                     help="run the forward under torch.autocast in this dtype, as mixed-precision training does")
    mem.add_argument("--measure", action="store_true",
                     help="also run one real step (after a warm-up step; the weights are restored) and show the "
                          "measured figures beside the predicted ones, with the error of each")
    mem.add_argument("--budget", type=parse_budget, metavar="BUDGET",
                     help="plan activation checkpointing under this budget: a percentage of the activation peak "
                          "without checkpointing (60%%), or a cap on the whole step's peak (2GiB, 512MiB, bytes)")
    mem.add_argument("--depth", type=int, default=1, metavar="N",
                     help="module names cut to N dots in the per-module table (default 1; 0: the innermost modules)")
    mem.add_argument("--csv", metavar="TABLE.csv", help="save the breakdown (bytes per figure)")
    add_memory_options(mem)
    mem.set_defaults(run=run_memory, parser=mem)

    part = add_partition_command(commands, _model_arguments)
    par = add_parallelize_command(commands, _model_arguments)
    lin = add_lint_command(commands, _model_arguments)
    bench = add_bench_command(commands, _model_arguments)

    commands.add_parser("rewrites", help="list the built-in rewrites",
                        description="List the built-in rewrites, one line each.").set_defaults(run=run_rewrites)
    for sub in (opt, exp, prof, show, mem, part, par, lin, bench):  # --debug also after the command's name
        sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks and warnings")
    return parser


def _quiet_libraries() -> None:
    """torch's export and ONNX loggers print progress and warnings on stderr: errors only."""
    from fxforge.exporters.program import NOISY_LOGGERS

    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def check_precision(args: argparse.Namespace) -> None:
    """``--precision`` and ``--tolerance`` of ``fxforge optimize``: a reduced precision runs with ``--target native``
    or ``auto`` (not written to a file yet), for int8 with ``--target onnxruntime`` (the file quantized by ONNX
    Runtime), and for int8 and auto with ``--target inductor`` (not written to a file).

    Raises:
        argparse.ArgumentTypeError: (a usage error) the combination is not served.

    Example:
        >>> check_precision(argparse.Namespace(precision="bf16", target="inductor", output=None, tolerance=None))
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: --precision bf16 runs with --target native or auto (int8 also with --target onnxruntime or inductor)
    """
    if args.tolerance is not None and not args.tolerance > 0:
        raise argparse.ArgumentTypeError(f"--tolerance {args.tolerance}: expected a positive relative error")
    if args.precision == "float32":
        return
    if args.precision == "int8" and args.target == "onnxruntime":
        return
    if args.target not in ("native", "auto") and not (args.target == "inductor" and args.precision in ("int8", "auto")):
        raise argparse.ArgumentTypeError(f"--precision {args.precision} runs with --target native or auto (int8 "
                                         "also with --target onnxruntime or inductor)")
    if args.output:
        raise argparse.ArgumentTypeError(f"--precision {args.precision} plans of --target {args.target} are not "
                                         "written to files yet; leave out -o (int8: --target onnxruntime -o "
                                         "model.onnx)")


def check_objective(args: argparse.Namespace) -> None:
    """``--objective throughput`` of ``fxforge optimize`` runs with ``--target native`` or ``onnxruntime`` (``auto``,
    the default, is taken as native) and float32.

    Raises:
        argparse.ArgumentTypeError: (a usage error) the combination is not served.

    Example:
        >>> check_objective(argparse.Namespace(objective="throughput", target="inductor", precision="float32"))
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: --objective throughput runs with --target native or onnxruntime, not inductor
    """
    if args.objective != "throughput":
        return
    if args.target == "auto":
        args.target = "native"
    if args.target not in THROUGHPUT_TARGETS:
        raise argparse.ArgumentTypeError(f"--objective throughput runs with --target {' or '.join(THROUGHPUT_TARGETS)}, "
                                         f"not {args.target}")
    if args.precision != "float32":
        raise argparse.ArgumentTypeError("--objective throughput runs in float32; leave out --precision")


def main(argv: list[str] | None = None) -> int:
    """Run the command line with ``argv`` (default ``sys.argv[1:]``); returns the exit code.

    Example:
        >>> main(["optimize", "torch.nn:NoSuchModule", "--input", "2x8"])  # stderr: one line saying why
        1
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if hasattr(args, "input") and not args.input and not getattr(args, "inputs", None):
            raise argparse.ArgumentTypeError("give the model's example inputs: --input SHAPE[:DTYPE] (one per input) "
                                             "or --inputs FILE.py:FACTORY")
        if args.command == "optimize":
            check_precision(args)
            check_objective(args)
        if args.command in ("optimize", "export"):
            check_target(args)
            check_dynamic(args)
            if args.report:
                check_output_suffix(args.report, (".html", ".htm"), "--report")
        elif args.command == "show" and args.output:
            check_output_suffix(args.output, (".svg", ".html", ".htm"), "-o")
        elif args.command in ("profile", "memory", "lint") and args.csv:
            check_output_suffix(args.csv, (".csv",), "--csv")
        if args.command == "memory" and args.depth < 0:
            raise argparse.ArgumentTypeError("--depth must be 0 or more")
        if getattr(args, "bench_reps", 1) < 0:
            raise argparse.ArgumentTypeError("--bench-reps must be 0 or more")
    except argparse.ArgumentTypeError as error:
        getattr(args, "parser", parser).error(str(error))
    if not args.debug:
        _quiet_libraries()
    try:
        if args.debug:
            return args.run(args)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return args.run(args)
    except KeyboardInterrupt:
        print("fxforge: interrupted", file=sys.stderr)
        return 130
    except SystemExit as error:  # the model's code called sys.exit (fxforge's own code never does)
        if args.debug:
            raise
        print(f"fxforge: error: the model called sys.exit({error.code!r})", file=sys.stderr)
        return 1
    except InputError as error:  # an --input that does not fit the model: a usage error
        if args.debug:
            raise
        print(f"{getattr(args, 'parser', parser).prog}: error: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        if args.debug:
            raise
        message = str(error) if isinstance(error, CommandError) else _one_line(error)
        captured = error if isinstance(error, CaptureError) else error.__cause__
        if isinstance(captured, CaptureError) and not isinstance(error, CommandError):  # its line, what to do
            message = capture_failure(str(captured).removeprefix("cannot capture ").split(":")[0], captured)
        print(f"fxforge: error: {message}", file=sys.stderr)
        return 1


def _one_line(error: BaseException) -> str:
    """The error's first line, with its type unless it is one of fxforge's (whose messages say what failed)."""
    text = " ".join(str(error).strip().splitlines()[:1]) or type(error).__name__
    own = type(error).__module__.startswith("fxforge") or isinstance(error, (FileNotFoundError, PermissionError))
    return text if own else f"{type(error).__name__}: {text}"
