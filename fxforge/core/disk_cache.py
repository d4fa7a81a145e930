"""Measurements remembered on disk, per machine: JSON files under ``$FXFORGE_CACHE_DIR`` (``~/.cache/fxforge``).

Autotune's timings (``autotune.json``, :mod:`fxforge.lowering.autotune`) and the roofline's machine figures
(:mod:`fxforge.runtime.roofline`) only depend on what was measured, its shapes, the torch build and the
machine, so they are stored under keys made of exactly those (:func:`machine_key`), each file read once
and written atomically, entries other processes wrote meanwhile kept.

Example:
    >>> import tempfile, pathlib
    >>> cache = TuningCache(pathlib.Path(tempfile.mkdtemp()) / "autotune.json")
    >>> cache.put("conv 1x3x8x8", {"composite": 0.2, "mkldnn": 0.1}); cache.save()
    >>> TuningCache(cache.path).get("conv 1x3x8x8")
    {'composite': 0.2, 'mkldnn': 0.1}
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import threading
from typing import Any

import torch

from fxforge.core.files import atomic_write

# 2: timings carry the machine's load when measured, and busy or inconsistent ones are no longer stored
# (version 1's entries may hold timings measured on a busy machine, trusted from then on).
VERSION = 2
# Other work per core (load average beyond this process's own threads) above which the machine is busy:
# timings measured then are used but not remembered.
BUSY_LOAD = 0.5


def machine_key(device: torch.device) -> str:
    """What a timing depends on besides the op: torch build, CPU (or GPU) model, thread count.

    Example:
        >>> machine_key(torch.device("cpu")).startswith(f"v{VERSION} torch {torch.__version__}")
        True
    """
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = cpu_model()
    return f"v{VERSION} torch {torch.__version__} {platform.machine()} {name} threads {torch.get_num_threads()}"


def machine_load() -> float:
    """Other work per core: the one-minute load average less this process's own compute threads
    (``torch.get_num_threads()``), per core (0 where the system does not say). Above :data:`BUSY_LOAD`,
    other work competed for the cores while something was timed.

    Example:
        >>> machine_load() >= 0
        True
    """
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        return 0.0
    return max(0.0, load - torch.get_num_threads()) / (os.cpu_count() or 1)


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows.

    Example:
        >>> isinstance(cpu_model(), str)
        True
    """
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


class TuningCache:
    """A JSON file of ``key -> measurement``, read once, written atomically (a temporary file renamed).

    Attributes:
        path: the file.
    """

    def __init__(self, path: pathlib.Path):
        self.path = pathlib.Path(path)
        self._data: dict[str, Any] | None = None
        self._new: dict[str, Any] = {}
        self._lock = threading.Lock()  # one cache object serves every thread that optimizes

    def _entries(self) -> dict[str, Any]:
        if self._data is None:
            try:
                self._data = json.loads(self.path.read_text(encoding="utf-8"))
            except (OSError, ValueError):  # missing or unreadable: start afresh
                self._data = {}
        return self._data

    def get(self, key: str) -> Any:
        """The stored measurement, or None."""
        with self._lock:
            return self._entries().get(key)

    def put(self, key: str, value: Any) -> None:
        """Store a measurement (written by :meth:`save`)."""
        with self._lock:
            self._entries()[key] = value
            self._new[key] = value

    def save(self) -> None:
        """Add what was measured to the file (entries other processes wrote meanwhile are kept); a
        failure to write only costs the next run its time."""
        with self._lock:
            if not self._new:
                return
            self._data = None  # re-read: another process may have added entries
            merged = {**self._entries(), **self._new}
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(str(self.path),
                             lambda tmp: pathlib.Path(tmp).write_text(json.dumps(merged), encoding="utf-8"))
            except OSError:
                return
            self._data, self._new = merged, {}


def cache_dir() -> pathlib.Path:
    """Where fxforge keeps what it measured on this machine: ``$FXFORGE_CACHE_DIR``, or ``~/.cache/fxforge``.

    Example:
        >>> cache_dir().is_absolute() or "FXFORGE_CACHE_DIR" in os.environ
        True
    """
    return pathlib.Path(os.environ.get("FXFORGE_CACHE_DIR") or pathlib.Path.home() / ".cache" / "fxforge")


# path -> its open cache: every optimize in the process shares one object per file (configuration-like
# state: which file is open; what it holds is on disk, keyed by what was measured).
_OPEN: dict[pathlib.Path, TuningCache] = {}
_OPEN_LOCK = threading.Lock()


def open_cache(filename: str) -> TuningCache:
    """The cache stored in ``cache_dir() / filename``, one object per file in the process.

    Example:
        >>> open_cache("autotune.json") is open_cache("autotune.json")
        True
    """
    path = cache_dir() / filename
    with _OPEN_LOCK:
        if path not in _OPEN:
            _OPEN[path] = TuningCache(path)
        return _OPEN[path]
