"""The README and every page of docs/ are true: their Python runs, their links resolve, the CLI page lists
every command and option the parser has, and the README fits one screen.

Each page's ```python blocks run in order in one namespace (as a reader pastes them into one session), in a
temporary working directory, with fxforge's on-disk caches pointed there. A block whose fence says
``python no-run`` is shown but not run: for code that cannot run on the test machine (a GPU, several hosts);
``NO_RUN_LIMIT`` keeps those rare. A failing block names the page and the line.
"""

from __future__ import annotations

import linecache
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
README_MAX_LINES = 80
NO_RUN_LIMIT = 3
FENCE = re.compile(r"^```(\S*)(.*)$")
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")


def code_blocks(text: str) -> list[tuple[int, str, str]]:
    """Every fenced block of ``text`` as (line number of its first code line, info string, code)."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if match and match.group(1):
            start, info = i + 1, (match.group(1) + match.group(2)).strip()
            end = next((j for j in range(start, len(lines)) if lines[j].startswith("```")), None)
            assert end is not None, f"line {i + 1}: the ``` block is never closed"
            blocks.append((start + 1, info, "\n".join(lines[start:end])))
            i = end
        i += 1
    return blocks


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """The blocks of ``page`` that run: (first line, code)."""
    return [(line, code) for line, info, code in code_blocks(page.read_text())
            if info.split()[0] == "python" and "no-run" not in info.split()[1:]]


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_the_pages_exist():
    names = {p.name for p in DOCS.glob("*.md")}
    assert {"index.md", "targets.md", "rewrites.md", "dynamic-shapes.md", "guards.md", "onnx.md",
            "training-memory.md", "pipelines.md", "profiling.md", "cli.md"} <= names, names


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_page_code_runs(page, tmp_path, monkeypatch):
    blocks = python_blocks(page)
    if page.name != "cli.md":
        assert blocks, f"{_name(page)} has no Python to run"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FXFORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FXFORGE_TARGET_CACHE", "0")
    monkeypatch.setenv("FXFORGE_PROGRESS", "0")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.syspath_prepend(str(ROOT))  # `from examples.models import EXAMPLES`, as from a clone's root
    filename = str(page)
    # tracebacks, inspect and fxforge's source lines read the page itself
    linecache.cache[filename] = (len(page.read_text()), None, page.read_text().splitlines(True), filename)
    namespace = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    sys.modules.pop(namespace["__name__"], None)
    try:
        for line, code in blocks:
            exec(compile("\n" * (line - 1) + code, filename, "exec"), namespace)  # noqa: S102 (the page is ours)
    finally:
        linecache.cache.pop(filename, None)


def test_no_run_blocks_are_rare():
    no_run = [(_name(p), line) for p in PAGES for line, info, _ in code_blocks(p.read_text())
              if info.startswith("python") and "no-run" in info.split()[1:]]
    assert len(no_run) <= NO_RUN_LIMIT, no_run


def test_readme_fits_one_screen():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; one screen is {README_MAX_LINES}"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    for target, _ in LINK.findall(text):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (page.parent / target).exists(), f"{_name(page)} links to {target}, which does not exist"


def test_index_and_readme_link_every_page():
    pages = {p.name for p in DOCS.glob("*.md")} - {"index.md"}
    index = {Path(t).name for t, _ in LINK.findall((DOCS / "index.md").read_text())}
    readme = {Path(t).name for t, _ in LINK.findall((ROOT / "README.md").read_text()) if t.startswith("docs/")}
    assert pages <= index, pages - index
    assert pages <= readme, pages - readme


def _commands():
    """Each subcommand's name and its options' long forms, read from the parser itself."""
    import argparse

    from fxforge.cli import build_parser

    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in action.choices.items():
        options = [max(a.option_strings, key=len) for a in parser._actions  # hidden ones are old spellings
                   if a.option_strings and a.option_strings != ["-h", "--help"] and a.help != argparse.SUPPRESS]
        yield name, options


def test_cli_page_lists_every_command_and_option():
    text = (DOCS / "cli.md").read_text()
    sections = dict(re.findall(r"^## `fxforge (\S+)`\n(.*?)(?=^## |\Z)", text, flags=re.DOTALL | re.MULTILINE))
    missing = []
    for name, options in _commands():
        if name not in sections:
            missing.append(f"## `fxforge {name}`")
            continue
        missing += [f"{name} {o}" for o in options if not re.search(f"`{re.escape(o)}(?![\\w-])", sections[name])]
    assert not missing, f"docs/cli.md does not describe: {', '.join(missing)}"
