"""``functional-dropout``: ``F.dropout(x, p)`` without ``training=self.training``: its ``training`` defaults
to True, so it keeps dropping values after ``model.eval()``: noisy, wrong predictions in evaluation and serving.

Found in an eval-mode capture (``fxforge.lint`` captures in eval mode): a dropout that still drops.

Example:
    >>> import torch.nn.functional as F
    >>> class Net(torch.nn.Module):
    ...     def forward(self, x):
    ...         return F.dropout(x, 0.1)
    >>> [f.rule for f in fxforge.lint(Net(), (torch.randn(4, 8),), rules=[RULE])]
    ['functional-dropout']
"""

from __future__ import annotations

import os

from fxforge.lint.graph import LintGraph
from fxforge.lint.rule import Rule

DROPOUTS = {"dropout", "native_dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout",
            "dropout1d", "dropout2d", "dropout3d"}
_MODULES = os.sep + os.path.join("torch", "nn", "modules") + os.sep


def from_module(node) -> bool:
    """Whether the node is a torch.nn module's (``nn.Dropout``): a module call of a trace, or recorded inside the
    module's forward (the recorded stack says so), not a function the user's code called."""
    return node.op == "call_module" or _MODULES in (node.meta.get("stack_trace") or "")


def active_dropouts(graph: LintGraph):
    """(node, p) of every dropout in the graph that drops (training true, p > 0)."""
    for node in graph.calls(*DROPOUTS):
        p = graph.arg(node, 1, "p", default=0.5)
        train = graph.arg(node, 2, "train", "training", default=True)
        if train is True and isinstance(p, (int, float)) and p > 0:
            yield node, p


def check(graph: LintGraph):
    if graph.model.training:
        return
    for node, p in active_dropouts(graph):
        if from_module(node):
            continue  # a module's dropout: mode-unreached
        yield graph.finding(
            node, f"functional dropout (p={p}) still drops in eval mode: its training argument defaults to True, "
                  "not the model's mode, so evaluation and serving see random noise",
            "pass the module's mode: F.dropout(x, p, training=self.training), or use an nn.Dropout(p) "
            "submodule", involved=graph.describe(node))


RULE = Rule("functional-dropout", "error", check,
            "F.dropout without training=self.training: it keeps dropping after model.eval()")
