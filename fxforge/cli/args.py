"""What the command line is given: input shapes, rewrite names, the model (file or module), outputs.

Parsing errors of arguments are ``argparse.ArgumentTypeError`` (exit 2, with usage); everything that goes
wrong with a well-formed argument (a missing file, a model that raises) is a :class:`CommandError`
(exit 1, one line).

Example:
    >>> parse_input("2x3x8x8")
    InputSpec(shape=(2, 3, 8, 8), dtype=None, path=())
    >>> parse_rewrites("cleanup,conv_bn_fold")
    ['cleanup', 'conv_bn_fold']
    >>> parse_budget("60%")
    '60%'
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fxforge.cli.inputs import DTYPES, InputSpec, format_input, parse_input  # noqa: F401 - the CLI's vocabulary
from fxforge.core import units


class CommandError(Exception):
    """A failure to report as one line with exit code 1.

    Example:
        >>> str(CommandError("no such file: m.py"))
        'no such file: m.py'
    """


def parse_rewrites(text: str) -> list[str]:
    """``a,b`` → the list of rewrite names (``default`` and the built-in names); ``""`` or ``none`` → none.

    Raises:
        argparse.ArgumentTypeError: an unknown name; the message lists the valid ones.

    Example:
        >>> parse_rewrites("none")
        []
    """
    from fxforge.rewrites.registry import UnknownRewriteError, resolve

    names = [n.strip() for n in text.split(",") if n.strip() and n.strip() != "none"]
    try:
        resolve(names)
    except UnknownRewriteError as error:
        raise argparse.ArgumentTypeError(str(error)) from error
    return names


def parse_budget(text: str) -> int | str:
    """A memory budget: ``60%`` (of the step's activation peak without checkpointing, kept as the text
    ``"60%"``), or a size in bytes (``2GiB``, ``512MiB``, ``1.5GB``, ``3000000``) as an int; read by
    :func:`fxforge.core.units.parse_budget` (binary ``KiB``/``MiB``/``GiB``, decimal ``kB``/``MB``/``GB``).

    Raises:
        argparse.ArgumentTypeError: not a percentage or a size, a percentage outside (0, 100], or 0 bytes.

    Example:
        >>> parse_budget("60%"), parse_budget("2GiB"), parse_budget("1.5kb"), parse_budget("4096")
        ('60%', 2147483648, 1500, 4096)
    """
    try:
        kind, value = units.parse_budget(text, name="budget")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error
    return f"{value * 100:g}%" if kind == "fraction" else int(value)


def parse_model_args(text: str) -> dict[str, Any]:
    """The JSON object of ``--model-args``.

    Raises:
        argparse.ArgumentTypeError: not JSON, or not an object.

    Example:
        >>> parse_model_args('{"width": 8}')
        {'width': 8}
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"--model-args is not valid JSON ({error})") from error
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--model-args must be a JSON object, like '{\"width\": 8}'")
    return value


def _import_root(path: Path) -> tuple[Path, str]:
    """The folder to put on ``sys.path`` and the dotted name of ``path``, so relative imports work in
    files that live inside packages (folders with ``__init__.py``)."""
    parts = [path.stem]
    folder = path.parent
    while (folder / "__init__.py").is_file():
        parts.insert(0, folder.name)
        folder = folder.parent
    return folder, ".".join(parts)


def _describe_error(error: BaseException) -> str:
    from fxforge.core.source import first_line, user_frame_of

    where = user_frame_of(error)
    return first_line(error) + (f" at {where}" if where else "")


def load_callable(spec: str, option: str = "MODEL") -> tuple[Any, str]:
    """The function or class named by ``path/to/file.py:Name`` or ``package.module:Name``, and its location.

    Raises:
        CommandError: a missing file, a module that fails to import (or calls ``sys.exit``), a name not
            in it, or something not callable.

    Example:
        >>> load_callable("torch.nn:ReLU")[0].__name__
        'ReLU'
    """
    location, sep, name = spec.rpartition(":")
    if not sep or not location or not name:
        raise CommandError(f"{option} must look like path/to/file.py:Name or package.module:Name, got {spec!r}")
    if location.endswith(".py"):
        path = Path(location)
        if not path.is_file():
            raise CommandError(f"no such file: {location}")
        root, dotted = _import_root(path.resolve())
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
        try:
            module = importlib.import_module(dotted)
        except SystemExit as error:
            raise CommandError(f"{location} called sys.exit({error.code!r}) while being imported") from None
        except Exception as error:
            raise CommandError(f"{location} failed to import: {_describe_error(error)}") from error
    else:
        try:
            module = importlib.import_module(location)
        except SystemExit as error:
            raise CommandError(f"{location} called sys.exit({error.code!r}) while being imported") from None
        except ImportError as error:
            raise CommandError(f"cannot import {location}: {error}") from error
        except Exception as error:
            raise CommandError(f"{location} failed to import: {_describe_error(error)}") from error
    factory = getattr(module, name, None)
    if factory is None:
        raise CommandError(f"{location} has no {name!r}")
    if not callable(factory):
        raise CommandError(f"{location}:{name} is a {type(factory).__name__}, not a class or a function")
    return factory, name


def call_factory(factory: Any, name: str, kwargs: dict[str, Any] | None = None) -> Any:
    """``factory(**kwargs)``; what it raised (or its ``sys.exit``) as a :class:`CommandError`.

    Example:
        >>> call_factory(dict, "dict", {"a": 1})
        {'a': 1}
    """
    kwargs = kwargs or {}
    call = f"{name}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"
    try:
        return factory(**kwargs)
    except SystemExit as error:
        raise CommandError(f"{call} called sys.exit({error.code!r})") from None
    except Exception as error:
        raise CommandError(f"{call} raised {_describe_error(error)}") from error


def load_model(spec: str, model_args: dict[str, Any] | None = None) -> nn.Module:
    """Build the model named by ``path/to/file.py:Name`` or ``package.module:Name``.

    ``Name`` is an ``nn.Module`` class or a factory function, called with ``model_args`` as keyword
    arguments. A factory may also return ``(model, example_inputs)`` (as the bundled examples do): the
    model is used.

    Raises:
        CommandError: a missing file, a module that fails to import (or calls ``sys.exit``), a name not
            in it, a call that raises (or calls ``sys.exit``), or something that is not an ``nn.Module``.

    Example:
        >>> type(load_model("torch.nn:ReLU")).__name__
        'ReLU'
    """
    factory, name = load_callable(spec)
    model = call_factory(factory, name, model_args)
    if isinstance(model, tuple) and model and isinstance(model[0], nn.Module):
        model = model[0]  # a factory returning (model, example_inputs)
    if not isinstance(model, nn.Module):
        call = f"{name}({', '.join(f'{k}={v!r}' for k, v in (model_args or {}).items())})"
        raise CommandError(f"{call} gave a {type(model).__name__}, not an nn.Module")
    return model


def load_weights(model: nn.Module, path: str) -> None:
    """Load a state dict (``torch.save(model.state_dict(), path)``, or a checkpoint dict holding one under
    ``"state_dict"``) into ``model``.

    Raises:
        CommandError: no such file, not a state dict, or keys/shapes that do not fit the model.

    Example:
        >>> load_weights(torch.nn.ReLU(), "missing.pt")
        Traceback (most recent call last):
        ...
        fxforge.cli.args.CommandError: no such weights file: missing.pt
    """
    if not os.path.isfile(path):
        raise CommandError(f"no such weights file: {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise CommandError(f"cannot read weights {path}: {type(error).__name__}: {str(error).splitlines()[0]}") from error
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise CommandError(f"{path} holds a {type(state).__name__}, not a state dict")
    try:
        model.load_state_dict(state)
    except Exception as error:
        message = " ".join(str(error).split())
        raise CommandError(f"weights {path} do not fit {type(model).__name__}: {message[:300]}") from error


def example_inputs(specs: list[InputSpec], seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random positional inputs of the given shapes and dtypes (normal floats; integers 0 or 1; booleans
    True); :func:`fxforge.cli.inputs.build_inputs` also places named ones.

    Example:
        >>> [tuple(t.shape) for t in example_inputs([parse_input("2x3"), parse_input("2:int64")])]
        [(2, 3), (2,)]
    """
    from fxforge.cli.inputs import build_inputs

    return build_inputs([s._replace(path=()) for s in specs], None, seed)


def call_model(model: Any, inputs: tuple | dict) -> Any:
    """``model(*inputs)`` for a tuple, ``model(**inputs)`` for a dict of keyword inputs.

    Example:
        >>> call_model(torch.nn.ReLU(), {"input": -torch.ones(1)}).tolist()
        [0.0]
    """
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def check_eager(model: nn.Module, inputs: tuple | dict, specs: list[InputSpec]) -> Any:
    """Run the model once on the inputs; its outputs, or a :class:`CommandError` naming the input shapes
    (the model rejects them, or raises for another reason).

    Example:
        >>> check_eager(torch.nn.Linear(8, 2), (torch.ones(2, 5),), [parse_input("2x5")])
        Traceback (most recent call last):
        ...
        fxforge.cli.args.CommandError: Linear raised on example inputs of shape 2x5: RuntimeError: mat1 and mat2 shapes cannot be multiplied (2x5 and 8x2)
    """
    from fxforge.core.verify import isolated

    try:
        with isolated(model), torch.no_grad():
            return call_model(model, inputs)
    except Exception as error:
        shapes = ", ".join(format_input(*spec) for spec in specs)
        raise CommandError(f"{type(model).__name__} raised on example inputs of shape {shapes}: "
                           f"{_describe_error(error)}") from error


def check_output_suffix(path: str, suffixes: tuple[str, ...], option: str) -> None:
    """Usage check of an output's suffix.

    Example:
        >>> check_output_suffix("m.txt", (".onnx", ".pt2"), "-o")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: -o m.txt: the file name must end in .onnx or .pt2
    """
    if not path.lower().endswith(suffixes):
        raise argparse.ArgumentTypeError(f"{option} {path}: the file name must end in {' or '.join(suffixes)}")


def check_output(path: str, suffixes: tuple[str, ...], option: str = "-o") -> str:
    """Check, before any work, that ``path`` can be written: a known suffix (else a usage error) and an
    existing folder that is not ``path`` itself.

    Raises:
        argparse.ArgumentTypeError: a suffix not in ``suffixes``.
        CommandError: no such folder, or ``path`` is a folder.

    Example:
        >>> check_output("/no/such/folder/m.onnx", (".onnx",))
        Traceback (most recent call last):
        ...
        fxforge.cli.args.CommandError: cannot write /no/such/folder/m.onnx: no folder /no/such/folder
    """
    check_output_suffix(path, suffixes, option)
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise CommandError(f"cannot write {path}: {folder} is a file, not a folder")
    if not os.path.isdir(folder):
        raise CommandError(f"cannot write {path}: no folder {folder}")
    if os.path.isdir(path):
        raise CommandError(f"cannot write {path}: it is a folder")
    if not os.access(folder, os.W_OK):
        raise CommandError(f"cannot write {path}: the folder {folder} is not writable")
    return path


_DYNAMIC_WORDS = {"batch": "batch", "length": "length", "seq": "length", "sequence": "length"}


def parse_dynamic(text: str) -> str | tuple:
    """``--dynamic``: ``auto``, ``none``, or a comma-separated list of ``batch``, ``length`` (also ``seq``) or
    dim numbers (``0,1``), as a tuple.

    Raises:
        argparse.ArgumentTypeError: another word, a negative dim, names and numbers mixed.

    Example:
        >>> parse_dynamic("auto"), parse_dynamic("none"), parse_dynamic("batch,seq"), parse_dynamic("0,2")
        ('auto', 'none', ('batch', 'length'), (0, 2))
    """
    words = [w.strip().lower() for w in text.split(",") if w.strip()]
    if words in (["auto"], ["none"]):
        return words[0]
    if not words:
        raise argparse.ArgumentTypeError("--dynamic takes auto, none, batch, batch,length or dim numbers like 0,1")
    if all(w.isdigit() for w in words):
        return tuple(sorted({int(w) for w in words}))
    unknown = [w for w in words if w not in _DYNAMIC_WORDS]
    if unknown:
        raise argparse.ArgumentTypeError(f"--dynamic {text}: unknown dim {unknown[0]!r}; write auto, none, batch, "
                                         "batch,length, or dim numbers like 0,1 (not mixed with names)")
    return tuple(dict.fromkeys(_DYNAMIC_WORDS[w] for w in words))
