"""fxforge's source files: none over 500 lines (DESIGN.md), and each compiles without a warning."""

from __future__ import annotations

import pathlib
import warnings

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "fxforge"
MAX_LINES = 500

# Files still over the limit while their owners split them (issue 47); take each off once its split lands
# (test_known_over_list_names_only_files_still_over says when). planner.py (the lead's), exporters/translations.py
# and rewrites/attention/index_masks.py were on it; all three are gone or within the limit now.
KNOWN_OVER: set[str] = set()


def sources() -> list[pathlib.Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_library_file_is_over_500_lines():
    lengths = {p.relative_to(PACKAGE).as_posix(): len(p.read_text().splitlines()) for p in sources()}
    over = {name: n for name, n in lengths.items() if n > MAX_LINES and name not in KNOWN_OVER}
    assert not over, f"split these by job into modules of at most {MAX_LINES} lines: {over}"


def test_known_over_list_names_only_files_still_over():
    lengths = {p.relative_to(PACKAGE).as_posix(): len(p.read_text().splitlines()) for p in sources()}
    done = sorted(name for name in KNOWN_OVER if lengths.get(name, 0) <= MAX_LINES)
    assert not done, f"these are {MAX_LINES} lines or fewer now: take them off KNOWN_OVER: {done}"


def test_every_source_compiles_without_warnings():
    # A compile-time SyntaxWarning (or, before Python 3.12, a DeprecationWarning for an invalid escape like
    # "\d") names the file, not a module, so pyproject's fxforge-module filters cannot turn it into an error.
    failed = {}
    for path in sources():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            try:
                compile(path.read_text(), str(path), "exec")
            except (SyntaxError, Warning) as problem:
                failed[path.relative_to(PACKAGE).as_posix()] = f"{type(problem).__name__}: {problem}"
    assert not failed, failed
