"""Values a plan computed from the model's tensors (folded and prepacked weights, buffers read as constants),
kept in step with them.

Folding BatchNorm into a convolution (:mod:`fxforge.rewrites.folding`) and prepacking a weight for oneDNN
(:mod:`fxforge.lowering.lower`) make new tensors from the model's own. Each is a :class:`Derived`: where
it lives, the tensors it is computed from, and how to compute it again. :class:`DerivedValues` checks the
sources on every call (:class:`SourceStates`) and recomputes what depends on a source that changed:

- its version (any in-place change PyTorch records: ``p.mul_(2)`` under ``no_grad``, ``copy_``,
  ``load_state_dict``);
- for a buffer, its storage (``b.data = ...``);
- an access to its ``.data`` (:func:`watch_data`: reading it, or setting it as ``p.data = ...``,
  ``vector_to_parameters`` and ``.to()`` do) followed by a change of its bits (a checksum): ``p.data.mul_(2)``,
  ``bn.running_mean.data.add_(1)`` and ``.data``-style EMA updates bypass the version counter (``t.data`` is
  a new tensor with a version counter of its own).

A rewrite that reads a buffer's values as constants (the attention rewrite proving a mask causal) cannot be
computed again: it notes the buffer (:func:`read_as_constants`), and the model's watch rebuilds every plan when
one changes (:class:`fxforge.runtime.guards.ModelWatch`).

Example:
    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> doubled = w.detach() * 2
    >>> values = DerivedValues([Derived(doubled, (w,), lambda: w.detach() * 2)])
    >>> with torch.no_grad():
    ...     _ = w.data.mul_(3)          # invisible to w's version counter
    >>> values.refresh_if_stale(), doubled.tolist()
    (True, [6.0, 6.0])
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from fxforge.core.statistics import with_counters
from fxforge.core.tensor_cache import version

_VERSION = operator.attrgetter("_version")


@dataclasses.dataclass
class Derived:
    """One tensor computed from the model's tensors.

    Attributes:
        tensor: the derived tensor as the plan holds it; recomputed values are copied into it (so every
            graph that shares it sees them) unless ``replace`` is given.
        sources: the tensors it is computed from.
        compute: computes it again from the sources as they are now.
        replace: for a value that cannot be updated in place (an opaque prepacked weight):
            ``replace(new_tensor)`` puts the new one where the plan reads it.
    """

    tensor: torch.Tensor
    sources: tuple[torch.Tensor, ...]
    compute: Callable[[], torch.Tensor]
    replace: Callable[[torch.Tensor], None] | None = None

    def recompute(self) -> None:
        """Compute the value again and put it where the plan reads it."""
        value = self.compute()
        if self.replace is not None:
            self.replace(value)
            self.tensor = value
        else:
            with torch.no_grad():
                self.tensor.copy_(value)


class SourceStates:
    """The state of some tensors (versions, storages, ``.data`` accesses and then checksums), to see on every
    call, at the cost of a comparison of two short lists, whether one changed (see the module docstring).

    Example:
        >>> mask = torch.ones(3, dtype=torch.bool)
        >>> states = SourceStates([mask]); states.changed()
        False
        >>> _ = mask.data.fill_(False); states.changed(), states.changed()   # seen once, then recorded
        (True, False)
    """

    def __init__(self, tensors: Iterable[torch.Tensor], record: bool = True):
        # (a running statistic with the counter that moves when a kernel updates it behind its version)
        self.tensors = with_counters(tensors)
        if record:
            self.record()

    def record(self) -> None:
        """Take the tensors' state as it is now."""
        self._versions = [version(t) for t in self.tensors]
        # A parameter's storage is swapped through its .data setter (p.data = ..., vector_to_parameters,
        # .to()), which is watched; a buffer's only by its pointer.
        self._buffers = [t for t in self.tensors if not isinstance(t, nn.Parameter)]
        self._pointers = [t.data_ptr() for t in self._buffers]
        watch_data(self.tensors)
        self._touches = DATA_TOUCHES.generation
        self._checksums = {id(t): checksum(t) for t in self.tensors}

    def changed(self) -> bool:
        """Whether a tensor changed since the state was taken; a change seen is recorded (the next call sees
        none). Runs on every call of a plan: it compares whole lists (one pass each over a few hundred tensors)."""
        if self._stale():
            self.record()
            return True
        return False

    def _stale(self) -> bool:
        try:
            versions = list(map(_VERSION, self.tensors))
        except RuntimeError:  # an inference tensor (no version counter) among them
            versions = [version(t) for t in self.tensors]
        if versions != self._versions or list(map(torch.Tensor.data_ptr, self._buffers)) != self._pointers:
            return True
        if DATA_TOUCHES.generation != self._touches:
            self._touches = DATA_TOUCHES.generation
            return any(checksum(t) != self._checksums[id(t)] for t in self.tensors if DATA_TOUCHES.was_touched(t))
        return False


class DerivedValues:
    """A plan's derived values, in the order they depend on each other, and the state of their sources.

    Example:
        >>> DerivedValues([]).refresh_if_stale()
        False
    """

    def __init__(self, items: Sequence[Derived]):
        self.items = list(items)
        # Concurrent calls: one checks and recomputes while the others wait, so none runs on values half
        # recomputed, or on old ones after the first has taken note of a change.
        self._lock = threading.RLock()
        self._sources = SourceStates((t for item in self.items for t in item.sources), record=False)
        self._record()

    def _record(self) -> None:
        self._sources.record()

    def __len__(self) -> int:
        return len(self.items)

    def stale(self) -> bool:
        """Whether a source changed since the values were computed (see the module docstring)."""
        return self._sources._stale()

    def refresh(self) -> None:
        """Recompute every derived value (in order) and record the sources' state."""
        with self._lock:
            for item in self.items:
                item.recompute()
            self._record()

    def refresh_if_stale(self) -> bool:
        """Recompute the values if a source changed; whether they were recomputed."""
        if not self.items:
            return False
        with self._lock:
            if self.stale():
                self.refresh()
                return True
        return False


def checksum(tensor: torch.Tensor) -> int:
    """A checksum of a tensor's bits: its elements read as integers of their width, summed chunk by chunk
    (a million at a time: no full-size copy) with every other element counted twice. Equal contents give
    equal checksums; a real edit (a scale, an update of every element, one element set) changes it.

    Example:
        >>> t = torch.ones(4); before = checksum(t); t[1] = 2.0; checksum(t) != before
        True
    """
    data = tensor.detach().contiguous().view(-1)
    ints = data.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[data.element_size()])
    total = 0
    for chunk in ints.split(1 << 20):
        total = (total * 1_000_003 + int(chunk.sum(dtype=torch.int64)) + int(chunk[::2].sum(dtype=torch.int64)))
        total %= 1 << 61
    return total


# ---------------------------------------------------------------------------------------------- .data


class _DataTouches:
    """Watched tensors (by identity, held weakly) whose ``.data`` was read or set, and a generation that
    moves on each such touch. (Tensors compare element by element, so they are kept by ``id``.)"""

    def __init__(self) -> None:
        self._watched: dict[int, weakref.ref] = {}
        self._counts: dict[int, int] = {}  # id -> touches so far (a touched tensor has a count)
        self.generation = 0

    def watch(self, tensor: torch.Tensor) -> None:
        key = id(tensor)
        entry = self._watched.get(key)
        if entry is None or entry() is not tensor:
            self._watched[key] = weakref.ref(tensor, lambda _, key=key: self._forget(key))

    def _forget(self, key: int) -> None:
        self._watched.pop(key, None)
        self._counts.pop(key, None)

    def watching(self, tensor: torch.Tensor) -> bool:
        entry = self._watched.get(id(tensor))
        return entry is not None and entry() is tensor

    def was_touched(self, tensor: torch.Tensor) -> bool:
        return self.touches(tensor) > 0

    def touch(self, tensor: torch.Tensor) -> None:
        if self.watching(tensor):
            self._counts[id(tensor)] = self._counts.get(id(tensor), 0) + 1
            self.generation += 1

    def touches(self, tensor: torch.Tensor) -> int:
        """How many times ``tensor``'s ``.data`` was touched: with its version, the key of a value made from
        it (a prepacked weight), since a ``.data`` edit leaves the version as it was."""
        return self._counts.get(id(tensor), 0) if self.watching(tensor) else 0


DATA_TOUCHES = _DataTouches()
_BASE_DATA = torch._C.TensorBase.data


def _get_data(self: torch.Tensor) -> torch.Tensor:
    DATA_TOUCHES.touch(self)
    return _BASE_DATA.__get__(self)


def _set_data(self: torch.Tensor, value: torch.Tensor) -> None:
    DATA_TOUCHES.touch(self)
    _BASE_DATA.__set__(self, value)


@functools.cache
def watch_parameter_data() -> None:
    """Wrap ``nn.Parameter.data`` once per process so that reading or setting it on a watched parameter is
    noted (plain tensors, and parameters nobody watches, behave exactly as before: the wrapper calls
    torch's own getter and setter).

    Example:
        >>> watch_parameter_data(); p = torch.nn.Parameter(torch.ones(1)); DATA_TOUCHES.watch(p)
        >>> _ = p.data; DATA_TOUCHES.was_touched(p)
        True
    """
    nn.Parameter.data = property(_get_data, _set_data, doc=_BASE_DATA.__doc__)


@functools.cache
def watch_tensor_data() -> None:
    """Wrap ``torch.Tensor.data`` once per process (the first time a plan holds a value made from a buffer, or
    reads one as a constant) so that reading or setting it on a watched buffer is noted as on a parameter
    (``bn.running_mean.data.add_(1)``); unwatched tensors behave exactly as before.

    Example:
        >>> watch_tensor_data(); mask = torch.ones(2); DATA_TOUCHES.watch(mask)
        >>> _ = mask.data; DATA_TOUCHES.was_touched(mask)
        True
    """
    torch.Tensor.data = property(_get_data, _set_data, doc=_BASE_DATA.__doc__)


def watch_data(tensors: Iterable[torch.Tensor]) -> None:
    """Note ``.data`` accesses on these tensors (parameters and buffers alike).

    Example:
        >>> p = torch.nn.Parameter(torch.ones(1)); watch_data([p]); DATA_TOUCHES.watching(p)
        True
    """
    watch_parameter_data()
    for tensor in tensors:
        if not isinstance(tensor, nn.Parameter):
            watch_tensor_data()
        DATA_TOUCHES.watch(tensor)


# ---------------------------------------------------------------------------------- constants read


class _ConstantReads:
    """Tensors a rewrite read as constants (by identity, held weakly)."""

    def __init__(self) -> None:
        self._read: dict[int, weakref.ref] = {}

    def add(self, tensor: torch.Tensor) -> None:
        key = id(tensor)
        self._read[key] = weakref.ref(tensor, lambda _, key=key: self._read.pop(key, None))

    def holds(self, tensor: torch.Tensor) -> bool:
        entry = self._read.get(id(tensor))
        return entry is not None and entry() is tensor


CONSTANT_READS = _ConstantReads()


def read_as_constants(tensors: Iterable[torch.Tensor]) -> None:
    """Note that a rewrite read these tensors (buffers of the model) as constants: a plan built on their values
    (a mask proven causal and dropped) holds only while they keep them, so the model's watch rebuilds its
    plans when one changes (:meth:`fxforge.runtime.guards.ModelWatch.constants_read`).

    Example:
        >>> mask = torch.ones(2, 2, dtype=torch.bool); read_as_constants([mask]); CONSTANT_READS.holds(mask)
        True
    """
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and not isinstance(tensor, nn.Parameter):
            CONSTANT_READS.add(tensor)
