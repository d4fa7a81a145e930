"""Progress of long steps on the Python API (``target="auto"``'s race: builds, checks, timings).

Each step is logged on the ``"fxforge"`` logger at INFO when it starts, and again with its seconds when it
took longer than :data:`SLOW_S` or failed (``logging.basicConfig(level=logging.INFO)`` shows them). On a terminal
(standard error is a TTY) a ``rich`` status line shows the running step too, and is gone when it ends; off
a terminal (a test, a pipe, a notebook's captured stream) only the log records are written, which no one
sees unless logging is configured: the steps are quiet unless asked. ``FXFORGE_PROGRESS=0`` turns the status
line off, ``=1`` forces it.

Example:
    >>> import logging
    >>> with step("timing native against eager"):
    ...     pass
    >>> LOGGER.name
    'fxforge'
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator

LOGGER = logging.getLogger("fxforge")
# A step that took longer than this many seconds is logged again when it ends, with its seconds.
SLOW_S = 2.0


def status_line() -> bool:
    """Whether a step shows a live status line: ``FXFORGE_PROGRESS`` if set (``0``/``1``), else whether
    standard error is a terminal.

    Example:
        >>> import os; os.environ["FXFORGE_PROGRESS"] = "0"
        >>> status_line()
        False
        >>> del os.environ["FXFORGE_PROGRESS"]
    """
    forced = os.environ.get("FXFORGE_PROGRESS")
    if forced in ("0", "1"):
        return forced == "1"
    stream = sys.stderr
    return bool(getattr(stream, "isatty", None) and stream.isatty())


@contextlib.contextmanager
def step(message: str) -> Iterator[None]:
    """Run a block as one step of progress: logged when it starts (``"fxforge: <message>"``), and with its
    seconds when it ends after more than :data:`SLOW_S`; shown as a ``rich`` status line on a terminal.

    Example:
        >>> with step("building native"):
        ...     x = 1 + 1
    """
    LOGGER.info("%s ...", message)
    began = time.perf_counter()
    status = contextlib.nullcontext()
    if status_line():
        from rich.console import Console

        forced = os.environ.get("FXFORGE_PROGRESS") == "1" or None
        status = Console(stderr=True, force_terminal=forced).status(f"fxforge: {message}")
    try:
        with status:
            yield
    except BaseException:
        LOGGER.info("%s: failed after %.1f s", message, time.perf_counter() - began)
        raise
    seconds = time.perf_counter() - began
    if seconds > SLOW_S:
        LOGGER.info("%s: done in %.1f s", message, seconds)
