"""Copies of a model's buffers and a call's inputs that :func:`fxforge.core.verify.isolated` puts back after a block,
kept while the tensors are unchanged so that isolating the same model again costs no copy.

Example:
    >>> bn = torch.nn.BatchNorm1d(2).train()
    >>> snapshots = Snapshots()
    >>> [(buf.shape, version) for buf, version, _ in snapshots.take([bn])]   # training mode: always restored
    [(torch.Size([2]), None), (torch.Size([2]), None), (torch.Size([]), None)]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fxforge.core.derived import DATA_TOUCHES, watch_data
from fxforge.core.statistics import counter_of, note_statistics
from fxforge.core.tensor_cache import TensorCache
from fxforge.core.tensor_cache import version as tensor_version

# Buffers fxforge registers for constants it computed from parameters (folded weights). They are read by the
# replacement that folded them and written by nothing, so isolating a graph need not copy them.
CONSTANT_BUFFER_PREFIX = "_fxforge_folded"


class Snapshots:
    """Copies of buffers (and inputs), reused while a buffer is unchanged (same ``_version``, and no ``.data`` touched since:
    ``bn.running_mean.data.add_(1)`` changes the values and leaves the version, so a copy keyed by the version
    alone would put the old values back the next time a block writes the buffer).

    In eval mode nothing writes to buffers, so isolating the same model again costs no copy. Kernels
    may update buffers without bumping ``_version`` (BatchNorm's running statistics in training mode),
    so buffers of modules in training mode are always restored. fxforge's own folded constants
    (:data:`CONSTANT_BUFFER_PREFIX`) are not copied: for ResNet-50 they are 100 MB of weights.
    """

    def __init__(self) -> None:
        self._copies = TensorCache()

    def take(self, modules: Sequence[torch.nn.Module]) -> list[tuple[torch.Tensor, int | None, torch.Tensor]]:
        """``(buffer, its version or None to always restore, a copy)`` for each buffer of ``modules``; a running
        statistic's copy is also keyed by its counter (BatchNorm's kernels update it behind its version)."""
        saved, seen = [], set()
        for module in modules:
            note_statistics(module)
        for owner in (m for module in modules for m in module.modules()):
            for name, buf in owner._buffers.items():
                if buf is None or id(buf) in seen or name.startswith(CONSTANT_BUFFER_PREFIX):
                    continue
                seen.add(id(buf))
                version = tensor_version(buf)
                counter = counter_of(buf)
                key = (*self._key(buf, version), None if counter is None else tensor_version(counter))
                copy = self._copies.get(buf, key, lambda buf=buf: buf.detach().clone())
                saved.append((buf, None if owner.training else version, copy))
        return saved

    def take_inputs(self, inputs: Any) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
        """``(tensor, its version, a copy)`` for each tensor in ``inputs`` (a pytree), restored on exit if the
        block changed it in place."""
        tensors = {id(t): t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)}
        return [(t, tensor_version(t), self._copies.get(t, self._key(t, tensor_version(t)),
                                                        lambda t=t: t.detach().clone()))
                for t in tensors.values()]

    @staticmethod
    def _key(tensor: torch.Tensor, version: int) -> tuple[int, int]:
        """What a copy of ``tensor`` is kept under: its version and its ``.data`` touches (watched from now on)."""
        watch_data([tensor])
        return version, DATA_TOUCHES.touches(tensor)
