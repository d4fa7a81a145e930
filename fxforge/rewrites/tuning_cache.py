"""Autotune measurements remembered on disk, per machine, so optimizing the same shapes again is quick.

Autotune times every fused op's kernels and then the whole graph; on two CPU cores that is most of the
time ``fxforge.optimize`` takes. The results only depend on the op (or graph), its shapes and strides,
the torch build and the machine, so they are stored under a key made of exactly those, in one JSON file:
``$FXFORGE_CACHE_DIR/autotune.json`` (default ``~/.cache/fxforge``). A result read back is reported as
such ("measured earlier on this machine"). A whole-graph timing is only stored when one graph was clearly
faster (by more than ``autotune.DECISIVE``); a close call, or one a busy machine blurred, is measured again
next time. ``FXFORGE_AUTOTUNE_CACHE=0`` turns the cache off.

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
from typing import Any

import torch

from fxforge.files import atomic_write

VERSION = 1
NOTE = "measured earlier on this machine (autotune cache)"


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

    def _entries(self) -> dict[str, Any]:
        if self._data is None:
            try:
                self._data = json.loads(self.path.read_text(encoding="utf-8"))
            except (OSError, ValueError):  # missing or unreadable: start afresh
                self._data = {}
        return self._data

    def get(self, key: str) -> Any:
        """The stored measurement, or None."""
        return self._entries().get(key)

    def put(self, key: str, value: Any) -> None:
        """Store a measurement (written by :meth:`save`)."""
        self._entries()[key] = value
        self._new[key] = value

    def save(self) -> None:
        """Add what was measured to the file (entries other processes wrote meanwhile are kept); a
        failure to write only costs the next run its time."""
        if not self._new:
            return
        self._data = None  # re-read: another process may have added entries
        merged = {**self._entries(), **self._new}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(str(self.path), lambda tmp: pathlib.Path(tmp).write_text(json.dumps(merged), encoding="utf-8"))
        except OSError:
            return
        self._data, self._new = merged, {}


_OPEN: dict[pathlib.Path, TuningCache] = {}


def cache_dir() -> pathlib.Path:
    """Where fxforge keeps what it measured on this machine: ``$FXFORGE_CACHE_DIR``, or ``~/.cache/fxforge``.

    Example:
        >>> cache_dir().is_absolute() or "FXFORGE_CACHE_DIR" in os.environ
        True
    """
    return pathlib.Path(os.environ.get("FXFORGE_CACHE_DIR") or pathlib.Path.home() / ".cache" / "fxforge")


def default_cache() -> TuningCache | None:
    """The cache autotune uses: per ``$FXFORGE_CACHE_DIR`` (default ``~/.cache/fxforge``); None when
    ``FXFORGE_AUTOTUNE_CACHE=0``.

    Example:
        >>> cache = default_cache()
        >>> cache is None or cache.path.name == "autotune.json"
        True
    """
    if os.environ.get("FXFORGE_AUTOTUNE_CACHE", "1") == "0":
        return None
    path = cache_dir() / "autotune.json"
    if path not in _OPEN:
        _OPEN[path] = TuningCache(path)
    return _OPEN[path]
