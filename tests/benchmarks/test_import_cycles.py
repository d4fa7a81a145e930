"""benchmarks/ imports itself without a cycle (modelled on tests/test_layers.py's cycle finder).

Every import counts, including those inside functions: a deferred import is still a dependency, and a
cycle through one (run -> suite -> zoo -> run, once) is what this test exists to stop.
"""

from __future__ import annotations

import ast
import pathlib
import shutil

import pytest

from tests.import_graph import cycles, is_module, module_name

ROOT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def edges_of(root: pathlib.Path) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (``from benchmarks import x`` imports the module
    ``benchmarks.x`` when ``x`` is one; a package importing its own modules is not an edge)."""
    edges: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        importer = module_name(path, root)
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                imported |= {a.name for a in node.names if a.name.split(".")[0] == root.name}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                    and node.module.split(".")[0] == root.name:
                modules = {f"{node.module}.{a.name}" for a in node.names if is_module(f"{node.module}.{a.name}", root)}
                imported |= modules or {node.module}
                if len(modules) < len(node.names):
                    imported.add(node.module)
        edges[importer] = {m for m in imported if m != importer and not m.startswith(importer + ".")}
    return edges


def test_benchmarks_has_no_import_cycle():
    edges = edges_of(ROOT)
    assert "benchmarks.timed" in edges["benchmarks.sections"]  # the finder sees the package's imports
    assert cycles(edges) == []


def test_relative_imports_are_not_used():
    """The finder reads absolute imports only; a relative one would slip past it."""
    for path in ROOT.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level], path


@pytest.mark.parametrize("module, line, expected", [
    ("suite.py", "    from benchmarks.timed import TIMED\n", ["benchmarks.suite", "benchmarks.timed"]),
    ("report.py", "from benchmarks import zoo\n", ["benchmarks.report", "benchmarks.zoo"]),
])
def test_the_check_finds_a_cycle_it_is_given(tmp_path, module, line, expected):
    copy = tmp_path / "benchmarks"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__", "out", "*.md"))
    target = copy / module
    text = target.read_text(encoding="utf-8")
    if line.startswith("    "):  # an import inside a function counts too
        text += "\n\ndef _added():\n" + line
    else:
        header_end = text.index("\n\n", text.index('"""', 3)) + 2
        text = text[:header_end] + line + text[header_end:]
    target.write_text(text, encoding="utf-8")
    found = cycles(edges_of(copy))
    assert any(set(expected) <= set(c) for c in found), found
