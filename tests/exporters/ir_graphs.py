"""Running the small ONNX IR graphs the export passes' tests build, in ONNX Runtime's CPU provider."""

from __future__ import annotations

import collections

import numpy as np
import onnxruntime as ort
from onnxscript import ir


def run_graph(graph: ir.Graph, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """``graph``'s outputs on ``feeds`` (ONNX Runtime, CPU provider, warnings off)."""
    proto = ir.serde.serialize_model(ir.Model(graph, ir_version=10))
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def op_counts(graph: ir.Graph, *, subgraphs: bool = False) -> collections.Counter:
    """How many nodes of each op type ``graph`` has (with its subgraphs' when ``subgraphs``)."""
    nodes = ir.traversal.RecursiveGraphIterator(graph) if subgraphs else graph
    return collections.Counter(node.op_type for node in nodes)


def onnx_applied(report) -> list[str]:
    """The ONNX rules' applications in ``report`` as ``"<what>: <count>"`` lines, in the order they first ran
    (the form the export's translation lines have)."""
    counts: dict[str, int] = {}
    for match in report.matches:
        if match.stage == "onnx":
            counts[match.what] = counts.get(match.what, 0) + match.count
    return [f"{what}: {count}" for what, count in counts.items()]


def onnx_refused(report) -> list[str]:
    """The reasons of the ONNX rules' refusals in ``report``, in order."""
    return [miss.reason for miss in report.near_misses if miss.stage == "onnx"]
