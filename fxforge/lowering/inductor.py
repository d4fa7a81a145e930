"""The ``inductor`` target's lowering: the rewritten graph compiled by ``torch.compile`` (Inductor).

fxforge's verified rewrites run first (attention -> SDPA, conv+BatchNorm folds, cleanup, memory order); the
conv+activation fusion is left to Inductor, which fuses activations into its own kernels and cannot see into
fxforge's fused custom ops. The graph is compiled when the plan is built, not on the first call, and the
compiled graph is checked against the rewritten one on the example inputs before the plan is used: a
compiled graph that differs is refused with the difference (:class:`CompileRefused`), and the optimized
module runs the model eagerly for those inputs with a warning, as for any plan that cannot be built. On a
GPU that allows TensorFloat-32 (cuDNN's convolutions do by default) the check allows its rounding
(:func:`~fxforge.core.verify.tf32_scale`).

Freezing (Inductor's CPU-inference setting that makes parameters constants of the compiled code) is off:
a plan reads the model's live parameters, and in-place changes to folded constants (BatchNorm statistics
updated in training mode) must reach it without a recompile.

Example:
    >>> from fxforge.core.captured import Captured
    >>> from fxforge.core.report import Report
    >>> gm = torch.fx.symbolic_trace(torch.nn.Tanh())
    >>> cap = Captured(gm, "fx", [], (torch.ones(2),), {}, torch.nn.Tanh(), False, Report(method="fx"))
    >>> plan = inductor_plan(cap)   # doctest: +SKIP
"""

from __future__ import annotations

import time
from typing import Any

import torch

from fxforge.core.captured import Captured
from fxforge.core.plan import Plan
from fxforge.core.source import first_line
from fxforge.core.symbolic import size_expr
from fxforge.core.target_cache import device_of
from fxforge.core.verify import compare_outputs, isolated, tf32_scale
from fxforge.lowering.lower import derived_values

# Rewrites whose replacement Inductor cannot see into (fused custom ops): left to Inductor's own fusion.
LEFT_TO_INDUCTOR = ("conv_activation",)


class CompileRefused(RuntimeError):
    """The compiled graph does not compute what the rewritten graph computes (or could not be compiled)."""


class RebuiltOutputs:
    """``compiled`` (a graph returning its outputs flat) called, and its outputs put back into ``out_spec``'s
    structure (a model output class, a cache object) outside the compiled code.

    An export graph ends with ``pytree.tree_unflatten(outputs, self._out_spec)``, and TorchDynamo traces
    that too: the library's unflatten functions run inside the compile, where some fail (transformers'
    ``DynamicCache`` leaves a generator that TorchDynamo cannot rebuild: "'LocalGeneratorObjectVariable'
    object has no attribute 'remaining_items'", and LLaMA ran eagerly on the inductor target).
    """

    def __init__(self, compiled: Any, out_spec: Any):
        self.compiled, self.out_spec = compiled, out_spec

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return torch.utils._pytree.tree_unflatten(list(self.compiled(*args, **kwargs)), self.out_spec)


def flat_outputs(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, Any]:
    """A copy of ``gm`` (sharing its parameters and buffers) whose code returns its outputs flat, and the spec
    that rebuilds them; ``(gm, None)`` where ``gm`` returns them as they are.

    Example:
        >>> class Pair(torch.nn.Module):
        ...     def forward(self, x):
        ...         return {"double": x * 2, "half": x / 2}
        >>> gm = torch.export.export(Pair(), (torch.ones(2),)).module()
        >>> flat, spec = flat_outputs(gm)
        >>> type(flat(torch.ones(2))).__name__, spec is not None
        ('tuple', True)
    """
    from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo

    from fxforge.core.nodes import copy_graph_module

    info = getattr(gm.graph._codegen, "pytree_info", None)
    if not isinstance(gm.graph._codegen, _PyTreeCodeGen) or info is None or info.out_spec is None:
        return gm, None
    flat = copy_graph_module(gm)
    flat.graph._codegen = _PyTreeCodeGen(_PyTreeInfo(info.orig_args, info.in_spec, None))
    flat.recompile()
    return flat, info.out_spec


def compiled_with_flat_outputs(gm: torch.fx.GraphModule, **options: Any) -> Any:
    """``torch.compile(gm, backend="inductor", fullgraph=True, **options)``, with the outputs' structure
    rebuilt outside the compiled code (:class:`RebuiltOutputs`) where ``gm`` has one."""
    flat, spec = flat_outputs(gm)
    compiled = torch.compile(flat, backend="inductor", fullgraph=True, **options)
    return compiled if spec is None else RebuiltOutputs(compiled, spec)


def inductor_plan(captured: Captured, *, dynamic: bool = False) -> Plan:
    """A :class:`~fxforge.core.plan.Plan` whose executable is ``torch.compile`` of the rewritten graph,
    compiled now and checked against it on the example inputs.

    Raises:
        CompileRefused: compiling failed, or the compiled graph's outputs differ from the rewritten graph's.
    """
    gm = captured.graph_module
    args, kwargs = captured.example_args, captured.example_kwargs
    with isolated(gm, inputs=(args, kwargs)), torch.no_grad():
        expected = gm(*args, **kwargs)
    start = time.perf_counter()  # the first call compiles
    how, unbacked = "", False
    try:
        compiled, actual = None, None
        if dynamic and _symbolic_dims(gm):
            # The graph's dynamic dims are compiled unbacked: torch.compile would otherwise specialise a size of 1
            # and compile again for a batch or a length of one (seconds, on a user's call); the plan's first call
            # at 1 is checked against eager by the plan cache instead. A graph Inductor cannot compile that way
            # is compiled as usual.
            try:
                compiled = compiled_with_flat_outputs(gm, dynamic=True)
                with isolated(gm, inputs=(args, kwargs)), torch.no_grad():
                    actual = compiled(*_unbacked(gm, args, kwargs), **kwargs)
                how, unbacked = "; its dynamic dims unbacked, so a size of 1 needs no compile of its own", True
            except Exception as error:  # noqa: BLE001 - the usual compile below decides
                compiled, how = None, f"; compiled with its dims backed (unbacked: {first_line(error)})"
                # TorchDynamo remembers that this forward's code failed, and would fail the usual compile
                # without trying it (a U-Net's unbacked image sizes: "Attempt to trace generator"): the
                # graph's code is generated again, a new code object.
                gm.recompile()
        if compiled is None:
            compiled = compiled_with_flat_outputs(gm, dynamic=dynamic)
            with isolated(gm, inputs=(args, kwargs)), torch.no_grad():
                actual = compiled(*args, **kwargs)
    except Exception as error:  # any compile failure refuses the plan, with its reason
        raise CompileRefused(f"torch.compile failed: {type(error).__name__}: {error}".splitlines()[0]) from error
    # On a GPU that allows TensorFloat-32, Inductor's kernels and the graph's own round at its precision.
    result = compare_outputs(expected, actual, rtol_scale=tf32_scale(device_of(args, kwargs, gm)))
    if not result.ok:
        raise CompileRefused(f"the compiled graph differs from the rewritten one: {result.reason}")
    if getattr(captured.module, "fxforge_inference_mode", True):  # (a graph dynamo guards to no_grad calls: never)
        _compile_for_inference_mode(compiled, gm, args, kwargs, unbacked=unbacked)
    captured.report.notes.append(
        f"inductor: the rewritten graph compiled by torch.compile in {time.perf_counter() - start:.1f} s "
        f"(max abs error {result.max_abs_err:.3g} against it on the example inputs; freezing off, so "
        f"parameter changes reach it){how}")
    return Plan(captured, compiled, derived_values(gm, gm))


def _compile_for_inference_mode(compiled: Any, gm: torch.fx.GraphModule, args: tuple, kwargs: dict, *,
                                unbacked: bool) -> None:
    """Compile ``compiled`` for calls under ``torch.inference_mode`` too, now rather than on a user's call.

    TorchDynamo guards on the grad mode and on each input's dispatch keys, so a graph compiled under
    ``no_grad`` compiles again (0.8 s on a small U-Net, with Inductor's caches warm) at the first call under
    inference mode, and again for inputs made inside it (inference tensors). Both are compiled here, on the
    example inputs (their dims unbacked where the first compile's were). Not for a graph between breaks that
    dynamo handed over for calls outside inference mode (its host says ``fxforge_inference_mode = False``):
    dynamo's own guards send inference-mode calls to another graph.
    """
    def inputs(values: tuple) -> tuple:
        return _unbacked(gm, values, kwargs) if unbacked else values

    with isolated(gm, inputs=(args, kwargs)), torch.inference_mode():
        compiled(*inputs(args), **kwargs)  # tensors made outside inference mode, called inside it
        copies = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        compiled(*inputs(copies), **kwargs)  # inference tensors


def _symbolic_dims(gm: torch.fx.GraphModule) -> list[tuple[int, ...]]:
    """Per placeholder of ``gm``, the dims whose size is symbolic (a graph torch.export captured with dynamic dims)."""
    dims = []
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        shape = value.shape if isinstance(value, torch.Tensor) else ()
        dims.append(tuple(d for d, size in enumerate(shape) if not isinstance(size_expr(size), int)))
    return dims if any(dims) else []


def _unbacked(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> tuple:
    """Copies of the positional inputs with ``gm``'s symbolic dims marked unbacked for torch.compile (keyword
    inputs are not marked)."""
    marked = []
    for value, dims in zip(args, _symbolic_dims(gm)):
        if isinstance(value, torch.Tensor) and dims:
            value = value.clone()
            torch._dynamo.decorators.mark_unbacked(value, list(dims))
        marked.append(value)
    return (*marked, *args[len(marked):])
