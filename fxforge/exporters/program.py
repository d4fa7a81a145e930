"""``torch.export`` programs of rewritten graphs, the step before an ONNX file or a ``.pt2`` artifact, and
how an exported model is checked against PyTorch.

Example:
    >>> cap = fxforge.capture(torch.nn.ReLU(), (torch.ones(2, 3),))
    >>> program, _, _, _ = export_program(cap)
    >>> validate(program.module(), cap, None)
    {'example inputs': 0.0}
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fxforge.capture.dynamic import batch_dynamic_shapes, batch_size, with_batch
from fxforge.core.captured import Captured
from fxforge.core.nodes import attribute_tensor, copy_graph_module
from fxforge.core.source import first_line, user_frame_of
from fxforge.core.tracing import tracing
from fxforge.core.verify import compare_outputs, isolated

# ORT and PyTorch sum in different orders; through a deep model float32 rounding differs by a few 1e-5
# of the output's scale. Ten times the rewrite pipeline's tolerance (still far below a wrong op's O(1)).
VALIDATION_TOLERANCE_SCALE = 10.0

NOISY_LOGGERS = ("torch.onnx", "torch.export", "torch._export", "torch._dynamo", "torch.fx.experimental.symbolic_shapes",
                 "torch._subclasses", "onnxscript", "onnx_ir")


class ExportError(RuntimeError):
    """The model could not be exported to ONNX; nothing was written.

    Attributes:
        stage: where it failed: ``"torch.export"``, ``"translation"``, ``"checker"``, ``"validation"``,
            ``"input"`` (the arguments).
        op: the op that could not be translated, where one is to blame (``"fxtest::mystery"``).
        source: the user's source line of that op, where known (``"model.py:12: return f(x)"``).

    Example:
        >>> str(ExportError("no ONNX translation for aten::foo", op="aten::foo", source="m.py:3: y = foo(x)"))
        'no ONNX translation for aten::foo'
    """

    def __init__(self, message: str, *, stage: str = "export", op: str | None = None, source: str | None = None):
        super().__init__(message)
        self.stage, self.op, self.source = stage, op, source



@contextlib.contextmanager
def quiet(log: io.StringIO | None = None) -> Iterator[io.StringIO]:
    """Keep torch.export's and torch.onnx's progress lines, logger warnings and Python warnings off the
    console; what they print lands in ``log`` (returned), for error messages.

    Example:
        >>> with quiet() as log:
        ...     print("[torch.onnx] step...")
        >>> log.getvalue()
        '[torch.onnx] step...\\n'
    """
    log = log if log is not None else io.StringIO()
    loggers = [logging.getLogger(name) for name in NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            warnings.simplefilter("ignore")
            yield log
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def export_program(captured: Captured, dynamic_batch: bool = False, dynamic_shapes: Any = None
                   ) -> tuple[torch.export.ExportedProgram, Any, tuple | None, Any]:
    """``torch.export`` of a captured (rewritten) graph, the step before writing ONNX or a ``.pt2`` file.

    Returns the program, the model's output structure (see :func:`exportable`), the other batch's
    ``(label, args, kwargs)`` to validate on when the batch is dynamic (else None), and the dynamic shapes
    used. With ``dynamic_batch`` the leading dim of every batched input is dynamic; a batch of 1 is traced
    as a batch of 2 made from the example rows, since torch.export specialises a size-1 dim.

    Raises:
        ExportError: no input has a batch dim, or torch.export failed (with the user's line where known).

    Example:
        >>> import fxforge
        >>> cap = fxforge.capture(torch.nn.Linear(3, 2), (torch.ones(1, 3),))
        >>> program, _, other, _ = export_program(cap, dynamic_batch=True)
        >>> other[0], program.module()(torch.ones(5, 3)).shape
        ('batch 2', torch.Size([5, 2]))
    """
    gm, out_structure = exportable(captured.graph_module)
    args, kwargs = tuple(captured.example_args), dict(captured.example_kwargs)
    other_batch = None
    if dynamic_batch:
        batch = batch_size(args, kwargs)
        if batch is None:
            raise ExportError("dynamic_batch=True, but no input tensor has a dim 0", stage="input")
        if batch == 1:
            args, kwargs = with_batch(args, kwargs, batch, 2)
        other = batch + 1
        other_batch = (f"batch {other}", *with_batch(captured.example_args, captured.example_kwargs, batch, other))
        dynamic_shapes = batch_dynamic_shapes(gm, args, kwargs, 2 if batch == 1 else batch)
    try:
        with tracing(), quiet(), torch.no_grad():
            program = torch.export.export(gm, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as error:
        where = user_frame_of(error)
        what = "with a dynamic batch dim " if dynamic_batch else ""
        hint = ("; the graph holds the example's batch size somewhere (TORCH_LOGS=+dynamic shows where)"
                if dynamic_batch and "Constraints violated" in str(error) else "")
        raise ExportError(f"torch.export could not export the rewritten graph {what}({first_line(error)})"
                          + (f" at {where}" if where else "") + hint, stage="torch.export", source=where) from error
    return program, out_structure, other_batch, dynamic_shapes


_CONTIGUOUS = (torch.ops.aten.contiguous.default, torch.Tensor.contiguous)


def _plain_containers(value: Any) -> Any:
    """fx's immutable lists and dicts (in a graph's output) as the lists and dicts the model returned."""
    if isinstance(value, torch.fx.immutable_collections.immutable_dict):
        return {k: _plain_containers(v) for k, v in value.items()}
    if isinstance(value, torch.fx.immutable_collections.immutable_list):
        return [_plain_containers(v) for v in value]
    if type(value) is tuple:
        return tuple(_plain_containers(v) for v in value)
    return value


def exportable(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, tuple | None]:
    """``gm`` made fit for ``torch.export`` and ``torch.onnx``, and the output structure it had, as
    ``(pytree spec, per leaf ("tensor", index) or ("constant", value))``, or None if it returns as before.

    What is changed, on a copy:

    - a graph that ``torch.export`` produced rebuilds its outputs from a pytree spec at its end;
      rebuilding a transformers cache object runs the cache's code (``torch.tensor([])``, ``torch.cat``)
      inside the trace, so the copy returns the flat tensor outputs instead;
    - outputs that are Python values (``None``, numbers) cannot be ONNX outputs: the copy returns only
      its tensors, and the values go into the returned structure;
    - ``aten.lift_fresh_copy`` (and ``detach_``) of constant tensors: exported again, torch lifts those
      constants a second time and its decompositions fail ("Constant tensor lifted_tensor_4 is not in the
      constants dictionary"); a fresh copy of a constant that nothing writes to is the constant;
    - for the same reason, tensor attributes that are neither parameters nor buffers become
      non-persistent buffers;
    - ``contiguous()`` becomes a ``clone`` in that memory format: whether ``contiguous()`` copies depends
      on the strides of its input, and torch.onnx's decompositions see other strides for the output of
      ``scaled_dot_product_attention`` than ``torch.export`` did, so a ``view`` after a ``contiguous()``
      that was a no-op in one trace fails in the other. A clone is contiguous in both (and free in ONNX).

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.ReLU())
        >>> exportable(gm) == (gm, None)
        True
    """
    lift, detach_ = torch.ops.aten.lift_fresh_copy.default, torch.ops.aten.detach_.default

    def read_only(node: torch.fx.Node) -> bool:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            return False
        return not schema.is_mutable or (node.target is detach_ and all(read_only(u) for u in node.users))

    contiguous = [n for n in gm.graph.nodes if (n.op == "call_function" and n.target in _CONTIGUOUS)
                  or (n.op == "call_method" and n.target == "contiguous")]
    registered = {name for name, _ in gm.named_parameters()} | {name for name, _ in gm.named_buffers()}
    constants = {n.target for n in gm.graph.nodes if n.op == "get_attr" and n.target not in registered
                 and isinstance(attribute_tensor(gm, n.target), torch.Tensor)}
    codegen = gm.graph._codegen
    info = getattr(codegen, "pytree_info", None)
    out_spec = info.out_spec if info is not None else None
    output = next(n for n in gm.graph.nodes if n.op == "output")
    leaves, spec = pytree.tree_flatten(_plain_containers(output.args[0]))
    if out_spec is None and any(not isinstance(leaf, torch.fx.Node) for leaf in leaves):
        out_spec = spec
    lifts = any(n.op == "call_function" and n.target is lift for n in gm.graph.nodes)
    if not constants and not lifts and out_spec is None and not contiguous:
        return gm, None
    copy = copy_graph_module(gm)
    for node in list(copy.graph.nodes):
        if (node.op == "call_function" and node.target in _CONTIGUOUS) or (
                node.op == "call_method" and node.target == "contiguous"):
            fmt = node.kwargs.get("memory_format", node.args[1] if len(node.args) > 1 else torch.contiguous_format)
            with copy.graph.inserting_before(node):
                clone = copy.graph.call_function(torch.ops.aten.clone.default, (node.args[0],), {"memory_format": fmt})
            clone.meta.update(node.meta)
            node.replace_all_uses_with(clone)
            copy.graph.erase_node(node)
    structure = None
    if out_spec is not None:
        if info is not None:
            copy.graph._codegen = torch.fx.graph._PyTreeCodeGen(
                torch.fx.graph._PyTreeInfo(info.orig_args, info.in_spec, None))
        new_output = next(n for n in copy.graph.nodes if n.op == "output")
        kinds, tensors = [], []
        for leaf in pytree.tree_leaves(_plain_containers(new_output.args[0])):
            if isinstance(leaf, torch.fx.Node):
                kinds.append(("tensor", len(tensors)))
                tensors.append(leaf)
            else:
                kinds.append(("constant", leaf))
        new_output.args = (tuple(tensors),)
        structure = (out_spec, tuple(kinds))
    for i, node in enumerate(n for n in copy.graph.nodes if n.op == "get_attr" and n.target in constants):
        name = f"_fxforge_constant_{i}"
        copy.register_buffer(name, attribute_tensor(copy, node.target), persistent=False)
        node.target = name
    for node in list(copy.graph.nodes):
        if node.op == "call_function" and node.target is lift and all(read_only(u) for u in node.users):
            for user in [u for u in node.users if u.target is detach_]:  # detach_ of a constant: a no-op
                user.replace_all_uses_with(node)
                copy.graph.erase_node(user)
            node.replace_all_uses_with(node.args[0])
            copy.graph.erase_node(node)
    copy.graph.lint()
    copy.recompile()
    return copy, structure


def validate(module: Callable[..., Any], captured: Captured, other_batch: tuple | None, *,
             name: str = "ONNX Runtime") -> dict[str, float]:
    """Run an exported model (``module``, called like the model) and the PyTorch model on the example
    inputs (and another batch) and compare. ``name`` says what ran the exported model, in errors.

    Returns the largest absolute difference per input set.

    Raises:
        ExportError: outputs differ beyond tolerance, or the exported model failed to run.
    """
    cases = [("example inputs", captured.example_args, captured.example_kwargs, captured.example_outputs)]
    if other_batch is not None:
        cases.append((*other_batch, None))
    errors = {}
    for label, args, kwargs, reference in cases:
        if reference is None:
            with isolated(captured.module, inputs=(args, kwargs)), torch.no_grad():
                reference = captured.module(*args, **kwargs)
        try:
            with torch.no_grad():
                actual = module(*args, **kwargs)
        except Exception as error:
            raise ExportError(f"{name} failed to run the exported model on the {label}: {first_line(error)}",
                              stage="validation") from error
        result = compare_outputs(reference, actual, rtol_scale=VALIDATION_TOLERANCE_SCALE)
        if not result.ok:
            raise ExportError(f"{name}'s outputs differ from PyTorch's on the {label}: {result.reason}",
                              stage="validation")
        errors[label] = result.max_abs_err
    return errors
