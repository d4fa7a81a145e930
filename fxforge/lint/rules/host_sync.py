"""``host-sync``: forward reads a tensor's value on the host (``.item()``, ``.tolist()``, ``.cpu()``,
``.numpy()``, a Python ``if`` on a tensor): on a GPU each waits for every queued kernel, every call.

Found in the graph (``aten.item``, a copy to the CPU) and, where no single graph holds the model, at the places
TorchDynamo breaks it for a value read.

Example:
    >>> class Net(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x * x.abs().max().item()
    >>> [f.rule for f in fxforge.lint(Net(), (torch.randn(4, 8),), rules=[RULE])]
    ['host-sync']
"""

from __future__ import annotations

import re

import torch

from fxforge.lint.graph import LintGraph, parse_source
from fxforge.lint.rule import Rule

COST = ("on a GPU every call stops here until all queued kernels finish (a device-to-host sync: the host stops "
        "queueing work, typically tens of microseconds plus the drained pipeline), and it breaks torch.compile's graph")
READS = {"item": ".item()", "_local_scalar_dense": ".item()", "tolist": ".tolist()", "numpy": ".numpy()",
         "cpu": ".cpu()"}
# dynamo's break reasons (fxforge.core.breaks) that are a value read on the host.
BREAK_MARKERS = ("item()", "tolist", "tensor's value", "values (boolean", "numpy")


HOST_CODE = re.compile(r"\.cpu\(\)|\.numpy\(\)|[\"']cpu[\"']")


def _to_cpu(graph: LintGraph, node: torch.fx.Node) -> bool:
    """A copy to the CPU that the line asks for by name (``.cpu()``, ``.to("cpu")``): the example runs on the CPU,
    so ``.to(x.device)`` records the CPU too, and only the line tells them apart."""
    device = node.kwargs.get("device")
    if device is None:
        device = next((a for a in node.args[1:] if isinstance(a, (torch.device, str))), None)
    try:
        if device is None or torch.device(device).type != "cpu":
            return False
    except (RuntimeError, TypeError):  # a string that is no device (x.to("float") is a user error of its own)
        return False
    return bool(HOST_CODE.search(graph.source(node)[2]))


def check(graph: LintGraph):
    for node in graph.calls(*READS, "to", "_to_copy"):
        op = graph.op(node)
        if op in ("to", "_to_copy"):
            if not _to_cpu(graph, node):
                continue
            what = ".cpu() / .to('cpu')"
        else:
            what = READS[op]
        source = graph.tensor_args(node)[:1]
        yield graph.finding(node, f"{what} in forward copies a tensor's value to the host: {COST}",
                            "keep the value a tensor (a 0-d tensor works in arithmetic and torch.where), or move the "
                            "read out of forward (log it after the call)",
                            involved=graph.describe(source[0]) if source else "")
    for cut in graph.breaks:
        if not any(marker in cut.reason for marker in BREAK_MARKERS):
            continue
        file, line, _ = parse_source(cut.line)
        yield graph.finding(None, f"{cut.reason}: {COST}", cut.fix, where=(file, line, cut.code),
                            involved="Python control flow on a tensor value" if "branch" in cut.reason else "")


RULE = Rule("host-sync", "warning", check,
            "a read of a tensor's value on the host in forward (.item(), .tolist(), .cpu(), a Python branch on a "
            "tensor): a device sync every call", needs_graph=False)
