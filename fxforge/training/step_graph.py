"""A training step as two graphs: AOTAutograd's forward and backward, traced with fake tensors.

:func:`trace_step` wraps the model (and a loss, when one is given) in a module whose forward takes the
flattened inputs, and hands it to ``aot_module_simplified``: AOTAutograd fakes the parameters and inputs,
traces forward and backward into one joint graph (the ATen ops eager runs, after autograd), and a
partitioner splits it into the forward graph (whose extra outputs are the activations saved for backward)
and the backward graph. Nothing runs on real data. Each node carries the name of the innermost module
that ran it (``node.meta["custom"]["module"]``, backward nodes their forward node's), read from forward
hooks that annotate the trace while it runs.

The partitioner is torch's own default one (eager's saving: everything the backward formulas use), told
which forward nodes to recompute in the backward instead (:func:`partition`): nodes tagged
``MUST_RECOMPUTE`` are not saved, and the backward recomputes them right before their first use.

Example:
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    >>> step = trace_step(model, (torch.randn(4, 8),), {})
    >>> [n.name for n in step.saved_nodes()]   # the input, relu's output and an alias, a weight's view
    ['primals_5', 'relu', 'detach', 't_1']
    >>> step.parameter_names[:2]
    ['0.weight', '0.bias']
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import operator
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch._guards import TracingContext, detect_fake_mode, tracing
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import CheckpointPolicy

LossFn = Callable[[Any], torch.Tensor]


def default_loss(outputs: Any) -> torch.Tensor:
    """The sum of every floating-point tensor the model returns: a loss whose gradient reaches them all.

    Example:
        >>> default_loss({"a": torch.ones(2), "b": [torch.ones(3), torch.arange(2)]})
        tensor(5.)
    """
    leaves = [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not leaves:
        raise ValueError("the model returns no floating-point tensor to take a loss of; pass loss=")
    total = leaves[0].sum()
    for leaf in leaves[1:]:
        total = total + leaf.sum()
    return total


class StepModule(torch.nn.Module):
    """The model as AOTAutograd takes it: flat tensor inputs in, a tuple of tensors out.

    With a ``loss`` the tuple is ``(loss,)``; without, the model's output tensors (:meth:`rebuild` puts
    them back in the model's structure, with the values that are not tensors as the trace saw them).

    Example:
        >>> m = StepModule(torch.nn.Linear(2, 2), (torch.ones(1, 2),), {}, loss=default_loss)
        >>> m(torch.ones(1, 2))[0].shape
        torch.Size([])
    """

    def __init__(self, model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 loss: LossFn | None = None):
        super().__init__()
        self.model = model
        self.loss = loss
        leaves, self.input_spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        self.tensor_positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        self.constants = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        self.output_spec: pytree.TreeSpec | None = None
        self.output_positions: list[int] = []
        self.output_constants: list[Any] = []

    def flat_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """The tensors among ``args`` and ``kwargs``, in the order the module takes them."""
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        if spec != self.input_spec:
            raise ValueError(f"inputs of another structure than the example's: {spec} vs {self.input_spec}")
        return [leaves[i] for i in self.tensor_positions]

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        leaves = list(self.constants)
        for position, tensor in zip(self.tensor_positions, tensors):
            leaves[position] = tensor
        args, kwargs = pytree.tree_unflatten(leaves, self.input_spec)
        if isinstance(self.model, torch.fx.GraphModule):
            # Through the Interpreter, each traced op inherits its graph node's meta (its module stack);
            # keyword inputs are bound to the graph's placeholders by its forward's signature.
            bound = inspect.signature(self.model.forward).bind(*args, **kwargs)
            outputs = torch.fx.Interpreter(self.model).run(*bound.args, *bound.kwargs.values())
        else:
            outputs = self.model(*args, **kwargs)
        if self.loss is not None:
            return (self.loss(outputs),)
        flat, self.output_spec = pytree.tree_flatten(outputs)
        self.output_positions = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor)]
        self.output_constants = [None if isinstance(t, torch.Tensor) else t for t in flat]
        return tuple(flat[i] for i in self.output_positions)

    def rebuild(self, tensors: Any) -> Any:
        """The model's output structure around the flat tensors the traced step returned."""
        leaves = list(self.output_constants)
        for position, tensor in zip(self.output_positions, tensors):
            leaves[position] = tensor
        return pytree.tree_unflatten(leaves, self.output_spec)


@dataclasses.dataclass
class StepGraphs:
    """The joint graph of a training step and one partition of it into forward and backward.

    Attributes:
        joint: AOTAutograd's joint forward+backward graph (placeholders: primals, then tangents).
        joint_inputs: what the partitioner was given beside the joint graph.
        num_fwd_outputs: the forward's own outputs (the loss or the model's outputs, and mutated buffers);
            the forward graph's outputs after them are the values saved for backward.
        forward: the forward graph of the partition.
        backward: the backward graph (placeholders: the saved values, then the tangents).
        parameter_names: the primals that are parameters, in order (the first placeholders).
        buffer_names: the primals that are buffers, after the parameters.
        trainable: per parameter, whether it requires grad.
        recomputed: the joint graph's forward nodes the partition recomputes in the backward.
        partition_kwargs: the keyword arguments the partitioner was called with.
        wrapper: the :class:`StepModule` traced (it rebuilds the model's outputs).
        compiled: AOTAutograd's callable over the flat inputs (runs the graphs when compilers were given).

    Example:
        >>> step = trace_step(torch.nn.Linear(4, 4), (torch.randn(2, 4),), {})
        >>> len(step.saved_nodes()), step.recomputed
        (1, set())
    """

    joint: torch.fx.GraphModule
    joint_inputs: Any
    num_fwd_outputs: int
    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule
    parameter_names: list[str]
    buffer_names: list[str]
    trainable: list[bool]
    recomputed: set[str] = dataclasses.field(default_factory=set)
    partition_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    wrapper: StepModule | None = None
    compiled: Callable[..., Any] | None = None

    def saved_nodes(self) -> list[torch.fx.Node]:
        """The forward graph's nodes saved for backward (its outputs after the step's own)."""
        (out,) = self.forward.graph.find_nodes(op="output")
        saved = out.args[0][self.num_fwd_outputs:]
        return [n for n in saved if isinstance(n, torch.fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)]

    def forward_nodes(self) -> list[torch.fx.Node]:
        """The joint graph's forward compute nodes (what a partition may choose to recompute)."""
        return [n for n in self.joint.graph.nodes if n.op == "call_function" and is_forward(n)]

    def repartition(self, recompute: Iterable[str]) -> StepGraphs:
        """A new partition of the same joint graph that recomputes the forward nodes named in ``recompute``.

        Example:
            >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
            >>> step = trace_step(model, (torch.randn(4, 8),), {})
            >>> [n.name for n in step.repartition({"relu", "detach"}).saved_nodes()]   # relu's input instead
            ['primals_5', 'addmm', 't_1']
        """
        recompute = set(recompute)
        # A plan tries many partitions and reads only their nodes: their Python code is generated on first
        # call, not here (a third of a partition's time on ResNet-50 and on an LSTM).
        with lazy_code():
            forward, backward = partition(self.joint, self.joint_inputs, recompute, **self.partition_kwargs)
        return dataclasses.replace(self, forward=forward, backward=backward, recomputed=recompute)


@contextlib.contextmanager
def lazy_code():
    """Within it, the graph modules torch's partitioner makes generate their Python code on their first call
    rather than when made: ``_make_graph_module`` makes lazy modules under torch's own switch, and the one
    module its backward reordering builds directly (``reordering_to_mimic_autograd_engine``) is made lazy
    here, for the length of that call only. Graphs and their order are the same either way (the tests hold
    the two partitions equal).
    """
    from torch._functorch import partitioners
    from torch.fx._lazy_graph_module import _LazyGraphModule, _use_lazy_graph_module

    original = partitioners.reordering_to_mimic_autograd_engine

    def reordering(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        made = torch.fx.GraphModule
        torch.fx.GraphModule = _LazyGraphModule
        try:
            return original(gm)
        finally:
            torch.fx.GraphModule = made

    partitioners.reordering_to_mimic_autograd_engine = reordering
    try:
        with _use_lazy_graph_module(True):
            yield
    finally:
        partitioners.reordering_to_mimic_autograd_engine = original


def is_forward(node: torch.fx.Node) -> bool:
    """Whether a joint-graph node belongs to the forward (AOTAutograd tags each node with its side)."""
    tag = node.meta.get("partitioner_tag")
    if tag is not None:
        return tag == "is_forward"
    return not _reaches_from_tangents(node)


def _reaches_from_tangents(node: torch.fx.Node) -> bool:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n.op == "placeholder" and "tangents" in n.name:
            return True
        for i in n.all_input_nodes:
            if i not in seen:
                seen.add(i)
                stack.append(i)
    return False


def is_random(node: torch.fx.Node) -> bool:
    """Whether a node draws random numbers (an op tagged ``nondeterministic_seeded``: dropout, rand...)."""
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def partition(joint: torch.fx.GraphModule, joint_inputs: Any, recompute: set[str], *, num_fwd_outputs: int,
              **kwargs: Any) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """Split ``joint`` into forward and backward, recomputing the forward nodes named in ``recompute``.

    Torch's default partitioner does the splitting: it saves what the backward uses and is not tagged
    ``MUST_RECOMPUTE``, saves the inputs of a recomputed region, and places each recomputed node right
    before its first use in the backward. Random nodes are never recomputed here (they would draw new
    numbers on CPU); the planner does not offer them.

    Raises:
        ValueError: ``recompute`` names a node that is not a forward node of ``joint``, or a random one.
    """
    by_name = {n.name: n for n in joint.graph.nodes}
    for name in recompute:
        node = by_name.get(name)
        if node is None or node.op != "call_function" or not is_forward(node):
            raise ValueError(f"{name!r} is not a forward node of the step's graph")
        if is_random(node):
            raise ValueError(f"{name!r} draws random numbers and cannot be recomputed")
    for node in joint.graph.nodes:
        node.meta.pop("recompute", None)
        if node.name in recompute:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    from torch._functorch.partitioners import default_partition  # imports Inductor: only when partitioning

    try:
        forward, backward = default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
    finally:
        for node in joint.graph.nodes:
            node.meta.pop("recompute", None)
    # The partitioner copies random forward ops into the backward along with their inputs even where the
    # backward uses none of their results (they count as impure); run there, they would draw numbers the
    # forward did not, and hold memory. Unused, they go; a random op the backward does use stays.
    backward.graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure(impure_random=False))
    backward.recompile()
    return forward, backward


@contextlib.contextmanager
def module_annotations(model: torch.nn.Module):
    """Within it, every op traced while a submodule of ``model`` runs is annotated with that module's name.

    Forward pre- and post-hooks enter and leave ``torch.fx.traceback.annotate({"module": name})``; the
    innermost module wins. The hooks are removed on exit.
    """
    handles, stack = [], []

    def enter(name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            context = fx_traceback.annotate({"module": name})
            context.__enter__()
            stack.append(context)
        return hook

    def leave(module: torch.nn.Module, args: Any, output: Any) -> None:
        if stack:
            stack.pop().__exit__(None, None, None)

    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(enter(name)))
        handles.append(module.register_forward_hook(leave, always_call=True))
    try:
        with fx_traceback.preserve_node_meta():
            yield
    finally:
        while stack:
            stack.pop().__exit__(None, None, None)
        for handle in handles:
            handle.remove()


def module_of(node: torch.fx.Node) -> str:
    """The name of the innermost module that ran ``node`` ("" for the root, the loss, and the step's glue).

    Example:
        >>> step = trace_step(torch.nn.Sequential(torch.nn.Linear(4, 4)), (torch.randn(2, 4),), {})
        >>> sorted({module_of(n) for n in step.forward.graph.nodes})
        ['', '0']
    """
    custom = node.meta.get("custom") or {}
    if isinstance(custom, dict) and "module" in custom:
        return custom["module"]
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    if stack:
        path = list(stack.values())[-1][0]
        return clean_module_path(path)
    return ""


def clean_module_path(path: str) -> str:
    """``L['self'].transformer.h[0]`` (dynamo's spelling) or ``transformer.h.0`` -> ``transformer.h.0``."""
    path = path.replace("L['self'].", "").replace("L['self']", "")
    return path.replace("[", ".").replace("]", "").replace("'", "")


def trace_step(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *,
               loss: LossFn | None = default_loss, recompute: Iterable[str] = (),
               autocast: torch.dtype | None = None,
               compilers: tuple[Callable[..., Any], Callable[..., Any]] | None = None,
               choose: Callable[[StepGraphs], Iterable[str]] | None = None,
               finish: Callable[[StepGraphs], None] | None = None,
               strides_from_compiler: bool = False,
               decompositions: dict[Any, Callable[..., Any]] | None = None,
               ) -> StepGraphs:
    """Trace one training step of ``model`` on fake copies of ``args``/``kwargs`` into :class:`StepGraphs`.

    Args:
        model: the model (its mode decides dropout and batch-norm behaviour, as in eager).
        args, kwargs: example inputs (only their shapes, dtypes and devices are used).
        loss: outputs -> scalar; None traces the model's outputs themselves (the backward then takes one
            gradient per floating-point output, as a user's loss would give).
        recompute: forward nodes of the joint graph to recompute in the backward (node names).
        autocast: trace under ``torch.autocast(device, dtype)`` (mixed precision), or None.
        compilers: ``(forward, backward)`` compilers for AOTAutograd; default: keep the graphs (the step
            is only traced). :mod:`fxforge.training.module` passes runners here.
        choose: called with the unconstrained partition while AOTAutograd waits for one; the names it
            returns are recomputed in the partition AOTAutograd compiles (a checkpointing plan chosen on
            the same trace, so the callable it returns runs the plan).
        finish: called with the final partition before AOTAutograd compiles it (it may reorder the
            backward graph in place).
        strides_from_compiler: the forward compiler chooses the strides of the values it saves (Inductor
            does): AOTAutograd runs in a ``TracingContext`` of its own, through which the compiler reports them
            and the backward is compiled for them (as under ``torch.compile``).
        decompositions: ATen decompositions applied while tracing (Inductor's, for a step Inductor
            compiles: the plan then chooses among the ops Inductor will see, a batch norm's statistics apart
            from its elementwise normalization).

    Returns:
        The graphs (``.compiled``: AOTAutograd's callable over the flat inputs).

    Example:
        >>> step = trace_step(torch.nn.Linear(4, 4), (torch.randn(2, 4),), {})
        >>> sorted(step.trainable), step.buffer_names
        ([True, True], [])
    """
    from torch._functorch.aot_autograd import aot_module_simplified  # imports Inductor: only when tracing

    wrapper = StepModule(model, args, kwargs, loss)
    flat = wrapper.flat_inputs(args, kwargs)
    recorded: dict[str, Any] = {}

    def partition_fn(joint, joint_inputs, **kw):
        # Metadata assertions the trace emits (a cast's dtype and device) were checked on the fake tensors;
        # left in, they are effects the partitioner will not recompute around.
        for node in list(joint.graph.nodes):
            if node.target is torch.ops.aten._assert_tensor_metadata.default and not node.users:
                joint.graph.erase_node(node)
        recorded.update(joint=joint, joint_inputs=joint_inputs, kwargs=kw)
        names = set(recompute)
        forward, backward = partition(joint, joint_inputs, names, **kw)
        if choose is not None:
            unconstrained = _graphs(recorded, wrapper, forward, backward, names)
            names = set(choose(unconstrained))
            forward, backward = partition(joint, joint_inputs, names, **kw)
        if finish is not None:
            finish(_graphs(recorded, wrapper, forward, backward, names))
        recorded.update(forward=forward, backward=backward, recompute=names)
        return forward, backward

    keep = (lambda gm, example: gm)
    forward_compiler, backward_compiler = compilers or (keep, keep)
    device = next((t.device.type for t in flat if t.device.type != "meta"), "cpu")
    amp = torch.autocast(device, dtype=autocast) if autocast is not None else contextlib.nullcontext()
    annotations = contextlib.nullcontext() if isinstance(model, torch.fx.GraphModule) else module_annotations(model)
    # Fake copies of the inputs made here, in a mode that lets the model and the loss read real tensors the
    # caller closed over (labels, a mask): they enter the graphs as constants.
    # A trace inside another's (a loss sized while the step's partition is chosen) has fake tensors of its own,
    # not those of the enclosing trace's context.
    with tracing(None):
        fake_mode = detect_fake_mode(flat) or FakeTensorMode(allow_non_fake_inputs=True)
        fake = [t if isinstance(t, FakeTensor) else fake_mode.from_tensor(t) for t in flat]
        context = TracingContext(fake_mode) if strides_from_compiler else None
        with tracing(context), amp, annotations, fx_traceback.preserve_node_meta():
            compiled = aot_module_simplified(wrapper, fake, fw_compiler=forward_compiler,
                                             bw_compiler=backward_compiler, partition_fn=partition_fn,
                                             decompositions=decompositions)
    if "joint" not in recorded:
        raise RuntimeError("the model has no parameter or input that requires grad: there is no backward to plan")
    step = _graphs(recorded, wrapper, recorded["forward"], recorded["backward"], recorded["recompute"])
    step.compiled = compiled
    return step


def _graphs(recorded: dict[str, Any], wrapper: StepModule, forward: torch.fx.GraphModule,
            backward: torch.fx.GraphModule, recompute: set[str]) -> StepGraphs:
    params = dict(wrapper.named_parameters(remove_duplicate=False))
    buffers = dict(wrapper.named_buffers(remove_duplicate=False))
    kw = dict(recorded["kwargs"])
    num_fwd_outputs = kw.pop("num_fwd_outputs")
    return StepGraphs(recorded["joint"], recorded["joint_inputs"], num_fwd_outputs, forward, backward,
                      [_strip(n) for n in params], [_strip(n) for n in buffers],
                      [p.requires_grad for p in params.values()], set(recompute),
                      {"num_fwd_outputs": num_fwd_outputs, **kw}, wrapper)


def _strip(name: str) -> str:
    return name.removeprefix("model.")


def getitem_users(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The ``operator.getitem`` users of a multi-output node."""
    return [u for u in node.users if u.op == "call_function" and u.target is operator.getitem]
