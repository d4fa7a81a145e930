"""The package's layers, read from its own imports: every stage imports only the stages below it.

Layers, bottom to top (DESIGN.md): core -> capture -> rewrites -> lowering -> runtime, exporters -> training,
parallel, lint -> targets (one module per target behind one protocol) -> api, cli. A module may import its own layer or lower ones; packages form no cycle
(runtime and exporters share a layer, so only one of them may import the other); no module imports a
``_private`` name of another package; and no two modules import each other, even inside one package.
Every import counts, including those inside functions: a deferred import is still a dependency.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import shutil

import pytest

from tests.import_graph import cycles, is_module, module_name

ROOT = pathlib.Path(__file__).resolve().parents[1] / "fxforge"

# First part of the module path under fxforge -> its layer.
LAYERS = {
    "core": 0,
    "capture": 1,
    "rewrites": 2,
    "lowering": 3,
    "runtime": 4,
    "exporters": 4,
    "training": 5,  # a stage over runtime: traces, simulates and runs training steps
    "parallel": 5,  # a stage over training: pipeline stages (and the parallel plans to come) over the traced step
    "lint": 5,  # rules over a captured graph: reads capture and core only
    "targets": 6,  # one module per target: builds on every stage below
    "api": 7,
    "cli": 7,
    "": 7,  # the package face (fxforge/__init__.py): the public names, which the CLI uses too
}


@dataclasses.dataclass(frozen=True)
class Import:
    importer: str  # dotted module name: fxforge.core.nodes
    imported: str  # dotted module name the import resolves to
    names: tuple[str, ...]  # names taken from it (empty for `import x`)
    line: int


def imports_of(path: pathlib.Path, root: pathlib.Path) -> list[Import]:
    """Every import of a fxforge module in ``path`` (``from fxforge.x import y`` counts as importing the
    module ``fxforge.x.y`` when ``y`` is a module)."""
    importer = module_name(path, root)
    package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [Import(importer, alias.name, (), node.lineno) for alias in node.names
                      if alias.name.split(".")[0] == root.name]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != root.name:
                continue
            modules = [a.name for a in node.names if is_module(f"{base}.{a.name}", root)]
            names = tuple(a.name for a in node.names if a.name not in modules)
            if names:
                found.append(Import(importer, base, names, node.lineno))
            found += [Import(importer, f"{base}.{m}", (), node.lineno) for m in modules]
    return found


def all_imports(root: pathlib.Path) -> list[Import]:
    return [i for path in sorted(root.rglob("*.py")) for i in imports_of(path, root)]


def part(name: str) -> str:
    """The first part under the package root: ``fxforge.core.nodes`` -> ``core``; the root itself -> ''."""
    pieces = name.split(".")
    return pieces[1] if len(pieces) > 1 else ""


def layer_violations(imports: list[Import]) -> list[str]:
    problems = []
    for imp in imports:
        src, dst = part(imp.importer), part(imp.imported)
        if src == "":
            continue  # the package face hands the public names on
        if src not in LAYERS or dst not in LAYERS:
            problems.append(f"{imp.importer}: {src or dst!r} is in no layer")
        elif LAYERS[dst] > LAYERS[src]:
            problems.append(f"{imp.importer}:{imp.line} imports {imp.imported} (layer {dst} above {src})")
    return problems


def package_cycles(imports: list[Import]) -> list[list[str]]:
    edges: dict[str, set[str]] = {}
    for imp in imports:
        src, dst = part(imp.importer), part(imp.imported)
        if src and dst and src != dst:
            edges.setdefault(src, set()).add(dst)
    return cycles(edges)


def module_cycles(imports: list[Import]) -> list[list[str]]:
    edges: dict[str, set[str]] = {}
    for imp in imports:
        # a package's face importing its own modules is how a package hands names on, not a dependency
        if imp.imported != imp.importer and not imp.imported.startswith(imp.importer + "."):
            edges.setdefault(imp.importer, set()).add(imp.imported)
    return cycles(edges)


def private_imports(imports: list[Import]) -> list[str]:
    problems = []
    for imp in imports:
        if part(imp.importer) == part(imp.imported):
            continue
        private = [n for n in imp.names if n.startswith("_")]
        private += [m for m in imp.imported.split(".") if m.startswith("_") and not m.startswith("__")]
        if private:
            problems.append(f"{imp.importer}:{imp.line} imports {', '.join(private)} from {imp.imported}")
    return problems


def check(root: pathlib.Path) -> list[str]:
    imports = all_imports(root)
    problems = layer_violations(imports) + private_imports(imports)
    problems += [f"package cycle: {' -> '.join(c)}" for c in package_cycles(imports)]
    problems += [f"module cycle: {' -> '.join(c)}" for c in module_cycles(imports)]
    return problems


def test_every_module_is_in_a_layer_and_imports_only_its_own_or_lower_ones():
    modules = {module_name(p, ROOT) for p in ROOT.rglob("*.py")}
    assert {part(m) for m in modules} == set(LAYERS), "a package or top-level module is in no layer"
    assert check(ROOT) == []


def test_core_imports_nothing_else_of_fxforge():
    assert {part(i.imported) for i in all_imports(ROOT) if part(i.importer) == "core"} <= {"core"}


@pytest.mark.parametrize("importer, line, expected", [
    ("core/nodes.py", "from fxforge.targets import TARGETS\n", "imports fxforge.targets (layer targets above core)"),
    ("capture/export.py", "    from fxforge.rewrites import pipeline\n",
     "imports fxforge.rewrites.pipeline (layer rewrites above capture)"),
    ("runtime/signature.py", "from fxforge.exporters import program\n", "package cycle: exporters -> runtime -> exporters"),
    ("exporters/onnx.py", "from fxforge.capture.model import _private_helper\n", "imports _private_helper from"),
    ("rewrites/passes.py", "import fxforge.rewrites.pipeline\n", "module cycle: "),
])
def test_the_check_fails_on_what_it_forbids(tmp_path, importer, line, expected):
    copy = tmp_path / "fxforge"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert check(copy) == []
    target = copy / importer
    text = target.read_text()
    if line.startswith("    "):  # an import inside a function counts too
        text += "\n\ndef _added():\n" + line
    else:
        header_end = text.index("\n\n", text.index('"""', 3)) + 2
        text = text[:header_end] + line + text[header_end:]
    target.write_text(text)
    problems = check(copy)
    assert any(expected in p for p in problems), problems
