"""Native artifacts: a rewritten graph saved with ``torch.export`` (``.pt2``) and loaded back as a module.

:func:`save_native` exports a :class:`~fxforge.core.captured.Captured` (usually rewritten) with
``torch.export``, keeping fxforge's fused ops (``torch.ops.fxforge.conv_pointwise``,
``linear_pointwise``: they are registered with ``torch.library`` and have fake implementations, so
export records them as single ops, with the kernel autotune chose). The program is written to a
temporary file beside the target, loaded back, run on the example inputs (and on another batch size
with ``dynamic_batch``) and compared with the model; only then is it renamed into place. A failure at
any step raises :class:`~fxforge.exporters.program.ExportError` and leaves nothing on disk.

:func:`load` (also ``fxforge.load``) registers the fused ops before ``torch.export.load`` and returns
an ``nn.Module`` that returns what the model returned.

Example:
    >>> import os, tempfile, torch, fxforge
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval()
    >>> cap = fxforge.rewrite(fxforge.capture(model, (torch.randn(2, 4),)))
    >>> path = os.path.join(tempfile.mkdtemp(), "m.pt2")
    >>> saved = save_native(cap, path)
    >>> x = torch.randn(2, 4)
    >>> torch.allclose(load(path)(x), model(x), atol=1e-6)
    True
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import Counter
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from fxforge.core.captured import Captured
from fxforge.core.files import atomic_write
from fxforge.core.source import first_line
from fxforge.exporters.program import ExportError, export_program, validate
from fxforge.lowering import kernels  # noqa: F401 - a saved graph's fused ops run the kernels chosen for them
from fxforge.rewrites import fused_ops  # noqa: F401 - registers torch.ops.fxforge.* before a program is read

_EXTRA = "fxforge.json"  # the extra file of the archive holding the model's output structure


@dataclasses.dataclass
class NativeExport:
    """What :func:`save_native` wrote, and how it was checked.

    Attributes:
        path: the ``.pt2`` file.
        ops: fxforge's fused ops in the saved program, ``{"fxforge::conv_pointwise": 3}``.
        validation: the largest absolute difference from the model, per input set checked on the
            artifact loaded back from disk.
        dynamic_batch: whether dim 0 of the batch inputs is dynamic.

    Example:
        >>> print(NativeExport("m.pt2", {"fxforge::linear_pointwise": 1}, {"example inputs": 0.0}))
        m.pt2: torch.export program, static shapes
          fxforge::linear_pointwise x1
          checked after loading on example inputs: max abs error 0
    """

    path: str
    ops: dict[str, int]
    validation: dict[str, float]
    dynamic_batch: bool = False

    def __str__(self) -> str:
        shapes = "dynamic batch" if self.dynamic_batch else "static shapes"
        lines = [f"{self.path}: torch.export program, {shapes}"]
        lines += [f"  {op} x{n}" for op, n in self.ops.items()]
        lines += [f"  checked after loading on {k}: max abs error {v:.3g}" for k, v in self.validation.items()]
        return "\n".join(lines)


def _structure_json(structure: tuple | None) -> str | None:
    """The output structure :func:`~fxforge.exporters.onnx.exportable` returned, as JSON (None: plain)."""
    if structure is None:
        return None
    spec, kinds = structure
    try:
        text = json.dumps({"spec": pytree.treespec_dumps(spec), "kinds": [list(k) for k in kinds]})
    except Exception as error:
        raise ExportError(f"the model's output structure cannot be saved in a .pt2 file ({error})",
                          stage="save") from error
    return text


class _Restructured(nn.Module):
    """The loaded program, returning the model's own structure (the program returns a flat tuple of tensors,
    or fx's immutable containers) and taking its inputs by name too where it takes positional tensors
    (``model(ids, attention_mask=mask)`` of a program exported from ``(ids, mask)``)."""

    def __init__(self, program_module: nn.Module, spec: Any, kinds: list | None, names: tuple[str, ...] = ()):
        super().__init__()
        self.program = program_module
        self._spec = spec
        self._kinds = kinds
        self._names = names

    @property
    def graph(self) -> torch.fx.Graph:
        """The program's graph (fxforge's fused ops in it, as saved)."""
        return self.program.graph

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs and self._names and set(kwargs) == set(self._names[len(args):]):
            args = (*args, *(kwargs.pop(name) for name in self._names[len(args):] if name in kwargs))
        flat = self.program(*args, **kwargs)
        if self._spec is None:
            return _plain(flat)
        flat = (flat,) if isinstance(flat, torch.Tensor) else tuple(flat)
        leaves = [flat[value] if kind == "tensor" else value for kind, value in self._kinds]
        return pytree.tree_unflatten(leaves, self._spec)


def load(path: str | os.PathLike) -> nn.Module:
    """Load a native artifact written by :func:`save_native` (``fxforge optimize ... -o model.pt2``).

    fxforge's fused ops are registered first (the program calls them), then the file is read with
    ``torch.export.load``. The module returned takes the model's inputs and returns what the model
    returned.

    Args:
        path: the ``.pt2`` file.

    Returns:
        An ``nn.Module`` running the saved graph.

    Raises:
        FileNotFoundError: no such file.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "relu.pt2")
        >>> _ = save_native(fxforge.capture(torch.nn.ReLU().eval(), (torch.ones(2),)), path)
        >>> load(path)(-torch.ones(2)).tolist()
        [0.0, 0.0]
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such file: {path}")
    extra = {_EXTRA: ""}
    program = torch.export.load(path, extra_files=extra)
    module = program.module()
    spec, kinds = None, None
    if extra[_EXTRA]:
        saved = json.loads(extra[_EXTRA])
        spec, kinds = pytree.treespec_loads(saved["spec"]), [(kind, value) for kind, value in saved["kinds"]]
    return _Restructured(module, spec, kinds, _positional_names(program))


def _positional_names(program: torch.export.ExportedProgram) -> tuple[str, ...]:
    """The names of a program's inputs when it takes only positional tensors (a call may name them), else ()."""
    from torch.export.graph_signature import InputKind

    in_spec = program.call_spec.in_spec
    names = tuple(s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT)
    if in_spec is None or in_spec.num_children != 2 or in_spec.child(1).num_children:
        return ()
    return names if in_spec.child(0).num_children == len(names) else ()


def _plain(value: Any) -> Any:
    """fx's immutable containers (a program's outputs) as the dicts and lists the model returned."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_plain(item) for item in value)
    return value


def fused_op_counts(graph: torch.fx.Graph) -> dict[str, int]:
    """How many of fxforge's fused ops (``fxforge::...``) a graph calls.

    Example:
        >>> fused_op_counts(torch.fx.symbolic_trace(torch.nn.ReLU()).graph)
        {}
    """
    counts: Counter = Counter()
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            name = node.target.name()
            if name.startswith("fxforge::"):
                counts[name] += 1
    return dict(counts)


def save_native(captured: Captured, path: str | os.PathLike, *, dynamic_batch: bool = False) -> NativeExport:
    """Save ``captured``'s graph as a ``torch.export`` program at ``path``, checked after loading it back.

    Args:
        captured: a (rewritten) capture of a model in eval mode.
        path: the ``.pt2`` file; its folder must exist. An existing file is replaced only by a complete,
            checked one.
        dynamic_batch: make dim 0 of every input whose dim 0 is the batch size dynamic; checked on
            another batch size too.

    Returns:
        A :class:`NativeExport`.

    Raises:
        ExportError: the graph was captured in training mode, ``torch.export`` failed, or the loaded
            artifact's outputs differ from the model's; nothing is left on disk.
        FileNotFoundError: the folder does not exist.

    Example:
        >>> import os, tempfile
        >>> cap = fxforge.capture(torch.nn.Linear(3, 2).eval(), (torch.ones(4, 3),))
        >>> saved = save_native(cap, os.path.join(tempfile.mkdtemp(), "lin.pt2"), dynamic_batch=True)
        >>> sorted(saved.validation), load(saved.path)(torch.ones(7, 3)).shape
        (['batch 5', 'example inputs'], torch.Size([7, 2]))
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"cannot write {path!r}: no folder {directory!r}")
    if captured.training:
        raise ExportError("the graph was captured in training mode; save it after model.eval()", stage="input")
    program, structure, other_batch, _ = export_program(captured, dynamic_batch)
    extra = _structure_json(structure)
    validation: dict[str, float] = {}

    def write_and_check(scratch: str) -> None:
        try:
            torch.export.save(program, scratch, extra_files={_EXTRA: extra} if extra else None)
        except Exception as error:
            raise ExportError(f"writing the .pt2 file failed: {first_line(error)}", stage="save") from error
        validation.update(validate(load(scratch), captured, other_batch, name="the saved .pt2 program"))

    atomic_write(path, write_and_check)
    return NativeExport(path, fused_op_counts(program.graph), validation, dynamic_batch)
