"""The TorchScript exporter (``torch.onnx.export(..., dynamo=False)``) as the fallback for a program that
torch.onnx's dynamo exporter refuses: it writes the same program's graph, with the same inputs and outputs in
the same order, so the file is fed, validated and reported like any other (see
:func:`fxforge.exporters.onnx.write_checked`).

Cases where torch 2.13's dynamo exporter fails and the TorchScript exporter does not: attention on 5-D query,
key and value (``only 4D query, key, and value are supported``), and a view of SDPA's output where SDPA took an
additive float mask computed in forward (the decomposition gives its output other strides: ``Cannot view a
tensor with shape ... and strides ...``).

Example:
    >>> import torch
    >>> program = torch.export.export(torch.nn.Linear(3, 2), (torch.ones(4, 3),))
    >>> [name for name, _ in dynamic_axes(program)[0].items()]
    []
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fxforge.core.source import first_line
from fxforge.core.tracing import tracing
from fxforge.exporters.program import ExportError, quiet


@contextlib.contextmanager
def native_output(log: io.StringIO) -> Iterator[None]:
    """Send what C++ code writes to the process's stdout during the block into ``log``, and leave torch's ONNX
    log switch as it was: torch 2.13's TorchScript exporter turns it on for good (its ``setup_onnx_logging``
    tests the function ``_jit_is_onnx_log_enabled`` for truth instead of calling it) and then prints the
    whole TorchScript graph to stdout when an op fails to translate.

    Example:
        >>> log = io.StringIO()
        >>> with native_output(log):
        ...     _ = os.write(1, b"from C++\\n")
        >>> log.getvalue()
        'from C++\\n'
    """
    enabled = torch._C._jit_is_onnx_log_enabled()
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with tempfile.TemporaryFile() as sink:
            os.dup2(sink.fileno(), 1)
            try:
                yield
            finally:
                os.dup2(saved, 1)
                sink.seek(0)
                log.write(sink.read().decode(errors="replace"))
    finally:
        os.close(saved)
        torch._C._jit_set_onnx_log_enabled(enabled)


class _FlatProgram(torch.nn.Module):
    """The module a program was exported from, called with its tensor user inputs, flat and in order,
    returning its tensor outputs flat and in order: what the TorchScript exporter traces (its graph inputs and
    outputs then line up with the program's, as :meth:`~fxforge.exporters.io_spec.IOSpec.from_exported_program`
    reads them)."""

    def __init__(self, module: torch.nn.Module, args: tuple, kwargs: dict):
        super().__init__()
        self.inner = module
        leaves, self.structure = pytree.tree_flatten((tuple(args), dict(kwargs)))
        self.slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        self.leaves = [None if i in self.slots else leaf for i, leaf in enumerate(leaves)]

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        leaves = list(self.leaves)
        for slot, tensor in zip(self.slots, tensors):
            leaves[slot] = tensor
        args, kwargs = pytree.tree_unflatten(leaves, self.structure)
        return tuple(leaf for leaf in pytree.tree_leaves(self.inner(*args, **kwargs)) if isinstance(leaf, torch.Tensor))


def dynamic_axes(program: torch.export.ExportedProgram,
                 dynamic_shapes: Any = None) -> tuple[dict[str, dict[int, str]], list[str], list[str]]:
    """``(dynamic_axes, input_names, output_names)`` for the TorchScript exporter: every dim that ``program``
    keeps symbolic, on its tensor user inputs and outputs, named as ``dynamic_shapes`` (the spec it was
    exported with) names its ``Dim`` (``batch``), else by its symbol (``s0``) or expression, as the dynamo
    exporter's files are.

    Example:
        >>> batch = torch.export.Dim("batch")
        >>> spec = ({0: batch},)
        >>> program = torch.export.export(torch.nn.Linear(3, 2), (torch.ones(4, 3),), dynamic_shapes=spec)
        >>> dynamic_axes(program, spec)
        ({'input_0': {0: 'batch'}, 'output_0': {0: 'batch'}}, ['input_0'], ['output_0'])
    """
    from torch.export.graph_signature import InputKind, OutputKind, TensorArgument

    nodes = {n.name: n for n in program.graph.nodes}
    axes: dict[str, dict[int, str]] = {}

    def named(kind: str, specs: list) -> list[str]:
        names = []
        for spec in specs:
            if not isinstance(spec.arg, TensorArgument):
                continue
            name = f"{kind}_{len(names)}"
            names.append(name)
            value = nodes[spec.arg.name].meta.get("val") if spec.arg.name in nodes else None
            dims = {axis: str(size.node.expr) for axis, size in enumerate(getattr(value, "shape", ()))
                    if isinstance(size, torch.SymInt)}
            if dims:
                axes[name] = dims
        return names

    signature = program.graph_signature
    inputs = named("input", [s for s in signature.input_specs if s.kind == InputKind.USER_INPUT])
    outputs = named("output", [s for s in signature.output_specs if s.kind == OutputKind.USER_OUTPUT])
    names = _dim_names(axes, inputs, dynamic_shapes)
    return {k: {axis: names.get(dim, dim) for axis, dim in v.items()} for k, v in axes.items()}, inputs, outputs


def _dim_names(axes: dict[str, dict[int, str]], inputs: list[str], dynamic_shapes: Any) -> dict[str, str]:
    """``{symbol: Dim name}`` from the spec (flattened as torch.onnx flattens it: one entry per tensor input,
    in order); {} where the spec does not line up with the inputs."""
    if dynamic_shapes is None:
        return {}
    from torch.onnx._internal.exporter import _dynamic_shapes

    try:
        flat, _ = _dynamic_shapes._flatten_dynamic_shapes_to_axes(dynamic_shapes)
    except Exception:  # noqa: BLE001 - a spec torch.onnx cannot read: the symbols keep their names
        return {}
    if len(flat) != len(inputs):
        return {}
    names: dict[str, str] = {}
    for name, spec in zip(inputs, flat):
        dims = spec.items() if isinstance(spec, dict) else enumerate(spec or ())
        for axis, dim in dims:
            symbol, given = axes.get(name, {}).get(axis), getattr(dim, "__name__", None)
            if symbol is not None and isinstance(given, str):
                names.setdefault(symbol, given)
    return names


def requested_axes(module: torch.nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any
                   ) -> dict[int, dict[int, str]]:
    """``{tensor input: {axis: name}}``: the dims ``dynamic_shapes`` asks to be dynamic, per tensor input in
    order (as the TorchScript exporter names its inputs ``input_0``...), named by their ``Dim`` (else
    ``d{input}_{axis}``).

    Example:
        >>> linear = torch.nn.Linear(4, 2)
        >>> requested_axes(linear, (torch.ones(3, 4),), {}, {"input": {0: torch.export.Dim("rows")}})
        {0: {0: 'rows'}}
    """
    from fxforge.capture.dims import leaf_dims

    leaves = pytree.tree_leaves((tuple(args), dict(kwargs)))
    tensor_index = {leaf: i for i, leaf in enumerate(j for j, v in enumerate(leaves) if isinstance(v, torch.Tensor))}
    found = leaf_dims(module, args, kwargs, dynamic_shapes)
    return {tensor_index[leaf]: {axis: getattr(dim, "__name__", None) or f"d{tensor_index[leaf]}_{axis}"
                                 for axis, dim in axes.items()}
            for leaf, axes in found.items() if leaf in tensor_index}


def resized_inputs(args: tuple, kwargs: dict, axes: dict[int, dict[int, str]]) -> list[tuple[str, tuple, dict]]:
    """Inputs to validate a file on whose ``axes`` (as :func:`requested_axes`) are dynamic: each such dim one
    larger, then halved (where that leaves at least 1), the example's entries repeated
    (:func:`fxforge.capture.dims.resized`); ``(label, args, kwargs)`` each.

    Example:
        >>> [(label, a[0].shape) for label, a, _ in resized_inputs((torch.ones(2, 6),), {}, {0: {1: "seq"}})]
        [('seq 7', torch.Size([2, 7])), ('seq 3', torch.Size([2, 3]))]
    """
    from fxforge.capture.dims import resized

    leaves, structure = pytree.tree_flatten((tuple(args), dict(kwargs)))
    tensors = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    found = []
    for grow in (lambda size: size + 1, lambda size: size // 2):
        changed, labels = list(leaves), []
        for index, dims in axes.items():
            tensor = changed[tensors[index]]
            for axis, name in dims.items():
                new = grow(tensor.shape[axis])
                if new >= 1 and new != tensor.shape[axis]:
                    tensor = resized(tensor, axis, new)
                    labels.append(f"{name} {new}")
            changed[tensors[index]] = tensor
        if labels:
            new_args, new_kwargs = pytree.tree_unflatten(changed, structure)
            found.append((", ".join(dict.fromkeys(labels)), new_args, new_kwargs))
    return found


def torchscript_export(program: torch.export.ExportedProgram, module: torch.nn.Module, args: tuple, kwargs: dict,
                       path: str, opset: int, dynamic_shapes: Any = None,
                       axes: dict[int, dict[int, str]] | None = None) -> list[str]:
    """Write ``module`` (the graph ``program`` was exported from, traced on ``args``/``kwargs``, the inputs it
    was exported with) to ``path`` with torch.onnx's TorchScript exporter, at ``opset`` or the highest that
    exporter writes below it, with ``program``'s dynamic dims (named as in ``dynamic_shapes``), and ``axes``
    (:func:`requested_axes`) dynamic too: dims torch.export specialised that the TorchScript exporter keeps
    dynamic where the graph computes with them (an LSTM's length). Returns the ONNX graph's input names, in the
    program's order of tensor user inputs.

    Raises:
        ExportError: the TorchScript exporter failed too (stage ``translation``).
    """
    from torch.onnx import _constants

    found, inputs, outputs = dynamic_axes(program, dynamic_shapes)
    for index, dims in (axes or {}).items():
        if index < len(inputs):
            found.setdefault(inputs[index], {}).update(dims)
    axes = found
    flat = _FlatProgram(module, args, kwargs).eval()
    tensors = tuple(leaf for leaf in pytree.tree_leaves((tuple(args), dict(kwargs))) if isinstance(leaf, torch.Tensor))
    log = io.StringIO()
    try:
        with tracing(), quiet(log), native_output(log), torch.no_grad():
            torch.onnx.export(flat, tensors, path, dynamo=False, input_names=inputs, output_names=outputs,
                              dynamic_axes=axes or None,
                              opset_version=min(opset, _constants.ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET))
    except Exception as error:
        raise ExportError(f"the TorchScript exporter failed too: {first_line(error)}", stage="translation") from error
    return inputs
