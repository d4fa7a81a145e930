"""The targets: one module each, behind one protocol (:class:`~fxforge.targets.base.Target`), listed once in
:data:`TARGETS`.

A new target is one module with one :class:`~fxforge.targets.base.Target` and one line below; the API, the
CLI (its ``--target`` choices, which suffix ``-o`` takes), checkpointed training and ``target="auto"``'s race
read it from here.

Example:
    >>> list(TARGETS)
    ['native', 'onnxruntime', 'inductor', 'auto']
    >>> lookup("tvm")
    Traceback (most recent call last):
    ...
    ValueError: unknown target 'tvm'; available targets: native, onnxruntime, inductor, auto
"""

from __future__ import annotations

from fxforge.targets.auto import AutoTarget
from fxforge.targets.base import COMMON_OPTIONS, Contract, Target
from fxforge.targets.inductor import INDUCTOR
from fxforge.targets.native import NATIVE
from fxforge.targets.onnxruntime import ONNXRUNTIME

# Every target, by name, in the order auto builds the raced ones (native first: its graph's size gives
# Inductor's compile estimate).
TARGETS: dict[str, Target] = {}
for _target in (NATIVE, ONNXRUNTIME, INDUCTOR, AutoTarget(TARGETS)):
    TARGETS[_target.name] = _target


def lookup(name: str) -> Target:
    """The target called ``name``.

    Raises:
        ValueError: no target has that name.
    """
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; available targets: {', '.join(TARGETS)}")
    return TARGETS[name]


def by_artifact(suffix: str) -> Target | None:
    """The target that writes files ending in ``suffix`` (``".pt2"``, ``".onnx"``), or None.

    Example:
        >>> by_artifact(".onnx").name, by_artifact(".svg")
        ('onnxruntime', None)
    """
    return next((t for t in TARGETS.values() if t.contract.artifact == suffix.lower()), None)


__all__ = ["COMMON_OPTIONS", "TARGETS", "Contract", "Target", "by_artifact", "lookup"]
