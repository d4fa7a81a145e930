"""A checkpointing plan's forward and backward graphs compiled by Inductor (``target="inductor"``).

:class:`~fxforge.training.module.CheckpointedModule` hands AOTAutograd a pair of compilers for the two
graphs of the partition its plan chose. By default they run the graphs op by op (ATen, as eager does);
:func:`inductor_compilers` gives Inductor's instead, so the plan's choices (what the forward saves, what the
backward recomputes, where) are kept, and the recomputed ops are fused with their users into Inductor's
kernels.

The step is traced with Inductor's decompositions (:func:`inductor_decompositions`), so the plan is made on
the ATen ops Inductor lowers: a batch norm is its statistics (a reduction) and its elementwise normalization,
and the plan may save a convolution's output and recompute the normalization and the activation after it,
which Inductor fuses into the kernel that uses them. The plan costs such a recomputation at one write of its
output (``fused=True`` in :func:`~fxforge.training.checkpointing.plan_step`), and Inductor's own min-cut
partitions are offered to it as candidates (:mod:`fxforge.training.inductor_partitions`): they choose per
value (a layer norm's statistics kept, its normalization recomputed), finer than the planner's pieces. Each
graph is then the one the plan was simulated on; ``compile_fx_inner`` compiles it as ``torch.compile``'s
forward and backward compilers do (AOTAutograd passes the strides Inductor chose for the saved values on to
the backward). Inductor's joint-graph passes (which run before its own partitioner) are not run: the joint
graph is the plan's.

Random numbers: ``torch._inductor.config.fallback_random`` is set while compiling, so random ops (dropout)
run ATen's kernels and draw the numbers eager draws for the same seed, in the graph's order; the plan never
recomputes them. Numbers are Inductor's: fused kernels reorder float arithmetic, so outputs and gradients
equal eager's to about 1e-6 relative in float32, not bitwise.

Memory: Inductor allocates its own buffers (fusions make fewer of them, buffer reuse shares them), so the
plan's simulation of the ATen graphs is an estimate of the compiled step, not a replay of it. Measured with
the profiler's allocator records (``benchmarks/step_memory.py``, which sees Inductor's buffers), forward and
backward above the step's start: GPT-2 (4 layers, hidden 256, S 512, batch 8) at 60 % and 40 %, equal to the
simulation (337.3 and 233.2 MiB, as the op-by-op runner); the tests' GPT-2 (4 layers, hidden 64, S 128), the
whole step 8-9 % under the plan's peak; a small ResNet (basic blocks of 64-512 channels, batch 8, 128 x 128)
at 60 %, 69.4 MiB against 64.0 simulated (+8 %; the op-by-op runner 65.8, convolution scratch), the whole
step +2.8 % over the plan's peak: Inductor's kernels hold more at once there than the ATen graph does (its
fused batch-norm backward of a residual block's two branches writes both branches' gradients together, for
one), which the plan does not model. :class:`~fxforge.training.module.CheckpointedModule` corrects for it
on CPU: it measures one step of the compiled plan and, where that step holds more than the budget, plans
again with what it held beyond its simulation kept back (its ``check``).

Layout optimization (convolutions in channels-last) is on only where that check runs: on torchvision's
ResNet-50 (batch 8, 224 x 224, 60 %) it made the step 0.90x -> 0.82x eager's time, but it holds 25-75 MiB
the plan does not simulate (channels-last copies of the weights and activations), which only a measured step
finds; where the check cannot measure (CUDA, ``check=False``, under ``torch.profiler``) it stays off, and
where the plan does not fit with it, the step is planned again without it. Under it Inductor would also hand
the backward a channels-last copy of every weight the forward saves (held from the forward to the
backward, 65 MiB beyond the simulation on ResNet-50 at 100 %); the forward's outputs to the caller and the
inputs it saves, and the backward's gradients, are marked to keep their traced strides, so the parameters
themselves are saved and each is converted right before its use (33 MiB beyond the simulation).

Matrix products: each graph's float32 ``mm`` / ``addmm`` runs on oneDNN where that measured faster than
torch's BLAS on this machine (:func:`~fxforge.lowering.gemm.route_matmuls`; MKL's sgemm runs at half
oneDNN's speed on the AMD EPYC of the benchmarks). The graphs' numbers are Inductor's already (about 1e-6
relative), and a product summed in another order stays within that; the op-by-op runner (``target="native"``)
keeps BLAS, and eager's numbers exactly.

Example:
    >>> forward, backward = inductor_compilers()
    >>> forward.__name__, backward.__name__
    ('inductor_forward', 'inductor_backward')
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fxforge.lowering.gemm import route_matmuls

Compiler = Callable[[torch.fx.GraphModule, Sequence[Any]], Any]

INDUCTOR_CONFIG = {"fallback_random": True}
"""Inductor's settings while it compiles a plan's graphs: random ops on ATen's kernels (eager's numbers).
``layout_optimization`` is set per plan (:func:`inductor_compilers`)."""


def _visible_outputs(gm: torch.fx.GraphModule, is_backward: bool) -> list[int]:
    """Which outputs of a step's graph Inductor must return in their traced strides (the rest it lays out as
    its kernels prefer, channels-last under layout optimization): the backward's gradients (the parameters'
    strides, as ``torch.compile``'s backward); the forward's outputs to the caller (and the inputs it mutates),
    and the inputs it saves for the backward (the parameters and inputs themselves, not a channels-last copy
    of each, which the forward would hold until the backward)."""
    output = gm.graph.output_node()
    values = output.args[0] if isinstance(output.args[0], (tuple, list)) else output.args
    if is_backward:
        return [i for i, v in enumerate(values) if isinstance(v, torch.fx.Node)]
    visible = {i for i, v in enumerate(values) if isinstance(v, torch.fx.Node) and v.op == "placeholder"}
    context = torch._guards.TracingContext.try_get()
    meta = context.fw_metadata if context is not None else None
    if meta is not None:
        visible.update(range(meta.num_mutated_inp_runtime_indices + len(meta.output_info)))
    return sorted(i for i in visible if isinstance(values[i], torch.fx.Node))


def _inductor(is_backward: bool, layout_optimization: bool, record: dict[str, int] | None) -> Compiler:
    def compile(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        from torch._inductor import config
        from torch._inductor.compile_fx import compile_fx_inner  # imports Inductor: only when compiling

        routed = route_matmuls(gm)
        if record is not None:
            record["onednn_matmuls"] = record.get("onednn_matmuls", 0) + routed
            # (what Inductor's layout optimization looks for: a graph without one compiles the same either way)
            record["convolutions"] = record.get("convolutions", 0) + len(gm.graph.find_nodes(
                op="call_function", target=torch.ops.aten.convolution.default))
        gm.graph.output_node().meta["user_visible_output_idxs"] = _visible_outputs(gm, is_backward)
        with config.patch({**INDUCTOR_CONFIG, "layout_optimization": layout_optimization}):
            return compile_fx_inner(gm, example_inputs, is_backward=is_backward)

    compile.__name__ = f"inductor_{'backward' if is_backward else 'forward'}"
    return compile


def inductor_decompositions() -> dict[Any, Callable[..., Any]]:
    """Inductor's ATen decompositions, to trace a step with so that its plan is made on the ops Inductor lowers.

    Example:
        >>> torch.ops.aten.native_batch_norm.default in inductor_decompositions()
        True
    """
    # Some decompositions ask Inductor's lowerings whether to apply (max pooling's): loaded here, since
    # nothing else has imported them before the step is traced.
    import torch._inductor.lowering  # noqa: F401
    from torch._inductor.decomposition import select_decomp_table  # imports Inductor: only when compiling

    return select_decomp_table()


def inductor_compilers(layout_optimization: bool = False, record: dict[str, int] | None = None,
                       ) -> tuple[Compiler, Compiler]:
    """AOTAutograd's ``(fw_compiler, bw_compiler)``: each graph of a step traced with
    :func:`inductor_decompositions` compiled by Inductor, random ops on ATen's kernels (eager's numbers),
    matrix products on oneDNN where it measured faster, and convolutions in channels-last where
    ``layout_optimization`` (Inductor's heuristic decides per graph; what that holds beyond the plan's
    simulation only a measured step shows). See the module docstring.

    Args:
        layout_optimization: Inductor's ``layout_optimization`` setting.
        record: where given, ``record["onednn_matmuls"]`` counts the products the two graphs run on oneDNN, and
            ``record["convolutions"]`` their convolutions.

    Example:
        >>> forward, backward = inductor_compilers(layout_optimization=True)
        >>> backward.__name__
        'inductor_backward'
    """
    return _inductor(False, layout_optimization, record), _inductor(True, layout_optimization, record)
