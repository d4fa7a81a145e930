"""The targets ``target="auto"`` chose, remembered on disk (``$FXFORGE_CACHE_DIR/targets.json``).

A choice depends on the model's structure (its module tree and its parameters' shapes and dtypes, not
their values), the input signature, the options of the race (which targets, which rewrites), the machine
(device, CPU or GPU model, thread count: :func:`~fxforge.core.disk_cache.machine_key`) and the libraries'
versions (torch, onnxruntime, onnx, fxforge): :func:`choice_key` hashes exactly those. An entry holds the
winner, every contender's median latency and eager's, measured in the same interleaved rounds, and the
machine's load while they were timed. ``FXFORGE_TARGET_CACHE=0`` turns the cache off.

The same file remembers how long Inductor took to compile per graph node on this machine
(:func:`compile_rate`), which is how the race's time budget estimates a compile before starting it.

Example:
    >>> import torch
    >>> key = choice_key(torch.nn.Linear(2, 2), (torch.ones(1, 2),), {}, "targets native")
    >>> key == choice_key(torch.nn.Linear(2, 2), (torch.zeros(1, 2),), {}, "targets native")  # values don't count
    True
    >>> key == choice_key(torch.nn.Linear(2, 3), (torch.ones(1, 2),), {}, "targets native")
    False
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import sys
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fxforge.core.disk_cache import BUSY_LOAD, TuningCache, machine_key, machine_load, open_cache

FILENAME = "targets.json"
# Seconds Inductor takes per graph node on CPU where this machine never compiled one yet (measured on the
# 2-core machines this project runs on: BERT's 4-layer graph took about 0.1 s per node).
DEFAULT_COMPILE_S_PER_NODE = {"cpu": 0.1, "cuda": 0.1}


def target_cache() -> TuningCache | None:
    """The on-disk cache of chosen targets; None when ``FXFORGE_TARGET_CACHE=0``.

    Example:
        >>> cache = target_cache()
        >>> cache is None or cache.path.name == "targets.json"
        True
    """
    return None if os.environ.get("FXFORGE_TARGET_CACHE", "1") == "0" else open_cache(FILENAME)


@functools.cache  # installed versions do not change while the process runs
def library_versions() -> str:
    """The versions a choice depends on: Python, torch, onnxruntime, onnx and fxforge.

    Example:
        >>> "torch " + torch.__version__ in library_versions()
        True
    """
    parts = [f"python {sys.version_info.major}.{sys.version_info.minor}", f"torch {torch.__version__}"]
    for package in ("onnxruntime", "onnx", "fxforge"):
        try:
            parts.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            parts.append(f"{package} none")
    return ", ".join(parts)


def device_of(args: tuple, kwargs: dict, model: torch.nn.Module | None = None) -> torch.device:
    """The device of the first tensor input (else of the model's first parameter, else the CPU).

    Example:
        >>> device_of((torch.ones(1),), {}).type
        'cpu'
    """
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    for tensor in (model.parameters() if model is not None else ()):
        return tensor.device
    return torch.device("cpu")


def _signature(value: Any) -> str:
    leaves, spec = pytree.tree_flatten(value)
    described = [(tuple(v.shape), str(v.dtype), str(v.device)) if isinstance(v, torch.Tensor) else repr(v)
                 for v in leaves]
    return f"{spec} {described}"


def choice_key(model: torch.nn.Module, args: tuple, kwargs: dict, options: str) -> str:
    """The key of a choice: the machine, the libraries, and a digest of the model's structure, the input
    signature, the model's mode and ``options`` (the race's settings as text).

    Example:
        >>> choice_key(torch.nn.ReLU(), (torch.ones(2),), {}, "").startswith(machine_key(torch.device("cpu")))
        True
    """
    state = [(name, tuple(t.shape), str(t.dtype), t.requires_grad)
             for name, t in [*model.named_parameters(), *model.named_buffers()]]
    described = "\n".join([type(model).__qualname__, repr(model), repr(state), _signature((args, kwargs)),
                           f"training {model.training}", options])
    digest = hashlib.sha256(described.encode()).hexdigest()
    return f"{machine_key(device_of(args, kwargs, model))} | {library_versions()} | target {digest}"


def compile_rate(device: torch.device) -> tuple[float, bool]:
    """Seconds per graph node Inductor took on this machine, and whether that was measured here (else the
    default for the device type).

    Example:
        >>> rate, measured = compile_rate(torch.device("cpu"))
        >>> rate > 0
        True
    """
    cache = target_cache()
    stored = cache.get(_rate_key(device)) if cache else None
    if stored is not None:
        return float(stored), True
    return DEFAULT_COMPILE_S_PER_NODE.get(device.type, 0.1), False


def remember_compile_rate(device: torch.device, seconds: float, nodes: int) -> None:
    """Record a compile's seconds per node: the latest compile made while the machine was not busy (a
    compile slowed by other work would make the budget skip Inductor from then on).

    Example:
        >>> remember_compile_rate(torch.device("cpu"), 0.0, 0)   # nothing to learn from an empty graph
    """
    cache = target_cache()
    if cache is None or nodes <= 0 or machine_load() > BUSY_LOAD:
        return
    cache.put(_rate_key(device), seconds / nodes)
    cache.save()


def _rate_key(device: torch.device) -> str:
    return f"{machine_key(device)} | {library_versions()} | inductor s per node"
