"""The ``fxforge`` command.

Commands so far: ``fxforge rewrites`` lists the built-in rewrites; ``fxforge optimize MODEL --input
SHAPE[:DTYPE]`` captures and rewrites a model and prints the report. Exit codes: 0 done, 1 failed (one
line saying why), 2 usage.

Example:
    >>> main(["rewrites"])  # doctest: +ELLIPSIS
    cleanup  ...
    0
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
           "bfloat16": torch.bfloat16, "float64": torch.float64, "double": torch.float64, "int64": torch.int64,
           "long": torch.int64, "int32": torch.int32, "int": torch.int32, "bool": torch.bool, "uint8": torch.uint8}
_SHAPE = re.compile(r"^\d+(x\d+)*$")


class CommandError(Exception):
    """A failure to report as one line with exit code 1."""


def parse_input(text: str) -> tuple[tuple[int, ...], torch.dtype]:
    """``2x3x224x224`` or ``1x128:int64`` → shape and dtype.

    Example:
        >>> parse_input("1x128:int64")
        ((1, 128), torch.int64)
    """
    shape_text, _, dtype_text = text.partition(":")
    if not _SHAPE.match(shape_text):
        raise argparse.ArgumentTypeError(f"malformed shape {shape_text!r}; write it like 2x3x224x224")
    dtype_name = dtype_text or "float32"
    if dtype_name not in _DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {dtype_name!r}; choose one of {', '.join(_DTYPES)}")
    return tuple(int(d) for d in shape_text.split("x")), _DTYPES[dtype_name]


def load_model(spec: str, model_args: dict[str, Any]) -> nn.Module:
    """Build the model named by ``path/to/file.py:Name`` or ``package.module:Name`` (a class or factory).

    Example:
        >>> type(load_model("torch.nn:ReLU", {})).__name__
        'ReLU'
    """
    location, sep, name = spec.rpartition(":")
    if not sep or not location or not name:
        raise CommandError(f"MODEL must look like path/to/file.py:Name or package.module:Name, got {spec!r}")
    if location.endswith(".py"):
        path = Path(location)
        if not path.is_file():
            raise CommandError(f"no such file: {location}")
        root, dotted = _import_root(path.resolve())
        sys.path.insert(0, str(root))
        try:
            module = importlib.import_module(dotted)
        except Exception as error:
            raise CommandError(f"{location} failed to import: {type(error).__name__}: {error}") from error
    else:
        try:
            module = importlib.import_module(location)
        except ImportError as error:
            raise CommandError(f"cannot import {location}: {error}") from error
    factory = getattr(module, name, None)
    if factory is None:
        raise CommandError(f"{location} has no {name!r}")
    try:
        model = factory(**model_args)
    except Exception as error:
        raise CommandError(f"{name}({', '.join(f'{k}={v!r}' for k, v in model_args.items())}) raised "
                           f"{type(error).__name__}: {error}") from error
    if not isinstance(model, nn.Module):
        raise CommandError(f"{name} gave a {type(model).__name__}, not an nn.Module")
    return model


def _import_root(path: Path) -> tuple[Path, str]:
    """The folder to put on ``sys.path`` and the dotted name of ``path``, so relative imports work
    in files that live inside packages (folders with ``__init__.py``)."""
    parts = [path.stem]
    folder = path.parent
    while (folder / "__init__.py").is_file():
        parts.insert(0, folder.name)
        folder = folder.parent
    return folder, ".".join(parts)


def _example(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype)
    if dtype == torch.bool:
        return torch.ones(shape, dtype=torch.bool)
    return torch.randint(0, 2, shape, dtype=dtype)


def _cmd_rewrites(args: argparse.Namespace) -> int:
    from fxforge.rewrites.registry import BUILTIN, DEFAULT

    width = max(len(n) for n in BUILTIN)
    for name, rewrite_pass in BUILTIN.items():
        default = " (default)" if name in DEFAULT else ""
        print(f"{name:<{width}}  {rewrite_pass.description}{default}")
    return 0


def _cmd_optimize(args: argparse.Namespace) -> int:
    import fxforge

    model = load_model(args.model, args.model_args).eval()
    inputs = tuple(_example(shape, dtype) for shape, dtype in args.input)
    try:
        captured = fxforge.capture(model, inputs)
    except fxforge.CaptureError as error:
        raise CommandError(str(error)) from error
    new = fxforge.rewrite(captured, args.rewrites, verify=not args.no_verify)
    print(new.report)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (also used for ``--help``)."""
    parser = argparse.ArgumentParser(prog="fxforge", description="Capture, rewrite and run PyTorch models.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("rewrites", help="list the built-in rewrites").set_defaults(run=_cmd_rewrites)
    opt = commands.add_parser("optimize", help="capture and rewrite a model, print the report")
    opt.add_argument("model", help="path/to/file.py:Name or package.module:Name (class or factory)")
    opt.add_argument("--input", action="append", type=parse_input, required=True, metavar="SHAPE[:DTYPE]",
                     help="one per model input, e.g. 2x3x224x224 or 1x128:int64")
    opt.add_argument("--rewrites", default="default", help="comma-separated rewrite names (default: default)")
    opt.add_argument("--no-verify", action="store_true", help="skip the numerical check of each rewrite")
    opt.add_argument("--model-args", type=json.loads, default={}, help='JSON keyword arguments, e.g. \'{"width": 8}\'')
    opt.set_defaults(run=_cmd_optimize)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    from fxforge.rewrites.registry import UnknownRewriteError, resolve

    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "rewrites", None) is not None:
        try:
            resolve(args.rewrites)
        except UnknownRewriteError as error:
            parser.error(str(error))
    if getattr(args, "model_args", None) is not None and not isinstance(args.model_args, dict):
        parser.error("--model-args must be a JSON object")
    try:
        return args.run(args)
    except CommandError as error:
        print(f"fxforge: error: {error}", file=sys.stderr)
        return 1
    except Exception as error:
        if args.debug:
            raise
        print(f"fxforge: error: {type(error).__name__}: {error}".splitlines()[0], file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
