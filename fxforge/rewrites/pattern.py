"""The pattern engine: rules written as ordinary torch code that match every call form of their ops.

A :class:`Rule` is a pattern function, a replacement function and an optional ``check``. The pattern is
traced with ``torch.fx`` and each of its nodes, like each node of the graph being rewritten, is seen as a
*canonical op* (:func:`canonicalize`): ``nn.ReLU()``, ``F.relu``, ``torch.relu``, ``x.relu()``, ``relu_``,
``inplace=True`` and ``aten.relu_`` are all ``relu``; ``+``, ``torch.add``, ``x.add_`` and ``aten.add.Tensor``
are all ``add`` (operands in either order); ``/``, ``torch.div`` and ``aten.div.Tensor`` are all ``div``;
``@``, ``mm`` and ``bmm`` are all ``matmul``; ``nn.Conv2d``, ``F.conv2d``, ``aten.conv2d`` and
``aten.convolution`` are all ``conv2d``. Matching then compares canonical ops and their arguments:

- a pattern *argument* (a parameter of the pattern function) matches anything and binds it; used twice,
  it must bind the same value;
- a constant in the pattern, or an argument it leaves at its default, must equal the graph's value;
- a match never swallows an intermediate value used outside it, never drops a side effect, and never
  moves an op past an in-place change of its input: such matches are refused with the reason.

The replacement is called with the bindings (graph values as ``torch.fx.Proxy``, constants as they are)
and its torch calls are recorded into the graph. With ``fold=True`` the parts of the replacement that
depend only on parameters are computed once (in float64) and registered as new tensors on the
GraphModule; the model's own parameters are never modified.

Example:
    >>> import torch.nn.functional as F
    >>> from fxforge.rewrites.pattern import Rule
    >>> silu = Rule("silu", lambda x: x * torch.sigmoid(x), lambda x: F.silu(x))
    >>> gm = torch.fx.symbolic_trace(lambda x: torch.sigmoid(x).mul(x) + 1)
    >>> from fxforge.rewrites.passes import PassContext
    >>> ctx = PassContext("silu", training=False, method="fx")
    >>> silu.apply(gm, ctx); [m.what for m in ctx.matches]
    ['silu']
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.fx import Node

from fxforge.core.nodes import (
    CALL_OPS,
    attribute_tensor,
    is_effectful,
    is_inplace,
    is_view_op,
    submodule,
)
from fxforge.core.source import inherit_origin
from fxforge.core.verify import CONSTANT_BUFFER_PREFIX
from fxforge.rewrites.passes import Pass, PassContext, Refusal

F = nn.functional
aten = torch.ops.aten
_REQUIRED = object()

# Canonical ops: argument names in order, with defaults. Every call form is bound to these names.
SIGNATURES: dict[str, tuple[tuple[str, Any], ...]] = {
    "relu": (("input", _REQUIRED),),
    "hardtanh": (("input", _REQUIRED), ("min_val", -1.0), ("max_val", 1.0)),
    "leaky_relu": (("input", _REQUIRED), ("negative_slope", 0.01)),
    "gelu": (("input", _REQUIRED), ("approximate", "none")),
    "silu": (("input", _REQUIRED),),
    "sigmoid": (("input", _REQUIRED),),
    "tanh": (("input", _REQUIRED),),
    "hardswish": (("input", _REQUIRED),),
    "add": (("input", _REQUIRED), ("other", _REQUIRED), ("alpha", 1)),
    "sub": (("input", _REQUIRED), ("other", _REQUIRED), ("alpha", 1)),
    "mul": (("input", _REQUIRED), ("other", _REQUIRED)),
    "div": (("input", _REQUIRED), ("other", _REQUIRED), ("rounding_mode", None)),
    "matmul": (("input", _REQUIRED), ("other", _REQUIRED)),
    "linear": (("input", _REQUIRED), ("weight", _REQUIRED), ("bias", None)),
    "batch_norm": (("input", _REQUIRED), ("running_mean", _REQUIRED), ("running_var", _REQUIRED), ("weight", None),
                   ("bias", None), ("training", False), ("momentum", 0.1), ("eps", 1e-5)),
    **{f"conv{n}d": (("input", _REQUIRED), ("weight", _REQUIRED), ("bias", None), ("stride", 1), ("padding", 0),
                     ("dilation", 1), ("groups", 1)) for n in (1, 2, 3)},
}
COMMUTATIVE = {"add", "mul"}


def _some(owner: Any, *names: str) -> tuple:
    return tuple(getattr(owner, n) for n in names if hasattr(owner, n))


# Every call form of each canonical op, read top to bottom:
#   canonical op, functions (torch, F, operator, aten packets), Tensor methods, nn.Module classes.
FORMS: list[tuple[str, tuple, tuple[str, ...], tuple[type, ...]]] = [
    ("relu", (F.relu, F.relu_, torch.relu, torch.relu_, aten.relu, aten.relu_), ("relu", "relu_"), (nn.ReLU,)),
    ("hardtanh", (F.hardtanh, F.hardtanh_, F.relu6, aten.hardtanh, aten.hardtanh_, aten.relu6), (),
     (nn.Hardtanh,)),  # nn.ReLU6 is a Hardtanh(0, 6)
    ("leaky_relu", (F.leaky_relu, F.leaky_relu_, aten.leaky_relu, aten.leaky_relu_), (), (nn.LeakyReLU,)),
    ("gelu", (F.gelu, aten.gelu, aten.gelu_), (), (nn.GELU,)),
    ("silu", (F.silu, aten.silu, aten.silu_), (), (nn.SiLU,)),
    ("sigmoid", (F.sigmoid, torch.sigmoid, torch.sigmoid_, aten.sigmoid, aten.sigmoid_), ("sigmoid", "sigmoid_"),
     (nn.Sigmoid,)),
    ("tanh", (F.tanh, torch.tanh, torch.tanh_, aten.tanh, aten.tanh_), ("tanh", "tanh_"), (nn.Tanh,)),
    ("hardswish", (F.hardswish, aten.hardswish, aten.hardswish_), (), (nn.Hardswish,)),
    ("add", (operator.add, operator.iadd, torch.add, aten.add, aten.add_), ("add", "add_", "__add__", "__iadd__"), ()),
    ("sub", (operator.sub, operator.isub, torch.sub, aten.sub, aten.sub_), ("sub", "sub_", "__sub__", "__isub__"), ()),
    ("mul", (operator.mul, operator.imul, torch.mul, aten.mul, aten.mul_), ("mul", "mul_", "__mul__", "__imul__"), ()),
    ("div", (operator.truediv, operator.itruediv, torch.div, torch.true_divide, aten.div, aten.div_, aten.true_divide),
     ("div", "div_", "true_divide", "__truediv__", "__itruediv__"), ()),
    ("matmul", (operator.matmul, torch.matmul, torch.bmm, aten.matmul, aten.mm, aten.bmm),
     ("matmul", "mm", "bmm", "__matmul__"), ()),  # mm and bmm are matmul on the inputs they accept
    ("linear", (F.linear, aten.linear), (), (nn.Linear,)),
    ("conv1d", (F.conv1d, aten.conv1d), (), (nn.Conv1d,)),
    ("conv2d", (F.conv2d, aten.conv2d), (), (nn.Conv2d,)),
    ("conv3d", (F.conv3d, aten.conv3d), (), (nn.Conv3d,)),
    ("batch_norm", (F.batch_norm, torch.batch_norm, aten.batch_norm), (),
     (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)),
]
_FUNCTIONS = {fn: name for name, fns, _, _ in FORMS for fn in fns}
_METHODS = {m: name for name, _, methods, _ in FORMS for m in methods}
_MODULES = {cls: name for name, _, _, classes in FORMS for cls in classes}
_FIXED = {F.relu6: {"min_val": 0.0, "max_val": 6.0}, aten.relu6: {"min_val": 0.0, "max_val": 6.0}}
# Multi-output batch norms of decomposed export graphs, seen through ``getitem(node, 0)``.
_BN_TUPLES = set(_some(aten, "_native_batch_norm_legit_no_training", "_native_batch_norm_legit", "native_batch_norm"))
_DUNDER = {"__add__": "add", "__iadd__": "add_", "__sub__": "sub", "__isub__": "sub_", "__mul__": "mul",
           "__imul__": "mul_", "__truediv__": "div", "__itruediv__": "div_", "__matmul__": "matmul"}
_IGNORED_ARGS = {"inplace", "cudnn_enabled", "output_padding"}
_PARAMETERS = ("weight", "bias", "running_mean", "running_var")


@dataclasses.dataclass(frozen=True)
class ParamRef:
    """A parameter or buffer of a called module (``conv.weight``), which the graph has no node for."""

    target: str


@dataclasses.dataclass
class Op:
    """One graph node seen as a canonical op.

    Attributes:
        name: the canonical op (``"relu"``, ``"conv2d"``...), or the call target for ops outside the table.
        args: canonical argument name -> ``Node``, :class:`ParamRef` or constant, defaults filled in.
        node: the node whose value the op is.
        covered: other nodes the op consists of (a multi-output batch norm behind ``getitem``).
        inplace: the op writes its result into ``args["input"]``.
        effect: a side effect the op has besides its result, if any.
    """

    name: Any
    args: dict[str, Any]
    node: Node
    covered: tuple[Node, ...] = ()
    inplace: bool = False
    effect: str | None = None


@functools.cache
def _python_signature(fn: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _bind_schema(schema: torch.FunctionSchema, args: tuple, kwargs: dict) -> dict | None:
    positional = [a for a in schema.arguments if not a.kwarg_only]
    names = {a.name for a in schema.arguments}
    if len(args) > len(positional) or any(k not in names for k in kwargs):
        return None
    bound = {a.name: v for a, v in zip(positional, args)}
    bound.update(kwargs)
    if any(a.name not in bound and not a.has_default_value() for a in schema.arguments):
        return None
    return bound


def _bind_aten(name: str, args: tuple, kwargs: dict) -> dict | None:
    packet = getattr(aten, name, None)
    for overload in packet.overloads() if packet is not None else []:
        bound = _bind_schema(getattr(packet, overload)._schema, args, kwargs)
        if bound is not None:
            return bound
    return None


def _bind_call(node: Node) -> dict | None:
    """The node's arguments by name, using the signature of what it calls."""
    target, args, kwargs = node.target, tuple(node.args), dict(node.kwargs)
    if node.op == "call_method":
        return _bind_aten(_DUNDER.get(target, target), args, kwargs)
    if isinstance(target, torch._ops.OpOverload):
        return _bind_schema(target._schema, args, kwargs)
    if target in (operator.add, operator.iadd, operator.sub, operator.isub, operator.mul, operator.imul,
                  operator.truediv, operator.itruediv, operator.matmul):
        return {"input": args[0], "other": args[1]} if len(args) == 2 and not kwargs else None
    signature = _python_signature(target)
    if signature is not None:
        try:
            return dict(signature.bind(*args, **kwargs).arguments)
        except TypeError:
            return None
    return _bind_aten(getattr(target, "__name__", ""), args, kwargs)


def _tensor(gm: torch.fx.GraphModule, value: Any) -> torch.Tensor | None:
    """The real tensor behind a ParamRef or get_attr node, else the node's FakeTensor, else None."""
    target = value.target if isinstance(value, ParamRef) else None
    if isinstance(value, Node):
        if value.op == "get_attr":
            target = value.target
        else:
            val = value.meta.get("val")
            return val if isinstance(val, torch.Tensor) else None
    return None if target is None else attribute_tensor(gm, target)


def _normalize_conv(gm: torch.fx.GraphModule, args: dict, n: int) -> dict | None:
    """Conv strides/paddings/dilations as n-tuples; ``padding="same"/"valid"`` as numbers where exact."""
    def tup(v):
        if isinstance(v, Node):  # a pattern argument: it binds the whole tuple
            return v
        return tuple(v) * (n if len(v) == 1 else 1) if isinstance(v, (list, tuple)) else (v,) * n
    args["stride"], args["dilation"] = tup(args["stride"]), tup(args["dilation"])
    padding = args["padding"]
    if padding == "valid":
        padding = 0
    elif padding == "same":
        weight = _tensor(gm, args["weight"])
        total = None if weight is None else [d * (k - 1) for d, k in zip(args["dilation"], weight.shape[2:])]
        if total is not None and all(t % 2 == 0 for t in total) and all(s == 1 for s in args["stride"]):
            padding = [t // 2 for t in total]
    args["padding"] = padding if isinstance(padding, str) else tup(padding)
    return args


def _bind_module(node: Node, module: nn.Module, name: str) -> dict | None:
    if node.kwargs or len(node.args) != 1:
        return None
    bound: dict[str, Any] = {"input": node.args[0]}
    for arg, _ in SIGNATURES[name][1:]:
        if arg in _PARAMETERS:
            bound[arg] = ParamRef(f"{node.target}.{arg}") if getattr(module, arg, None) is not None else None
        elif hasattr(module, arg) and arg != "training":
            bound[arg] = getattr(module, arg)
    if name.startswith("conv") and module.padding_mode != "zeros":
        return None
    if name == "batch_norm":
        bound["training"] = module.training or module.running_mean is None
        bound["momentum"] = 0.0 if module.momentum is None else module.momentum
    return bound


def _lookup(node: Node, gm: torch.fx.GraphModule) -> tuple[Any, dict | None, tuple[Node, ...]]:
    """(canonical name, arguments by name, covered nodes) for a node, or (None, None, ()) if unknown."""
    if node.op == "call_module":
        module = submodule(node, gm)
        for cls in type(module).__mro__ if module is not None else ():
            if cls in _MODULES and type(module).forward is cls.forward:
                return _MODULES[cls], _bind_module(node, module, _MODULES[cls]), ()
        return None, None, ()
    if node.op == "call_method":
        return _METHODS.get(str(node.target)), _bind_call(node), ()
    if node.op != "call_function":
        return None, None, ()
    target = node.target
    if target is operator.getitem and node.args[1] == 0 and isinstance(node.args[0], Node):
        source = node.args[0]
        if source.op == "call_function" and getattr(source.target, "overloadpacket", None) in _BN_TUPLES:
            bound = _bind_schema(source.target._schema, tuple(source.args), dict(source.kwargs))
            siblings = tuple(u for u in source.users if u is not node and u.target is operator.getitem and not u.users)
            if bound is not None:
                bound.setdefault("training", False)
            return "batch_norm", bound, (source, *siblings)
    packet = target.overloadpacket if isinstance(target, torch._ops.OpOverload) else target
    if packet is aten.convolution:
        bound = _bind_call(node)
        return (f"conv{len(bound['stride'])}d" if bound else None), bound, ()
    try:
        name = _FUNCTIONS.get(packet)
    except TypeError:  # unhashable target
        name = None
    bound = _bind_call(node) if name else None
    if bound is not None and packet in _FIXED:
        bound.update(_FIXED[packet])
    return name, bound, ()


def canonicalize(node: Node, gm: torch.fx.GraphModule) -> Op | None:
    """``node`` as a canonical :class:`Op`; calls outside the table keep their own target and arguments.

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU(inplace=True)))
        >>> op = canonicalize([n for n in gm.graph.nodes if n.op == "call_module"][0], gm)
        >>> op.name, op.inplace
        ('relu', True)
    """
    if node.op not in CALL_OPS:
        return None
    name, bound, covered = _lookup(node, gm)
    if name is None:
        args = {str(i): a for i, a in enumerate(node.args)} | dict(node.kwargs)
        key = ("method", node.target) if node.op != "call_function" else node.target
        return Op(key, args, node, inplace=False)
    if bound is None:
        return None
    bound = {("input" if k == "self" else "other" if k == "mat2" else k): v for k, v in bound.items()}
    inplace = bool(bound.get("inplace")) or is_inplace(node, gm)
    if bound.pop("transposed", False):
        return None
    args = {}
    for arg, default in SIGNATURES[name]:
        if arg not in bound and default is _REQUIRED:
            return None
        args[arg] = bound.pop(arg, default)
    if any(k not in _IGNORED_ARGS for k in bound):
        return None  # an argument the canonical op does not have (out=, dtype=...)
    if name.startswith("conv"):
        args = _normalize_conv(gm, args, int(name[4]))
    effect = None
    if name == "batch_norm" and args["training"] and args["running_mean"] is not None:
        effect = "updates BatchNorm running statistics (training mode)"
    return Op(name, args, node, covered, inplace, effect)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (Node, ParamRef)) or isinstance(b, (Node, ParamRef)):
        return a is b if isinstance(a, Node) or isinstance(b, Node) else a == b
    seq_a, seq_b = isinstance(a, (list, tuple)), isinstance(b, (list, tuple))
    if seq_a and seq_b:
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if seq_a != seq_b:
        return all(_same(x, b if seq_a else a) for x in (a if seq_a else b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable values do not match
        return False


@dataclasses.dataclass
class Match:
    """One place where a rule's pattern matched: what the pattern's arguments bound to, and the nodes.

    ``match["w"]`` is what the pattern argument ``w`` bound to (a graph node, a module parameter or a
    constant); :meth:`tensor` gives its tensor (real for parameters and buffers, a FakeTensor otherwise).

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x"); _ = g.output(x)
        >>> Match(torch.fx.GraphModule(torch.nn.Module(), g), {"x": x}, [x])["x"].name
        'x'
    """

    graph_module: torch.fx.GraphModule
    bindings: dict[str, Any]
    nodes: list[Node]
    ops: dict[str, Op] = dataclasses.field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.bindings[name]

    def tensor(self, name: str) -> torch.Tensor | None:
        """The tensor a pattern argument bound to, or None (a constant, or no metadata)."""
        return _tensor(self.graph_module, self.bindings[name])

    @property
    def anchor(self) -> Node:
        """The node whose value the pattern computes (its uses get the replacement)."""
        return self.nodes[-1]


class Pattern:
    """A pattern function traced into canonical ops, matched against graph nodes.

    Example:
        >>> p = Pattern(lambda x, y: torch.relu(x + y))
        >>> gm = torch.fx.symbolic_trace(lambda a, b: (b + a).relu_())
        >>> m = next(p.matches(list(gm.graph.nodes)[-2], gm))
        >>> m["x"].name, m["y"].name, [n.name for n in m.nodes]
        ('b', 'a', ['add', 'relu_'])
    """

    def __init__(self, fn: Callable):
        self.graph_module = torch.fx.symbolic_trace(fn)
        nodes = list(self.graph_module.graph.nodes)
        self.arguments = [n.target for n in nodes if n.op == "placeholder"]
        output = nodes[-1].args[0]
        if not isinstance(output, Node) or output.op == "placeholder":
            raise ValueError("a pattern must return the result of a torch call")
        self.output = output
        self.ops = {n: canonicalize(n, self.graph_module) for n in nodes if n.op.startswith("call")}
        broken = [n.name for n, op in self.ops.items() if op is None]
        if broken:
            raise ValueError(f"pattern calls it cannot read: {', '.join(broken)}")

    def matches(self, node: Node, gm: torch.fx.GraphModule) -> Iterator[Match]:
        """Every way the pattern's output matches ``node`` (commutative operands give alternatives)."""
        for bindings, mapping in self._op(self.output, node, gm, {}, {}):
            order = {n: i for i, n in enumerate(gm.graph.nodes)}
            matched = sorted((op.node for op in mapping.values()), key=order.__getitem__)
            ops = {p.name: op for p, op in mapping.items()}
            yield Match(gm, bindings, matched, ops)

    def _op(self, p: Node, t: Node, gm, bindings: dict, mapping: dict) -> Iterator[tuple[dict, dict]]:
        if p in mapping:
            if mapping[p].node is t:
                yield bindings, mapping
            return
        if any(op.node is t for op in mapping.values()):
            return
        p_op, t_op = self.ops[p], canonicalize(t, gm)
        if t_op is None or t_op.name != p_op.name:
            return
        orders = [p_op.args]
        if p_op.name in COMMUTATIVE and _same(t_op.args.get("alpha", 1), 1) and _same(p_op.args.get("alpha", 1), 1):
            orders.append({**p_op.args, "input": p_op.args["other"], "other": p_op.args["input"]})
        for p_args in orders:
            if set(p_args) != set(t_op.args):
                continue
            yield from self._args(list(p_args.items()), t_op, gm, bindings, {**mapping, p: t_op})

    def _args(self, items: list, t_op: Op, gm, bindings: dict, mapping: dict) -> Iterator[tuple[dict, dict]]:
        if not items:
            yield bindings, mapping
            return
        (name, p_value), rest = items[0], items[1:]
        for b, m in self._value(p_value, t_op.args[name], gm, bindings, mapping):
            yield from self._args(rest, t_op, gm, b, m)

    def _value(self, p: Any, t: Any, gm, bindings: dict, mapping: dict) -> Iterator[tuple[dict, dict]]:
        if isinstance(p, Node) and p.op == "placeholder":
            if p.target not in bindings:
                yield {**bindings, p.target: t}, mapping
            elif _same(bindings[p.target], t):
                yield bindings, mapping
        elif isinstance(p, Node):
            if isinstance(t, Node):
                yield from self._op(p, t, gm, bindings, mapping)
        elif isinstance(p, (list, tuple)) and any(isinstance(v, Node) for v in p):
            if isinstance(t, (list, tuple)) and len(t) == len(p):
                yield from self._args(list(zip(range(len(p)), p)), Op("", dict(enumerate(t)), None), gm,
                                      bindings, mapping)
        elif _same(p, t):
            yield bindings, mapping


@dataclasses.dataclass
class Rule:
    """A rewrite rule: ``pattern`` and ``replacement`` written with ordinary torch calls.

    A Rule is also a pass (``.name``, ``.apply``): ``fxforge.rewrite(cap, [rule])`` applies it alone and
    counts it under its own name; :func:`rules_pass` groups several under one name.

    Attributes:
        name: how the report names each change the rule makes.
        pattern: a function of tensors (and, for attributes such as strides, other values) returning
            the value to replace.
        replacement: a function with the same parameters returning the new value.
        check: ``check(match) -> Refusal | None`` (the reason may be a plain string too); a refusal
            leaves the match alone and lands in the report.
        fold: compute the parameter-only parts of the replacement once, as new tensors (eval only).
        description: one line for ``fxforge rewrites``.

    Example:
        >>> rule = Rule("double", lambda x: x + x, lambda x: x * 2)
        >>> rule.pattern_graph.arguments
        ['x']
    """

    name: str
    pattern: Callable
    replacement: Callable
    check: Callable[[Match], Refusal | str | None] | None = None
    fold: bool = False
    description: str = ""
    keeps_meta = True  # the engine gives each node it creates shape metadata (see Pass.keeps_meta)

    def __post_init__(self) -> None:
        self.pattern_graph = Pattern(self.pattern)

    def apply(self, graph_module: torch.fx.GraphModule, ctx: PassContext) -> None:
        """Apply this rule everywhere in ``graph_module`` (the pipeline calls this)."""
        apply_rules(graph_module, ctx, [self])


def rules_pass(name: str, rules: list[Rule], description: str = "") -> Pass:
    """A :class:`~fxforge.rewrites.passes.Pass` applying ``rules`` top to bottom, each over the whole graph.

    Example:
        >>> rules_pass("double", [Rule("x+x", lambda x: x + x, lambda x: x * 2)]).name
        'double'
    """
    return Pass(name, lambda gm, ctx: apply_rules(gm, ctx, rules), description, keeps_meta=True)


def apply_rules(gm: torch.fx.GraphModule, ctx: PassContext, rules: list[Rule]) -> None:
    """Apply each rule, top to bottom, at every node where its pattern matches and nothing refuses.

    Example:
        >>> gm = torch.fx.symbolic_trace(lambda x: x + x)
        >>> ctx = PassContext("d", False, "fx"); apply_rules(gm, ctx, [Rule("d", lambda x: x + x, lambda x: 2 * x)])
        >>> len(ctx.matches)
        1
    """
    for rule in rules:
        for node in list(gm.graph.nodes):
            if getattr(node, "_erased", False) or node.op not in CALL_OPS:
                continue
            reason = None
            for match in rule.pattern_graph.matches(node, gm):
                reason = _refusal(rule, match, ctx)
                if reason is None:
                    ctx.matched(rule.name, match.nodes)
                    _replace(rule, match)
                    break
            if reason is not None:
                ctx.refused(node, reason)


def _refusal(rule: Rule, match: Match, ctx: PassContext) -> Refusal | None:
    """Why this match must not be replaced, or None: the rule's check, then the engine's safety rules."""
    refusal = Refusal.of(rule.check(match)) if rule.check is not None else None
    if refusal is not None:
        return refusal
    if rule.fold and ctx.training:
        return Refusal("folds parameters into constants, which would stop their gradients in training mode")
    gm, inside = match.graph_module, set(match.nodes)
    for op in match.ops.values():
        inside.update(op.covered)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in sorted(inside - {match.anchor}, key=order.__getitem__):
        outside = [u.name for u in node.users if u not in inside]
        if outside:
            return Refusal(f"the value of {node.name} is also used outside the match (by {', '.join(outside)})")
    for op in match.ops.values():
        unknown = op.name not in SIGNATURES  # known ops' only state is BatchNorm's (op.effect)
        if op.effect or (unknown and is_effectful(op.node, gm)):
            return Refusal(f"{op.node.name} has a side effect the replacement would drop "
                           f"({op.effect or 'state or mutation'})")
        mutated = op.args.get("input") if op.inplace else None
        visible = isinstance(mutated, Node) and (mutated.op in ("placeholder", "get_attr") or is_view_op(mutated)
                                                 or len(mutated.users) > 1)
        if visible and mutated not in inside:
            return Refusal(f"{op.node.name} changes {mutated.name} in place, and that change is visible outside "
                           "the match")
    first, last = order[match.nodes[0]], order[match.anchor]
    for value in match.bindings.values():
        for user in value.users if isinstance(value, Node) else ():
            if user not in inside and first < order[user] < last and is_effectful(user, gm):
                return Refusal(f"{value.name} is changed in place by {user.name} between the matched ops")
    return None


def _replace(rule: Rule, match: Match) -> None:
    gm, graph, anchor = match.graph_module, match.graph_module.graph, match.anchor
    before = set(graph.nodes)
    tracer = torch.fx.proxy.GraphAppendingTracer(graph)
    with graph.inserting_before(anchor):
        def proxy(value):
            if isinstance(value, ParamRef):
                value = graph.get_attr(value.target)
            return torch.fx.Proxy(value, tracer) if isinstance(value, Node) else value
        result = rule.replacement(**{k: proxy(v) for k, v in match.bindings.items()})
        if not isinstance(result, torch.fx.Proxy):
            raise TypeError(f"rule {rule.name!r}: the replacement must return a value computed from its inputs")
        new = [n for n in graph.nodes if n not in before]
        if rule.fold:
            new = _fold_constants(gm, new)
    inherit_origin(new, match.nodes, gm)
    _propagate_meta(gm, new, result=(result.node, anchor.meta.get("val")))
    anchor.replace_all_uses_with(result.node)
    doomed = set(match.nodes).union(*(op.covered for op in match.ops.values()))
    doomed.update(v for v in match.bindings.values() if isinstance(v, Node) and v.op == "get_attr")
    for node in reversed(list(graph.nodes)):
        if node in doomed and not node.users:
            graph.erase_node(node)


def _fold_constants(gm: torch.fx.GraphModule, new: list[Node]) -> list[Node]:
    """Compute new nodes that depend only on parameters/buffers; register them as tensors on ``gm``.

    Values are computed in float64, and in the model's precision for the dtype of the result (on meta
    tensors that second computation took longer than on real ones).
    """
    exact = _constant_values(gm, new, lambda t: t.double() if t.is_floating_point() else t)
    plain = _constant_values(gm, new, lambda t: t)
    kept = []
    for node in new:
        value = plain.get(node)
        if node.op != "get_attr" and isinstance(value, torch.Tensor) and any(u not in plain for u in node.users):
            name = _free_name(gm, CONSTANT_BUFFER_PREFIX)
            # One conversion into a new tensor: the folded value never aliases a parameter.
            folded = exact[node].detach().to(dtype=value.dtype, copy=True)
            gm.register_buffer(name, folded, persistent=False)
            with gm.graph.inserting_before(node):
                constant = gm.graph.get_attr(name)
            node.replace_all_uses_with(constant)
            kept.append(constant)
    for node in reversed(new):
        if node in plain and not node.users:
            gm.graph.erase_node(node)
    return [n for n in new if n.graph is gm.graph and n not in plain] + kept


def _constant_values(gm: torch.fx.GraphModule, new: list[Node], convert: Callable[[torch.Tensor], Any]
                     ) -> dict[Node, Any]:
    """The values of the nodes among ``new`` computed from parameters and buffers alone, each tensor
    taken through ``convert`` first (to float64, or as it is)."""
    values: dict[Node, Any] = {}
    for node in new:
        if node.op == "get_attr":
            values[node] = convert(_tensor(gm, node))
            continue
        inputs = node.all_input_nodes
        if node.op not in ("call_function", "call_method") or not all(n in values or n.op == "get_attr" for n in inputs):
            continue
        for n in inputs:
            if n not in values:
                values[n] = convert(_tensor(gm, n))
        with torch.no_grad():
            values[node] = _call(node, values.__getitem__)
    return values


def _call(node: Node, value_of: Callable[[Node], Any]) -> Any:
    """Run a ``call_function``/``call_method`` node with its input nodes replaced by ``value_of(node)``."""
    args = torch.fx.node.map_arg(node.args, value_of)
    kwargs = torch.fx.node.map_arg(node.kwargs, value_of)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    return node.target(*args, **kwargs)


def _free_name(gm: torch.fx.GraphModule, prefix: str) -> str:
    # The search starts where the last one on this module ended (a hint: the loop still checks), so folding
    # n convolutions asks for n names, not n * n / 2.
    hints = gm.__dict__.setdefault("_fxforge_free_names", {})
    i = hints.get(prefix, 0)
    while hasattr(gm, f"{prefix}_{i}"):
        i += 1
    hints[prefix] = i + 1
    return f"{prefix}_{i}"


def _propagate_meta(gm: torch.fx.GraphModule, nodes: list[Node], result: tuple[Node, Any] | None = None) -> None:
    """Give new nodes ``meta['val']`` so later rules in the same pass can check shapes.

    ``result`` is ``(the node that replaces the match, the replaced value's val)``: that node computes the
    same value, so it gets a tensor of the same shape, strides and dtype (its own storage) without running
    its op on fake tensors (a fake convolution costs a millisecond; a rewrite makes one per match).
    """
    mode = next((n.meta["val"].fake_mode for n in gm.graph.nodes
                 if hasattr(n.meta.get("val"), "fake_mode")), None)
    if mode is None:
        return
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in sorted(nodes, key=order.__getitem__):
        try:
            if result is not None and node is result[0] and isinstance(result[1], torch.Tensor):
                val = result[1]
                with mode:
                    node.meta["val"] = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
                continue
            if node.op == "get_attr":
                node.meta["val"] = mode.from_tensor(_tensor(gm, node), static_shapes=True)
                continue
            with mode:
                node.meta["val"] = _call(node, lambda n: n.meta.get("val"))
        except Exception:  # noqa: BLE001 - metadata is a convenience; the pipeline re-annotates after the pass
            node.meta.pop("val", None)
