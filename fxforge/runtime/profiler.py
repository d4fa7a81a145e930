"""``fxforge.profile``: where a graph spends its time and memory, node by node.

:func:`profile` runs a graph node by node with a ``torch.fx.Interpreter`` and records, for every node
that computes (``call_function``, ``call_method``, ``call_module``):

- ``time_ms``: the median over ``repeat`` runs (after ``warmup`` runs) of the node's own call, with
  ``torch.cuda.synchronize`` before and after it on CUDA, so a node is charged for its kernels only;
- ``flops``: counted by ``torch.utils.flop_counter.FlopCounterMode`` on one run, so the counts are
  torch's own (a linear layer ``2·B·N_in·N_out``, a convolution ``2·B·H'·W'·K²·C_in·C_out``; pointwise
  ops count 0). fxforge's fused ops, and the oneDNN/cuDNN kernels they lower to, count the FLOPs of
  their convolution or linear layer (:data:`FLOP_FORMULAS`);
- ``bytes``: the sizes of the node's tensor inputs (a module's parameters included) plus those of its
  outputs; a view (``view``, ``transpose``, ``getitem``...) that returns an alias moves nothing and counts 0;
- ``intensity`` (FLOPs per byte) and ``bound``: ``"compute"`` at or above the machine's ridge point
  (:func:`fxforge.runtime.roofline.measure_machine`), else ``"memory"``;
- ``live_bytes``: activation bytes alive after the node, simulated from the shapes
  (:class:`fxforge.runtime.memory.GraphMemory`), and ``measured_live_bytes``: the same measured during
  the counting run (storages created during the run and still alive: a dispatch-mode tracker on CPU, the
  caching allocator on CUDA);
- ``module`` (the user's module path), ``source`` (the user's ``file:line``) where known.

Timing through an interpreter adds a few microseconds per node to the run, not to the nodes' own
times; ``Profile.graph_ms`` is the graph called directly, for reference.

Example:
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU())
    >>> p = fxforge.profile(model, (torch.randn(8, 64),), warmup=1, repeat=3)
    >>> p.table[["node", "op", "module", "flops"]].values.tolist()
    [['_0', 'linear', '0', 32768], ['_1', 'relu', '1', 0]]
    >>> set(p.table["bound"]) <= {"compute", "memory"}
    True
"""

from __future__ import annotations

import dataclasses
import html
import math
import operator
import re
import statistics
import time
import warnings
from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count, sdpa_flop_count

from fxforge.capture.meta import placeholder_values
from fxforge.capture.source import node_source
from fxforge.captured import Captured
from fxforge.rewrites.graph_utils import CALL_OPS, is_inplace, is_view_op, submodule, target_name
from fxforge.runtime.memory import GraphMemory, MemoryTimeline, StorageTracker, device_of, tensor_leaves
from fxforge.runtime.roofline import Machine, measure_machine

COLUMNS = ["node", "op", "target", "module", "source", "time_ms", "flops", "bytes", "intensity", "bound",
           "live_bytes", "measured_live_bytes"]
aten = torch.ops.aten


# ------------------------------------------------------------------------------------------------ FLOPs

def _mm_flops(input_shape: Any, out_features: int) -> int:
    return 2 * math.prod(input_shape[:-1]) * int(input_shape[-1]) * int(out_features)


def _conv_pointwise_flop(input_shape, weight_shape, bias_shape, stride, padding, dilation, groups, other_shape,
                         activation, scalars, kernel, *, out_shape=None, **kwargs) -> int:
    return conv_flop_count(input_shape, weight_shape, out_shape)


def _linear_pointwise_flop(input_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return _mm_flops(input_shape, weight_shape[0])


def _mkldnn_conv_flop(input_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return conv_flop_count(input_shape, weight_shape, out_shape)


def _mkldnn_conv_binary_flop(input_shape, other_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return conv_flop_count(input_shape, weight_shape, out_shape)


def _mkldnn_linear_flop(input_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return _mm_flops(input_shape, out_shape[-1])


def _cudnn_conv_flop(input_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return conv_flop_count(input_shape, weight_shape, out_shape)


def _sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _flop_formulas() -> dict[Any, Any]:
    import fxforge.fused_ops  # noqa: F401 - registers torch.ops.fxforge.*

    formulas: dict[Any, Any] = {
        torch.ops.fxforge.conv_pointwise: _conv_pointwise_flop,
        torch.ops.fxforge.linear_pointwise: _linear_pointwise_flop,
        aten.cudnn_convolution_relu: _cudnn_conv_flop,
        aten.cudnn_convolution_add_relu: _cudnn_conv_flop,
    }
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        # CPU attention's fused kernel: torch counts its CUDA siblings, not it (the same formula as theirs).
        formulas[aten._scaled_dot_product_flash_attention_for_cpu] = _sdpa_flop
    mkldnn = torch.ops.mkldnn
    if hasattr(mkldnn, "_convolution_pointwise"):
        # The overload packet has two overloads with different argument orders: one formula that looks
        # at which it got (the binary one's second argument is a tensor of the input's rank).
        def conv(*args, out_shape=None, **kwargs):
            if len(args) > 2 and isinstance(args[2], torch.Size) and len(args[2]) == len(args[0]):
                return _mkldnn_conv_binary_flop(*args, out_shape=out_shape)
            return _mkldnn_conv_flop(*args, out_shape=out_shape)

        formulas[mkldnn._convolution_pointwise] = conv
    if hasattr(mkldnn, "_linear_pointwise"):
        formulas[mkldnn._linear_pointwise] = _mkldnn_linear_flop
    return formulas


FLOP_FORMULAS = _flop_formulas()
"""FLOP formulas ``FlopCounterMode`` lacks: fxforge's fused ops and the kernels they lower to (the FLOPs of
their convolution or linear layer; the activation and the residual add, like every pointwise op, count 0),
and CPU's fused attention kernel (``4·B·H·S_q·S_kv·D``, as torch counts the CUDA ones), so an attention
rewritten to ``scaled_dot_product_attention`` keeps the FLOPs of its two matrix products."""


def flop_counter() -> FlopCounterMode:
    """A silent ``FlopCounterMode`` that also knows fxforge's fused ops (:data:`FLOP_FORMULAS`).

    Example:
        >>> x, w = torch.randn(1, 3, 8, 8), torch.randn(4, 3, 3, 3)
        >>> with flop_counter() as counter:
        ...     _ = torch.ops.fxforge.conv_pointwise(x, w, None, [1, 1], [1, 1], [1, 1], 1, None, "relu", [],
        ...                                          "composite")
        >>> counter.get_total_flops() == 2 * 8 * 8 * 9 * 3 * 4
        True
    """
    return FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS)


# ------------------------------------------------------------------------------------------------ op names

_OPERATORS = {operator.add: "add", operator.iadd: "add", operator.sub: "sub", operator.isub: "sub",
              operator.mul: "mul", operator.imul: "mul", operator.truediv: "div", operator.itruediv: "div",
              operator.floordiv: "floor_divide", operator.matmul: "matmul", operator.imatmul: "matmul",
              operator.neg: "neg", operator.pow: "pow", operator.getitem: "getitem", operator.mod: "remainder"}
_FUSED = {"fxforge::conv_pointwise": "fxforge.conv_pointwise", "fxforge::linear_pointwise": "fxforge.linear_pointwise",
          "mkldnn::_convolution_pointwise": "fxforge.conv_pointwise",
          "mkldnn::_linear_pointwise": "fxforge.linear_pointwise",
          "aten::cudnn_convolution_relu": "fxforge.conv_pointwise",
          "aten::cudnn_convolution_add_relu": "fxforge.conv_pointwise"}
_MODULES = {"BatchNorm1d": "batch_norm", "BatchNorm2d": "batch_norm", "BatchNorm3d": "batch_norm",
            "ReLU": "relu", "ReLU6": "relu6", "GELU": "gelu", "SiLU": "silu", "PReLU": "prelu", "ELU": "elu",
            "SELU": "selu", "CELU": "celu", "GLU": "glu", "LeakyReLU": "leaky_relu", "MultiheadAttention":
            "multi_head_attention"}


def _snake(name: str) -> str:
    name = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()


def _plain(name: str) -> str:
    """``relu_`` -> ``relu`` (in-place variants grouped with their op); dunders kept."""
    return name[:-1] if name.endswith("_") and not name.endswith("__") and len(name) > 1 else name


def op_type(node: torch.fx.Node, graph_module: torch.nn.Module | None = None) -> str:
    """The kind of op a node runs, the same however the user's code reached it.

    ``nn.Conv2d``, ``F.conv2d`` and ``torch.conv2d`` are all ``"conv2d"``; ``nn.ReLU``, ``F.relu``,
    ``x.relu_()`` and ``aten.relu.default`` are all ``"relu"``; ``+`` is ``"add"``; fxforge's fused ops (and
    the oneDNN/cuDNN kernels the runtime lowers them to) are ``"fxforge.conv_pointwise"`` and
    ``"fxforge.linear_pointwise"``; a module that is not from ``torch.nn`` is its class name.

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Conv2d(1, 1, 1), torch.nn.ReLU()))
        >>> [op_type(n, gm) for n in gm.graph.nodes if n.op == "call_module"]
        ['conv2d', 'relu']
    """
    target = node.target
    if node.op == "call_module":
        module = submodule(node, graph_module) if graph_module is not None else None
        if module is None:
            return str(target)
        cls = type(module)
        if not cls.__module__.startswith("torch.nn"):
            return cls.__name__
        return _MODULES.get(cls.__name__) or _snake(cls.__name__)
    if node.op == "call_method":
        return _plain(str(target))
    if isinstance(target, torch._ops.OpOverload):
        name = target._schema.name
        if name in _FUSED:
            return _FUSED[name]
        if target.namespace == "aten":
            return _plain(target._opname)
        return f"{target.namespace}.{target._opname}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return _FUSED.get(target._qualified_op_name, str(target))
    if target in _OPERATORS:
        return _OPERATORS[target]
    return _plain(getattr(target, "__name__", str(target)))


# ------------------------------------------------------------------------------------------------ modules

def _stack_paths(node: torch.fx.Node) -> list[tuple[str, Any]]:
    stack = node.meta.get("nn_module_stack") or {}
    paths = []
    for key, value in stack.items():
        path, kind = (value[0], value[1]) if isinstance(value, tuple) and len(value) >= 2 else (key, None)
        path = re.sub(r"^L\['self'\]\.?", "", str(path))
        paths.append((path, kind))
    return paths


def _own_module(node: torch.fx.Node) -> str | None:
    """The module a node belongs to according to its own metadata, or None when it has none."""
    if node.op == "call_module":
        return str(node.target)
    paths = _stack_paths(node)
    return paths[-1][0] if paths else None


def _enclosing(node: torch.fx.Node) -> str | None:
    """The module whose ``forward`` holds the node's source line (a torch.nn layer's line is in its parent)."""
    paths = _stack_paths(node)
    if node.op == "call_module":
        path = str(node.target)
        return path.rsplit(".", 1)[0] if "." in path else ""
    if not paths:
        return None
    kind = paths[-1][1]
    module_name = kind.__module__ if isinstance(kind, type) else str(kind or "")
    if module_name.startswith("torch.nn") and len(paths) > 1:
        return paths[-2][0]
    return paths[-1][0]


def module_paths(graph_module: torch.fx.GraphModule, model: nn.Module | None = None) -> dict[str, str]:
    """The user's module path of each computing node (``""`` where none is known).

    A ``call_module`` node's target is its path; other nodes use ``meta["nn_module_stack"]`` (fx traces and
    torch.export both record it). Nodes a rewrite created carry no stack; for them, in this order:

    1. a parameter they read by its path (``fc.weight`` -> ``fc``: a fused linear layer);
    2. the module whose ``forward`` holds their source line, read from a nearby node (up to three edges
       away) with the same source line and a stack (a folded conv+BN next to its block's ReLU);
    3. with ``model`` given: the one submodule of ``model`` whose class's ``forward`` holds their source line
       (several instances of that class, and no nearby node telling which: unknown).

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
        >>> module_paths(gm)
        {'_0': '0', '_1': '1'}
    """
    result: dict[str, str] = {}
    lines: _SourceIndex | None = None
    for node in graph_module.graph.nodes:
        if node.op not in CALL_OPS:
            continue
        own = _own_module(node)
        if own is None:
            own = _parameter_owner(node)
        if own is None:
            own = _nearby_enclosing(node)
        if own is None and model is not None:
            lines = lines or _SourceIndex(model)
            own = lines.module_of(node)
        result[node.name] = own or ""
    return result


def _parameter_owner(node: torch.fx.Node) -> str | None:
    for arg in node.all_input_nodes:
        target = str(arg.target) if arg.op == "get_attr" else ""
        if "." in target and not target.startswith("_fxforge"):
            return target.rsplit(".", 1)[0]
    return None


class _SourceIndex:
    """Which submodules of a model run a given source line in their class's ``forward``."""

    def __init__(self, model: nn.Module):
        import inspect
        import os

        self.spans: list[tuple[str, str, int, int]] = []  # (path, file, first line, last line)
        spans: dict[type, tuple[str, int, int] | None] = {}
        for path, module in model.named_modules():
            cls = type(module)
            if cls not in spans:
                try:
                    forward = inspect.unwrap(cls.forward)
                    code_lines, first = inspect.getsourcelines(forward)
                    spans[cls] = (os.path.abspath(inspect.getsourcefile(forward) or ""), first,
                                  first + len(code_lines) - 1)
                except (OSError, TypeError):
                    spans[cls] = None
            if spans[cls] is not None:
                self.spans.append((path, *spans[cls]))

    def module_of(self, node: torch.fx.Node) -> str | None:
        import os

        match = re.match(r"(?P<file>.+?):(?P<line>\d+)(?::|$)", node_source(node) or "")
        if not match:
            return None
        file, line = os.path.abspath(match["file"]), int(match["line"])
        found = [path for path, f, first, last in self.spans if f == file and first <= line <= last]
        return found[0] if len(found) == 1 else None


def _nearby_enclosing(node: torch.fx.Node, hops: int = 3) -> str | None:
    source = node_source(node)
    if not source:
        return None
    seen = {node}
    frontier = [node]
    for _ in range(hops):
        nxt = []
        for current in frontier:
            for other in [*current.all_input_nodes, *current.users]:
                if other in seen or other.op not in CALL_OPS:
                    continue
                seen.add(other)
                nxt.append(other)
        for other in nxt:
            if node_source(other) == source:
                found = _enclosing(other)
                if found is not None:
                    return found
        frontier = nxt
    return None


# ------------------------------------------------------------------------------------------------ bytes

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


# ------------------------------------------------------------------------------------------------ running

class _NodeRunner(torch.fx.Interpreter):
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


def _simulate(graph_module: torch.fx.GraphModule, values: dict[torch.fx.Node, Any]) -> MemoryTimeline:
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


# ------------------------------------------------------------------------------------------------ Profile

@dataclasses.dataclass(eq=False)
class Profile:
    """A graph's time, FLOPs, bytes and memory, node by node (see :func:`profile`).

    Attributes:
        table: a pandas DataFrame, one row per computing node in run order: ``node``, ``op``, ``target``,
            ``module``, ``source``, ``time_ms``, ``flops``, ``bytes``, ``intensity``, ``bound``,
            ``live_bytes`` (simulated, after the node) and ``measured_live_bytes``.
        machine: the device's measured :class:`~fxforge.runtime.roofline.Machine` (peak, bandwidth, ridge).
        graph_module: the graph profiled.
        timeline: the simulated :class:`~fxforge.runtime.memory.MemoryTimeline` (every node, inputs included).
        graph_ms: the median time of the whole graph called directly (no interpreter).
        what: what was profiled (``"captured graph"``, ``"rewritten graph"``, ``"lowered graph ..."``).
        name: the model's class name.
        warmup, repeat: the runs behind the timings.

    Example:
        >>> p = fxforge.profile(torch.nn.Linear(8, 8), (torch.randn(2, 8),), warmup=0, repeat=1)
        >>> p.by_op().index.tolist(), round(float(p.by_op()["share"].sum()), 6)
        (['linear'], 1.0)
    """

    table: Any
    machine: Machine
    graph_module: torch.fx.GraphModule
    timeline: MemoryTimeline
    graph_ms: float
    what: str
    name: str
    warmup: int
    repeat: int
    device: str = "cpu"

    @property
    def total_ms(self) -> float:
        """The sum of the nodes' median times, in ms."""
        return float(self.table["time_ms"].sum())

    @property
    def total_flops(self) -> int:
        """The sum of the nodes' FLOPs."""
        return int(self.table["flops"].sum())

    def _group(self, column: str) -> Any:
        import pandas as pd

        table = self.table
        grouped = table.groupby(column, sort=False).agg(
            count=("node", "size"), time_ms=("time_ms", "sum"), flops=("flops", "sum"), bytes=("bytes", "sum"))
        total = float(table["time_ms"].sum())
        grouped["share"] = grouped["time_ms"] / total if total > 0 else 0.0
        grouped = grouped.sort_values("time_ms", ascending=False, kind="stable")
        grouped.index = pd.Index(grouped.index, name=column)
        return grouped

    def by_op(self) -> Any:
        """Time, FLOPs and bytes per op type: a DataFrame indexed by ``op`` with ``count``, ``time_ms``,
        ``flops``, ``bytes`` and ``share`` (of the total time), slowest first.

        Example:
            >>> p = fxforge.profile(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()),
            ...                     (torch.ones(1, 4),), warmup=0, repeat=1)
            >>> sorted(p.by_op().index), int(p.by_op()["count"].sum())
            (['linear', 'relu'], 2)
        """
        return self._group("op")

    def by_module(self, depth: int | None = None) -> Any:
        """The same per module path; with ``depth``, paths cut to their first ``depth`` parts (``layers.0``).

        Example:
            >>> p = fxforge.profile(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()),
            ...                     (torch.ones(1, 4),), warmup=0, repeat=1)
            >>> sorted(p.by_module().index)
            ['0', '1']
        """
        if depth is None:
            return self._group("module")
        cut = self.table.copy()
        cut["module"] = cut["module"].map(lambda m: ".".join(str(m).split(".")[:depth]) if m else m)
        return dataclasses.replace(self, table=cut)._group("module")

    def compare(self, other: Profile) -> Any:
        """Time per op type here (before) and in ``other`` (after): where an optimization won or lost time.

        Returns:
            A DataFrame indexed by op type, with ``count_before``, ``count_after``, ``time_ms_before``,
            ``time_ms_after`` and ``delta_ms`` (after − before), largest times first, and a last row
            ``"total"``. Ops that disappeared have ``count_after == 0``, new ones ``count_before == 0``.
            ``.attrs`` holds ``total_ms_before``, ``total_ms_after``, ``speedup`` (before / after) and
            ``summary`` (one sentence).

        Example:
            >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
            >>> a = fxforge.profile(model, (torch.ones(1, 4),), warmup=0, repeat=1)
            >>> c = a.compare(a)
            >>> c.index[-1], float(c.loc["total", "delta_ms"]), c.attrs["speedup"]
            ('total', 0.0, 1.0)
        """
        import pandas as pd

        before, after = self.by_op(), other.by_op()
        table = pd.DataFrame({
            "count_before": before["count"], "count_after": after["count"],
            "time_ms_before": before["time_ms"], "time_ms_after": after["time_ms"],
        })
        table = table.fillna(0)
        table[["count_before", "count_after"]] = table[["count_before", "count_after"]].astype(int)
        table["delta_ms"] = table["time_ms_after"] - table["time_ms_before"]
        order = table[["time_ms_before", "time_ms_after"]].max(axis=1).sort_values(ascending=False, kind="stable")
        table = table.loc[order.index]
        total_before, total_after = self.total_ms, other.total_ms
        total = pd.DataFrame({"count_before": [int(table["count_before"].sum())],
                              "count_after": [int(table["count_after"].sum())],
                              "time_ms_before": [total_before], "time_ms_after": [total_after],
                              "delta_ms": [total_after - total_before]}, index=["total"])
        table = pd.concat([table, total])
        table.index.name = "op"
        speedup = total_before / total_after if total_after > 0 else float("inf")
        table.attrs.update({
            "total_ms_before": total_before, "total_ms_after": total_after, "speedup": speedup,
            "summary": (f"{self.name} ({self.what}) {total_before:.3f} ms -> {other.name} ({other.what}) "
                        f"{total_after:.3f} ms: {speedup:.2f}x"),
        })
        return table

    # -------------------------------------------------------------------------------------------- plots

    def plot_top(self, n: int = 15, ax: Any = None) -> Any:
        """Horizontal bars of the ``n`` slowest nodes (matplotlib Axes); see :mod:`fxforge.runtime.plots`."""
        from fxforge.runtime import plots

        return plots.plot_top(self, n=n, ax=ax)

    def plot_roofline(self, ax: Any = None) -> Any:
        """The machine's roofline with one point per node, log-log (matplotlib Axes)."""
        from fxforge.runtime import plots

        return plots.plot_roofline(self, ax=ax)

    def plot_memory(self, ax: Any = None, measured: bool = True) -> Any:
        """Simulated live bytes after each node, and the measured ones when ``measured`` (matplotlib Axes)."""
        from fxforge.runtime import plots

        return plots.plot_memory(self, ax=ax, measured=measured)

    def node_colors(self) -> dict[str, str]:
        """A fill colour per profiled node, pale yellow (fast) to dark red (the slowest node).

        Example:
            >>> p = fxforge.profile(torch.nn.Linear(8, 8), (torch.randn(2, 8),), warmup=0, repeat=1)
            >>> p.node_colors()
            {'linear': '#b10026'}
        """
        times = dict(zip(self.table["node"], self.table["time_ms"]))
        slowest = max(times.values(), default=0.0)
        return {name: time_color(t / slowest if slowest > 0 else 0.0) for name, t in times.items()}

    def graph_svg(self, *, engine: str = "auto") -> str:
        """The graph as SVG with nodes coloured by time and labelled with their op and time.

        Example:
            >>> p = fxforge.profile(torch.nn.Linear(8, 8), (torch.randn(2, 8),), warmup=0, repeat=1)
            >>> p.graph_svg(engine="builtin").startswith("<svg")
            True
        """
        from fxforge.draw import graph_svg

        labels = {row.node: f"{row.node}\n{row.op}\n{row.time_ms:.3f} ms" for row in self.table.itertuples()}
        title = f"{self.name}: {self.what}, {self.total_ms:.3f} ms on {self.device}"
        return graph_svg(self.graph_module, node_colors=self.node_colors(), node_labels=labels, title=title,
                         engine=engine)

    # -------------------------------------------------------------------------------------------- text

    def summary(self) -> str:
        """A few lines: what was profiled, the totals, the machine, the slowest op types.

        Example:
            >>> p = fxforge.profile(torch.nn.Linear(8, 8), (torch.randn(2, 8),), warmup=0, repeat=1)
            >>> p.summary().splitlines()[0].startswith("Linear: captured graph, 1 nodes")
            True
        """
        m = self.machine
        lines = [
            (f"{self.name}: {self.what}, {len(self.table)} nodes, {self.total_ms:.3f} ms summed over nodes "
             f"({self.graph_ms:.3f} ms called directly), {self.total_flops / 1e9:.3f} GFLOP, "
             f"peak {self.timeline.peak_bytes / 2**20:.2f} MiB simulated"),
            (f"machine {m.device}: {m.peak_gflops:.1f} GFLOP/s, {m.bandwidth_gbs:.1f} GB/s, "
             f"ridge {m.ridge:.1f} FLOP/byte"),
        ]
        bounds = self.table["bound"].value_counts().to_dict()
        lines.append(f"compute bound: {bounds.get('compute', 0)} nodes, memory bound: {bounds.get('memory', 0)}")
        for op, row in self.by_op().head(5).iterrows():
            lines.append(f"  {op:<28} {int(row['count']):>4}x {row['time_ms']:>9.3f} ms {row['share']:>7.1%}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        return f"<Profile {self.name}: {len(self.table)} nodes, {self.total_ms:.3f} ms on {self.device}>"

    def _repr_html_(self) -> str:
        """A compact summary for Jupyter: the totals, the machine, the slowest op types and nodes."""
        first, machine, bounds, *_ = self.summary().splitlines()
        top_ops = self.by_op().head(8).copy()
        top_ops["share"] = (top_ops["share"] * 100).round(1).astype(str) + " %"
        columns = ["node", "op", "module", "time_ms", "flops", "bytes", "intensity", "bound"]
        top_nodes = self.table.sort_values("time_ms", ascending=False).head(8)[columns]
        return (f"<div><b>{html.escape(first)}</b><br>{html.escape(machine)}<br>{html.escape(bounds)}"
                f"<p>By op type</p>{top_ops.to_html(float_format=lambda v: f'{v:.4g}')}"
                f"<p>Slowest nodes</p>{top_nodes.to_html(index=False, float_format=lambda v: f'{v:.4g}')}</div>")


_COLOR_STOPS = [(1.0, 1.0, 0.8), (0.996, 0.851, 0.463), (0.992, 0.553, 0.235), (0.890, 0.102, 0.110),
                (0.694, 0.0, 0.149)]


def time_color(fraction: float) -> str:
    """A colour from pale yellow (0) through orange to dark red (1), as ``#rrggbb``.

    Example:
        >>> time_color(0.0), time_color(1.0)
        ('#ffffcc', '#b10026')
    """
    f = min(1.0, max(0.0, float(fraction))) * (len(_COLOR_STOPS) - 1)
    i = min(int(f), len(_COLOR_STOPS) - 2)
    t = f - i
    a, b = _COLOR_STOPS[i], _COLOR_STOPS[i + 1]
    return "#" + "".join(f"{round(255 * (x + (y - x) * t)):02x}" for x, y in zip(a, b))


# ------------------------------------------------------------------------------------------------ profile()

@dataclasses.dataclass
class _Target:
    graph_module: torch.fx.GraphModule
    args: tuple
    kwargs: dict
    what: str
    model: nn.Module | None

    @property
    def name(self) -> str:
        return type(self.model if self.model is not None else self.graph_module).__name__


def _resolve(model_or_captured: Any, example_inputs: Any) -> _Target:
    from fxforge.capture import capture, normalize_inputs
    from fxforge.runtime.native import OptimizedModule
    from fxforge.runtime.signature import input_signature

    args, kwargs = normalize_inputs(example_inputs)
    if isinstance(model_or_captured, OptimizedModule):
        opt = model_or_captured
        if example_inputs is None:
            if opt.captured is None:
                raise ValueError("profile: this OptimizedModule has not run yet; pass example_inputs")
            args, kwargs = opt.captured.example_args, opt.captured.example_kwargs
        captured = opt.prepare(*args, **kwargs)
        if captured is None:
            raise ValueError(f"profile: {type(opt.original).__name__} runs eagerly for these inputs (fxforge "
                             "could not capture it), so there is no graph to profile")
        executable = opt.cache.executables.get(input_signature(args, kwargs, opt.original.training))
        if executable is not None:
            return _Target(executable, args, kwargs, "lowered graph", opt.original)
        return _Target(captured.graph_module, args, kwargs, "rewritten graph", opt.original)
    if isinstance(model_or_captured, Captured):
        cap = model_or_captured
        if example_inputs is None:
            args, kwargs = cap.example_args, cap.example_kwargs
        rewritten = any(getattr(cap.report, "counts", {}).values())
        return _Target(cap.graph_module, args, kwargs, "rewritten graph" if rewritten else "captured graph",
                       cap.module)
    if isinstance(model_or_captured, torch.fx.GraphModule) and example_inputs is not None:
        return _Target(model_or_captured, args, kwargs, "graph", None)
    if isinstance(model_or_captured, nn.Module):
        if example_inputs is None:
            raise ValueError("profile: example_inputs are needed to capture a model")
        cap = capture(model_or_captured, example_inputs)
        return _Target(cap.graph_module, cap.example_args, cap.example_kwargs, "captured graph", model_or_captured)
    raise TypeError("profile takes an nn.Module, a fxforge.Captured or an OptimizedModule, "
                    f"got {type(model_or_captured).__name__}")


def profile(model_or_captured: Any, example_inputs: Any = None, *, warmup: int = 2, repeat: int = 10,
            device: torch.device | str | None = None) -> Profile:
    """Profile a model's graph node by node: time, FLOPs, bytes, roofline verdict, memory.

    What is profiled:

    - an ``nn.Module``: captured with :func:`fxforge.capture` (no rewrites), its graph;
    - a :class:`~fxforge.Captured` (from ``fxforge.capture`` or ``fxforge.rewrite``): its graph as it is
      (fused ops are custom-op calls choosing their kernel at each call);
    - an :class:`~fxforge.OptimizedModule`: the graph it runs for these inputs when no gradient is
      recorded: the lowered graph (:func:`fxforge.runtime.lowering.lower`), whose fused ops are direct
      calls of their oneDNN/cuDNN kernels on prepacked weights (their ``op`` is still
      ``fxforge.conv_pointwise``; ``target`` names the kernel). (With gradients on, it runs the rewritten
      graph instead: profile ``opt.captured`` for that.)

    Nodes run under ``torch.no_grad()``; the graph's buffers (BatchNorm statistics in training mode) and the
    RNG are restored afterwards. See the module docstring for every column.

    Args:
        model_or_captured: what to profile (above).
        example_inputs: a tuple of inputs, one tensor, or a dict of keyword inputs; for a ``Captured`` or an
            ``OptimizedModule`` that has run, the inputs it was captured with by default.
        warmup: untimed runs first.
        repeat: timed runs; each node's time is its median.
        device: the device whose roofline judges the nodes (default: the inputs' or parameters' device).
            Inputs and the model are not moved.

    Returns:
        A :class:`Profile`.

    Example:
        >>> conv = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1)
        >>> p = fxforge.profile(conv, (torch.randn(2, 3, 16, 16),), warmup=1, repeat=2)
        >>> int(p.table["flops"][0]) == 2 * 2 * 8 * 8 * 3 * 3 * 3 * 8
        True
    """
    import pandas as pd

    from fxforge.verify import isolated

    if warmup < 0 or repeat < 1:
        raise ValueError(f"profile needs warmup >= 0 and repeat >= 1 (got {warmup}, {repeat})")
    target = _resolve(model_or_captured, example_inputs)
    graph_module, args, kwargs, what, name = target.graph_module, target.args, target.kwargs, target.what, target.name
    values = placeholder_values(graph_module, args, kwargs)
    run_device = device_of(graph_module, values)
    judge = torch.device(device) if device is not None else run_device
    runner = _NodeRunner(graph_module, run_device)
    with isolated(graph_module), torch.no_grad():
        runner.count(values)
        runner.time(values, warmup, repeat)
        graph_ms = _time_graph(graph_module, args, kwargs, run_device, repeat)
    if runner.uncounted:
        warnings.warn(f"fxforge.profile: {len(runner.uncounted)} node(s) could not run under torch's FLOP counter "
                      f"and count 0 FLOPs: {', '.join(runner.uncounted[:5])}", stacklevel=2)
    machine = measure_machine(judge, dtype=_compute_dtype(graph_module, values, judge))
    timeline = _simulate(graph_module, runner.values)
    live = dict(zip(timeline.nodes, timeline.after))
    modules = module_paths(graph_module, target.model)
    rows = []
    for node in graph_module.graph.nodes:
        if node.op not in CALL_OPS:
            continue
        times = runner.times.get(node.name) or [0.0]
        flops, nbytes = int(runner.flops.get(node.name, 0)), int(runner.bytes.get(node.name, 0))
        intensity = flops / nbytes if nbytes > 0 else (math.inf if flops > 0 else 0.0)
        rows.append({
            "node": node.name, "op": op_type(node, graph_module), "target": target_name(node),
            "module": modules.get(node.name, ""), "source": node_source(node) or "",
            "time_ms": float(statistics.median(times)), "flops": flops, "bytes": nbytes,
            "intensity": float(intensity), "bound": machine.bound(intensity),
            "live_bytes": int(live.get(node.name, 0)), "measured_live_bytes": int(runner.measured.get(node.name, 0)),
        })
    table = pd.DataFrame(rows, columns=COLUMNS)
    return Profile(table=table, machine=machine, graph_module=graph_module, timeline=timeline, graph_ms=graph_ms,
                   what=what, name=name, warmup=warmup, repeat=repeat, device=str(run_device))


def _compute_dtype(graph_module: nn.Module, values: list[Any], device: torch.device) -> torch.dtype:
    """The dtype the roofline's peak is measured in: float32, or on CUDA the half-precision dtype most of
    the parameters (else inputs) have (their peak is several times float32's)."""
    if device.type != "cuda":
        return torch.float32
    tensors = [*graph_module.parameters()] or tensor_leaves(values)
    counts: dict[torch.dtype, int] = defaultdict(int)
    for t in tensors:
        if t.is_floating_point():
            counts[t.dtype] += t.numel()
    dtype = max(counts, key=counts.__getitem__) if counts else torch.float32
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.float32


def _time_graph(graph_module: torch.fx.GraphModule, args: tuple, kwargs: dict, device: torch.device,
                repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        graph_module(*args, **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append((time.perf_counter() - start) * 1e3)
    return float(statistics.median(samples))
