"""The model's example inputs on the command line: ``--input [NAME=]SHAPE[:DTYPE]`` and ``--inputs FILE:FACTORY``.

An ``--input`` without a name is the next positional argument of ``forward``. A name is the argument's
name (``--input attention_mask=2x8:int64``: a keyword input), followed by keys into a dict or indices into a
list the argument holds: ``batch.image`` or ``batch[image]`` is ``forward(batch)`` called with
``batch={"image": ...}``; ``pair[0]`` and ``pair[1]`` make ``pair`` a tuple of two tensors. ``--inputs
file.py:make_inputs`` calls a factory returning the inputs (a tuple of positional inputs, one tensor, a dict
of keyword inputs, or ``(args, kwargs)``); each ``--input`` then gives another shape (and dtype) to one tensor
of them, named as above, with values drawn like the factory's (integers within its range).

Example:
    >>> spec = parse_input("batch.tokens=2x6:int64")
    >>> spec.path, spec.shape, spec.dtype, spec.name
    (('batch', 'tokens'), (2, 6), torch.int64, 'batch.tokens')
    >>> inputs = build_inputs([parse_input("mask=2x3:int64")], signature_of(Masked()))
    Traceback (most recent call last):
    ...
    fxforge.cli.inputs.InputError: --input mask=2x3:int64: the model.forward(x, mask=None) needs x too: give it first (--input SHAPE) or by name (--input x=SHAPE)
    >>> inputs = build_inputs([parse_input("x=2x3"), parse_input("mask=2x3:int64")], signature_of(Masked()))
    >>> [tuple(t.shape) for t in inputs], [t.dtype for t in inputs]   # forward's first two: positional
    ([(2, 3), (2, 3)], [torch.float32, torch.int64])
"""

from __future__ import annotations

import argparse
import inspect
import re
from typing import Any, NamedTuple

import torch
from torch import nn

DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
          "bfloat16": torch.bfloat16, "float64": torch.float64, "double": torch.float64, "int64": torch.int64,
          "long": torch.int64, "int32": torch.int32, "int": torch.int32, "bool": torch.bool, "uint8": torch.uint8}
_SHAPE = re.compile(r"^\d+(x\d+)*$")
_NAME = re.compile(r"^[A-Za-z_]\w*((\.\w+)|(\[\w+\]))*$")
_PART = re.compile(r"\.(\w+)|\[(\w+)\]")


class Masked(nn.Module):
    """A model taking ``x`` and an optional ``mask`` (the module docstring's example).

    Example:
        >>> Masked()(torch.ones(2), mask=torch.zeros(2)).tolist()
        [0.0, 0.0]
    """

    def forward(self, x, mask=None):
        return x if mask is None else x * mask


class InputSpec(NamedTuple):
    """One ``--input``: the shape, the dtype (None: not given, float32 or the factory's), and where the
    tensor goes (``()``: the next positional input; else the argument's name, then dict keys (str) or list
    indices (int)).

    Example:
        >>> InputSpec((2, 8), torch.float32, ("batch", "image")).name
        'batch.image'
    """

    shape: tuple[int, ...]
    dtype: torch.dtype | None = None
    path: tuple = ()

    @property
    def name(self) -> str:
        """The path as a user writes it (``batch.image``, ``pair[0]``; ``""`` for a positional input)."""
        return path_text(self.path)


def path_text(path: tuple) -> str:
    """``("batch", "image")`` -> ``batch.image``; ``("pair", 0)`` -> ``pair[0]``; ``(0,)`` -> ``[0]``.

    Example:
        >>> path_text(("batch", "image")), path_text(("pair", 0)), path_text((1, "a"))
        ('batch.image', 'pair[0]', '[1].a')
    """
    text = ""
    for i, part in enumerate(path):
        text += f"[{part}]" if isinstance(part, int) else (part if i == 0 else f".{part}")
    return text


def parse_input(text: str) -> InputSpec:
    """``[NAME=]SHAPE[:DTYPE]``: ``2x3x224x224``, ``1x128:int64``, ``image=2x3x64x64``, ``batch.tokens=2x6:int64``.

    Raises:
        argparse.ArgumentTypeError: a malformed name or shape, or an unknown dtype.

    Example:
        >>> parse_input("1x128:int64")
        InputSpec(shape=(1, 128), dtype=torch.int64, path=())
        >>> parse_input("pair[1]=4x12").path
        ('pair', 1)
    """
    name, equals, rest = text.rpartition("=")
    path: tuple = ()
    if equals:
        if not _NAME.match(name):
            raise argparse.ArgumentTypeError(
                f"malformed input name {name!r} in {text!r}; write NAME=SHAPE, NAME being forward's argument "
                "(image), then .key or [key] into a dict it takes (batch.image) or [0] into a list")
        head = re.match(r"^[A-Za-z_]\w*", name).group(0)
        keys = [a or b for a, b in _PART.findall(name[len(head):])]
        path = (head, *(int(k) if k.isdigit() else k for k in keys))
    shape_text, _, dtype_text = rest.partition(":")
    if not _SHAPE.match(shape_text):
        raise argparse.ArgumentTypeError(f"malformed shape {shape_text!r} in {text!r}; write it like 2x3x224x224")
    if dtype_text and dtype_text not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {dtype_text!r} in {text!r}; choose one of {', '.join(DTYPES)}")
    return InputSpec(tuple(int(d) for d in shape_text.split("x")), DTYPES[dtype_text] if dtype_text else None, path)


class InputError(Exception):
    """An ``--input`` or ``--inputs`` that does not fit the model or the factory: a usage error (exit 2).

    Example:
        >>> str(InputError("--input imag=2x3: Net.forward() has no argument 'imag'"))
        "--input imag=2x3: Net.forward() has no argument 'imag'"
    """


def format_input(shape: tuple[int, ...], dtype: torch.dtype | None = None, path: tuple = ()) -> str:
    """The ``[NAME=]SHAPE[:DTYPE]`` text of one input, as a user writes it.

    Example:
        >>> format_input((1, 128), torch.int64), format_input((2, 8), torch.float32, ("image",))
        ('1x128:int64', 'image=2x8')
    """
    shape_text = "x".join(str(d) for d in shape) or "scalar"
    name = path_text(path)
    text = shape_text if dtype in (None, torch.float32) else f"{shape_text}:{str(dtype).removeprefix('torch.')}"
    return f"{name}={text}" if name else text


def signature_of(model: nn.Module) -> inspect.Signature | None:
    """``model.forward``'s signature (None where Python cannot read it).

    Example:
        >>> list(signature_of(Masked()).parameters)
        ['x', 'mask']
    """
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None


def _random(spec: InputSpec, generator: torch.Generator, like: torch.Tensor | None = None) -> torch.Tensor:
    """A tensor of ``spec``'s shape: normal floats, integers 0 or 1, booleans True; drawn like ``like`` (its
    dtype unless the spec gives one, integers within its range, a constant tensor kept constant)."""
    dtype = spec.dtype or (like.dtype if like is not None else torch.float32)
    if like is not None and like.numel() and bool((like == like.flatten()[0]).all()):
        return torch.full(spec.shape, like.flatten()[0].item(), dtype=dtype)  # a constant stays one (a mask)
    if like is not None and like.numel() and not like.is_floating_point() and not dtype.is_floating_point:
        low, high = int(like.min()), int(like.max())
        if dtype == torch.bool:
            return torch.full(spec.shape, bool(high), dtype=dtype)
        return torch.randint(low, high + 1, spec.shape, generator=generator, dtype=torch.int64).to(dtype)
    if dtype.is_floating_point:
        return torch.randn(spec.shape, generator=generator).to(dtype)
    if dtype == torch.bool:
        return torch.ones(spec.shape, dtype=torch.bool)
    return torch.randint(0, 2, spec.shape, generator=generator, dtype=dtype)


def _nest(specs: list[InputSpec], generator: torch.Generator) -> dict[str, Any]:
    """The named specs as argument name -> tensor, dict or tuple."""
    roots: dict[str, Any] = {}
    for spec in specs:
        where: Any = roots
        for i, part in enumerate(spec.path):
            last = i == len(spec.path) - 1
            if isinstance(where, torch.Tensor) or (not isinstance(where, dict)):
                raise InputError(f"--input {format_input(*spec)}: {path_text(spec.path[:i])} is already one tensor")
            if last:
                if part in where:
                    raise InputError(f"--input {format_input(*spec)}: {spec.name} is given twice")
                where[part] = _random(spec, generator)
            else:
                where = where.setdefault(part, {})
    return {name: _listed(value, name) for name, value in roots.items()}


def _listed(value: Any, name: str) -> Any:
    """Dicts whose keys are all integers become tuples (they must be 0..n-1)."""
    if not isinstance(value, dict):
        return value
    items = {k: _listed(v, path_text((name, k)) if isinstance(name, str) else name) for k, v in value.items()}
    numbered = [k for k in items if isinstance(k, int)]
    if not numbered:
        return items
    if len(numbered) != len(items) or sorted(numbered) != list(range(len(numbered))):
        raise InputError(f"--input {name}[...]: a list input needs the indices 0 to n-1 and nothing else, "
                         f"got {', '.join(map(str, sorted(items, key=str)))}")
    return tuple(items[i] for i in range(len(items)))


def build_inputs(specs: list[InputSpec], signature: inspect.Signature | None, seed: int = 0,
                 model_name: str = "the model") -> tuple | dict:
    """The example inputs of ``--input`` specs without a factory: a tuple of positional inputs, or (with
    names) a dict of keyword inputs naming every argument, as ``fxforge.optimize`` takes them.

    Raises:
        InputError: a name ``forward`` has no argument for, an argument given twice, a list with gaps.

    Example:
        >>> build_inputs([parse_input("mask=2:int64")], signature_of(Masked()))
        Traceback (most recent call last):
        ...
        fxforge.cli.inputs.InputError: --input mask=2:int64: the model.forward(x, mask=None) needs x too: give it first (--input SHAPE) or by name (--input x=SHAPE)
    """
    generator = torch.Generator().manual_seed(seed)
    positional = [_random(s, generator) for s in specs if not s.path]
    named = [s for s in specs if s.path]
    if not named:
        return tuple(positional)
    roots = _nest(named, generator)
    if signature is None:
        raise InputError(f"--input {format_input(*named[0])}: cannot read {model_name}.forward's arguments")
    call = f"{model_name}.forward{signature!s}"
    parameters = signature.parameters
    accepts_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    for name in roots:
        if name not in parameters and not accepts_any:
            spec = next(s for s in named if s.path[0] == name)
            raise InputError(f"--input {format_input(*spec)}: {call} has no argument {name!r} "
                             f"(its arguments: {', '.join(parameters) or 'none'})")
    try:
        bound = signature.bind(*positional, **roots)
    except TypeError as error:
        missing = [p for p in parameters.values() if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                   p.POSITIONAL_OR_KEYWORD) and p.name not in roots][len(positional):]
        if missing:
            raise InputError(f"--input {format_input(*named[0])}: {call} needs {missing[0].name} too: give it first "
                             f"(--input SHAPE) or by name (--input {missing[0].name}=SHAPE)") from error
        raise InputError(f"--input {format_input(*named[0])}: {call} cannot take these inputs: {error}") from error
    order = [p for p in parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    given = [p.name for p in order if p.name in bound.arguments]
    if given == [p.name for p in order[:len(given)]] and set(bound.arguments) == set(given):
        return tuple(bound.arguments[n] for n in given)  # a prefix of the positional arguments
    if any(p.kind in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL) and p.name in bound.arguments for p in parameters.values()):
        raise InputError(f"--input {format_input(*named[0])}: {call} takes positional-only inputs, which cannot "
                         "be mixed with named ones; give every input without a name, in order")
    return dict(bound.arguments)


def leaves(inputs: Any, path: tuple = ()) -> list[tuple[tuple, torch.Tensor]]:
    """Every tensor of an inputs structure with its path (positional inputs by index).

    Example:
        >>> [(p, tuple(t.shape)) for p, t in leaves(({"image": torch.ones(2, 3)}, torch.ones(4)))]
        [((0, 'image'), (2, 3)), ((1,), (4,))]
    """
    if isinstance(inputs, torch.Tensor):
        return [(path, inputs)]
    if isinstance(inputs, dict):
        return [leaf for k, v in inputs.items() for leaf in leaves(v, (*path, k))]
    if isinstance(inputs, (tuple, list)):
        return [leaf for i, v in enumerate(inputs) for leaf in leaves(v, (*path, i))]
    return []


def described(inputs: tuple | dict, signature: inspect.Signature | None) -> list[InputSpec]:
    """The specs that describe ``inputs`` (positional tensors unnamed, others by argument name and keys), so
    the summary shows what was run.

    Example:
        >>> [format_input(*s) for s in described(({"image": torch.ones(2, 3)}, torch.ones(4)), None)]
        ['[0].image=2x3', '4']
    """
    names = [p.name for p in signature.parameters.values()] if signature is not None else []
    specs = []
    for path, tensor in leaves(inputs):
        if isinstance(inputs, tuple):
            index = path[0]
            if len(path) == 1:
                path = ()
            elif index < len(names):
                path = (names[index], *path[1:])
        specs.append(InputSpec(tuple(tensor.shape), tensor.dtype, path))
    return specs


def factory_inputs(value: Any, where: str, signature: inspect.Signature | None = None) -> tuple | dict:
    """What an ``--inputs`` factory returned, as ``fxforge.optimize`` takes it: a tuple of positional inputs
    (from a tuple, a list or one tensor), a dict of keyword inputs, or positional inputs bound to their names
    (from ``(args, kwargs)``: a tuple/list and a dict).

    Raises:
        InputError: something else, or no tensor at all.

    Example:
        >>> factory_inputs(((torch.ones(2),), {"mask": torch.ones(2)}), "f.py:make", signature_of(Masked()))
        {'x': tensor([1., 1.]), 'mask': tensor([1., 1.])}
    """
    if isinstance(value, torch.Tensor):
        value = (value,)
    if (isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[0], (tuple, list))
            and isinstance(value[1], dict)):
        args, kwargs = tuple(value[0]), dict(value[1])
        if not kwargs:
            value = args
        elif not args:
            value = kwargs
        elif signature is None:
            raise InputError(f"--inputs {where}: cannot read forward's arguments to name its positional inputs")
        else:
            try:
                value = dict(signature.bind(*args, **kwargs).arguments)
            except TypeError as error:
                raise InputError(f"--inputs {where}: forward{signature} cannot take its (args, kwargs): {error}") from error
    if isinstance(value, list):
        value = tuple(value)
    if not isinstance(value, (tuple, dict)):
        raise InputError(f"--inputs {where} returned a {type(value).__name__}; return a tuple of inputs, one tensor, "
                         "a dict of keyword inputs, or (args, kwargs)")
    if not leaves(value):
        raise InputError(f"--inputs {where} returned no tensor")
    return value


def reshaped(inputs: tuple | dict, specs: list[InputSpec], signature: inspect.Signature | None, where: str,
             seed: int = 0) -> tuple | dict:
    """The factory's ``inputs`` with each spec's tensor drawn anew at its shape (and dtype, if given): an
    unnamed spec is the next positional input, a named one the tensor at its path.

    Raises:
        InputError: a spec that names no tensor of the inputs.

    Example:
        >>> out = reshaped({"x": torch.ones(2), "mask": torch.ones(2)}, [parse_input("mask=5")], None, "f:g")
        >>> tuple(out["mask"].shape), out["mask"].unique().tolist()
        ((5,), [1.0])
    """
    generator = torch.Generator().manual_seed(seed)
    names = [p.name for p in signature.parameters.values()] if signature is not None else []
    have = [s.name or f"positional input {i + 1}" for i, s in enumerate(described(inputs, signature))]
    value: Any = _copy(inputs)
    position = 0
    for spec in specs:
        path = spec.path
        if not path:
            if not isinstance(inputs, tuple) or position >= len(value):
                raise InputError(f"--input {format_input(*spec)}: {where} gives no positional input {position + 1}; "
                                 f"name the tensor to reshape ({', '.join(have)})")
            path, position = (position,), position + 1
        elif isinstance(inputs, tuple):
            if path[0] not in names or names.index(path[0]) >= len(value):
                raise InputError(f"--input {format_input(*spec)}: {where} gives no input {path[0]!r} "
                                 f"(it gives {', '.join(have)})")
            path = (names.index(path[0]), *path[1:])
        holder, key = _holder(value, path)
        old = holder.get(key) if isinstance(holder, dict) else (holder[key] if isinstance(key, int) and
                                                                 key < len(holder) else None)
        if not isinstance(old, torch.Tensor):
            raise InputError(f"--input {format_input(*spec)}: {where} gives no tensor at {spec.name or path_text(path)} "
                             f"(it gives {', '.join(have)})")
        holder[key] = _random(spec, generator, like=old)
    return _frozen(value)


def _copy(value: Any) -> Any:
    """A structure of lists and dicts (to fill in) holding the same leaves."""
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_copy(v) for v in value]
    return value


def _frozen(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _frozen(v) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


def _holder(value: Any, path: tuple) -> tuple[Any, Any]:
    """The container holding ``path``'s last step, and that step (None where the path leads nowhere)."""
    for part in path[:-1]:
        if isinstance(value, dict) and part in value or isinstance(value, list) and isinstance(part, int) and part < len(value):
            value = value[part]
        else:
            return {}, None
    return (value, path[-1]) if isinstance(value, (dict, list)) else ({}, None)


def dynamic_shapes_for(inputs: tuple | dict, dims: tuple[int, ...]) -> Any:
    """``torch.export``'s ``dynamic_shapes`` making ``dims`` of every input tensor that has them dynamic: one
    ``Dim`` per dim number and size (inputs of equal size there share it), the structure that of ``inputs``.

    Example:
        >>> shapes = dynamic_shapes_for((torch.ones(2, 5), {"t": torch.ones(2, 7)}), (0, 1))
        >>> [sorted(d) for d in (shapes[0], shapes[1]["t"])], shapes[0][0] is shapes[1]["t"][0]
        ([[0, 1], [0, 1]], True)
    """
    made: dict[tuple[int, int], Any] = {}

    def spec(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return {d: made.setdefault((d, value.shape[d]), torch.export.Dim(f"d{d}_{value.shape[d]}"))
                    for d in dims if d < value.dim()} or None
        if isinstance(value, dict):
            return {k: spec(v) for k, v in value.items()}
        if isinstance(value, (tuple, list)):
            return type(value)(spec(v) for v in value)
        return None

    return spec(inputs)
