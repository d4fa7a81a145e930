"""A cache of values derived from tensors, valid while the tensor lives and keeps the same key.

Tensors compare element-wise, so they cannot key a dict or a ``WeakKeyDictionary``; this cache keys by
identity, holds the tensor weakly, and recomputes when the caller's key (which usually includes the
tensor's ``_version``) changes. Prepacked oneDNN weights (:mod:`fxforge.rewrites.fused_ops`) and buffer
snapshots (:func:`fxforge.core.verify.isolated`) both use it.

Example:
    >>> cache, t = TensorCache(), torch.ones(2)
    >>> cache.get(t, (t._version,), lambda: t * 2).tolist()
    [2.0, 2.0]
    >>> _ = t.add_(1); cache.get(t, (t._version,), lambda: t * 2).tolist()
    [4.0, 4.0]
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch


def version(tensor: torch.Tensor) -> int:
    """``tensor._version`` (how many in-place changes PyTorch recorded), or -1 for an inference tensor, which
    has none: such a tensor can change only inside ``torch.inference_mode()``, where nothing records it.

    Example:
        >>> t = torch.ones(1); _ = t.add_(1); version(t)
        1
        >>> with torch.inference_mode():
        ...     version(torch.ones(1))
        -1
    """
    return -1 if tensor.is_inference() else tensor._version


class TensorCache:
    """One derived value per live tensor, recomputed when its key changes (see the module docstring)."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref, Any, Any]] = {}

    def get(self, tensor: torch.Tensor, key: Any, make: Callable[[], Any]) -> Any:
        """The value cached for ``tensor`` under ``key``, made with ``make()`` if there is none yet."""
        ident = id(tensor)
        entry = self._by_id.get(ident)
        if entry is None or entry[0]() is not tensor or entry[1] != key:
            ref = weakref.ref(tensor, lambda _: self._by_id.pop(ident, None))
            entry = (ref, key, make())
            self._by_id[ident] = entry
        return entry[2]
