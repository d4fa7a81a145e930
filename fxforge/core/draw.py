"""Drawing an fx graph as a self-contained SVG document.

:func:`graph_svg` draws every node of a ``GraphModule`` (inputs, parameters, ops, the output) top to
bottom along its data flow. With graphviz's ``dot`` on the ``PATH`` it lays the graph out with dot;
otherwise with a built-in layered layout:

1. layers by longest path from the inputs (parameters and constants sit just above their first user);
2. edges that span several layers pass through invisible waypoints, one per layer crossed;
3. crossings reduced by barycenter sweeps (each node moves to the mean position of its neighbours in
   the layer above, then below, a few times);
4. x positions: each layer centred, then pulled toward its neighbours while keeping the order and a gap.

The result has no external references (no fonts, images, scripts or stylesheets fetched): it can be
written to a file, embedded in HTML, or shown in Jupyter as it is. Each node is one
``<g class="node" id="node-NAME">`` element, so tools and tests can find it.

Example:
    >>> import xml.etree.ElementTree as ET
    >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
    >>> svg = graph_svg(gm, node_colors={"_1": "#ff0000"}, engine="builtin")
    >>> root = ET.fromstring(svg)
    >>> len([g for g in root.iter("{http://www.w3.org/2000/svg}g") if g.get("class", "").startswith("node")])
    4
"""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
from collections.abc import Iterable
from xml.sax.saxutils import escape, quoteattr

import torch

from fxforge.core.nodes import target_name

ENGINES = ("auto", "builtin", "dot")
# "auto" hands graphs up to this many nodes to dot; larger ones (dot takes minutes on thousands of nodes)
# get the built-in layout.
DOT_MAX_NODES = 1000
DOT_TIMEOUT_S = 30

_FILL = {"placeholder": "#d9f2d9", "get_attr": "#e8ecf4", "output": "#e6e6e6"}
_FONT = 11
_CHAR_W = 6.6  # average width of a character of the 11px monospace font
_LINE_H = 14
_PAD_X, _PAD_Y = 8, 6
_GAP_X, _GAP_Y = 18, 42
_SWEEPS = 6


def default_label(node: torch.fx.Node, graph_module: torch.nn.Module | None = None) -> str:
    """The label a node gets unless told otherwise: its name, and what it calls.

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x"); n = g.call_method("relu", (x,))
        >>> default_label(n)
        'relu\\n.relu()'
    """
    if node.op == "placeholder":
        return f"{node.name}\ninput"
    if node.op == "output":
        return "output"
    if node.op == "get_attr":
        return str(node.target)
    if node.op == "call_method":
        return f"{node.name}\n.{node.target}()"
    if node.op == "call_module" and graph_module is not None:
        try:
            kind = type(graph_module.get_submodule(str(node.target))).__name__
            return f"{node.name}\n{kind}"
        except AttributeError:
            pass
    return f"{node.name}\n{target_name(node)}"


def _size(label: str) -> tuple[float, float]:
    lines = label.split("\n")
    return max(len(line) for line in lines) * _CHAR_W + 2 * _PAD_X, len(lines) * _LINE_H + 2 * _PAD_Y


# ------------------------------------------------------------------------------------------------ layout


def _layers(nodes: list[torch.fx.Node]) -> list[int]:
    """Longest-path layer of each node; nodes without inputs other than placeholders move down to just
    above their first user."""
    index = {n: i for i, n in enumerate(nodes)}
    inputs = [[index[a] for a in n.all_input_nodes if a in index] for n in nodes]
    layer = [0] * len(nodes)
    for i, preds in enumerate(inputs):  # fx graphs are in topological order
        if preds:
            layer[i] = 1 + max(layer[p] for p in preds)
    users = [[index[u] for u in n.users if u in index] for n in nodes]
    for i in reversed(range(len(nodes))):
        if not inputs[i] and nodes[i].op != "placeholder" and users[i]:
            layer[i] = max(0, min(layer[u] for u in users[i]) - 1)
    return layer


def _layout(nodes: list[torch.fx.Node], sizes: list[tuple[float, float]]):
    """Positions (centre x, centre y) of the nodes and the polyline of each edge."""
    n = len(nodes)
    layer = _layers(nodes)
    index = {node: i for i, node in enumerate(nodes)}
    # Vertices: the nodes, then one waypoint per layer an edge crosses.
    vlayer = list(layer)
    width = [s[0] for s in sizes]
    up: list[list[int]] = [[] for _ in range(n)]
    down: list[list[int]] = [[] for _ in range(n)]
    edges: list[list[int]] = []  # vertex chain of each edge, source to target
    for t, node in enumerate(nodes):
        for arg in dict.fromkeys(node.all_input_nodes):
            s = index.get(arg)
            if s is None:
                continue
            chain = [s]
            for lay in range(layer[s] + 1, layer[t]):
                v = len(vlayer)
                vlayer.append(lay)
                width.append(4.0)
                up.append([])
                down.append([])
                chain.append(v)
            chain.append(t)
            for a, b in itertools.pairwise(chain):
                down[a].append(b)
                up[b].append(a)
            edges.append(chain)
    depth = max(vlayer, default=-1) + 1
    rows: list[list[int]] = [[] for _ in range(depth)]
    for v, lay in enumerate(vlayer):
        rows[lay].append(v)
    position = [0.0] * len(vlayer)
    for row in rows:
        for k, v in enumerate(row):
            position[v] = float(k)

    def sweep(row: list[int], neighbours: list[list[int]]) -> list[int]:
        keyed = []
        for k, v in enumerate(row):
            near = neighbours[v]
            keyed.append((sum(position[u] for u in near) / len(near) if near else position[v], k, v))
        keyed.sort()
        ordered = [v for _, _, v in keyed]
        for k, v in enumerate(ordered):
            position[v] = float(k)
        return ordered

    for it in range(_SWEEPS):
        if it % 2 == 0:
            for lay in range(1, depth):
                rows[lay] = sweep(rows[lay], up)
        else:
            for lay in range(depth - 2, -1, -1):
                rows[lay] = sweep(rows[lay], down)

    # x: each row packed left to right, centred on 0, then pulled toward its neighbours' mean.
    x = [0.0] * len(vlayer)
    for row in rows:
        total = sum(width[v] for v in row) + _GAP_X * max(0, len(row) - 1)
        cursor = -total / 2
        for v in row:
            x[v] = cursor + width[v] / 2
            cursor += width[v] + _GAP_X
    for it in range(4):
        order = range(1, depth) if it % 2 == 0 else range(depth - 2, -1, -1)
        for lay in order:
            row = rows[lay]
            neighbours = up if it % 2 == 0 else down
            wanted = [sum(x[u] for u in neighbours[v]) / len(neighbours[v]) if neighbours[v] else x[v]
                      for v in row]
            placed = _place_row(row, wanted, width)
            for v, value in zip(row, placed):
                x[v] = value
    # y: rows stacked with their tallest node.
    heights = [0.0] * depth
    for v in range(n):
        heights[vlayer[v]] = max(heights[vlayer[v]], sizes[v][1])
    tops, cursor = [], 0.0
    for h in heights:
        tops.append(cursor)
        cursor += max(h, 8.0) + _GAP_Y
    y = [tops[vlayer[v]] + max(heights[vlayer[v]], 8.0) / 2 for v in range(len(vlayer))]
    return x, y, edges, cursor - _GAP_Y


def _place_row(row: list[int], wanted: list[float], width: list[float]) -> list[float]:
    """x of each vertex of a row, as near ``wanted`` as the order and the gaps allow (left then right pass,
    averaged)."""
    left = []
    for k, v in enumerate(row):
        value = wanted[k]
        if k:
            value = max(value, left[-1] + (width[row[k - 1]] + width[v]) / 2 + _GAP_X)
        left.append(value)
    right = [0.0] * len(row)
    for k in range(len(row) - 1, -1, -1):
        value = wanted[k]
        if k < len(row) - 1:
            value = min(value, right[k + 1] - (width[row[k + 1]] + width[row[k]]) / 2 - _GAP_X)
        right[k] = value
    mixed = [(a + b) / 2 for a, b in zip(left, right)]
    # The average of two feasible placements is feasible: gaps hold in both.
    return mixed


# ------------------------------------------------------------------------------------------------ SVG


def _node_svg(node: torch.fx.Node, label: str, fill: str, marked: bool, cx: float, cy: float,
              size: tuple[float, float]) -> str:
    w, h = size
    cls = "node marked" if marked else "node"
    title = escape(label.replace("\n", " "))
    parts = [f'<g class="{cls}" id={quoteattr("node-" + node.name)}><title>{title}</title>']
    rx = h / 2 if node.op in ("placeholder", "output") else 4
    parts.append(f'<rect x="{cx - w / 2:.1f}" y="{cy - h / 2:.1f}" width="{w:.1f}" height="{h:.1f}" rx="{rx:.1f}" '
                 f'fill={quoteattr(fill)}/>')
    lines = label.split("\n")
    first = cy - (len(lines) - 1) * _LINE_H / 2 + _FONT * 0.35
    parts.append(f'<text x="{cx:.1f}" y="{first:.1f}">')
    for k, line in enumerate(lines):
        dy = "0" if k == 0 else str(_LINE_H)
        weight = ' font-weight="bold"' if k == 0 and len(lines) > 1 else ""
        parts.append(f'<tspan x="{cx:.1f}" dy="{dy}"{weight}>{escape(line)}</tspan>')
    parts.append("</text></g>")
    return "".join(parts)


_STYLE = (
    "text{font-family:monospace;font-size:11px;text-anchor:middle;fill:#222}"
    ".node rect{stroke:#555;stroke-width:1}"
    ".node.marked rect{stroke:#1f5fd6;stroke-width:3;stroke-dasharray:6 2}"
    ".edge{fill:none;stroke:#888;stroke-width:1}"
    ".title{font-size:14px;font-weight:bold;text-anchor:start}"
)


def _builtin_svg(graph_module: torch.fx.GraphModule, colors: dict[str, str], labels: dict[str, str],
                 marked: set[str], title: str | None) -> str:
    nodes = list(graph_module.graph.nodes)
    texts = [labels.get(n.name) or default_label(n, graph_module) for n in nodes]
    sizes = [_size(t) for t in texts]
    x, y, edges, height = _layout(nodes, sizes)
    if nodes:
        left = min(x[v] - sizes[v][0] / 2 for v in range(len(nodes)))
        right = max(x[v] + sizes[v][0] / 2 for v in range(len(nodes)))
        left = min([left, *(x[v] for chain in edges for v in chain)])
        right = max([right, *(x[v] for chain in edges for v in chain)])
    else:
        left, right = 0.0, 100.0
    margin = 12.0
    top = margin + (24.0 if title else 0.0)
    dx, dy = margin - left, top
    total_w = right - left + 2 * margin
    if title:
        total_w = max(total_w, len(title) * 8.5 + 2 * margin)
    total_h = height + top + margin
    out = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{total_w:.0f}" height="{total_h:.0f}" '
            f'viewBox="0 0 {total_w:.0f} {total_h:.0f}">'),
           f"<style>{_STYLE}</style>",
           ('<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" '
            'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="#888"/></marker></defs>')]
    if title:
        out.append(f'<text class="title" x="{margin:.0f}" y="{margin + 12:.0f}">{escape(title)}</text>')
    out.append('<g class="edges">')
    n = len(nodes)
    for chain in edges:
        s, t = chain[0], chain[-1]
        points = [(x[s] + dx, y[s] + sizes[s][1] / 2 + dy)]
        points += [(x[v] + dx, y[v] + dy) for v in chain[1:-1]]
        points.append((x[t] + dx, y[t] - sizes[t][1] / 2 + dy))
        d = "M " + " L ".join(f"{px:.1f} {py:.1f}" for px, py in points)
        out.append(f'<path class="edge" d="{d}" marker-end="url(#arrow)"/>')
    out.append("</g>")
    for v in range(n):
        node = nodes[v]
        fill = colors.get(node.name) or _FILL.get(node.op, "#ffffff")
        out.append(_node_svg(node, texts[v], fill, node.name in marked, x[v] + dx, y[v] + dy, sizes[v]))
    out.append("</svg>")
    return "\n".join(out)


def _dot_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _dot_svg(graph_module: torch.fx.GraphModule, colors: dict[str, str], labels: dict[str, str],
             marked: set[str], title: str | None, dot: str) -> str:
    nodes = list(graph_module.graph.nodes)
    lines = ["digraph G {", "rankdir=TB;",
             'node [shape=box, style="rounded,filled", fontname="monospace", fontsize=10];',
             'edge [color="#888888"];']
    if title:
        lines.append(f"label={_dot_quote(title)}; labelloc=t;")
    for node in nodes:
        label = labels.get(node.name) or default_label(node, graph_module)
        fill = colors.get(node.name) or _FILL.get(node.op, "#ffffff")
        extra = ', color="#1f5fd6", penwidth=3, class="node marked"' if node.name in marked else ""
        lines.append(f"{_dot_quote(node.name)} [label={_dot_quote(label)}, fillcolor={_dot_quote(fill)}, "
                     f"id={_dot_quote('node-' + node.name)}{extra}];")
    for node in nodes:
        for arg in dict.fromkeys(node.all_input_nodes):
            lines.append(f"{_dot_quote(arg.name)} -> {_dot_quote(node.name)};")
    lines.append("}")
    result = subprocess.run([dot, "-Tsvg"], input="\n".join(lines), capture_output=True, text=True,
                            timeout=DOT_TIMEOUT_S, check=True)
    svg = result.stdout
    # Keep it self-contained: no XML declaration or DOCTYPE pointing at the SVG DTD on the web.
    svg = re.sub(r"<\?xml[^>]*\?>", "", svg)
    svg = re.sub(r"<!DOCTYPE[^>]*>", "", svg)
    svg = re.sub(r"<!--.*?-->", "", svg, flags=re.DOTALL)
    return svg.strip()


def graph_svg(graph_module: torch.fx.GraphModule, *, node_colors: dict[str, str] | None = None,
              node_labels: dict[str, str] | None = None, marked: Iterable[str] = (), title: str | None = None,
              engine: str = "auto") -> str:
    """The graph of ``graph_module`` as a self-contained SVG document (a string).

    Args:
        graph_module: the graph to draw (a ``torch.fx.GraphModule``, or anything with a ``graph_module``
            attribute such as a ``Captured``).
        node_colors: node name -> fill colour (any SVG colour: ``"#ff8800"``, ``"red"``); other nodes get
            a colour by kind (inputs green, parameters blue-grey, ops white).
        node_labels: node name -> label (``\\n`` separates lines); other nodes show their name and target.
        marked: names of nodes drawn with a thick dashed blue outline (the CLI marks the nodes a rewrite
            created).
        title: a line of text above the graph.
        engine: ``"auto"`` (graphviz ``dot`` when it is on the PATH and the graph has at most
            ``DOT_MAX_NODES`` nodes, else the built-in layout), ``"builtin"`` or ``"dot"``.

    Returns:
        An ``<svg>`` document in which each node is a ``<g>`` element of class ``node`` (``node marked``
        for marked ones) with id ``node-NAME``.

    Raises:
        ValueError: an unknown engine.
        RuntimeError: ``engine="dot"`` without ``dot`` on the PATH, or dot failing.

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.ReLU())
        >>> svg = graph_svg(gm, marked=["relu"], title="relu", engine="builtin")
        >>> svg.startswith("<svg"), 'class="node marked" id="node-relu"' in svg
        (True, True)
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    graph_module = getattr(graph_module, "graph_module", graph_module)
    colors = dict(node_colors or {})
    labels = dict(node_labels or {})
    marked_set = set(marked)
    dot = shutil.which("dot")
    use_dot = engine == "dot" or (engine == "auto" and dot is not None
                                   and len(graph_module.graph.nodes) <= DOT_MAX_NODES)
    if use_dot:
        if dot is None:
            raise RuntimeError("engine='dot' needs graphviz's dot on the PATH (install graphviz), "
                               "or use engine='builtin'")
        try:
            return _dot_svg(graph_module, colors, labels, marked_set, title, dot)
        except (subprocess.SubprocessError, OSError) as error:
            if engine == "dot":
                raise RuntimeError(f"dot failed: {error}") from error
    return _builtin_svg(graph_module, colors, labels, marked_set, title)
