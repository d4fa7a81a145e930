"""``mode-unreached``: a Dropout or BatchNorm that runs in training mode while the model is in eval mode, because
``model.eval()`` does not reach it: it was made in ``forward`` (``nn.Dropout(0.1)(x)``) or is kept in a plain list
or dict instead of ``nn.ModuleList``/``nn.ModuleDict``. Dropout keeps dropping; BatchNorm normalizes with the
batch's statistics and updates its running ones during evaluation.

Example:
    >>> class Net(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.norms = [torch.nn.BatchNorm1d(8)]
    ...     def forward(self, x):
    ...         return self.norms[0](x)
    >>> [f.rule for f in fxforge.lint(Net(), (torch.randn(4, 8),), rules=[RULE])]
    ['mode-unreached']
"""

from __future__ import annotations

from fxforge.lint.graph import LintGraph
from fxforge.lint.rule import Rule
from fxforge.lint.rules.dropout_mode import active_dropouts, from_module

NORMS = {"batch_norm", "_native_batch_norm_legit", "native_batch_norm", "cudnn_batch_norm"}
FIX = ("register it in __init__ as an attribute (self.drop = nn.Dropout(p)), and keep lists and dicts of layers in "
       "nn.ModuleList / nn.ModuleDict, so model.eval() and model.to() reach them")


def check(graph: LintGraph):
    if graph.model.training:
        return
    for node, p in active_dropouts(graph):
        if not from_module(node):
            continue  # functional-dropout
        yield graph.finding(
            node, f"a Dropout (p={p}) runs in training mode in an eval-mode model: model.eval() does not reach it "
                  "(made in forward, or kept outside the module tree), so it drops values in evaluation",
            FIX, involved=graph.describe(node))
    for node in graph.calls(*NORMS):
        training = graph.arg(node, 5, "training")
        running_mean = graph.arg(node, 3, "running_mean")
        if training is not True or running_mean is None:
            continue  # eval mode, or no running statistics (track_running_stats=False): batch statistics by design
        yield graph.finding(
            node, "a BatchNorm runs in training mode in an eval-mode model: model.eval() does not reach it (made in "
                  "forward, or kept in a plain list or dict), so evaluation uses each batch's statistics and updates "
                  "the running ones", FIX, involved=graph.describe(node))


RULE = Rule("mode-unreached", "error", check,
            "a Dropout or BatchNorm that model.eval() does not reach (made in forward, or kept in a plain list)")
