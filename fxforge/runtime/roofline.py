"""Measuring the machine's roofline: its peak FLOP/s and its memory bandwidth, on this device.

The roofline model itself (:class:`~fxforge.core.costs.Machine`: the ridge point ``peak / bandwidth``,
compute or memory bound, a node's estimated seconds) is the cost model of :mod:`fxforge.core.costs`;
:func:`measure_machine` measures its two figures instead of trusting a data sheet:

- peak: the best of a few timed square float32 matrix products (``torch.mm``), large enough to reach the
  BLAS library's (or cuBLAS's) steady state;
- bandwidth: the best of a few timed copies of a large tensor into another (``Tensor.copy_``), counting
  the bytes read plus the bytes written.

On this kind of two-core CPU the measurement takes a few tenths of a second. Its result is remembered per
device (torch build, CPU or GPU model, thread count: the key autotune uses) in
``$FXFORGE_CACHE_DIR/machine.json`` (default ``~/.cache/fxforge/machine.json``), so it runs once per machine,
and in memory, so it runs once per process. ``FXFORGE_MACHINE_CACHE=0`` keeps it off the disk (so does
``FXFORGE_AUTOTUNE_CACHE=0``, the switch the test suite sets, unless ``FXFORGE_MACHINE_CACHE=1``).

Example:
    >>> m = measure_machine("cpu")     # a core.costs.Machine, measured the first time, read back afterwards
    >>> m.peak_gflops > 0 and m.bandwidth_gbs > 0, m.bound(m.ridge / 2)
    (True, 'memory')
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import time
from typing import Any

import torch

from fxforge.core.costs import Machine
from fxforge.core.disk_cache import cache_dir, machine_key
from fxforge.core.files import atomic_write

FILE_NAME = "machine.json"
# The matrix product and the copy, per device type: (GEMM size, copy bytes). Chosen so that one
# repetition takes milliseconds on a laptop-class CPU and the whole measurement stays under a second.
SIZES = {"cpu": (768, 64 * 2**20), "cuda": (8192, 1024 * 2**20)}
REPEATS = 5


def cache_path() -> pathlib.Path:
    """``$FXFORGE_CACHE_DIR/machine.json``, or ``~/.cache/fxforge/machine.json``.

    Example:
        >>> cache_path().name
        'machine.json'
    """
    return cache_dir() / FILE_NAME


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(call: Any, device: torch.device, repeats: int) -> float:
    call()  # warm-up: allocation, library initialisation, caches
    _synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        _synchronize(device)
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def measure_peak_gflops(device: torch.device | str = "cpu", *, size: int | None = None,
                        dtype: torch.dtype = torch.float32, repeats: int = REPEATS) -> float:
    """The best rate of a ``size`` x ``size`` matrix product on ``device``, in GFLOP/s (2·n³ FLOPs each).

    Example:
        >>> measure_peak_gflops("cpu", size=64, repeats=1) > 0
        True
    """
    device = torch.device(device)
    n = size or SIZES.get(device.type, SIZES["cuda"])[0]
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    seconds = _best_seconds(lambda: torch.mm(a, b, out=out), device, repeats)
    return 2.0 * n**3 / seconds / 1e9


def measure_bandwidth_gbs(device: torch.device | str = "cpu", *, nbytes: int | None = None,
                          repeats: int = REPEATS) -> float:
    """The best rate of copying ``nbytes`` into another tensor on ``device``, in GB/s (read + written).

    Example:
        >>> measure_bandwidth_gbs("cpu", nbytes=2**20, repeats=1) > 0
        True
    """
    device = torch.device(device)
    size = nbytes or SIZES.get(device.type, SIZES["cuda"])[1]
    src = torch.ones(size // 4, device=device)
    dst = torch.empty_like(src)
    seconds = _best_seconds(lambda: dst.copy_(src), device, repeats)
    return 2.0 * src.numel() * src.element_size() / seconds / 1e9


def _device_name(device: torch.device) -> str:
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def _read(path: pathlib.Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(path: pathlib.Path, key: str, entry: dict[str, Any]) -> None:
    """Add one entry to the cache file (re-read first: other processes may have added theirs); written to a
    temporary name and renamed. A failure to write only costs the next process a measurement."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {**_read(path), key: entry}
        atomic_write(str(path), lambda tmp: pathlib.Path(tmp).write_text(json.dumps(data, indent=1), encoding="utf-8"))
    except OSError:
        return


# Machines measured or read in this process, by (cache file, key).
_KNOWN: dict[tuple[str, str], Machine] = {}


def disk_cache_enabled() -> bool:
    """Whether measurements are read from and written to :func:`cache_path` (see the module docstring).

    Example:
        >>> isinstance(disk_cache_enabled(), bool)
        True
    """
    explicit = os.environ.get("FXFORGE_MACHINE_CACHE")
    if explicit is not None:
        return explicit != "0"
    return os.environ.get("FXFORGE_AUTOTUNE_CACHE", "1") != "0"


def measure_machine(device: torch.device | str | None = None, *, dtype: torch.dtype = torch.float32,
                    refresh: bool = False, cache: bool = True) -> Machine:
    """The :class:`Machine` of ``device`` (default: CUDA when available, else CPU), measured once per machine.

    Args:
        device: the device to measure.
        dtype: the dtype of the matrix product that gives the peak.
        refresh: measure again even when a result is cached (and store the new one).
        cache: use the cache: in memory, and on disk unless :func:`disk_cache_enabled` says no (False:
            always measure, store nothing).

    Example:
        >>> m = measure_machine("cpu")     # measured the first time on a machine, read back afterwards
        >>> m.device, m.peak_gflops > 0, m.bound(m.ridge * 2)
        ('cpu', True, 'compute')
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    name = _device_name(device)
    key = f"{machine_key(device)} {name} {str(dtype).replace('torch.', '')}"
    disk = disk_cache_enabled()
    path = cache_path()
    memo = (str(path) if disk else "<memory>", key)
    if cache and not refresh:
        if memo in _KNOWN:
            return _KNOWN[memo]
        entry = _read(path).get(key) if disk else None
        if isinstance(entry, dict):
            try:
                machine = Machine(name, float(entry["peak_gflops"]), float(entry["bandwidth_gbs"]),
                                  str(entry["measured_at"]), str(entry.get("dtype", "float32")))
            except (KeyError, TypeError, ValueError):
                machine = None
            if machine is not None:
                _KNOWN[memo] = machine
                return machine
    # Real tensors, whatever mode the caller is in: measured under a FakeTensorMode (a trace that asks for
    # costs) the products are not computed and the "machine" came out ten times faster than it is.
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        peak = measure_peak_gflops(device, dtype=dtype)
        bandwidth = measure_bandwidth_gbs(device)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    machine = Machine(name, round(peak, 3), round(bandwidth, 3), now, str(dtype).replace("torch.", ""))
    if cache:
        if disk:
            entry = dataclasses.asdict(machine)
            del entry["device"]
            _write(path, key, entry)
        _KNOWN[memo] = machine
    return machine
