"""The one progress log of the benchmarks, and the one way an exception becomes a row's error text.

Every section writes its progress to stderr through :func:`log` (stdout carries the tables), so that a
run's output can be piped while its progress stays on the terminal.

Example:
    >>> error_text(ValueError("bad\\n  shape"), one_line=True)
    'ValueError: bad shape'
    >>> len(error_text(RuntimeError("x" * 50), limit=20))
    20
"""

from __future__ import annotations

import sys


def log(msg: str) -> None:
    """One progress line on stderr, flushed at once (a long run shows where it is)."""
    print(msg, file=sys.stderr, flush=True)


def error_text(exc: BaseException, limit: int = 2000, *, one_line: bool = False) -> str:
    """``"Type: message"`` of ``exc``, cut to ``limit`` characters (with an ellipsis); ``one_line`` folds
    every run of whitespace (newlines included) into one space."""
    text = f"{type(exc).__name__}: {exc}"
    text = " ".join(text.split()) if one_line else text.strip()
    return text if len(text) <= limit else text[: limit - 1] + "…"
