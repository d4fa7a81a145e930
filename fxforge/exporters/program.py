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

from fxforge.capture.dynamic import (
    batch_dynamic_shapes,
    batch_size,
    export_refining,
    resized,
    suggested_fixes,
    trace_inputs,
    with_batch,
)
from fxforge.core.captured import Captured
from fxforge.core.nodes import attribute_tensor, copy_graph_module
from fxforge.core.source import first_line, user_frame_of
from fxforge.core.tracing import tracing
from fxforge.core.verify import Comparison, Float64Reference, compare_outputs, isolated

# ORT and PyTorch sum in different orders; through a deep model float32 rounding differs by a few 1e-5
# of the output's scale. Ten times the rewrite pipeline's tolerance (still far below a wrong op's O(1)).
VALIDATION_TOLERANCE_SCALE = 10.0
# Where float32 eager is itself far from the exact (float64) result (deep, random weights, large activations
# before a LayerNorm), the exported model may be this many times as far from float64 as float32 eager is, on
# top of the tolerance above: both are float32 evaluations of one function, summed in other orders.
FLOAT64_FACTOR = 4.0

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


def export_program(captured: Captured, dynamic_batch: bool = False, dynamic_shapes: Any = None, *,
                   refine: Any = False) -> tuple[torch.export.ExportedProgram, Any, tuple | None, Any]:
    """``torch.export`` of a captured (rewritten) graph, the step before writing ONNX or a ``.pt2`` file.

    Returns the program, the model's output structure (see :func:`exportable`), the other batch's
    ``(label, args, kwargs)`` to validate on when the batch is dynamic (else None), and the dynamic shapes
    used. With ``dynamic_batch`` the leading dim of every batched input is dynamic. A dim that
    ``dynamic_shapes`` (or ``dynamic_batch``) makes dynamic and that is 1 in the example is traced at 2 (made
    from the example's entries), since torch.export specialises a size-1 dim. With ``refine`` (True, or the
    names of the dims that must stay dynamic), a constraint violation is answered with torch.export's
    suggested fixes (see :func:`fxforge.capture.dynamic.export_refining`); ``dynamic_batch`` refines.

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
        other = batch + 1
        other_batch = (f"batch {other}", *with_batch(captured.example_args, captured.example_kwargs, batch, other))
        dynamic_shapes = batch_dynamic_shapes(gm, args, kwargs, batch)
        refine = True
    if dynamic_shapes is not None:
        args, kwargs = trace_inputs(gm, args, kwargs, dynamic_shapes)

    def export(spec: Any) -> torch.export.ExportedProgram:
        with tracing(), quiet(), torch.no_grad():
            return torch.export.export(gm, args, kwargs, dynamic_shapes=spec, strict=False)

    try:
        program, dynamic_shapes = export_refining(export, dynamic_shapes, refine)
    except Exception as error:
        where = user_frame_of(error)
        dynamic = dynamic_batch or dynamic_shapes is not None
        what = "with a dynamic batch dim " if dynamic_batch else "with dynamic dims " if dynamic else ""
        fixes = suggested_fixes(error)
        hint = ("; the graph holds the example's size somewhere (TORCH_LOGS=+dynamic shows where)"
                if dynamic and "Constraints violated" in str(error) else "")
        hint += f"; torch.export's suggested fixes: {', '.join(fixes)}" if fixes else ""
        raise ExportError(f"torch.export could not export the rewritten graph {what}({first_line(error)})"
                          + (f" at {where}" if where else "") + hint, stage="torch.export", source=where) from error
    return program, out_structure, other_batch, dynamic_shapes


def validation_inputs(program: torch.export.ExportedProgram, captured: Captured,
                      name: Callable[[int, int], str | None] | None = None,
                      count: int = 2) -> list[tuple[str, tuple, dict]]:
    """Inputs of other sizes to validate an exported model with dynamic dims on: ``count`` sets (or fewer
    where the dims' ranges leave no room), each changing every dynamic dim of ``program`` (first one larger,
    then one smaller where the range allows: ``size + 1``, then ``size // 2``), within the ranges torch.export
    recorded. Each is ``(label, args, kwargs)``, made from ``captured``'s example inputs by repeating their
    entries (:func:`fxforge.capture.dynamic.resized`); dims derived from others (``2 * seq``) follow them.

    ``name(input, dim)`` names a dynamic dim of the ``input``-th tensor input in the labels (default: the
    symbol, ``s0``). A program without dynamic dims has none.

    Example:
        >>> import fxforge
        >>> cap = fxforge.capture(torch.nn.Linear(3, 2), (torch.ones(2, 3),))
        >>> program, _, _, _ = export_program(cap, dynamic_batch=True)
        >>> [(label, args[0].shape[0]) for label, args, _ in validation_inputs(program, cap, lambda i, d: "batch")]
        [('batch 3', 3), ('batch 1', 1)]
    """
    import sympy
    from torch.export._tree_utils import reorder_kwargs
    from torch.export.graph_signature import InputKind, TensorArgument

    kwargs = dict(captured.example_kwargs)
    with contextlib.suppress(Exception):  # the program's keyword order, as ONNX Runtime's inputs are fed
        kwargs = reorder_kwargs(kwargs, program.call_spec.in_spec)
    leaves, structure = pytree.tree_flatten((tuple(captured.example_args), kwargs))
    user = [spec for spec in program.graph_signature.input_specs if spec.kind == InputKind.USER_INPUT]
    if len(user) != len(leaves):
        return []
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    dims, example, labels, tensors = [], {}, {}, 0  # dims: (leaf position, axis, size expression)
    for position, (spec, leaf) in enumerate(zip(user, leaves)):
        if not isinstance(spec.arg, TensorArgument) or not isinstance(leaf, torch.Tensor):
            continue
        value = placeholders[spec.arg.name].meta.get("val") if spec.arg.name in placeholders else None
        for axis, size in enumerate(getattr(value, "shape", ())):
            if isinstance(size, torch.SymInt):
                expr = size.node.expr
                dims.append((position, axis, expr))
                if isinstance(expr, sympy.Symbol) and expr not in example:
                    example[expr] = int(leaf.shape[axis])
                    labels[expr] = (name(tensors, axis) if name is not None else None) or str(expr)
        tensors += 1
    if any(not expr.free_symbols <= set(example) for _, _, expr in dims):
        return []  # a size this cannot set (a dim only ever derived from another)
    choices = {symbol: _other_sizes(size, program.range_constraints.get(symbol)) for symbol, size in example.items()}
    choices = {symbol: sizes for symbol, sizes in choices.items() if sizes}
    cases = []
    for case in range(min(count, max((len(sizes) for sizes in choices.values()), default=0))):
        sizes = {symbol: choices[symbol][min(case, len(choices[symbol]) - 1)] if symbol in choices else size
                 for symbol, size in example.items()}
        new = list(leaves)
        for position, axis, expr in dims:
            target = int(expr.xreplace(sizes))
            if new[position].shape[axis] != target:
                new[position] = resized(new[position], axis, target)
        args, kwargs = pytree.tree_unflatten(new, structure)
        label = ", ".join(f"{labels[symbol]} {sizes[symbol]}" for symbol in choices)
        cases.append((label, tuple(args), dict(kwargs)))
    return cases


def _other_sizes(size: int, bounds: Any) -> list[int]:
    """Two sizes other than ``size`` within ``bounds`` (a torch ``ValueRanges``, or None): larger first."""
    def bound(value: Any, default: int) -> int:
        try:
            return int(value)
        except (TypeError, ValueError, AttributeError, OverflowError):
            return default

    low = max(1, bound(getattr(bounds, "lower", 1), 1))
    high = bound(getattr(bounds, "upper", None), 2**62)
    found = []
    for candidate in (size + 1, size // 2, size - 1, size + 2, size + 3):
        if low <= candidate <= high and candidate != size and candidate not in found:
            found.append(candidate)
    return found[:2]


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
    # every name a parameter or buffer is registered under: a tied weight (``lm_head.weight`` is
    # ``wte.weight``) or a module used twice has second names that plain named_parameters() leaves out
    registered = ({name for name, _ in gm.named_parameters(remove_duplicate=False)}
                  | {name for name, _ in gm.named_buffers(remove_duplicate=False)})
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
    names: dict[str, str] = {}  # one buffer per constant, however many get_attr nodes read it
    for node in [n for n in copy.graph.nodes if n.op == "get_attr" and n.target in constants]:
        if node.target not in names:
            taken = len(names)
            while hasattr(copy, f"_fxforge_constant_{taken}"):  # a graph exported before keeps its own
                taken += 1
            names[node.target] = f"_fxforge_constant_{taken}"
            copy.register_buffer(names[node.target], attribute_tensor(copy, node.target), persistent=False)
        node.target = names[node.target]
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


def validate(module: Callable[..., Any], captured: Captured, others: Any, *,
             name: str = "ONNX Runtime", judged: dict[str, str] | None = None) -> dict[str, float]:
    """Run an exported model (``module``, called like the model) and the PyTorch model on the example
    inputs and on ``others`` (one ``(label, args, kwargs)``, a list of them, or None: inputs of other
    sizes, see :func:`validation_inputs`) and compare. ``name`` says what ran the exported model, in errors.

    Outputs beyond the tolerance of float32 eager are judged again against the model run in float64 (see
    :func:`judge_by_float64`): where float32 eager is itself that far from the exact result, the exported
    model passes when it is about as close to it. ``judged`` (a dict, if given) gets, per input set, which
    reference judged: ``"float32 eager"`` or a line saying float64 eager did and the distances.

    Returns the largest absolute difference from float32 eager per input set.

    Raises:
        ExportError: outputs differ beyond tolerance (from both references), or the exported model failed to run.
    """
    cases = [("example inputs", captured.example_args, captured.example_kwargs, captured.example_outputs)]
    if isinstance(others, tuple):
        others = [others]
    cases.extend((*other, None) for other in others or [])
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
        verdict = "float32 eager"
        if not result.ok:
            exact = judge_by_float64(captured.module, args, kwargs, reference, actual)
            if exact is None or not exact.ok:
                why = f"; against float64 eager: {exact.reason}" if exact is not None else ""
                raise ExportError(f"{name}'s outputs differ from PyTorch's on the {label}: {result.reason}{why}",
                                  stage="validation")
            verdict = f"float64 eager ({exact.note})"
        errors[label] = result.max_abs_err
        if judged is not None:
            judged[label] = verdict
    return errors


def judge_by_float64(model: torch.nn.Module, args: tuple, kwargs: dict, reference: Any, actual: Any) -> Comparison | None:
    """Whether ``actual`` (an exported model's outputs) is as close to ``model`` run in float64 as its float32
    outputs ``reference`` are: accepted where ``|actual - exact|`` is within :data:`FLOAT64_FACTOR` times
    float32 eager's own largest distance from ``exact`` (per output) plus the validation tolerance. None where
    the model does not run in float64 (nothing to judge by).

    Example:
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)).eval()
        >>> x = torch.randn(2, 8)
        >>> with torch.no_grad():
        ...     y = model(x)
        >>> judge_by_float64(model, (x,), {}, y, y + 1e-7).ok, judge_by_float64(model, (x,), {}, y, y + 1.0).ok
        (True, False)
    """
    exact = Float64Reference(model, [(tuple(args), dict(kwargs))])(0)
    if exact is None:
        return None
    leaves = [pytree.tree_leaves(x) for x in (reference, actual, exact)]
    if len({len(x) for x in leaves}) != 1:
        return Comparison(False, float("inf"), "output structures differ")
    moved, own_worst, worst = [], 0.0, 0.0
    for r, a, e in zip(*leaves):
        if not (isinstance(a, torch.Tensor) and a.is_floating_point() and isinstance(e, torch.Tensor)
                and isinstance(r, torch.Tensor) and r.shape == a.shape == e.shape):
            moved.append(a)
            continue
        r64, a64, e64 = (x.detach().cpu().double() for x in (r, a, e))
        finite = torch.isfinite(r64) & torch.isfinite(a64) & torch.isfinite(e64)
        own = float((r64 - e64)[finite].abs().max()) if finite.any() else 0.0
        gap = (a64 - e64).abs()
        worst, own_worst = max(worst, float(gap[finite].max()) if finite.any() else 0.0), max(own_worst, own)
        # |actual - exact| less FLOAT64_FACTOR * own, then the validation tolerance against exact decides
        shrunk = e64 + torch.sign(a64 - e64) * (gap - FLOAT64_FACTOR * own).clamp(min=0)
        moved.append(torch.where(finite, shrunk, a64).to(a.dtype))
    exact_like = [e.to(a.dtype) if isinstance(e, torch.Tensor) and isinstance(a, torch.Tensor) else e
                  for a, e in zip(leaves[1], leaves[2])]
    result = compare_outputs(exact_like, moved, rtol_scale=VALIDATION_TOLERANCE_SCALE)
    distances = f"{worst:.3g} from the float64 result, float32 eager {own_worst:.3g}"
    if not result.ok:
        return Comparison(False, worst, f"{distances} ({result.reason})")
    return Comparison(True, worst, note=distances)
