"""Running statistics that normalization layers update behind their version counters, and the counter that moves
with them.

In training mode BatchNorm's kernels write ``running_mean`` and ``running_var`` in place without bumping their
``_version`` (``native_batch_norm`` takes them as plain inputs), so a value derived from them (a BatchNorm folded
into a convolution) cannot see the update by their versions: ``model.train(); model(x); model.eval()`` outside the
optimized module left such a plan on the old statistics. Every update also counts ``num_batches_tracked`` up with
``add_(1)``, which does bump its version. :func:`note_statistics` records, for the statistics of each normalization
layer of a model, that counter; :func:`with_counters` adds it to the tensors a derived value is watched by
(:class:`fxforge.core.derived.SourceStates`).

Statistics written by ``F.batch_norm(..., training=True)`` on tensors of the caller's own, with no counter, are
not covered (nothing moves with them); a module of torch's keeps its counter.

Example:
    >>> bn = torch.nn.BatchNorm1d(2)
    >>> note_statistics(bn)
    >>> counter_of(bn.running_mean) is bn.num_batches_tracked, counter_of(bn.weight)
    (True, None)
    >>> before = bn.running_mean._version
    >>> with torch.no_grad():
    ...     _ = bn.train()(torch.randn(4, 2))
    >>> bn.running_mean._version == before, bn.num_batches_tracked._version > 0   # the counter moved
    (True, True)
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

_COUNTERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}  # id(statistic) -> (statistic, its counter)
_LOCK = threading.Lock()


def _forget(key: int) -> None:
    with _LOCK:
        _COUNTERS.pop(key, None)


def note_statistics(model: nn.Module) -> None:
    """Record the counter of each running statistic of ``model``'s normalization layers (those that track them).

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 1), torch.nn.BatchNorm2d(2, track_running_stats=False))
        >>> note_statistics(net); counter_of(net[0].weight) is None
        True
    """
    for module in model.modules():
        counter = getattr(module, "num_batches_tracked", None)
        if not isinstance(module, _NormBase) or not module.track_running_stats or not isinstance(counter, torch.Tensor):
            continue
        for statistic in (module.running_mean, module.running_var):
            if isinstance(statistic, torch.Tensor):
                key = id(statistic)
                with _LOCK:
                    _COUNTERS[key] = (weakref.ref(statistic, lambda _, key=key: _forget(key)), weakref.ref(counter))


def counter_of(tensor: torch.Tensor) -> torch.Tensor | None:
    """The counter that moves when ``tensor`` (a running statistic noted by :func:`note_statistics`) is updated,
    or None."""
    entry = _COUNTERS.get(id(tensor))
    if entry is None or entry[0]() is not tensor:
        return None
    return entry[1]()


def with_counters(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors``, then the counter of each running statistic among them (each tensor once).

    Example:
        >>> bn = torch.nn.BatchNorm1d(2); note_statistics(bn)
        >>> [t is bn.num_batches_tracked for t in with_counters([bn.weight, bn.running_mean, bn.running_var])]
        [False, False, False, True]
    """
    found = {id(t): t for t in tensors}
    for tensor in list(found.values()):
        counter = counter_of(tensor)
        if counter is not None:
            found.setdefault(id(counter), counter)
    return list(found.values())
