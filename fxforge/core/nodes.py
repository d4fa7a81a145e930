"""Facts about fx nodes that every rewrite needs: which ops have effects, what a node's tensor is, and
how to copy a GraphModule without copying the model's parameters.

Example:
    >>> import torch
    >>> gm = torch.fx.symbolic_trace(torch.nn.ReLU(inplace=True))
    >>> [is_effectful(n, gm) for n in gm.graph.nodes if n.op == "call_function"]
    [True]
"""

from __future__ import annotations

import copy
import operator
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.fx.node import _side_effectful_functions

from fxforge.core.vocabulary import SDPA_TARGETS, has_hooks, read_dropout, sdpa_arguments

_INPLACE_OPERATORS = {
    operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
    operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
    operator.ilshift, operator.irshift, operator.imatmul,
}
# The same operators reached as Tensor methods: x.__iadd__(y), x.__setitem__(i, v).
_INPLACE_DUNDERS = {f"__{op.__name__}__" for op in _INPLACE_OPERATORS}

F = nn.functional

# The node kinds that compute something (not inputs, outputs or parameter reads).
CALL_OPS = ("call_function", "call_method", "call_module")
# Functions whose result depends on the RNG unless told they are not training (dropout: see is_random).
_RANDOM_FUNCTIONS = {
    torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like, torch.randint_like,
    torch.randperm, torch.bernoulli, torch.multinomial, torch.normal, torch.poisson, F.rrelu, F.gumbel_softmax,
}
_RANDOM_METHODS = {"bernoulli", "multinomial", "random_", "uniform_", "normal_", "exponential_", "geometric_"}


def target_name(node: torch.fx.Node) -> str:
    """A readable name for what a node calls: ``relu``, ``Conv2d``, ``aten.add.Tensor``, ``view``.

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x"); n = g.call_method("view", (x, 2))
        >>> target_name(n)
        'view'
    """
    target = node.target
    if node.op == "call_module":
        return str(target)
    if node.op == "call_method":
        return str(target)
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target._opname}.{target._overloadname}" if target.namespace == "aten" else str(target)
    return getattr(target, "__name__", str(target))


def count_calls(graph: torch.fx.Graph) -> int:
    """The number of nodes that compute (calls), not counting inputs, outputs and parameter reads, so a
    folded weight does not count as a node.

    Example:
        >>> count_calls(torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())).graph)
        2
    """
    return sum(node.op in CALL_OPS for node in graph.nodes)


def submodule(node: torch.fx.Node, gm: torch.fx.GraphModule) -> nn.Module | None:
    """The module a ``call_module`` node calls, else None.

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU()))
        >>> [type(submodule(n, gm)).__name__ for n in gm.graph.nodes if n.op == "call_module"]
        ['ReLU']
    """
    return named_submodule(gm, node.target) if node.op == "call_module" else None


def named_submodule(model: nn.Module, name: str) -> nn.Module | None:
    """The submodule called ``name`` in ``model`` (``""``: the model), else None.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.ReLU())
        >>> type(named_submodule(model, "0")).__name__, named_submodule(model, "1")
        ('ReLU', None)
    """
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def is_torch_nn_module(module: nn.Module) -> bool:
    """Whether ``module`` is one of torch.nn's own modules (whose effects fxforge knows), not a user's.

    Example:
        >>> is_torch_nn_module(torch.nn.ReLU()), is_torch_nn_module(torch.fx.symbolic_trace(torch.nn.ReLU()))
        (True, False)
    """
    return type(module).__module__.startswith("torch.nn.modules")


def is_inplace(node: torch.fx.Node, gm: torch.fx.GraphModule) -> bool:
    """True when ``node`` writes into one of its inputs: ``relu_``/``x.add_``, ``inplace=True`` (argument or
    module attribute), ``+=`` and ``setitem`` (as operators or dunder methods), ATen ops with mutable schemas.

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x")
        >>> a, b, c = (g.call_method(m, (x, 1)) for m in ("__iadd__", "__invert__", "mul_")); _ = g.output(x)
        >>> gm = torch.fx.GraphModule(torch.nn.Module(), g)
        >>> is_inplace(a, gm), is_inplace(b, gm), is_inplace(c, gm)
        (True, False, True)
    """
    if node.kwargs.get("inplace") is True:
        return True
    target = node.target
    if node.op == "call_module":
        return bool(getattr(submodule(node, gm), "inplace", False))
    if node.op == "call_method":
        name = str(target)
        return name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("__"))
    if node.op != "call_function":
        return False
    if target in _INPLACE_OPERATORS:
        return True
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable
    name = getattr(target, "__name__", "")
    return name.endswith("_") and not name.startswith("_")


def is_effectful(node: torch.fx.Node, gm: torch.fx.GraphModule) -> bool:
    """True when removing or reordering ``node`` could change results even if its value is unused.

    Effects: mutation (in-place ops, ``inplace=True``, setitem, ATen ops with mutable schemas), random
    numbers (an unused dropout still advances the RNG in training), and calls into modules whose effects
    fxforge cannot see (user modules kept opaque, torch.nn modules in training mode or with hooks, export's
    guards).

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x")
        >>> a, b = g.call_method("add_", (x, 1)), g.call_method("add", (x, 1)); _ = g.output(x)
        >>> gm = torch.fx.GraphModule(torch.nn.Module(), g)
        >>> is_effectful(a, gm), is_effectful(b, gm)
        (True, False)
    """
    if node.op in ("placeholder", "output"):
        return True
    if node.op == "get_attr":
        return False
    target = node.target
    if node.op == "call_module":
        module = submodule(node, gm)
        if module is None or not is_torch_nn_module(module) or has_hooks(module):
            return True
        return is_inplace(node, gm) or module.training
    if node.op == "call_method":
        return is_inplace(node, gm) or is_random(node)
    if target in _side_effectful_functions or is_inplace(node, gm):
        return True
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.is_mutable or is_random(node)
    if isinstance(target, torch._ops.OpOverloadPacket):
        return True
    return is_random(node)


def is_random(node: torch.fx.Node) -> bool:
    """True when ``node`` draws random numbers (it advances the RNG: its order relative to other random
    ops decides their values). Dropout counts only when its ``training`` flag is on.

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x")
        >>> is_random(g.call_function(torch.nn.functional.dropout, (x, 0.5, False)))
        False
        >>> is_random(g.call_method("bernoulli", (x,)))
        True
    """
    target = node.target
    if node.op == "call_method":
        return str(target) in _RANDOM_METHODS
    if node.op != "call_function":
        return False
    if target in SDPA_TARGETS:  # random only through its attention dropout
        p = sdpa_arguments(node).get("dropout_p", 0.0)
        return not (isinstance(p, (int, float)) and p == 0)
    if isinstance(target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in target.tags
    dropout = read_dropout(node)
    if dropout is not None:
        return dropout.drops
    return target in _RANDOM_FUNCTIONS and _training_flag(node, default=True)


def _training_flag(node: torch.fx.Node, default: bool) -> bool:
    """The ``training``/``train`` argument of a dropout-like call (third positional argument)."""
    for key in ("training", "train"):
        if key in node.kwargs:
            return bool(node.kwargs[key])
    if len(node.args) >= 3 and isinstance(node.args[2], bool):
        return node.args[2]
    return default


def attribute_tensor(gm: torch.nn.Module, target: str) -> torch.Tensor | None:
    """The tensor at a dotted attribute path of ``gm`` (what a ``get_attr`` node reads), or None.

    Example:
        >>> attribute_tensor(torch.nn.Sequential(torch.nn.Linear(2, 3)), "0.bias").shape
        torch.Size([3])
    """
    obj: Any = gm
    for part in str(target).split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, torch.Tensor) else None


def constant_tensor(gm: torch.nn.Module, value: Any) -> torch.Tensor | None:
    """The real tensor a ``get_attr`` node reads (a weight, a bias), else None.

    Example:
        >>> g = torch.fx.Graph(); w = g.get_attr("weight")
        >>> constant_tensor(torch.nn.Linear(2, 3), w).shape
        torch.Size([3, 2])
    """
    if not isinstance(value, torch.fx.Node) or value.op != "get_attr":
        return None
    return attribute_tensor(gm, value.target)


def fake_value(node: Any) -> torch.Tensor | None:
    """The FakeTensor recorded on a node (``meta['val']``), or None when it has none or is no tensor.

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x")
        >>> fake_value(x) is None
        True
    """
    if not isinstance(node, torch.fx.Node):
        return None
    value = node.meta.get("val")
    return value if isinstance(value, torch.Tensor) else None


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A GraphModule with its own copy of the graph that shares every submodule, parameter and buffer.

    Passes mutate the copy; the original stays intact for comparison and rollback.

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
        >>> copy_graph_module(gm).weight is gm.weight
        True
    """
    with warnings.catch_warnings():
        # Deep-copying export's pytree codegen trips a deprecation inside torch's own treespec pickling.
        warnings.simplefilter("ignore", FutureWarning)
        graph = copy.deepcopy(gm.graph)
    new = torch.fx.GraphModule(gm, graph, gm.__class__.__name__)
    # A copy of each table in meta (the folds' recipes, ...): what a pass adds to the copy stays in the copy.
    new.meta = {k: dict(v) if isinstance(v, dict) else v for k, v in getattr(gm, "meta", {}).items()}
    return new


def mutated_aliases(node: torch.fx.Node, gm: torch.fx.GraphModule) -> bool:
    """True when ``node``'s value, or a view of it reached through its users, is mutated in place.

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x"); v = g.call_method("view", (x, -1))
        >>> _ = g.call_method("add_", (v, 1))
        >>> mutated_aliases(x, torch.fx.GraphModule(torch.nn.Module(), g))
        True
    """
    return any(is_effectful(user, gm) and (user.args[:1] == (alias,) or user.op == "call_module")
               for alias, user in alias_users(node))


def alias_users(node: torch.fx.Node) -> Iterator[tuple[torch.fx.Node, torch.fx.Node]]:
    """``(alias, user)`` for every user (but the output) of ``node`` and of each view of it reached through its
    users, views first found first.

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x"); v = g.call_method("view", (x, -1))
        >>> a = g.call_method("add_", (v, 1))
        >>> [(alias.name, user.name) for alias, user in alias_users(x)]
        [('x', 'view'), ('view', 'add_')]
    """
    seen: set[torch.fx.Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        for user in current.users:
            if user.op == "output":
                continue
            yield current, user
            if is_view_op(user):
                stack.append(user)


_VIEW_METHODS = {"view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "transpose", "permute",
                 "squeeze", "unsqueeze", "expand", "expand_as", "narrow", "select", "t", "T", "mT",
                 "contiguous", "to", "type", "type_as", "float", "double", "half", "detach", "unfold",
                 "chunk", "split", "unbind", "__getitem__", "as_strided", "movedim", "swapaxes"}


def is_view_op(node: torch.fx.Node) -> bool:
    """True when ``node`` may return a view (an alias) of its first argument.

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x")
        >>> is_view_op(g.call_method("transpose", (x, 0, 1)))
        True
    """
    target = node.target
    if node.op == "call_method":
        return str(target) in _VIEW_METHODS
    if node.op != "call_function":
        return False
    if isinstance(target, torch._ops.OpOverload):
        return target.is_view or any(a.alias_info is not None and not a.alias_info.is_write
                                     for a in target._schema.returns)
    name = getattr(target, "__name__", "")
    return name in _VIEW_METHODS or target is operator.getitem


def call_node(node: torch.fx.Node, value_of: Any) -> Any:
    """Run a ``call_function``/``call_method`` node with each input node replaced by ``value_of(node)``.

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x"); y = g.call_method("add", (x, 1))
        >>> call_node(y, {x: torch.ones(1)}.__getitem__).tolist()
        [2.0]
    """
    args = torch.fx.node.map_arg(node.args, value_of)
    kwargs = torch.fx.node.map_arg(node.kwargs, value_of)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    return node.target(*args, **kwargs)
