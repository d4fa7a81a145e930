"""The ways to spread a training step over ``devices``: every mesh ``dp x fsdp x tp x pp`` whose product is
the device count, with the limits the model sets (the tensor-parallel degree must divide its heads; a
pipeline needs as many places to split as stages).

The axes, from the outermost (slowest link) to the innermost (fastest), as they are laid on a cluster:

- ``pp``: pipeline stages (:func:`fxforge.partition`), each a slice of the layers;
- ``dp``: replicas on different parts of the batch, gradients all-reduced (DDP);
- ``fsdp``: replicas on different parts of the batch whose parameters, gradients and optimizer state are
  sharded (FSDP2's ``fully_shard``): parameters all-gathered per block for the forward and the backward,
  gradients reduce-scattered;
- ``tp``: one layer's matrices split across devices (``parallelize_module``), activations all-reduced or
  all-gathered inside every block: the innermost axis, so its collectives stay on the fastest link.

Example:
    >>> [name(m) for m in meshes(4, tp_degrees=(1, 2, 4), pipeline=False)]
    ['dp4', 'fsdp4', 'tp4', 'dp2 x fsdp2', 'dp2 x tp2', 'fsdp2 x tp2']
    >>> name({"dp": 1, "fsdp": 1, "tp": 1, "pp": 1})
    'single'
"""

from __future__ import annotations

from collections.abc import Iterable

AXES = ("pp", "dp", "fsdp", "tp")
"""Mesh axes from the outermost to the innermost."""


def full(mesh: dict[str, int]) -> dict[str, int]:
    """``mesh`` with every axis present (1 where absent), in :data:`AXES` order.

    Example:
        >>> full({"tp": 2})
        {'pp': 1, 'dp': 1, 'fsdp': 1, 'tp': 2}

    Raises:
        ValueError: an unknown axis or a size below 1.
    """
    unknown = sorted(set(mesh) - set(AXES))
    if unknown:
        raise ValueError(f"unknown mesh axis {unknown[0]!r}: the axes are {', '.join(AXES)}")
    for axis, size in mesh.items():
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"mesh axis {axis!r} must be a positive integer, not {size!r}")
    return {axis: int(mesh.get(axis, 1)) for axis in AXES}


def devices_of(mesh: dict[str, int]) -> int:
    """How many devices ``mesh`` spans.

    Example:
        >>> devices_of({"dp": 2, "tp": 4})
        8
    """
    total = 1
    for size in mesh.values():
        total *= size
    return total


def name(mesh: dict[str, int]) -> str:
    """A short name: the axes above 1, outermost first (``"dp2 x tp2"``), or ``"single"``.

    Example:
        >>> name({"tp": 2, "pp": 2})
        'pp2 x tp2'
    """
    parts = [f"{axis}{mesh[axis]}" for axis in AXES if mesh.get(axis, 1) > 1]
    return " x ".join(parts) or "single"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(devices: int, *, tp_degrees: Iterable[int] = (1,), pipeline: bool = True,
           max_stages: int | None = None) -> list[dict[str, int]]:
    """Every mesh over exactly ``devices`` devices, fewest axes first.

    Args:
        devices: the device count.
        tp_degrees: the tensor-parallel degrees the model allows (its head counts divide them).
        pipeline: whether pipeline stages are offered (``max_stages`` caps them: the places to split + 1).

    A mesh with both ``dp`` and ``fsdp`` above 1 is the hybrid (HSDP) layout: shards inside a group,
    replicas across. Each mesh is a dict over :data:`AXES`.

    Example:
        >>> [name(m) for m in meshes(2, tp_degrees=(1, 2))]
        ['pp2', 'dp2', 'fsdp2', 'tp2']
    """
    if devices < 1:
        raise ValueError(f"devices must be at least 1, not {devices}")
    allowed_tp = set(tp_degrees) | {1}
    found = []
    for pp in _divisors(devices):
        if pp > 1 and (not pipeline or (max_stages is not None and pp > max_stages)):
            continue
        for tp in _divisors(devices // pp):
            if tp not in allowed_tp:
                continue
            rest = devices // pp // tp
            for dp in _divisors(rest):
                found.append({"pp": pp, "dp": dp, "fsdp": rest // dp, "tp": tp})
    order = {axis: i for i, axis in enumerate(AXES)}
    return sorted(found, key=lambda m: (sum(v > 1 for v in m.values()),
                                        [-m[a] for a in sorted(AXES, key=order.get)]))
