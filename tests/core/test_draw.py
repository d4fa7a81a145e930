"""fxforge.core.draw.graph_svg: well-formed, self-contained SVG, one element per node, fast on 2,000 nodes."""

from __future__ import annotations

import re
import shutil
import time
import xml.etree.ElementTree as ET

import pytest
import torch
from torch import nn

from examples.models.branchy import synthetic_2000
from fxforge.core import draw
from fxforge.core.draw import graph_svg

SVG = "{http://www.w3.org/2000/svg}"


def _nodes(svg: str) -> dict[str, ET.Element]:
    root = ET.fromstring(svg)
    return {g.get("id"): g for g in root.iter(f"{SVG}g") if "node" in (g.get("class") or "").split()}


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        y = torch.relu(self.a(x))
        z = torch.sigmoid(self.b(x))
        return torch.cat([y + z, x * 2], dim=-1)


def _gm() -> torch.fx.GraphModule:
    return torch.fx.symbolic_trace(Branchy())


def test_builtin_svg_has_one_element_per_node_with_colours_labels_and_marks():
    gm = _gm()
    svg = graph_svg(gm, node_colors={"relu": "#ff0000", "a": "blue"}, node_labels={"cat": "join\nthe two"},
                    marked=["add"], title="Branchy <net>", engine="builtin")
    nodes = _nodes(svg)
    assert set(nodes) == {f"node-{n.name}" for n in gm.graph.nodes}
    assert nodes["node-relu"].find(f"{SVG}rect").get("fill") == "#ff0000"
    assert nodes["node-a"].find(f"{SVG}rect").get("fill") == "blue"
    assert nodes["node-x"].find(f"{SVG}rect").get("fill") == draw._FILL["placeholder"]
    assert [t.text for t in nodes["node-cat"].iter(f"{SVG}tspan")] == ["join", "the two"]
    assert nodes["node-add"].get("class") == "node marked"
    assert [g for g, e in nodes.items() if e.get("class") == "node marked"] == ["node-add"]
    assert "Branchy &lt;net&gt;" in svg
    edges = ET.fromstring(svg).findall(f".//{SVG}path[@class='edge']")
    assert len(edges) == sum(len(set(n.all_input_nodes)) for n in gm.graph.nodes)


def test_svg_is_self_contained():
    svg = graph_svg(_gm(), engine="builtin")
    without_namespace = svg.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "http" not in without_namespace and "<script" not in svg and "@import" not in svg
    assert not re.search(r'href="(?!#)', svg)


def test_layout_flows_downward_and_nodes_do_not_overlap():
    gm = _gm()
    root = ET.fromstring(graph_svg(gm, engine="builtin"))
    boxes = {}
    for g in root.iter(f"{SVG}g"):
        if "node" in (g.get("class") or "").split():
            r = g.find(f"{SVG}rect")
            boxes[g.get("id")[5:]] = tuple(float(r.get(k)) for k in ("x", "y", "width", "height"))
    for node in gm.graph.nodes:
        for arg in node.all_input_nodes:  # every input sits above its user
            assert boxes[arg.name][1] + boxes[arg.name][3] <= boxes[node.name][1]
    items = list(boxes.values())
    for i, (x1, y1, w1, h1) in enumerate(items):
        for x2, y2, w2, h2 in items[i + 1:]:
            assert x1 + w1 <= x2 or x2 + w2 <= x1 or y1 + h1 <= y2 or y2 + h2 <= y1


def test_auto_without_dot_uses_the_builtin_layout(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    svg = graph_svg(_gm())
    assert svg.startswith("<svg") and 'class="edges"' in svg
    with pytest.raises(RuntimeError, match="graphviz"):
        graph_svg(_gm(), engine="dot")
    with pytest.raises(ValueError, match="engine"):
        graph_svg(_gm(), engine="neato")


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz dot is not installed")
def test_dot_engine():
    gm = _gm()
    svg = graph_svg(gm, node_colors={"relu": "#ff0000"}, marked=["add"], engine="dot")
    assert "<!DOCTYPE" not in svg
    nodes = _nodes(svg)
    assert {f"node-{n.name}" for n in gm.graph.nodes} <= set(nodes)
    assert "#ff0000" in ET.tostring(nodes["node-relu"], encoding="unicode")


def test_empty_and_tiny_graphs():
    gm = torch.fx.symbolic_trace(nn.Identity())
    assert len(_nodes(graph_svg(gm, engine="builtin"))) == 2


def test_two_thousand_nodes_draw_quickly():
    model, _ = synthetic_2000()
    gm = torch.fx.symbolic_trace(model)
    assert len(gm.graph.nodes) >= 2000
    start = time.perf_counter()
    svg = graph_svg(gm, engine="builtin")
    elapsed = time.perf_counter() - start
    assert len(_nodes(svg)) == len(gm.graph.nodes)
    assert elapsed < 6.0  # about 0.8 s on an idle two-core machine
