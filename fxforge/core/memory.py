"""Peak activation memory of a graph, simulated from shape metadata.

The code torch.fx generates for a ``GraphModule`` drops each value right after its last use (a value
nobody uses is dropped right after the node that made it), so the order of the nodes decides how many
bytes are alive at once. :func:`simulate_peak` replays that rule on the shape metadata of every node
(``node.meta["val"]``, FakeTensors, which every captured graph carries), storage by storage:

- a node *allocates* the storages of its result that no input of it refers to; views (``view``,
  ``transpose``, ``getitem`` of a multi-output op, ``x.contiguous()`` of a contiguous ``x``...) and
  in-place ops (``relu_``, ``+=``) allocate nothing: their result is a storage they were given, which
  they keep alive for as long as they are alive themselves. The fake tensors say which storage each
  result lives in, so an op that may or may not copy (``reshape``, ``contiguous``) is counted as what it
  did on these shapes. Nodes without metadata fall back to op semantics (view ops and in-place ops
  alias their first input, anything else allocates an unknown, uncounted amount);
- a storage is freed once every node that refers to it, or uses a value that refers to it, has run;
- graph inputs (placeholders) and parameters/buffers (``get_attr``) are not activations: nothing that
  lives in their storages is counted;
- the graph's outputs stay alive to the end (and are counted: they are allocated during the call).

The peak is the largest number of bytes alive while a node runs: what was alive before it plus what it
allocates (its inputs are still alive then), plus the *scratch* of the few ops known to create a tensor
they drop before returning (:func:`scratch_bytes`: max pooling computes int64 indices, layer and group
norm their mean and rstd, a matrix product copies an operand BLAS cannot read in place). Other scratch
memory an op uses inside its kernel is invisible to the simulation. :mod:`fxforge.runtime.memory` measures
the same quantity on a real run.

Example:
    >>> class Net(torch.nn.Module):
    ...     def forward(self, x):
    ...         a = x * 2            # 4 KiB
    ...         b = a.view(-1)       # a view: nothing new, but a stays alive as long as b
    ...         c = torch.relu(a)    # 4 KiB
    ...         return b * c.view(-1)  # 4 KiB more while a and c are alive
    >>> gm = fxforge.capture(Net(), (torch.ones(32, 32),)).graph_module
    >>> timeline = simulate_peak(gm)
    >>> timeline.peak_bytes, timeline.peak_node, timeline.output_bytes
    (12288, 'mul_1', 4096)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fxforge.core.nodes import is_inplace, is_view_op, submodule
from fxforge.core.symbolic import hint
from fxforge.core.vocabulary import argument, module_op_name, op_name

_ROOTS = ("placeholder", "get_attr")

def scratch_bytes(node: torch.fx.Node, gm: torch.nn.Module) -> int:
    """Bytes ``node`` allocates and frees again while it runs (0 for ops not known to).

    Known: max pooling in 2 and 3 dimensions (``F.max_pool2d``, ``nn.MaxPool3d``, adaptive ones...) without
    ``return_indices`` computes int64 indices the size of its result; layer norm and group norm compute a
    mean and an rstd per normalized group; a matrix product (``mm``, ``addmm``, ``matmul`` of two matrices)
    copies each operand BLAS cannot read in place (:func:`blas_copy_bytes`), such as the gradient of a sum,
    an expanded tensor whose strides are 0.

    Example:
        >>> gm = fxforge.capture(torch.nn.MaxPool2d(2), (torch.ones(1, 1, 8, 8),)).graph_module
        >>> [scratch_bytes(n, gm) for n in gm.graph.nodes if n.op.startswith("call")]   # 16 int64 indices
        [128]
    """
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or node.op not in ("call_function", "call_module"):
        return 0
    if node.op == "call_function" and node.target in _MATRIX_PRODUCTS:
        operands = [_meta(a) for a in node.args[_MATRIX_PRODUCTS[node.target]:][:2]]
        if len(operands) == 2 and all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in operands):
            return sum(blas_copy_bytes(t) for t in operands)
        return 0
    # Max pooling computes the argmax (int64, the shape of the result) and returns only the values; layer
    # and group norm compute their mean and rstd (the input's dtype) and return only the normalized tensor.
    module = submodule(node, gm)
    name = module_op_name(module) if module is not None else op_name(node)
    if name == "max_pool":
        indices = module.return_indices if module is not None else argument(node, 5, "return_indices", False)
        return 0 if indices else hint(value.numel()) * 8
    if name == "layer_norm":
        shape = module.normalized_shape if module is not None else argument(node, 1, "normalized_shape", ())
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        groups = hint(value.numel()) // max(1, hint(torch.Size(shape).numel()))
        return 2 * groups * value.element_size()
    if name == "group_norm":
        groups = module.num_groups if module is not None else argument(node, 1, "num_groups", 1)
        return 2 * hint(value.shape[0]) * int(groups) * value.element_size()
    return 0


# A matrix product's first matrix operand: ``mm(a, b)``, ``addmm(bias, a, b)``.
_MATRIX_PRODUCTS = {torch.ops.aten.mm.default: 0, torch.ops.aten.addmm.default: 1, torch.mm: 0, torch.addmm: 1,
                    torch.matmul: 0}


def _meta(arg: Any) -> Any:
    return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg


def blas_copy_bytes(matrix: torch.Tensor) -> int:
    """Bytes a matrix product copies ``matrix`` to before BLAS reads it (0 when BLAS reads it in place).

    BLAS reads a matrix in row-major or column-major order: one stride 1, and the other at least the size
    of that dimension (a dimension of size 1 may have any stride). ATen copies any other operand to a
    contiguous temporary inside the kernel, where a dispatch mode does not see it (measured against the CPU
    allocator's records for every layout in ``tests/core/test_memory_scratch.py``).

    Example:
        >>> blas_copy_bytes(torch.ones(4, 8)), blas_copy_bytes(torch.ones(8, 4).t())
        (0, 0)
        >>> blas_copy_bytes(torch.ones(()).expand(4, 8))    # a sum's gradient: strides (0, 0)
        128
    """
    (rows, cols), (row_stride, col_stride) = matrix.shape, matrix.stride()
    rows, cols, row_stride, col_stride = (hint(v) for v in (rows, cols, row_stride, col_stride))
    row_major = col_stride == 1 and (row_stride >= max(1, cols) or rows == 1)
    column_major = row_stride == 1 and (col_stride >= max(1, rows) or cols == 1)
    return 0 if row_major or column_major else rows * cols * matrix.element_size()


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors inside a value (a tensor, or any pytree of them); none for what pytree cannot walk.

    Example:
        >>> len(tensor_leaves({"a": torch.ones(1), "b": [torch.ones(2), 3]}))
        2
    """
    if isinstance(value, torch.Tensor):
        return [value]
    if value is None or isinstance(value, (int, float, bool, str, torch.SymInt)):
        return []
    try:
        leaves = pytree.tree_leaves(value)
    except Exception:  # noqa: BLE001 - a value pytree cannot walk holds no tensor we can see
        return []
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def value_bytes(value: Any) -> int:
    """Bytes of the tensors inside a value (a tensor or any pytree of them; symbolic sizes at their hint).

    Example:
        >>> value_bytes({"a": torch.ones(2, 3), "b": [torch.ones(4, dtype=torch.int8), 7]})
        28
    """
    return sum(hint(t.numel()) * t.element_size() for t in tensor_leaves(value))


def _storage_of(tensor: torch.Tensor) -> tuple[int, int] | None:
    """``(identity, bytes)`` of a tensor's storage, or None where it has none we can read."""
    try:
        storage = tensor.untyped_storage()
        return storage._cdata, hint(storage.nbytes())  # symbolic sizes: the example's (no guard)
    except Exception:  # noqa: BLE001 - sparse, nested, symbolic sizes: no storage to account
        return None


class GraphMemory:
    """The storages of a graph's values: which node allocates each, its size, and who keeps it alive.

    Built once from the shape metadata; :meth:`simulate` then replays any node order. The memory
    reordering pass (``fxforge.rewrites.memory_reorder``) schedules on the same model.

    Attributes:
        nodes: every node but the output node, in graph order.
        index: node -> its position in ``nodes``.
        sizes: bytes of each storage (storage ids index this list).
        activation: per storage, True when a node of the graph allocates it (False for the storages of
            inputs and parameters, which are never counted).
        refs: per node, the storages its value lives in.
        allocs: per node, the storages it allocates (the subset of ``refs`` new at that node).
        touches: per node, the storages it keeps alive until it has run: its own ``refs`` and those of
            its inputs. A storage is freed once every node touching it has run.
        pinned: storages the graph returns (alive to the end).
        unknown: names of nodes without shape metadata (their allocations count as 0 bytes).
        scratch: per node, bytes it allocates and frees while it runs (:func:`scratch_bytes`).

    Example:
        >>> gm = fxforge.capture(torch.nn.ReLU(), (torch.ones(8),)).graph_module
        >>> mem = GraphMemory(gm)
        >>> [mem.allocated_bytes(n) for n in mem.nodes]
        [0, 32]
    """

    def __init__(self, graph_module: torch.fx.GraphModule):
        self.graph_module = graph_module
        self.nodes: list[torch.fx.Node] = [n for n in graph_module.graph.nodes if n.op != "output"]
        self.index: dict[torch.fx.Node, int] = {n: i for i, n in enumerate(self.nodes)}
        self.sizes: list[int] = []
        self.activation: list[bool] = []
        self.refs: list[tuple[int, ...]] = []
        self.allocs: list[tuple[int, ...]] = []
        self.touches: list[tuple[int, ...]] = []
        self.unknown: list[str] = []
        self.scratch: list[int] = []
        by_key: dict[int, int] = {}
        for node in self.nodes:
            inputs = [self.refs[self.index[i]] for i in node.all_input_nodes if i in self.index]
            input_storages = {s for refs in inputs for s in refs}
            refs: list[int] = []
            allocs: list[int] = []
            if "val" not in node.meta and node.op not in _ROOTS:
                self.unknown.append(node.name)
                first = node.all_input_nodes[0] if node.all_input_nodes else None
                if first in self.index and (is_view_op(node) or is_inplace(node, graph_module)):
                    refs = list(self.refs[self.index[first]])
                else:
                    allocs = refs = [self._new(0, activation=True)]
            else:
                for leaf in tensor_leaves(node.meta.get("val")):
                    storage = _storage_of(leaf)
                    if storage is None:
                        continue
                    key, nbytes = storage
                    sid = by_key.get(key)
                    # A storage seen before is shared only when an input (or this node) holds it: an alias
                    # has to come through the data flow. Anything else is a new allocation that happens to
                    # reuse an identity (or a module handing out its own buffer).
                    if sid is None or not (sid in input_storages or sid in refs):
                        sid = self._new(nbytes, activation=node.op not in _ROOTS)
                        by_key[key] = sid
                        allocs.append(sid)
                    if sid not in refs:
                        refs.append(sid)
            self.refs.append(tuple(refs))
            self.allocs.append(tuple(allocs))
            self.scratch.append(scratch_bytes(node, graph_module))
            self.touches.append(tuple(dict.fromkeys([*refs, *sorted(input_storages)])))
        self.pinned: set[int] = set()
        for node in graph_module.graph.nodes:
            if node.op == "output":
                for value in node.all_input_nodes:
                    if value in self.index:
                        self.pinned.update(self.refs[self.index[value]])

    def _new(self, nbytes: int, activation: bool) -> int:
        self.sizes.append(nbytes)
        self.activation.append(activation)
        return len(self.sizes) - 1

    def allocated_bytes(self, node: torch.fx.Node) -> int:
        """Activation bytes ``node`` allocates.

        Example:
            >>> from fxforge.core.shapes import annotate
            >>> gm = torch.fx.symbolic_trace(torch.nn.Flatten())
            >>> _ = annotate(gm, (torch.ones(2, 3, 4),), {})
            >>> [GraphMemory(gm).allocated_bytes(n) for n in gm.graph.nodes if n.op.startswith("call")]
            [0]
        """
        return sum(self.sizes[s] for s in self.allocs[self.index[node]] if self.activation[s])

    def consumers(self) -> list[int]:
        """How many nodes touch each storage (it is freed after the last of them).

        Example:
            >>> gm = fxforge.capture(torch.nn.ReLU(), (torch.ones(8),)).graph_module
            >>> GraphMemory(gm).consumers()   # the input: the placeholder and relu; relu's result: relu
            [2, 1]
        """
        counts = [0] * len(self.sizes)
        for touched in self.touches:
            for s in touched:
                counts[s] += 1
        return counts

    def simulate(self, order: Sequence[torch.fx.Node | str] | None = None) -> MemoryTimeline:
        """Replay ``order`` (default: the graph's order) and return its :class:`MemoryTimeline`.

        Args:
            order: nodes or node names; placeholders and ``get_attr`` nodes left out run first, the
                output node is ignored. Every other node must appear exactly once, after its inputs.

        Raises:
            ValueError: a node missing, repeated, unknown, or before one of its inputs.

        Example:
            >>> gm = fxforge.capture(torch.nn.ReLU(), (torch.ones(8),)).graph_module
            >>> GraphMemory(gm).simulate().during
            [0, 32]
        """
        positions = self._check_order(order)
        remaining = self.consumers()
        live = 0
        names, allocated, during, after = [], [], [], []
        peak, peak_node = 0, None
        for i in positions:
            node = self.nodes[i]
            new = sum(self.sizes[s] for s in self.allocs[i] if self.activation[s])
            live += new
            if live + self.scratch[i] > peak:
                peak, peak_node = live + self.scratch[i], node.name
            names.append(node.name)
            allocated.append(new)
            during.append(live + self.scratch[i])
            for s in self.touches[i]:
                remaining[s] -= 1
                if remaining[s] == 0 and self.activation[s] and s not in self.pinned:
                    live -= self.sizes[s]
            after.append(live)
        return MemoryTimeline(names, allocated, during, after, peak, peak_node, live, list(self.unknown),
                              [self.scratch[i] for i in positions])

    def _check_order(self, order: Sequence[torch.fx.Node | str] | None) -> list[int]:
        if order is None:
            return list(range(len(self.nodes)))
        by_name = {n.name: i for i, n in enumerate(self.nodes)}
        positions: list[int] = []
        for item in order:
            if isinstance(item, torch.fx.Node) and item.op == "output":
                continue
            name = item.name if isinstance(item, torch.fx.Node) else str(item)
            if name not in by_name:
                raise ValueError(f"order names {name!r}, which is not a node of the graph")
            positions.append(by_name[name])
        if len(set(positions)) != len(positions):
            raise ValueError("order lists a node twice")
        given = set(positions)
        roots = [i for i, n in enumerate(self.nodes) if n.op in _ROOTS and i not in given]
        missing = [n.name for i, n in enumerate(self.nodes) if i not in given and n.op not in _ROOTS]
        if missing:
            raise ValueError(f"order leaves out {', '.join(missing[:5])}")
        positions = roots + positions
        done: set[torch.fx.Node] = set()
        for i in positions:
            node = self.nodes[i]
            late = [a.name for a in node.all_input_nodes if a not in done]
            if late:
                raise ValueError(f"order runs {node.name} before its input {late[0]}")
            done.add(node)
        return positions


@dataclasses.dataclass
class MemoryTimeline:
    """Live activation bytes of a graph in one node order, node by node.

    Attributes:
        nodes: node names in execution order (placeholders and ``get_attr`` included, with 0 bytes).
        allocated: bytes each node allocated (and left allocated: its result).
        during: bytes alive while each node runs (everything alive before it, what it allocates, its scratch).
        after: bytes alive after each node, once the values it used for the last time are freed.
        peak_bytes: ``max(during)``.
        peak_node: the first node where the peak is reached (None when nothing is allocated).
        output_bytes: bytes alive at the end: the outputs.
        unknown: nodes without shape metadata, counted as allocating 0 bytes.
        scratch: bytes each node allocated and freed again while it ran (:func:`scratch_bytes`).

    Example:
        >>> t = MemoryTimeline(["x", "relu"], [0, 32], [0, 32], [0, 32], 32, "relu", 32, [])
        >>> t.peak_mib, t.rows()[1]
        (3.0517578125e-05, {'node': 'relu', 'allocated': 32, 'during': 32, 'after': 32})
    """

    nodes: list[str]
    allocated: list[int]
    during: list[int]
    after: list[int]
    peak_bytes: int
    peak_node: str | None
    output_bytes: int
    unknown: list[str] = dataclasses.field(default_factory=list)
    scratch: list[int] = dataclasses.field(default_factory=list)

    @property
    def peak_mib(self) -> float:
        """The peak in MiB."""
        return self.peak_bytes / 2**20

    def rows(self) -> list[dict[str, Any]]:
        """One dict per node (``node``, ``allocated``, ``during``, ``after``): ``pandas.DataFrame(rows)``."""
        return [
            {"node": n, "allocated": a, "during": d, "after": f}
            for n, a, d, f in zip(self.nodes, self.allocated, self.during, self.after)
        ]


def simulate_peak(graph_module: torch.fx.GraphModule,
                  order: Sequence[torch.fx.Node | str] | None = None) -> MemoryTimeline:
    """Simulated live activation bytes of ``graph_module`` run in ``order`` (default: its own order).

    See the module docstring for what is counted. Every node needs ``meta["val"]`` (captured graphs
    have it; ``fxforge.core.shapes.annotate`` fills it for a hand-made one).

    Args:
        graph_module: the graph.
        order: a topological order of its nodes (nodes or names); see :meth:`GraphMemory.simulate`.

    Example:
        >>> gm = fxforge.capture(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()),
        ...                      (torch.ones(2, 4),)).graph_module
        >>> simulate_peak(gm).during   # input, linear (64 bytes), relu (64 more, the linear's still alive)
        [0, 64, 128]
    """
    return GraphMemory(graph_module).simulate(order)
