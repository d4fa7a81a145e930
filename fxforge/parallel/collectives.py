"""Collectives of a training step: counted as they run, and predicted exactly for data parallel (DDP, or
FSDP2's ``replicate``) and fully sharded (FSDP2 ``fully_shard``) training.

:class:`CollectiveCounter` records every collective issued inside it (functional collectives, as DTensor
and tensor parallel issue them, and c10d's in-place ops, as ``dist.*``, DDP and FSDP2 issue them) with
its bytes, group and phase; :func:`data_parallel_collectives` and :func:`fsdp_collectives` predict the
same records from the model's parameters alone. Bytes are always those of the full tensor
(:class:`Collective`), so a prediction and a count compare record by record.

What one training step issues (``ranks`` processes, gradients ``G`` bytes in all):

- DDP: in forward, one broadcast of the module's buffers (per dtype) when it has any; in backward, one
  all-reduce per gradient bucket, ``G`` bytes in all. The first step has one bucket per dtype (DDP does
  not bucket before it has seen the order gradients become ready); the second step opens with two small
  broadcasts (the rebuilt bucket layout: ``4 * (parameters + 1)`` and ``4 * buckets`` bytes) and from then
  on the buckets are cut in gradient-ready order at 1 MiB for the first and 25 MiB (``bucket_cap_mb``)
  for the others.
- FSDP2 (``fully_shard`` on each block, then the root): in forward one all-gather per group; in backward
  one all-gather per block (by default the root keeps its parameters from forward to backward) and one
  reduce-scatter per group. Each parameter is padded on dim 0 to a multiple of ``ranks``, and the padding
  is sent: a group moves ``ranks * sum(ceil(dim0 / ranks) * rest)`` elements.
- ``replicate`` (FSDP2's data parallel): one all-reduce per group in backward, nothing in forward.

Example:
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    >>> [(c.kind, c.nbytes, c.phase) for c in fsdp_collectives(model, ranks=2)]
    [('all_gather', 112, 'forward'), ('reduce_scatter', 112, 'backward')]
    >>> total_bytes(data_parallel_collectives(model, ranks=2), phase="backward")
    92
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

DDP_FIRST_BUCKET_BYTES = 1024 * 1024
"""DDP's first bucket (the last gradients of the backward) when ``bucket_cap_mb`` is left at its default."""
DDP_BUCKET_MB = 25
"""DDP's ``bucket_cap_mb`` default."""
DDP_BUFFER_BUCKET_BYTES = 250 * 1024 * 1024
"""DDP coalesces its buffer broadcasts in chunks of this size."""
ROOT = "(root)"
"""``where`` of the root module's collectives."""


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a training step, measured or predicted.

    Attributes:
        kind: "all_reduce" | "all_gather" | "reduce_scatter" | "broadcast" | "all_to_all".
        nbytes: bytes of the FULL (unsharded) tensor, per rank: all_reduce: the tensor's bytes;
            all_gather: the gathered output's bytes; reduce_scatter: the input's (unscattered) bytes.
        ranks: the group size.
        group: the mesh dimension: "tp" | "dp" | "fsdp" | "pp" (or a process group's name).
        phase: "forward" | "backward" | "optimizer".
        where: the module qualname (or parameter) it belongs to, for the report.
    """

    kind: str
    nbytes: int
    ranks: int
    group: str
    phase: str
    where: str = ""


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


# op -> (kind, the argument whose bytes count, times the group size?, the group argument). Functional
# collectives name their group by a string, c10d's ops pass a boxed ProcessGroup.
_FUNCTIONAL = {"all_reduce": ("all_reduce", 0, False, 2), "all_gather_into_tensor": ("all_gather", 0, True, 2),
               "reduce_scatter_tensor": ("reduce_scatter", 0, False, 3),
               "all_to_all_single": ("all_to_all", 0, False, 3), "broadcast": ("broadcast", 0, False, 2)}
_OPS: dict[str, tuple[str, int, bool, int]] = {
    **{f"_c10d_functional.{name}{tail}": spec for name, spec in _FUNCTIONAL.items()
       for tail in ("", "_", "_coalesced", "_coalesced_", "_out")},
    **{f"_c10d_functional_autograd.{name}": spec for name, spec in _FUNCTIONAL.items()},
    "c10d.allreduce_": ("all_reduce", 0, False, 1), "c10d.allreduce_coalesced_": ("all_reduce", 0, False, 1),
    "c10d._allgather_base_": ("all_gather", 0, False, 2), "c10d.allgather_": ("all_gather", 1, True, 2),
    "c10d.allgather_coalesced_": ("all_gather", 1, True, 2),
    "c10d.allgather_into_tensor_coalesced_": ("all_gather", 0, False, 2),
    "c10d._reduce_scatter_base_": ("reduce_scatter", 1, False, 2),
    "c10d.reduce_scatter_": ("reduce_scatter", 1, False, 2),
    "c10d.reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, False, 2),
    "c10d.broadcast_": ("broadcast", 0, False, 1), "c10d.alltoall_": ("all_to_all", 1, False, 2),
    "c10d.alltoall_base_": ("all_to_all", 1, False, 2), "c10d.reduce_": ("reduce", 0, False, 1),
    "c10d.gather_": ("gather", 1, True, 2), "c10d.scatter_": ("scatter", 0, True, 2),
    "c10d.send": ("send", 0, False, 1), "c10d.recv_": ("recv", 0, False, 1),
}


def _group_of(arg: Any) -> dist.ProcessGroup:
    if isinstance(arg, str):
        return dist.distributed_c10d._resolve_process_group(arg)
    if isinstance(arg, dist.ProcessGroup):
        return arg
    return dist.ProcessGroup.unbox(arg)


class CollectiveCounter(TorchDispatchMode):
    """Records every collective issued inside it as a :class:`Collective`.

    It sees the functional collectives (``torch.ops._c10d_functional``, DTensor's and tensor parallel's)
    and c10d's in-place ops (``torch.ops.c10d``: what ``dist.all_reduce``, FSDP2's all-gathers and
    reduce-scatters, DDP's bucket all-reduces and its buffer broadcasts issue). Bytes follow
    :class:`Collective`'s convention (the full tensor: an all-gather counts its output, a reduce-scatter
    its input); a coalesced call is one record with the bytes of all its tensors.

    The phase is "backward" while autograd runs a backward pass (``torch._C._current_graph_task_id()``
    is set: FSDP2's backward all-gathers and reduce-scatters, including the root's in the end-of-backward
    callback, and DDP's all-reduces), otherwise the phase set last with :meth:`phase` ("forward" to begin
    with; mark ``counter.phase("optimizer")`` around the step).

    Records carry no ``where`` (the hooks that issue them run outside the modules they serve).

    Args:
        groups: label per process group: a mapping from a ``ProcessGroup`` or its ``group_name`` to a
            label ("dp", "fsdp", "tp"), or a ``DeviceMesh`` whose dimension names become the labels.
            A group not named is labelled by its ``group_name``.

    Example:
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
        >>> with CollectiveCounter(groups={dist.group.WORLD: "dp"}) as counter:
        ...     dist.all_reduce(torch.ones(8))
        >>> counter.collectives
        [Collective(kind='all_reduce', nbytes=32, ranks=4, group='dp', phase='forward', where='')]
        >>> dist.destroy_process_group()
    """

    def __init__(self, groups: Any = None):
        super().__init__()
        self.collectives: list[Collective] = []
        self._phase = "forward"
        self._labels: dict[str, str] = {}
        if groups is not None and hasattr(groups, "mesh_dim_names"):
            for name in groups.mesh_dim_names or ():
                self._labels[groups.get_group(name).group_name] = name
        elif groups is not None:
            for key, label in groups.items():
                self._labels[key if isinstance(key, str) else key.group_name] = label

    @contextlib.contextmanager
    def _restoring(self, previous: str):
        try:
            yield self
        finally:
            self._phase = previous

    def phase(self, name: str):
        """Sets the phase of what follows (outside a backward pass); as a context manager, restores the
        previous phase at its end."""
        previous, self._phase = self._phase, name
        return self._restoring(previous)

    supports_higher_order_operators = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))  # no collective itself; what it runs comes back here
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor lowers itself to plain collectives first, which come back here
        out = func(*args, **(kwargs or {}))
        packet = getattr(func, "_overloadpacket", None)
        op = _OPS.get(f"{func.namespace}.{packet.__name__}") if packet is not None else None
        if op is not None:
            self._record(op, args)
        return out

    def _record(self, op: tuple[str, int, bool, int], args: tuple) -> None:
        kind, tensor_index, times_ranks, group_index = op
        group = _group_of(args[group_index])
        ranks = group.size()
        nbytes = _nbytes(args[tensor_index]) * (ranks if times_ranks else 1)
        phase = "backward" if torch._C._current_graph_task_id() != -1 else self._phase
        label = self._labels.get(group.group_name, group.group_name)
        self.collectives.append(Collective(kind, nbytes, ranks, label, phase))


# ---------------------------------------------------------------------------------------------- predictions


def _params(module: torch.nn.Module, skip: set[int] = frozenset()) -> list[tuple[str, torch.nn.Parameter]]:
    """``module``'s parameters once each (a tied weight once), in registration order, minus ``skip``."""
    return [(n, p) for n, p in module.named_parameters() if id(p) not in skip]


def _bytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def _padded_bytes(p: torch.Tensor, ranks: int) -> int:
    """Bytes FSDP2 moves for ``p`` over ``ranks``: dim 0 padded up to a multiple of ``ranks``."""
    return math.ceil(p.shape[0] / ranks) * ranks * (p.numel() // max(p.shape[0], 1)) * p.element_size()


def fsdp_blocks(model: torch.nn.Module) -> list[str]:
    """The blocks to wrap with ``fully_shard`` before the root, as torchtitan does: the children of every
    outermost ``nn.ModuleList`` (or ``nn.ModuleDict``) that hold parameters (a transformer's layers), in
    order.

    Example:
        >>> net = torch.nn.Module()
        >>> net.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2)])
        >>> fsdp_blocks(net)
        ['layers.0', 'layers.2']
    """
    found: list[str] = []

    def visit(module: torch.nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            qualname = f"{prefix}{name}"
            if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
                found.extend(f"{qualname}.{i}" for i, block in child.named_children()
                             if any(True for _ in block.parameters()))
            else:
                visit(child, qualname + ".")

    visit(model, "")
    return found


def apply_fully_shard(model: torch.nn.Module, mesh: Any, blocks: Iterable[str] | None = None,
                      reshard_after_forward: bool | None = None) -> torch.nn.Module:
    """``fully_shard`` on each block (default :func:`fsdp_blocks`), then on the root; returns ``model``.

    ``reshard_after_forward`` goes to every ``fully_shard`` call: None (FSDP2's default) reshards the
    blocks after forward but not the root, True reshards the root too, False none.

    Example (the fake backend: collectives that move nothing, in this process):
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
        >>> mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (4,), mesh_dim_names=("fsdp",))
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 4))
        >>> predicted = fsdp_collectives(net, ranks=4)
        >>> with CollectiveCounter(mesh) as counter:
        ...     apply_fully_shard(net, mesh)(torch.ones(2, 3)).sum().backward()
        >>> comparable(counter.collectives) == comparable(predicted)
        True
        >>> dist.destroy_process_group()
    """
    from torch.distributed.fsdp import fully_shard

    for name in fsdp_blocks(model) if blocks is None else blocks:
        fully_shard(model.get_submodule(name), mesh=mesh, reshard_after_forward=reshard_after_forward)
    return fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)


def _groups(model: torch.nn.Module, blocks: Iterable[str] | None) -> list[tuple[str, list[torch.Tensor]]]:
    """FSDP2's parameter groups: each block's parameters (those not in an earlier block), then the root's."""
    seen: set[int] = set()
    groups = []
    for name in fsdp_blocks(model) if blocks is None else blocks:
        params = [p for _, p in _params(model.get_submodule(name), seen)]
        seen.update(id(p) for p in params)
        groups.append((name, params))
    groups.append((ROOT, [p for _, p in _params(model, seen)]))
    return groups


def fsdp_collectives(model: torch.nn.Module, ranks: int, *, blocks: Iterable[str] | None = None,
                     reshard_after_forward: bool | None = None, group: str = "fsdp") -> list[Collective]:
    """The collectives of one training step under :func:`apply_fully_shard` (FSDP2), in the order issued.

    Forward: an all-gather per group, the root's first. Backward: an all-gather per group resharded after
    forward (``reshard_after_forward``: None, FSDP2's default, reshards the blocks but not the root; True
    all; False none), the root's first and each block's prefetched before the reduce-scatter of the block
    after it; a reduce-scatter per group of its parameters that get a gradient (``requires_grad``), the
    root's last. Bytes include FSDP2's dim-0 padding to a multiple of ``ranks``. Every trainable
    parameter is assumed to get a gradient, and the blocks to run forward in the order given.

    Example:
        >>> net = torch.nn.Module()
        >>> net.layers = torch.nn.ModuleList([torch.nn.Linear(3, 4), torch.nn.Linear(4, 4)])
        >>> [(c.kind, c.nbytes, c.phase, c.where) for c in fsdp_collectives(net, ranks=3)][:3]
        [('all_gather', 96, 'forward', 'layers.0'), ('all_gather', 120, 'forward', 'layers.1'), ('all_gather', 120, 'backward', 'layers.1')]
    """
    scalars = [n for n, p in _params(model) if p.dim() == 0]
    if scalars:
        raise ValueError(f"fully_shard does not support scalar parameters: {', '.join(scalars)}")
    groups = _groups(model, blocks)
    gathered = {name: sum(_padded_bytes(p, ranks) for p in params) for name, params in groups}
    reduced = {name: sum(_padded_bytes(p, ranks) for p in params if p.requires_grad) for name, params in groups}
    order = [name for name, _ in groups if name != ROOT][::-1]
    forward = [Collective("all_gather", gathered[n], ranks, group, "forward", n) for n in [ROOT, *order[::-1]]]
    backward: list[Collective] = []

    def gather(name: str) -> None:
        if gathered[name] and (reshard_after_forward or (reshard_after_forward is None and name != ROOT)):
            backward.append(Collective("all_gather", gathered[name], ranks, group, "backward", name))

    gather(ROOT)
    if order:
        gather(order[0])
    for i, name in enumerate(order):
        if i + 1 < len(order):
            gather(order[i + 1])  # prefetched in this block's pre-backward
        if reduced[name]:
            backward.append(Collective("reduce_scatter", reduced[name], ranks, group, "backward", name))
    if reduced[ROOT]:
        backward.append(Collective("reduce_scatter", reduced[ROOT], ranks, group, "backward", ROOT))
    return [c for c in forward if c.nbytes] + backward


def _ddp_buckets(params: list[tuple[str, torch.Tensor]], limits: list[int]) -> list[list[int]]:
    tensors = [p for _, p in params]
    indices, _ = dist._compute_bucket_assignment_by_size(tensors, limits, [False] * len(tensors),
                                                         list(range(len(tensors))))
    return indices


def data_parallel_collectives(model: torch.nn.Module, ranks: int, *, style: str = "ddp", step: int = 3,
                              bucket_cap_mb: float | None = None, ready_order: list[str] | None = None,
                              broadcast_buffers: bool = True, blocks: Iterable[str] | None = None,
                              group: str = "dp") -> list[Collective]:
    """The collectives of one data-parallel training step, in the order issued.

    Args:
        model: the model each rank holds.
        ranks: the data-parallel group size.
        style: ``"ddp"`` (``DistributedDataParallel`` without ``find_unused_parameters`` or
            ``static_graph``) or ``"replicate"`` (FSDP2's
            ``replicate`` on each of ``blocks`` then the root: one all-reduce per group in backward).
        step: DDP's step number: 1 (one bucket per dtype), 2 (the bucket rebuild's two broadcasts, then
            the rebuilt buckets) or later (the rebuilt buckets).
        bucket_cap_mb: DDP's ``bucket_cap_mb`` (default 25, with a 1 MiB first bucket).
        ready_order: parameter names in gradient-ready order (:func:`~fxforge.parallel.overlap.gradient_ready_order`); DDP cuts its
            rebuilt buckets along it. Default: the reverse of registration order, which moves the cuts
            (never the total) where the backward produces gradients in another order.
        broadcast_buffers: DDP's flag: buffers are broadcast from rank 0 in each forward.
        blocks: ``replicate``'s groups (default :func:`fsdp_blocks`).
        group: the label of the records.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(1024, 512), torch.nn.Linear(512, 512))
        >>> [c.nbytes for c in data_parallel_collectives(model, 2)]
        [1050624, 2099200]
        >>> [c.nbytes for c in data_parallel_collectives(model, 2, step=1)]
        [3149824]
    """
    if style == "replicate":  # the blocks in backward order, then the root
        *block_groups, root = _groups(model, blocks)
        return [Collective("all_reduce", sum(_bytes(p) for p in params if p.requires_grad), ranks, group,
                           "backward", name)
                for name, params in [*block_groups[::-1], root] if any(p.requires_grad for p in params)]
    if style != "ddp":
        raise ValueError(f"style must be 'ddp' or 'replicate', not {style!r}")
    params = [(n, p) for n, p in _params(model) if p.requires_grad]
    out: list[Collective] = []
    if step == 1:
        buckets = _ddp_buckets(params, [2**63 - 1])[::-1]
    else:
        by_name = dict(params)
        names = ready_order if ready_order is not None else [n for n, _ in params][::-1]
        if sorted(names) != sorted(by_name):
            raise ValueError("ready_order must name every trainable parameter once")
        cap = int((DDP_BUCKET_MB if bucket_cap_mb is None else bucket_cap_mb) * 1024 * 1024)
        first = DDP_FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap
        ready = [(n, by_name[n]) for n in names]
        index = {n: i for i, (n, _) in enumerate(params)}
        buckets = [[index[ready[i][0]] for i in b] for b in _ddp_buckets(ready, [first, cap])]
        if step == 2:
            out += [Collective("broadcast", 4 * (len(params) + 1), ranks, group, "forward", "bucket rebuild"),
                    Collective("broadcast", 4 * len(buckets), ranks, group, "forward", "bucket rebuild")]
    buffers = list(model.buffers()) if broadcast_buffers else []
    for chunk in _ddp_buckets([("", b) for b in buffers], [DDP_BUFFER_BUCKET_BYTES]) if buffers else []:
        out.append(Collective("broadcast", sum(_bytes(buffers[i]) for i in chunk), ranks, group, "forward",
                              "buffers"))
    for bucket in buckets:
        names = [params[i][0] for i in bucket]
        where = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
        out.append(Collective("all_reduce", sum(_bytes(params[i][1]) for i in bucket), ranks, group,
                              "backward", where))
    return out


def blocking_allreduce_hook(process_group, bucket):  # DDP checks the annotations: none here
    """A DDP comm hook doing what DDP's default does (average the bucket over the group), as a blocking
    ``dist.all_reduce``: DDP's own path needs a backend whose work returns its tensor, which the fake
    backend's does not. ``ddp.register_comm_hook(None, blocking_allreduce_hook)`` (None: the default group).

    Example:
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        >>> ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2))
        >>> ddp.register_comm_hook(None, blocking_allreduce_hook)
        >>> with CollectiveCounter() as counter:
        ...     ddp(torch.ones(1, 3)).sum().backward()
        >>> [(c.kind, c.nbytes, c.phase) for c in counter.collectives]
        [('all_reduce', 32, 'backward')]
        >>> dist.destroy_process_group()
    """
    group = process_group or dist.group.WORLD
    buffer = bucket.buffer().div_(dist.get_world_size(group))
    dist.all_reduce(buffer, group=group)
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(buffer)
    return future


# ------------------------------------------------------------------------------------------------ summaries


def total_bytes(collectives: Iterable[Collective], group: str | None = None, phase: str | None = None,
                kind: str | None = None) -> int:
    """The bytes of the collectives of ``group``, ``phase`` and ``kind`` (None: any).

    Example:
        >>> total_bytes([Collective("all_reduce", 8, 2, "dp", "backward"),
        ...              Collective("broadcast", 4, 2, "dp", "forward")], phase="backward")
        8
    """
    return sum(c.nbytes for c in collectives if (group is None or c.group == group)
               and (phase is None or c.phase == phase) and (kind is None or c.kind == kind))


def comparable(collectives: Iterable[Collective]) -> list[tuple[str, int, int, str, str]]:
    """The records without ``where``, sorted: what a prediction and a count must share exactly.

    Example:
        >>> comparable([Collective("all_reduce", 8, 2, "dp", "backward", "layers.0")])
        [('all_reduce', 8, 2, 'dp', 'backward')]
    """
    return sorted((c.kind, c.nbytes, c.ranks, c.group, c.phase) for c in collectives)


def collectives_table(predicted: Iterable[Collective], measured: Iterable[Collective] | None = None):
    """A pandas table, one row per (group, phase, kind, ranks): the count and the bytes, predicted and (when
    given) measured.

    Example:
        >>> table = collectives_table([Collective("all_reduce", 8, 2, "dp", "backward")] * 2)
        >>> table[["kind", "count", "bytes"]].values.tolist()
        [['all_reduce', 2, 16]]
    """
    import pandas as pd

    keys = ["group", "phase", "kind", "ranks"]

    def summary(collectives: Iterable[Collective]):
        frame = pd.DataFrame([dataclasses.asdict(c) for c in collectives], columns=[*keys, "nbytes"])
        return frame.groupby(keys, sort=False).nbytes.agg(["count", "sum"]).rename(columns={"sum": "bytes"})

    table = summary(predicted)
    if measured is not None:
        table = table.add_suffix("_predicted").join(summary(measured).add_suffix("_measured"), how="outer")
        table = table.fillna(0).astype(int)
    return table.reset_index()
