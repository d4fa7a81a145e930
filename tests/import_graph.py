"""Reading a package's import graph from its source: module names, which names are modules, and cycles.

Shared by tests/test_layers.py (fxforge's layers and cycles) and tests/benchmarks/test_import_cycles.py.
"""

from __future__ import annotations

import pathlib


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(name: str, root: pathlib.Path) -> bool:
    relative = pathlib.Path(*name.split(".")[1:]) if "." in name else pathlib.Path()
    return (root / relative).with_suffix(".py").is_file() or (root / relative / "__init__.py").is_file()


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle found by a depth-first search (each reported once, as the path that closes it, from its
    alphabetically first member: the same cycle reads the same whichever node the search reached first)."""
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                if nxt not in path:
                    found.append([node, nxt])
                    continue
                body = path[path.index(nxt):]
                start = body.index(min(body))
                found.append([*body[start:], *body[:start], body[start]])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return found
