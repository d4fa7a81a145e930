"""Writing the command's files: each one whole or not at all, and none left behind when a later step fails.

Example:
    >>> import os, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> with Outputs() as outputs:
    ...     path = outputs.write_text(os.path.join(folder, "a.html"), "<p>hi</p>")
    >>> os.listdir(folder)
    ['a.html']
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from types import TracebackType
from typing import Any

from fxforge.core.files import atomic_write


class Outputs:
    """The files a command wrote; when the command fails (the ``with`` block raises) they are removed,
    so a failure leaves no output at all.

    Example:
        >>> import os, tempfile
        >>> folder = tempfile.mkdtemp()
        >>> try:
        ...     with Outputs() as outputs:
        ...         _ = outputs.write_text(os.path.join(folder, "a.svg"), "<svg/>")
        ...         raise RuntimeError("a later step failed")
        ... except RuntimeError:
        ...     pass
        >>> os.listdir(folder)
        []
    """

    def __init__(self) -> None:
        self.paths: list[str] = []

    def __enter__(self) -> Outputs:  # noqa: PYI034 - not meant to be subclassed
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        if kind is not None:
            for path in self.paths:
                with contextlib.suppress(OSError):
                    os.remove(path)

    def written(self, path: str) -> str:
        """Record a file written by someone else (``export_onnx``, ``save_native``); returns it."""
        self.paths.append(path)
        return path

    def write_text(self, path: str, text: str) -> str:
        """Write ``text`` to ``path`` atomically (UTF-8) and record it; returns the path."""

        def write(scratch: str) -> None:
            with open(scratch, "w", encoding="utf-8") as file:
                file.write(text)

        return self.written(atomic_write(path, write))

    def write_with(self, path: str, write: Callable[[str], Any]) -> str:
        """:func:`atomic_write` and record the file; returns the path."""
        return self.written(atomic_write(path, write))
