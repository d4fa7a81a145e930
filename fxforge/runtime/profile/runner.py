"""Running a graph node by node: each node's time, FLOPs, bytes moved and live memory.

Example:
    >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
    >>> runner = NodeRunner(gm, torch.device("cpu"))
    >>> with torch.no_grad():
    ...     runner.count([torch.ones(2, 4)])
    >>> runner.flops["_0"], runner.bytes["_1"]
    (64, 64)
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from fxforge.core.memory import GraphMemory, MemoryTimeline, tensor_leaves
from fxforge.core.nodes import CALL_OPS, is_inplace, is_view_op, submodule
from fxforge.runtime.memory import StorageTracker
from fxforge.runtime.profile.flops import flop_counter


def _nbytes(tensor: torch.Tensor) -> int:
    try:
        return int(tensor.numel()) * int(tensor.element_size())
    except Exception:  # noqa: BLE001 - nested or otherwise sizeless tensors
        return 0


def _storage_ptr(tensor: torch.Tensor) -> int | None:
    try:
        return int(tensor.untyped_storage().data_ptr())
    except Exception:  # noqa: BLE001 - mkldnn, sparse: no plain storage
        return None


def node_bytes(node: torch.fx.Node, graph_module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> int:
    """Bytes a node reads and writes: its tensor inputs (and a called module's parameters and buffers) plus
    its tensor outputs; 0 for a node whose outputs all alias its inputs without writing them (a view, or
    ``contiguous``/``to`` returning its input as it is), and for nodes returning no tensor.

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x"); n = g.call_function(torch.relu, (x,))
        >>> t = torch.ones(10)
        >>> node_bytes(n, None, (t,), {}, torch.relu(t))     # 40 read, 40 written
        80
    """
    outputs = tensor_leaves(output)
    if not outputs:
        return 0
    inputs = {id(t): t for t in tensor_leaves((args, kwargs))}
    module = submodule(node, graph_module) if graph_module is not None else None
    if module is not None:
        for tensor in [*module.parameters(), *module.buffers()]:
            inputs.setdefault(id(tensor), tensor)
    in_storages = {p for p in map(_storage_ptr, inputs.values()) if p is not None}
    aliases = all(_storage_ptr(t) in in_storages for t in outputs)
    if aliases and (is_view_op(node) or graph_module is not None and not is_inplace(node, graph_module)):
        return 0  # a view, or an op that returned its input as it was (contiguous, to, flatten)
    written = {id(t): t for t in outputs}
    return sum(map(_nbytes, inputs.values())) + sum(map(_nbytes, written.values()))


class NodeRunner(torch.fx.Interpreter):
    """Runs a graph node by node, timing each computing node, or counting its FLOPs, bytes and memory."""

    def __init__(self, graph_module: torch.fx.GraphModule, device: torch.device):
        super().__init__(graph_module, garbage_collect_values=True)
        self.device = device
        self.cuda = device.type == "cuda"
        self.mode = "run"
        self.times: dict[str, list[float]] = defaultdict(list)
        self.flops: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self.measured: dict[str, int] = {}
        self.values: dict[torch.fx.Node, Any] = {}
        self.uncounted: list[str] = []  # nodes that could not run under the FLOP counter (0 FLOPs)
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.counter: FlopCounterMode | None = None
        self.tracker: StorageTracker | None = None
        self._previous: torch.fx.Node | None = None
        self._baseline = 0

    def _live(self) -> int:
        if self.cuda:
            return torch.cuda.memory_allocated(self.device) - self._baseline
        return self.tracker.live if self.tracker is not None else 0

    def run_node(self, n: torch.fx.Node) -> Any:
        if self.mode == "count" and self._previous is not None:
            # Values used for the last time by the previous node have been dropped by now.
            self.measured[self._previous.name] = self._live()
        with self._set_current_node(n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            call = getattr(self, n.op)
            if n.op not in CALL_OPS:
                return call(n.target, args, kwargs)
            if self.mode == "time":
                if self.cuda:
                    torch.cuda.synchronize(self.device)
                start = time.perf_counter()
                out = call(n.target, args, kwargs)
                if self.cuda:
                    torch.cuda.synchronize(self.device)
                self.times[n.name].append((time.perf_counter() - start) * 1e3)
                return out
            if self.mode == "count":
                before = self.counter.get_total_flops() if self.counter is not None else 0
                nbytes_in = (args, kwargs)
                try:
                    out = call(n.target, args, kwargs)
                    self.flops[n.name] = (self.counter.get_total_flops() - before) if self.counter is not None else 0
                except Exception:  # noqa: BLE001 - an op the counting modes cannot run: run it plainly
                    from torch.utils._python_dispatch import _disable_current_modes

                    with _disable_current_modes():
                        out = call(n.target, args, kwargs)
                    self.flops[n.name] = 0
                    self.uncounted.append(n.name)
                self.bytes[n.name] = node_bytes(n, self.module, *nbytes_in, out)
                if "val" not in n.meta:
                    self.values[n] = _fake_of(out, self.fake_mode)
                self._previous = n
                return out
            return call(n.target, args, kwargs)

    def count(self, values: list[Any]) -> None:
        self.mode = "count"
        self._previous = None
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self._baseline = torch.cuda.memory_allocated(self.device)
        with StorageTracker() as tracker, flop_counter() as counter:
            self.tracker, self.counter = tracker, counter
            out = self.run(*values, enable_io_processing=False)
            if self._previous is not None:
                self.measured[self._previous.name] = self._live()
            del out
        self.tracker = self.counter = None
        self.mode = "run"

    def time(self, values: list[Any], warmup: int, repeat: int) -> None:
        self.mode = "run"
        for _ in range(warmup):
            self.run(*values, enable_io_processing=False)
        self.mode = "time"
        for _ in range(repeat):
            self.run(*values, enable_io_processing=False)
        self.mode = "run"


def _fake_of(value: Any, mode: Any) -> Any:
    """Shape-and-storage stand-ins (fake tensors sharing storages as the real ones do) for the memory model,
    for nodes that came without ``meta["val"]``."""

    def convert(t: torch.Tensor) -> Any:
        try:
            return mode.from_tensor(t.detach(), static_shapes=True)
        except Exception:  # noqa: BLE001 - mkldnn or other layouts: no stand-in
            return None

    try:
        return pytree.tree_map_only(torch.Tensor, convert, value)
    except Exception:  # noqa: BLE001
        return None


def simulate_with(graph_module: torch.fx.GraphModule, values: dict[torch.fx.Node, Any]) -> MemoryTimeline:
    """The simulated timeline; nodes without shape metadata borrow the values seen in the counting run."""
    borrowed = []
    for node in graph_module.graph.nodes:
        if node.op in CALL_OPS and "val" not in node.meta and values.get(node) is not None:
            node.meta["val"] = values[node]
            borrowed.append(node)
    try:
        return GraphMemory(graph_module).simulate()
    finally:
        for node in borrowed:
            node.meta.pop("val", None)
