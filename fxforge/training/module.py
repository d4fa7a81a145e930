"""``fxforge.optimize(model.train(), inputs, memory_budget=...)``: the model's training step under a budget.

:class:`CheckpointedModule` traces the step once per input signature (AOTAutograd, as
:mod:`fxforge.training.step_graph`), lets :func:`~fxforge.training.checkpointing.plan_step` choose what to
recompute on that very trace, and runs AOTAutograd's forward and backward graphs of the chosen partition:
the forward keeps only the planned values; the backward recomputes the rest right before use. The graphs
run in the boxed calling convention, so each input (a saved activation) is freed after its last use, as the
plan's simulation assumes. With ``target="inductor"`` Inductor compiles the same two graphs instead
(:mod:`fxforge.training.compiled`): the plan's saved values, fused kernels.

It is the model, not a snapshot: the parameters are the model's own (an optimizer stepping them is seen by the next
call; a parameter replaced by another tensor re-plans), buffers (batch-norm statistics) are updated as in eager, and
in eval mode or without grad the model runs eagerly (there is no backward to plan for). Inputs of another signature
(shapes, dtypes, which require grad) get a plan of their own; where no plan fits the budget for them, they run
eagerly after one warning that says why. Outputs come back in the model's structure. Random ops are never
recomputed, so dropout's masks are drawn once, in the forward.

Example:
    >>> layers = [m for _ in range(8) for m in (torch.nn.Linear(128, 128), torch.nn.Tanh())]
    >>> model = torch.nn.Sequential(*layers).train()
    >>> x = torch.randn(256, 128)
    >>> step = CheckpointedModule(model, (x,), "80%", optimizer=None)
    >>> step(x).sum().backward()
    >>> step.plan.predicted_activation_peak_bytes <= step.plan.budget_bytes
    True
"""

from __future__ import annotations

import gc
import warnings
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from fxforge.capture.model import normalize_inputs
from fxforge.core.follows import FollowsTraining
from fxforge.core.memory import tensor_leaves
from fxforge.core.symbolic import hint
from fxforge.core.units import format_bytes, parse_budget
from fxforge.rewrites.memory_reorder.planning import apply_order
from fxforge.rewrites.memory_reorder.planning import plan as plan_order
from fxforge.training.checkpointing import BudgetError, CheckpointPlan, plan_step
from fxforge.training.measure import unique_bytes
from fxforge.training.optimizer_memory import optimizer_memory
from fxforge.training.step_graph import StepGraphs, default_loss, trace_step
from fxforge.training.timeline import simulate_step

CHECK_REPLANS = 3
"""How many times a plan whose measured step holds more than the budget is made again, the excess kept back
(ResNet-50 at 40 % of its activations has needed two, and in one run two were not enough)."""

GIVE_BACK_MIN = 0.01
"""A first plan whose measured step holds less than its simulation by at least this fraction of the budget is
planned once more with the difference added (:meth:`CheckpointedModule._give_back`)."""

def next_margin(gaps: list[int]) -> int:
    """What the next plan keeps back from its budget, given what each measured plan so far held beyond its
    simulation (``gaps``, oldest first).

    The last plan's gap is at least its own margin plus its excess, so a next plan off by as much fits. A plan
    that recomputes more holds more beyond its simulation (each recomputed convolution's backward scratch,
    each fused kernel's buffers), so where the gap grew from one plan to the next, the next is expected to
    grow as much again (a linear extrapolation), rather than be met one re-plan too late.

    Example:
        >>> next_margin([4096])
        4096
        >>> next_margin([4096, 6144])  # grew by 2 KiB: 2 KiB more again
        8192
        >>> next_margin([6144, 4096])  # shrank: the last gap
        4096
    """
    growth = gaps[-1] - gaps[-2] if len(gaps) > 1 else 0
    return gaps[-1] + max(growth, 0)


def _boxed(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
    """Run ``gm`` taking its inputs as one list it clears: each input is freed after its last use."""
    gm.graph.set_codegen(torch.fx.graph._BoxedCodeGen())
    gm.recompile()

    def run(args: list[Any]) -> Any:
        return gm(args)

    run._boxed_call = True
    return run


def _signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple:
    return tuple((tuple(t.shape), t.dtype, t.device, t.requires_grad) if isinstance(t, torch.Tensor) else repr(t)
                 for t in torch.utils._pytree.tree_leaves((args, kwargs)))


def reorder_backward(step: StepGraphs, loss_bytes: int | None = None) -> bool:
    """Put the backward graph in the order with the lowest simulated peak (:mod:`fxforge.rewrites.memory_reorder`),
    kept only when the whole step's simulated peak falls; returns whether it changed.

    Example:
        >>> step = trace_step(torch.nn.Linear(4, 4), (torch.randn(2, 4),), {}, loss=None)
        >>> reorder_backward(step)
        False
    """
    before = simulate_step(step, loss_bytes=loss_bytes).peak_bytes
    order = [n for n in step.backward.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    schedule = plan_order(step.backward)
    if not schedule.changed:
        return False
    apply_order(step.backward, schedule.order)
    if simulate_step(step, loss_bytes=loss_bytes).peak_bytes < before:
        return True
    apply_order(step.backward, order)
    return False


def loss_peak_bytes(loss: Any, step: StepGraphs) -> int:
    """The most a loss holds at once over the step's outputs, forward and backward: its inputs (the outputs)
    while it uses them, what it allocates, the output gradients it hands the step's backward; traced on fake
    tensors of the outputs' shapes.

    Example:
        >>> step = trace_step(torch.nn.Linear(4, 16), (torch.randn(64, 4),), {}, loss=None)
        >>> loss_peak_bytes(lambda out: out.pow(2).mean(), step) >= 2 * 64 * 16 * 4   # the input and its gradient
        True
    """
    (out,) = step.forward.graph.find_nodes(op="output")
    values = [n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in out.args[0][:step.num_fwd_outputs]]
    wrapper = step.wrapper
    fakes = []
    with unset_fake_temporarily():
        # Fake tensors on the outputs' own device: the loss may read real tensors there (the labels).
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            for value in values[:len(wrapper.output_positions)]:
                fake = torch.empty_strided([hint(d) for d in value.shape], [hint(d) for d in value.stride()],
                                           dtype=value.dtype, device=value.device)
                fakes.append(fake.requires_grad_(value.is_floating_point() or value.is_complex()))

    class Loss(torch.nn.Module):
        def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
            return loss(wrapper.rebuild(tensors))

    with unset_fake_temporarily(), torch.enable_grad():  # called from inside AOTAutograd's trace of the step
        step = trace_step(Loss(), tuple(fakes), {})
        sim = simulate_step(step, eager_backward=True)
    # The loss's inputs (the step's outputs) are alive through its forward, and through its backward only
    # where it saved them (cross-entropy saves its log-softmax, not the logits).
    inputs = {n.name: n for n in step.forward.graph.find_nodes(op="placeholder")}
    saved = {n.name for n in step.saved_nodes()}
    total = sum(unique_bytes([n.meta["val"]]) for n in inputs.values())
    kept = sum(unique_bytes([n.meta["val"]]) for name, n in inputs.items() if name in saved)
    forward = max((a + g for (phase, _), a, g in zip(sim.nodes, sim.activations, sim.gradients)
                   if phase == "forward"), default=0)
    backward = max((a + g for (phase, _), a, g in zip(sim.nodes, sim.activations, sim.gradients)
                    if phase == "backward"), default=0)
    return max(forward + total, backward + kept)


class CheckpointedModule(torch.nn.Module):
    """The model whose training step recomputes what :attr:`plan` says, to fit ``memory_budget``.

    Attributes:
        model: the wrapped model (its parameters are this module's).
        plan: the :class:`~fxforge.training.checkpointing.CheckpointPlan` of the latest signature.
        plans: how many steps were traced (one per input signature, and after a parameter is replaced).
        compiled: what runs the plan's graphs: False ATen op by op (the native target), True Inductor's
            compiled kernels (the inductor target; :mod:`fxforge.training.compiled`; outputs and gradients eager's
            to float rounding, dropout's masks eager's).
        target: the name of the target that runs it, as the caller named it (for reports).
        layout_optimization: whether the latest plan's graphs compiled with Inductor's layout optimization.

    ``loss`` (outputs -> scalar, the one the caller will use) lets the plan count what the loss allocates
    between the forward and the backward (for a language model, a few tensors the size of the logits);
    without it, the plan counts one gradient per output, as a loss whose backward allocates nothing else.

    ``check`` (on by default): on CPU, each plan is measured on one real step of the example inputs (forward,
    that loss or the sum of the outputs, backward; through the CPU allocator's records,
    :mod:`fxforge.runtime.allocator`), with the parameters, buffers, gradients (the inputs' too) and random
    state restored after it. Where the step holds more than the budget (Inductor's kernels hold buffers the plan's
    ATen graphs do not; a convolution's backward has scratch the simulation does not model), the plan is made again
    with what it held beyond its simulation kept back from the budget (:func:`next_margin`: more again where that grew
    from one plan to the next), up to :data:`CHECK_REPLANS` times; where none fits, the one measured least over is
    kept, with a warning that says by how much. Where the first plan's step holds less than its simulation (by
    :data:`GIVE_BACK_MIN` of the budget or more), it is planned once more with that difference added to the budget,
    and the new plan is kept where it recomputes less and its own measured step fits. Compiled
    (``target="inductor"``), the checked plan compiles with Inductor's layout optimization
    (:attr:`layout_optimization`: faster convolutions, copies the plan does not simulate); where no plan fits with it
    and the step has a convolution (what it lays out), the step is planned and checked again without it (as without
    the check), and where neither fits, the closer of the two is kept. The plan's ``measured_bytes`` is the measured
    figure. Not on CUDA yet, nor while ``torch.profiler`` records. Its ``training`` flag is the model's:
    ``model.eval()`` makes calls plain forwards here too.
    """

    training = FollowsTraining(lambda self: self._modules.get("model"))

    def __init__(self, model: torch.nn.Module, example_inputs: Any, memory_budget: Any, *,
                 optimizer: Any = torch.optim.AdamW, loss: Any = None, autocast: torch.dtype | None = None,
                 compiled: bool = False, target: str | None = None, check: bool = True,
                 graph_module: torch.fx.GraphModule | None = None):
        super().__init__()
        parse_budget(memory_budget)  # a malformed budget fails now, not at the first call
        self.model = model
        self.compiled = bool(compiled)
        self.target = target or ("inductor" if compiled else "native")
        self.memory_budget = memory_budget
        self.optimizer = optimizer
        self.loss = loss
        self.autocast = autocast
        self.check = check
        self._steps: dict[tuple, Any] = {}
        self._unplannable: set[tuple] = set()
        self._references: dict[tuple, int] = {}
        self._captures: dict[tuple, torch.fx.GraphModule] = {}
        self._tried: dict[tuple, dict] = {}  # per capture: the partitions simulated (plan_step's tried), offered
        self.plans = 0
        self.plan: CheckpointPlan | None = None
        args, kwargs = normalize_inputs(example_inputs)
        if graph_module is not None:  # captured already on these inputs (fxforge.training_memory's step)
            self._captures[(_signature(args, kwargs), tuple(id(p) for p in model.parameters()))] = graph_module
        self._build(args, kwargs)

    def _build(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            return self._build_checked(args, kwargs)
        finally:
            self._tried.clear()  # the partitions simulated while planning: not kept with the module

    def _build_checked(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self._checkable(args, kwargs):
            return self._plan(args, kwargs)
        closest = None
        if self.compiled:
            entry, over = self._checked(args, kwargs, layout_optimization=True)
            if over <= 0:
                return entry
            closest = (entry, over, self.plan)
        # Without layout optimization (its channels-last copies left no plan that fits), where it lays out a conv.
        if closest is None or self.plan.compile_record.get("convolutions"):
            entry, over = self._checked(args, kwargs, layout_optimization=False)
        if closest is not None and 0 < closest[1] < over:  # neither fits: the closer one is kept
            entry, over, plan = closest
            self._keep(entry, plan, args, kwargs)
        if over > 0:
            warnings.warn(f"fxforge: the checkpointing plan measured {format_bytes(over)} over its budget on one "
                          "step, after planning again with the excess kept back; it is kept as the closest",
                          stacklevel=3)
        return entry

    @property
    def layout_optimization(self) -> bool:
        """Whether the latest plan's graphs compiled with Inductor's layout optimization."""
        return bool(self.plan is not None and self.plan.layout_optimization)

    def _keep(self, entry: Any, plan: CheckpointPlan, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Make an earlier plan of this signature (and its step) the current one again."""
        self.plan = plan
        self._steps[_signature(args, kwargs)] = entry

    def _checked(self, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                 layout_optimization: bool) -> tuple[Any, int]:
        """Plan, measure one step, and plan again with what it held beyond its simulation kept back (up to
        :data:`CHECK_REPLANS` times) or given back (:meth:`_give_back`); the plan that fits (where none does,
        the one measured least over) and how far its measured step is over the budget (<= 0: it fits)."""
        entry = self._plan(args, kwargs, layout_optimization=layout_optimization)
        gaps: list[int] = []
        closest = None
        for replans in range(CHECK_REPLANS + 1):
            over = self._measure(entry[0], args, kwargs)
            if closest is None or over <= closest[1]:
                closest = (entry, over, self.plan)
            if over <= 0 or replans == CHECK_REPLANS:
                break
            gaps.append(self.plan.measured_bytes - self._predicted(self.plan))
            try:
                entry = self._plan(args, kwargs, next_margin(gaps), layout_optimization=layout_optimization)
            except BudgetError:
                break
        if over > closest[1]:  # none fits, and a plan made again measured further over than an earlier one
            entry, over, plan = closest
            self._keep(entry, plan, args, kwargs)
        if over <= 0 and not gaps:
            entry = self._give_back(entry, args, kwargs)
        return entry, over

    def _give_back(self, entry: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Where the first plan's measured step held less than its simulation (Inductor's kernels free some
        values earlier than the ATen graphs do), plan once more with that difference added to the budget, and
        keep the new plan only where it recomputes less and its own measured step fits; else the first."""
        plan = self.plan
        gap = plan.measured_bytes - self._predicted(plan)
        if not plan.recomputed or -gap < GIVE_BACK_MIN * plan.budget_bytes:
            return entry
        try:
            relaxed = self._plan(args, kwargs, gap, layout_optimization=bool(plan.layout_optimization))
        except BudgetError:
            relaxed = None
        if (relaxed is not None and self.plan.recompute_seconds < plan.recompute_seconds
                and self._measure(relaxed[0], args, kwargs) <= 0):
            return relaxed
        self._keep(entry, plan, args, kwargs)
        return entry

    def _checkable(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        tensors = [*tensor_leaves((args, kwargs)), *self.model.parameters(), *self.model.buffers()]
        from fxforge.runtime.allocator import AllocatorRecords

        return self.check and all(t.device.type == "cpu" for t in tensors) and AllocatorRecords.available()

    def _measure(self, step: StepGraphs, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        """Run one step of the plan under the allocator's records; set the plan's ``measured_bytes`` and return
        how far it is over the budget (<= 0: it fits)."""
        from fxforge.runtime.allocator import AllocatorRecords
        from fxforge.training.measure import restored

        params = list(self.model.parameters())
        inputs = [(t, t.grad) for t in tensor_leaves((args, kwargs)) if t.requires_grad]
        with restored(self.model), torch.random.fork_rng(devices=[]):
            for p in params:
                p.grad = None
            gc.collect()
            with AllocatorRecords(gradients_of=params) as records:
                outputs = self._run(step, args, kwargs)
                value = (self.loss or default_loss)(outputs)
                # Without a loss the plan takes the outputs as held to the end, and counts no loss: the
                # stand-in's own two scalars (its value and the seed of its backward) are not counted.
                stand_in = 2 * value.element_size() if self.loss is None else 0
                if self.loss is not None:
                    outputs = None
                value.backward()
                del value
                records.mark("backward")
                del outputs
        for tensor, grad in inputs:
            tensor.grad = grad
        plan = self.plan
        if plan.budget_kind == "fraction":
            plan.measured_bytes = records.activation_peak_bytes("backward") - stand_in
        else:
            plan.measured_bytes = (plan.persistent_bytes + records.phases(["backward"])["backward"].peak_bytes
                                   - stand_in)
        return plan.measured_bytes - plan.budget_bytes

    @staticmethod
    def _predicted(plan: CheckpointPlan) -> int:
        """The simulated counterpart of ``plan.measured_bytes``."""
        if plan.budget_kind == "fraction":
            return plan.predicted_activation_peak_bytes
        return plan.persistent_bytes + plan.simulation.peak_bytes

    def _run(self, step: StepGraphs, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        flat = step.wrapper.flat_inputs(args, kwargs)
        amp = torch.autocast(flat[0].device.type if flat else "cpu", dtype=self.autocast) \
            if self.autocast is not None else torch.autocast("cpu", enabled=False)
        with amp:
            outputs = step.compiled(*flat)
        return step.wrapper.rebuild(outputs)

    def _plan(self, args: tuple[Any, ...], kwargs: dict[str, Any], margin: int = 0, *,
              layout_optimization: bool = False) -> Any:
        from fxforge.training.eager_graph import eager_like_graph

        # Captured once per signature (and set of parameters): a plan made again after a measured step reuses it.
        key = (_signature(args, kwargs), tuple(id(p) for p in self.model.parameters()))
        if key not in self._captures:
            self._captures = {key: eager_like_graph(self.model, args, kwargs)}
        graph_module = self._captures[key]
        tried = self._tried.setdefault((key, layout_optimization), {})
        opt = optimizer_memory(self.optimizer, list(dict.fromkeys(self.model.parameters())))
        persistent = (unique_bytes(self.model.parameters()) + unique_bytes(self.model.buffers())
                      + unique_bytes(tensor_leaves((args, kwargs))) + opt.state_bytes)
        chosen: dict[str, CheckpointPlan] = {}
        offers = self._tried.setdefault((key, "offers"), {})

        def offered(step):  # Inductor's partitions of this joint graph: made once per build, not once per plan
            from fxforge.training.inductor_partitions import mincut_candidates

            if "sets" not in offers:
                offers["sets"] = mincut_candidates(step)
            return offers["sets"]

        def choose(step):
            loss_bytes = loss_peak_bytes(self.loss, step) if self.loss is not None else None
            candidates = offered if self.compiled else None
            chosen["plan"] = plan_step(step, self.memory_budget, persistent_bytes=persistent,
                                       optimizer_step_bytes=opt.step_peak_bytes, loss_bytes=loss_bytes,
                                       fused=self.compiled, candidates=candidates,
                                       margin_bytes=margin, reference_activation_bytes=reference, tried=tried)
            return chosen["plan"].recomputed

        def finish(step):
            chosen["plan"].backward_reordered = reorder_backward(step, chosen["plan"].loss_bytes)

        decompositions = reference = record = None
        if self.compiled:
            from fxforge.training.compiled import inductor_compilers, inductor_decompositions

            reference = self._model_activation_peak(graph_module, args, kwargs)
            record = {}
            compilers = inductor_compilers(layout_optimization=layout_optimization, record=record)
            decompositions = inductor_decompositions()
        else:
            compilers = (_boxed, _boxed)
        step = trace_step(graph_module, args, kwargs, loss=None, autocast=self.autocast,
                          compilers=compilers, choose=choose, finish=finish,
                          strides_from_compiler=self.compiled, decompositions=decompositions)
        self.plan = chosen["plan"]
        self.plan.graph_module = graph_module
        self.plan.layout_optimization = layout_optimization if self.compiled else None
        self.plan.compile_record = record
        self.plans += 1
        entry = (step, [id(p) for p in self.model.parameters()])
        self._steps[_signature(args, kwargs)] = entry
        return entry

    def _model_activation_peak(self, graph_module: torch.fx.GraphModule, args: tuple[Any, ...],
                               kwargs: dict[str, Any]) -> int | None:
        """The unconstrained activation peak of the model's own step (ATen's ops, as eager runs them), which a
        fraction budget is a fraction of whatever graphs run the plan; None for a budget in bytes. Traced once
        per signature."""
        if parse_budget(self.memory_budget)[0] != "fraction":
            return None
        key = _signature(args, kwargs)
        if key not in self._references:
            step = trace_step(graph_module, args, kwargs, loss=None, autocast=self.autocast)
            loss_bytes = loss_peak_bytes(self.loss, step) if self.loss is not None else None
            self._references[key] = simulate_step(step, loss_bytes=loss_bytes).activation_peak_bytes
        return self._references[key]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.training and torch.is_grad_enabled()):
            return self.model(*args, **kwargs)
        signature = _signature(args, kwargs)
        entry = self._steps.get(signature)
        if entry is None or entry[1] != [id(p) for p in self.model.parameters()]:
            if signature in self._unplannable:
                return self.model(*args, **kwargs)
            try:
                entry = self._build(args, kwargs)
            except BudgetError as error:
                self._unplannable.add(signature)
                warnings.warn(f"fxforge: no checkpointing plan fits these inputs ({error}); this input "
                              "signature runs the model eagerly, without checkpointing", stacklevel=2)
                return self.model(*args, **kwargs)
        return self._run(entry[0], args, kwargs)

    def train(self, mode: bool = True) -> CheckpointedModule:
        super().train(mode)
        return self


def checkpointed(model: Any, example_inputs: Any, memory_budget: Any, *, optimizer: Any = torch.optim.AdamW,
                 loss: Any = None, autocast: torch.dtype | None = None, compiled: bool = False,
                 target: str | None = None, check: bool = True) -> CheckpointedModule:
    """The model's training step fitted under ``memory_budget`` by checkpointing: what
    ``optimize(model, inputs, memory_budget=...)`` returns (``compiled``: Inductor compiles the plan's forward
    and backward graphs, :mod:`fxforge.training.compiled`), after the usage checks.

    Raises:
        TypeError: not a model instance, no example inputs.
        ValueError: the model is in eval mode (nothing is saved for a backward), or a malformed budget.
        fxforge.training.checkpointing.BudgetError: no recomputation fits the budget.

    Example:
        >>> checkpointed(torch.nn.Linear(2, 2).eval(), (torch.ones(1, 2),), "60%")
        Traceback (most recent call last):
        ...
        ValueError: memory_budget plans checkpointing for training: the model is in eval mode (call model.train() first)
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError("memory_budget plans a training step: call fxforge.optimize(model, example_inputs, "
                        "memory_budget=...) on a model instance")
    if example_inputs is None:
        raise TypeError("memory_budget needs example_inputs: the plan is made for their shapes")
    if not model.training:
        raise ValueError("memory_budget plans checkpointing for training: the model is in eval mode "
                         "(call model.train() first)")
    return CheckpointedModule(model, example_inputs, memory_budget, optimizer=optimizer, loss=loss,
                              autocast=autocast, compiled=compiled, target=target, check=check)


def plan_checkpointing(model: torch.nn.Module, example_inputs: Any, memory_budget: Any, *,
                       optimizer: Any = torch.optim.AdamW, loss: Any = None,
                       autocast: torch.dtype | None = None, check: bool = True,
                       graph_module: torch.fx.GraphModule | None = None) -> CheckpointPlan:
    """The plan ``fxforge.optimize(model, inputs, memory_budget=...)`` would run, without keeping the module.
    ``graph_module``: the model as :func:`~fxforge.training.eager_graph.eager_like_graph` captured it on these
    inputs, where the caller has it (``training_memory(...).step.wrapper.model``): not captured again.

    Raises:
        fxforge.training.checkpointing.BudgetError: no recomputation fits the budget.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64))
        >>> plan = plan_checkpointing(model.train(), (torch.randn(256, 64),), "100%", optimizer=None)
        >>> plan.recomputed, plan.solver
        ([], 'none needed (the step fits unconstrained)')
    """
    return CheckpointedModule(model, example_inputs, memory_budget, optimizer=optimizer, loss=loss,
                              autocast=autocast, check=check, graph_module=graph_module).plan
