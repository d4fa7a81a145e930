"""``softmax-dim``: softmax or log_softmax over a dim that is not the last (feature) dim. Over the batch dim it
mixes the samples of a batch (a warning: almost never meant); over another dim it is often right (channels of an
image, a sequence) and only info.

Example:
    >>> class Net(torch.nn.Module):
    ...     def forward(self, logits):
    ...         return torch.log_softmax(logits, dim=0)
    >>> [(f.rule, f.severity) for f in fxforge.lint(Net(), (torch.randn(4, 10),), rules=[RULE])]
    [('softmax-dim', 'warning')]
"""

from __future__ import annotations

from fxforge.lint.graph import LintGraph
from fxforge.lint.rule import Rule

SOFTMAXES = {"softmax", "log_softmax", "_softmax", "_log_softmax"}


def check(graph: LintGraph):
    batch = {int(t.shape[0]) for t in graph.inputs if t.dim() > 0}
    for node in graph.calls(*SOFTMAXES):
        source = graph.tensor_args(node)[:1]
        shape = graph.shape(source[0]) if source else None
        dim = graph.arg(node, 1, "dim")
        if not shape or len(shape) < 2 or not isinstance(dim, int):
            continue
        dim %= len(shape)
        if dim == len(shape) - 1 or shape[dim] == 1:
            continue  # the feature dim; a size-1 dim is reduce-size-one's
        op = graph.op(node).lstrip("_")
        if dim == 0 and shape[0] in batch:
            yield graph.finding(
                node, f"{op} over dim 0 of {list(shape)}, the batch dim (size {shape[0]}, as the inputs' batch): each "
                      "sample's result depends on the other samples in its batch",
                "normalize over the classes or features: dim=-1 (or dim=1 for [B, C, ...])", severity="warning",
                involved=graph.describe(source[0]))
        else:
            yield graph.finding(
                node, f"{op} over dim {dim} of {list(shape)}, not the last (feature) dim: right for channels or a "
                      "sequence axis, a bug if the classes are last",
                "check the dim: dim=-1 normalizes over the last dim", involved=graph.describe(source[0]))


RULE = Rule("softmax-dim", "info", check, "softmax over a dim that is not the last; over the batch dim a warning")
