"""Python's cyclic garbage collector paused while a plan is built.

Building a plan allocates hundreds of thousands of short-lived objects (fx nodes, fake tensors, recipes),
which triggers full collections of every object the process holds: on ResNet-50 about 0.1 s of a 1.5 s
optimize went to one such collection. Nothing built then is garbage until the build ends, so collection
waits for it (as compilers written in Python commonly do). Builds in several threads share one pause: the
collector is enabled again when the last of them ends, if it was enabled before the first began.

Example:
    >>> import gc
    >>> with no_collection():
    ...     gc.isenabled()
    False
    >>> gc.isenabled()
    True
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_LOCK = threading.Lock()
_STATE = {"depth": 0, "was_enabled": False}


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """Run the block with the cyclic garbage collector paused (see the module docstring)."""
    with _LOCK:
        if _STATE["depth"] == 0:
            _STATE["was_enabled"] = gc.isenabled()
            gc.disable()
        _STATE["depth"] += 1
    try:
        yield
    finally:
        with _LOCK:
            _STATE["depth"] -= 1
            if _STATE["depth"] == 0 and _STATE["was_enabled"]:
                gc.enable()
