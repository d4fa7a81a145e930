"""``binary_fold``: a convolution or linear layer followed by ``* c``, ``/ c``, ``+ c`` or ``- c`` becomes one layer.

An elementwise op between a layer's output and a value ``c`` that is the same on every call and varies at most
along the output channels is the same layer with other weights (``v`` is ``c`` as one value per channel):

- ``conv(x) * c``, ``conv(x) / c``: ``w' = w * v`` (``w / v``) along the output channels, ``b' = b * v`` (``b / v``);
- ``conv(x) + c``, ``conv(x) - c``: ``b' = b + v`` (``b - v``), a layer without bias getting one;
- ``c - conv(x)``: ``w' = -w``, ``b' = v - b``.

``c`` is a Python number; a parameter, buffer or tensor constant (``torch.tensor(2.0)``), or a value computed from
those alone (``gamma[:, None, None]``), whose broadcast onto the output changes neither its shape nor its dtype and
varies only along the channel dim (``[C, 1, 1]``, ``[1, C, 1, 1]``, ``[1]``, 0-d; ``[out]`` or ``[1, out]`` after
a linear layer); or a tensor built from shapes alone that holds one value (``torch.ones(y.size())``,
``torch.full_like(y, 2.0)``), which is read as that number. The rules (one per op and layer: ``nn.ConvNd``,
``F.convNd`` and ATen convolutions 1d/2d/3d, ``nn.Linear``/``F.linear``, with or without bias, every call form of
the op, either operand order where it commutes) fold like ``conv_bn_fold``'s: the new weights are non-persistent
buffers computed once in float64, recomputed when the tensors they come from change; the model's own are never
modified.

Refused, with the reason in the report: ``c / conv(x)``, an operand computed at run time, one that varies along
the batch or spatial dims, one whose broadcast changes the output's shape or dtype, a non-floating-point operand
or layer, division by a constant holding 0, multiplication or division by inf or NaN, weights computed at run time,
training mode and calls that record gradients (folded weights have none), and (by the engine) a layer output also
used elsewhere. A value computed at run time with the output's own shape (a residual branch) is not a near miss.

A fold can put a convolution right before an eval-mode BatchNorm (``bn(conv(x) * c)``): the pass folds that
BatchNorm too (``conv_bn_fold``'s rules, counted as ``conv_bn_fold``) and looks again until nothing changes;
``bn(conv(x)) * c`` folds fully because ``conv_bn_fold`` runs before this pass.

Example:
    >>> from torch import nn
    >>> class LayerScale(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.conv, self.gamma = nn.Conv2d(3, 4, 3), nn.Parameter(torch.rand(4))
    ...     def forward(self, x):
    ...         return self.gamma[:, None, None] * self.conv(x) + 1.0
    >>> new = fxforge.rewrite(fxforge.capture(LayerScale().eval(), (torch.randn(1, 3, 8, 8),)), ["binary_fold"])
    >>> new.report.counts
    {'binary_fold': 2}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.fx import Node

from fxforge.core.vocabulary import op_name
from fxforge.rewrites.canonical import ParamRef, canonicalize
from fxforge.rewrites.conv_bn_fold import CONV_BN_FOLD
from fxforge.rewrites.conv_bn_fold import RULES as BATCH_NORM_RULES
from fxforge.rewrites.operands import Operand, is_pure, read_operand, same_shape
from fxforge.rewrites.passes import Pass, PassContext, Refusal
from fxforge.rewrites.pattern import Match, Rule, apply_rules

F = nn.functional
aten = torch.ops.aten
CONVS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
LAYERS = ("conv1d", "conv2d", "conv3d", "linear")
BINARY_OPS = ("add", "sub", "mul", "div", "rsub")
# A value computed at run time with the output's own shape (a residual branch): no near miss.
NOT_A_CONSTANT = Refusal("the operand is a value of the output's shape computed at run time (not a constant)")


# ---------------------------------------------------------------------------------------------- the rules


def _layer_name(layer: str) -> str:
    return "linear layer" if layer == "linear" else "convolution"


def refuse_unfoldable(match: Match, written: str, layer: str, folds: bool) -> Refusal | None:
    """Why the binary op ``written`` (``"{} * c"``) cannot fold into ``layer``, or None.

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x"); _ = g.output(x)
        >>> gm = torch.fx.GraphModule(torch.nn.Module(), g)
        >>> str(refuse_unfoldable(Match(gm, {}, [x]), "c / {}", "conv2d", folds=False))
        "c / conv2d divides by the convolution's output: no change of its weights computes that"
    """
    what = _layer_name(layer)
    if not folds:
        return Refusal(f"{written.format(layer)} divides by the {what}'s output: no change of its weights computes that")
    gm = match.graph_module
    layer_node = next(op.node for op in match.ops.values() if op.name == layer)
    out, y, weight = match.anchor.meta.get("val"), layer_node.meta.get("val"), match.tensor("w")
    if not all(isinstance(t, torch.Tensor) for t in (out, y, weight)):
        return Refusal(f"no shape metadata for the {what}'s weight or output")
    for key, part in (("w", "weight"), ("b", "bias")):
        value = match[key]
        if value is not None and not isinstance(value, ParamRef) and getattr(value, "op", None) != "get_attr":
            return Refusal(f"the {what}'s {part} is computed at run time, not a parameter or buffer")
    if not (weight.is_floating_point() and y.is_floating_point()):
        return Refusal(f"the {what} is not floating point ({y.dtype})")
    c = match["c"]
    operand = read_operand(c, gm)
    name = c.name if isinstance(c, Node) else repr(c)
    if operand.kind == "other":
        return Refusal(f"the operand {name} is not a number or a tensor")
    if operand.kind == "runtime":
        if isinstance(c.meta.get("val"), torch.Tensor) and same_shape(c.meta["val"], y):
            return NOT_A_CONSTANT
        if operand.dynamic:
            return Refusal(f"the operand {name} depends on a dynamic size of {operand.blame.name}")
        source = f" (from {operand.blame.name})" if operand.blame is not c else ""
        return Refusal(f"the operand {name} is computed at run time{source}, not from parameters and constants alone")
    if isinstance(operand.value, torch.Tensor):  # (a uniform one is read as its number: only its dims must be 1)
        refusal = _refuse_shape(operand.value, out, y, "" if operand.kind == "uniform" else layer, name)
        if refusal is not None:
            return refusal
    if operand.kind == "uniform":
        users = ", ".join(u.name for u in operand.uses_elsewhere(layer_node, match.anchor))
        return Refusal(f"the operand {name} is built from shapes alone and also used outside the match (by {users})"
                       if users else f"the operand {name}, built from shapes alone, is read as a number first")
    return _refuse_value(operand.value, written)


def _refuse_shape(c: torch.Tensor, out: torch.Tensor, y: torch.Tensor, layer: str, name: str) -> Refusal | None:
    """Why a tensor operand ``c`` of the layer's output ``y`` (``out``: the op's result) is no per-channel one; with
    ``layer`` empty (a uniform operand, read as its number), only its dtype and its broadcast are looked at."""
    if not c.is_floating_point():
        return Refusal(f"the operand {name} is a {c.dtype} tensor: only floating-point operands fold")
    if out.dtype != y.dtype:
        return Refusal(f"broadcasting with the operand {name} changes the output's dtype from {y.dtype} to {out.dtype}")
    shape = tuple(c.shape)
    if not same_shape(out, y):
        return Refusal(f"broadcasting the operand {name} of shape {shape} changes the output's shape from "
                       f"{tuple(y.shape)} to {tuple(out.shape)}")
    channel = y.dim() - 1 if layer == "linear" else y.dim() - int(layer[4]) - 1 if layer else None
    for i, size in enumerate(shape if layer else ()):
        dim = y.dim() - len(shape) + i
        if size != 1 and dim != channel:
            kind = "a batch dim" if dim < channel else "a spatial dim"
            return Refusal(f"the operand {name} of shape {shape} has size {size} along dim {dim} of the output ({kind}): "
                           f"only an operand of size 1 there (one that varies along the channels, dim {channel}) folds")
    return None


def _refuse_value(value: Any, written: str) -> Refusal | None:
    """Why the operand's value (a number or a tensor) cannot fold into the weights by ``written``'s op."""
    scaling = any(op in written for op in (" * ", " / "))
    tensor = torch.as_tensor(value)
    if scaling and not bool(tensor.isfinite().all()):
        return Refusal("the operand holds inf or NaN: folded into the weights it would not give eager's result")
    if " / " in written and bool((tensor == 0).any()):
        return Refusal("divides by a constant that contains 0")
    return None


def _recorded(c: Any) -> Any:
    """The operand in a replacement: a number as it is; a tensor's computation recorded again (from the tensors it
    reads) so that folding computes it, and computes it again when they change."""
    if not isinstance(c, torch.fx.Proxy) or c.node.op == "get_attr":
        return c
    graph, nodes = c.node.graph, read_operand(c.node, c.node.graph.owning_module).nodes
    copies: dict[Node, Node] = {}
    for node in sorted(nodes):
        copies[node] = graph.node_copy(node, copies.__getitem__)
    return torch.fx.Proxy(copies[c.node], c.tracer)


def _per_channel(c: Any, w: Any) -> Any:
    """The operand as one value per output channel (shape ``[C]`` or ``[1]``) in the weight's dtype."""
    if isinstance(c, torch.fx.Proxy):
        return _recorded(c).reshape(-1).type_as(w)
    return w.new_full((1,), c)


def _times(w, b, v, rows):
    return w * v.reshape(rows), None if b is None else b * v


def _over(w, b, v, rows):
    return w / v.reshape(rows), None if b is None else b / v


def _plus(w, b, v, rows):
    return w, v.expand(w.shape[0]) if b is None else b + v


def _minus(w, b, v, rows):
    return w, -v.expand(w.shape[0]) if b is None else b - v


def _from(w, b, v, rows):
    return -w, v.expand(w.shape[0]) if b is None else v - b


@dataclasses.dataclass(frozen=True)
class Binary:
    """One elementwise op after a layer, and how it folds.

    Attributes:
        written: how rule names write it, ``{}`` standing for the layer (``"{} * c"``).
        pattern: ``(y, c) -> value``: the op on the layer's output ``y`` and the operand ``c``.
        fold: ``(w, b, v, rows) -> (w', b')``: the new weight and bias from the old ones and ``v``, the operand as
            one value per output channel (``[C]`` or ``[1]``); ``rows`` reshapes ``v`` along the weight's first dim.
            None: no change of the weights computes the op.

    Example:
        >>> [b.written.format("conv2d") for b in BINARIES][:2]
        ['conv2d * c', 'conv2d / c']
    """

    written: str
    pattern: Callable[[Any, Any], Any]
    fold: Callable | None


BINARIES: list[Binary] = [
    Binary("{} * c", lambda y, c: y * c, _times),
    Binary("{} / c", lambda y, c: y / c, _over),
    Binary("{} + c", lambda y, c: y + c, _plus),
    Binary("{} - c", lambda y, c: y - c, _minus),
    Binary("c - {}", lambda y, c: c - y, _from),
    Binary("c - {}", lambda y, c: torch.rsub(y, c), _from),  # aten.rsub.Scalar(y, c): exported graphs' c - y
    Binary("c / {}", lambda y, c: c / y, None),
]


def _rule(layer: str, binary: Binary, pattern: Callable, replacement: Callable) -> Rule:
    name = binary.written.format(layer)
    return Rule(name, pattern, replacement, fold=True,
                check=lambda match: refuse_unfoldable(match, binary.written, layer, binary.fold is not None),
                description=f"{name} -> {layer} with folded weights" if binary.fold else f"{name}: refused")


def conv_rule(dims: int, binary: Binary) -> Rule:
    """The rule folding ``binary`` after a ``dims``-d convolution.

    Example:
        >>> conv_rule(3, BINARIES[0]).name
        'conv3d * c'
    """
    conv, rows = CONVS[dims], [-1] + [1] * (dims + 1)

    def pattern(x, w, b, stride, padding, dilation, groups, c):
        return binary.pattern(conv(x, w, b, stride, padding, dilation, groups), c)

    def replacement(x, w, b, stride, padding, dilation, groups, c):
        weight, bias = binary.fold(w, b, _per_channel(c, w), rows)
        return conv(x, weight, bias, stride, padding, dilation, groups)

    return _rule(f"conv{dims}d", binary, pattern, replacement)


def linear_rule(binary: Binary) -> Rule:
    """The rule folding ``binary`` after a linear layer.

    Example:
        >>> linear_rule(BINARIES[4]).name
        'c - linear'
    """
    def pattern(x, w, b, c):
        return binary.pattern(F.linear(x, w, b), c)

    def replacement(x, w, b, c):
        weight, bias = binary.fold(w, b, _per_channel(c, w), [-1, 1])
        return F.linear(x, weight, bias)

    return _rule("linear", binary, pattern, replacement)


RULES: list[Rule] = [rule for binary in BINARIES for rule in
                     (*(conv_rule(d, binary) for d in (2, 1, 3)), linear_rule(binary))]


# ---------------------------------------------------------------------------------------------- the pass


@dataclasses.dataclass
class _AsNumber:
    """A uniform operand of ``user`` read as its number while the rules look; undone where they do not fold it."""

    user: Node
    operand: Operand
    args: tuple
    kwargs: dict
    layer_output: Node
    stand_in: Node | None = None


def _is_layer(node: Any, gm: torch.fx.GraphModule) -> bool:
    op = canonicalize(node, gm) if isinstance(node, Node) else None
    return op is not None and op.name in LAYERS


def _keeps_result(user: Node, y: Node, value: Any) -> bool:
    """Whether ``user(y, tensor)`` equals ``user(y, number)``: its result has ``y``'s shape and dtype."""
    out, val = user.meta.get("val"), y.meta.get("val")
    if not (isinstance(out, torch.Tensor) and isinstance(val, torch.Tensor)) or isinstance(value, bool):
        return False
    floating = not isinstance(value, torch.Tensor) or value.is_floating_point()
    return floating and out.dtype == val.dtype and same_shape(out, val)


def _uniform_operands(gm: torch.fx.GraphModule) -> list[tuple[Node, Node, Node, Operand]]:
    """``(binary op, layer output, operand node, operand)`` where a uniform operand built from shapes alone, used by
    nothing else, is the same as its number next to a layer's output."""
    found = []
    for node in list(gm.graph.nodes):
        if node.op not in ("call_function", "call_method") or op_name(node, gm) not in BINARY_OPS:
            continue
        op = canonicalize(node, gm)
        if op is None or op.name not in BINARY_OPS or op.args.get("alpha", 1) != 1:
            continue
        for y, c in ((op.args["input"], op.args["other"]), (op.args["other"], op.args["input"])):
            if isinstance(c, Node) and c.op != "get_attr" and _is_layer(y, gm):
                operand = read_operand(c, gm)
                if operand.kind == "uniform" and not operand.uses_elsewhere(y, node) and \
                        _keeps_result(node, y, operand.value):
                    found.append((node, y, c, operand))
                    break
    return found


def _as_number(gm: torch.fx.GraphModule, user: Node, y: Node, c: Node, operand: Operand) -> _AsNumber:
    """Give ``user`` the operand's number instead of ``c``; the nodes computing ``c`` read the shape of a stand-in
    for ``y`` meanwhile, so that ``y`` has no other use."""
    value = operand.value
    number = value.reshape(-1)[0].item() if isinstance(value, torch.Tensor) else value
    change = _AsNumber(user, operand, user.args, dict(user.kwargs), y)
    readers = [n for n in operand.nodes if y in n.all_input_nodes]
    if readers:
        with gm.graph.inserting_before(next(iter(gm.graph.nodes))):
            change.stand_in = gm.graph.placeholder("binary_fold_stand_in")
        change.stand_in.meta = dict(y.meta)
        for reader in readers:
            reader.replace_input_with(y, change.stand_in)
    user.args = torch.fx.node.map_arg(user.args, lambda n: number if n is c else n)
    user.kwargs = torch.fx.node.map_arg(user.kwargs, lambda n: number if n is c else n)
    return change


def _settle(gm: torch.fx.GraphModule, change: _AsNumber) -> None:
    """Undo ``change`` where the rules did not fold its op; else remove the operand's computation."""
    graph = gm.graph
    if not getattr(change.user, "_erased", False):
        change.user.args, change.user.kwargs = change.args, change.kwargs
        if change.stand_in is not None:
            change.stand_in.replace_all_uses_with(change.layer_output)
    else:
        for node in sorted(change.operand.nodes, reverse=True):
            if not node.users:
                graph.erase_node(node)
    if change.stand_in is not None and not change.stand_in.users:
        graph.erase_node(change.stand_in)


def _fold_batch_norms(gm: torch.fx.GraphModule, ctx: PassContext, start: set[Node]) -> None:
    """Fold the eval-mode BatchNorms right after layers this pass made, with ``conv_bn_fold``'s rules (counted as
    ``conv_bn_fold``)."""
    made = [n for n in gm.graph.nodes if n not in start and _is_layer(n, gm)]
    at = {u for n in made for u in n.users}
    at |= {v for u in at for v in u.users}  # an exported BatchNorm's value is getitem(batch_norm, 0)
    if at:
        sub = dataclasses.replace(ctx, rule=CONV_BN_FOLD.name, matches=[], near_misses=[], tuning=[])
        apply_rules(gm, sub, BATCH_NORM_RULES, at=at)
        ctx.matches.extend(sub.matches)
        ctx.near_misses.extend(sub.near_misses)


def _erase_dead(gm: torch.fx.GraphModule, idle: set[Node]) -> None:
    """Erase the operands' computations the folds left unused (nodes unused before the pass stay)."""
    for node in reversed(list(gm.graph.nodes)):
        if not node.users and node not in idle and (node.op == "get_attr" or is_pure(node, gm)):
            gm.graph.erase_node(node)


def _drop_unused_folds(gm: torch.fx.GraphModule) -> None:
    """Drop the folded constants (and their recipes) no node reads any more: those a later fold folded again."""
    recipes = gm.meta.get("fxforge_folds", {})
    read = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for name in [name for name in recipes if name not in read]:
        del recipes[name]
        if name in gm._buffers:
            delattr(gm, name)


def _tidy_near_misses(ctx: PassContext, first: int) -> None:
    """Of the near misses this pass recorded (from index ``first``): none where a later round folded the op, none
    for values computed at run time with the output's shape, and one per node (the last)."""
    folded = {name for match in ctx.matches for name in match.nodes}
    mine = ctx.near_misses[first:]
    last = {(m.rule, m.node): i for i, m in enumerate(mine)}
    ctx.near_misses[first:] = [m for i, m in enumerate(mine) if last[(m.rule, m.node)] == i and m.node not in folded
                               and m.reason != NOT_A_CONSTANT.reason]


def fold_binary(graph_module: torch.fx.GraphModule, ctx: PassContext) -> None:
    """The ``binary_fold`` pass: apply :data:`RULES` (uniform operands built from shapes read as their numbers),
    fold the BatchNorms the folds put right after a convolution, and look again until nothing changes.

    Example:
        >>> class Halved(nn.Linear):
        ...     def forward(self, x):
        ...         return F.linear(x, self.weight, self.bias) / 2
        >>> gm = fxforge.capture(Halved(2, 3).eval(), (torch.ones(1, 2),)).graph_module
        >>> ctx = PassContext("binary_fold", training=False, method="fx"); fold_binary(gm, ctx)
        >>> [m.what for m in ctx.matches], [n.op for n in gm.graph.nodes]
        (['linear / c'], ['placeholder', 'get_attr', 'get_attr', 'call_function', 'output'])
    """
    graph = graph_module.graph
    start = set(graph.nodes)
    idle = {n for n in start if not n.users and n.op != "output"}
    first = len(ctx.near_misses)
    while True:
        before = len(ctx.matches)
        changes = [_as_number(graph_module, *found) for found in _uniform_operands(graph_module)]
        apply_rules(graph_module, ctx, RULES)
        for change in changes:
            _settle(graph_module, change)
        if len(ctx.matches) == before:
            break
        _fold_batch_norms(graph_module, ctx, start)
    _erase_dead(graph_module, idle)
    _drop_unused_folds(graph_module)
    _tidy_near_misses(ctx, first)


BINARY_FOLD = Pass("binary_fold", fold_binary, "conv (1d/2d/3d) or linear followed by * / + - a constant (a number or "
                   "a per-channel tensor) -> one layer with folded weights", keeps_meta=True)
