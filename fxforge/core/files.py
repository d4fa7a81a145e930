"""Writing files whole or not at all: a temporary file beside the target, renamed into place when complete.

Example:
    >>> import os, tempfile
    >>> target = os.path.join(tempfile.mkdtemp(), "x.txt")
    >>> _ = atomic_write(target, lambda p: open(p, "w").write("ok"))
    >>> sorted(os.listdir(os.path.dirname(target)))
    ['x.txt']
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str, write: Callable[[str], Any]) -> str:
    """Call ``write(temporary_path)`` for a temporary file beside ``path``, then rename it to ``path``.

    If ``write`` raises, the temporary file is removed and ``path`` is left as it was.

    Example:
        >>> import os, tempfile
        >>> target = os.path.join(tempfile.mkdtemp(), "x.txt")
        >>> atomic_write(target, lambda p: open(p, "w").write("ok")) == target, open(target).read()
        (True, 'ok')
    """
    folder = os.path.dirname(os.path.abspath(path))
    suffix = os.path.splitext(path)[1]
    handle, scratch = tempfile.mkstemp(prefix=".fxforge-", suffix=suffix, dir=folder)
    os.close(handle)
    try:
        write(scratch)
        os.chmod(scratch, 0o666 & ~_umask())  # mkstemp makes 0600 files; give the usual permissions
        os.replace(scratch, path)
    finally:
        with contextlib.suppress(OSError):
            os.remove(scratch)
    return path
