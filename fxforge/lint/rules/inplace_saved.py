"""``inplace-on-saved``: an in-place op (``x.mul_(2)``, ``x += y``, ``relu_``) on a tensor autograd saved for the
backward of an earlier op: ``sigmoid``, ``tanh``, ``exp``, ``relu`` and ``softmax`` save their output, ``mul``,
matrix products and convolutions their inputs. The backward then fails ("modified by an inplace operation"), or
with ``.data`` tricks computes wrong gradients.

Example:
    >>> class Net(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.fc = torch.nn.Linear(8, 8)
    ...     def forward(self, x):
    ...         h = torch.sigmoid(self.fc(x))
    ...         h.mul_(2)
    ...         return h
    >>> [f.rule for f in fxforge.lint(Net(), (torch.randn(4, 8),), rules=[RULE])]
    ['inplace-on-saved']
"""

from __future__ import annotations

import torch

from fxforge.lint.graph import LintGraph
from fxforge.lint.rule import Rule
from fxforge.lint.rules.hoistable import trainable

SAVES_OUTPUT = {"sigmoid", "tanh", "exp", "relu", "softmax", "log_softmax", "_softmax", "_log_softmax", "sqrt",
                "rsqrt", "exp2", "expm1", "reciprocal", "elu", "sigmoid_", "tanh_", "exp_", "relu_"}
# Ops that save an input for the gradient of another operand (x of x * w, the input of a linear layer): saved
# where another tensor operand needs a gradient.
SAVES_FOR_OTHERS = {"mul", "div", "matmul", "mm", "bmm", "linear", "addmm", "conv1d", "conv2d", "conv3d", "convolution",
                    "einsum", "atan2", "maximum", "minimum", "baddbmm", "scaled_dot_product_attention", "prelu"}
# Ops that save their input for its own gradient: saved where it needs one.
SAVES_INPUT = {"pow", "log", "sin", "cos", "abs", "layer_norm", "batch_norm", "gelu", "silu", "log1p", "erf", "tan"}


def _inplace(graph: LintGraph, node: torch.fx.Node) -> bool:
    op = graph.op(node)
    return op.endswith("_") and not op.startswith("_") and op not in ("_", "copy_") or op in ("add_", "mul_")


def _saves(graph: LintGraph, user: torch.fx.Node, target: torch.fx.Node, grad: set) -> bool:
    """Whether ``user`` saves ``target`` for its backward: for another operand's gradient, or for its own."""
    op = graph.op(user)
    if op in SAVES_FOR_OTHERS and user.op == "call_module":  # a layer of a trace: its weights are the operands
        return any(p.requires_grad for p in graph.owner(user).get_submodule(str(user.target)).parameters())
    if op in SAVES_FOR_OTHERS:
        return any(a is not target and a in grad for a in graph.tensor_args(user))
    return op in SAVES_INPUT and target in grad


def check(graph: LintGraph):
    grad = trainable(graph)
    order = {n: i for i, n in enumerate(graph.nodes())}
    for node in graph.calls():
        if not _inplace(graph, node):
            continue
        args = graph.tensor_args(node)
        if not args:
            continue
        target = args[0]
        saver = None
        if graph.op(target) in SAVES_OUTPUT and target in grad:
            saver = target
        else:
            saver = next((u for u in target.users if u is not node and order[u] < order[node]
                          and _saves(graph, u, target, grad)), None)
        if saver is None:
            continue
        file, line, _ = graph.source(saver)
        kept = "its output" if saver is target else "its input"
        yield graph.finding(
            node, f"{graph.op(node)} changes {target.name} in place, which {graph.op(saver)} (at {file}:{line}) saved "
                  f"as {kept} for its backward: training fails with 'one of the variables needed for gradient "
                  "computation has been modified by an inplace operation'",
            f"use the out-of-place op ({graph.op(node).rstrip('_')}: h = h * 2 instead of h.mul_(2)), or clone "
            "before modifying", involved=graph.describe(target))


RULE = Rule("inplace-on-saved", "error", check,
            "an in-place op on a tensor autograd saved for an earlier op's backward: the training step fails")
