"""Symbolic sizes: which calls a shape-generic graph serves.

A graph captured with dynamic dims (``torch.export`` with ``Dim.AUTO``) holds sympy expressions where the
example had sizes: its placeholders' fake values have shapes like ``[s0, s1]`` and strides like
``(s1, 1)``. :class:`ShapeGuard` reads them once, with the range each symbol may take, and for a call
answers whether the graph serves it: every static size equal, every symbol bound consistently (two inputs
sharing ``s1`` must agree), every symbol in its range, every stride as the graph assumed, and every size
assumption a rewrite made after capture (the guards it added to the graph's ``ShapeEnv``, such as
``Eq(s1, 64)`` when a rewrite read a size as a number) true for the call's sizes. The answer is made once
per input signature; the plan cache remembers it.

Kernel choices per shape bucket are made where the kernels run (:mod:`fxforge.lowering.buckets`).

Example:
    >>> import torch
    >>> from torch.export import Dim
    >>> ep = torch.export.export(torch.nn.Linear(4, 2), (torch.ones(3, 4),), dynamic_shapes=({0: Dim.AUTO},))
    >>> guard = ShapeGuard.of(ep.module())
    >>> guard.check(guard.leaves((torch.ones(7, 4),), {})) is None, guard.check([torch.ones(7, 5)])
    (True, 'input 0 dim 1 is 5; the graph takes 4')
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import sympy
import torch
from torch.utils import _pytree as pytree
from torch.utils._sympy.numbers import int_oo


def size_expr(value: Any) -> Any:
    """A size as an int or a sympy expression (comparing those adds no guard to a symbolic graph).

    Example:
        >>> ep = torch.export.export(torch.nn.Linear(4, 2), (torch.ones(3, 4),),
        ...                          dynamic_shapes=({0: torch.export.Dim.AUTO},))
        >>> x = ep.graph_module.graph.find_nodes(op="placeholder")[-1]
        >>> [type(size_expr(s)).__name__ for s in x.meta["val"].shape]
        ['Symbol', 'int']
    """
    if isinstance(value, torch.SymInt):
        expr = value.node.expr
        return int(expr) if expr.is_number else expr
    return int(value)


def shape_env_of(graph_module: torch.fx.GraphModule) -> Any:
    """The ``ShapeEnv`` behind a graph's symbolic sizes (None for a graph with static shapes only).

    Example:
        >>> shape_env_of(torch.fx.symbolic_trace(torch.nn.ReLU())) is None
        True
    """
    for node in graph_module.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            for size in (*value.shape, *value.stride()):
                if isinstance(size, torch.SymInt):
                    return size.node.shape_env
    return None


def is_symbolic(graph_module: torch.fx.GraphModule) -> bool:
    """Whether a graph's inputs have symbolic sizes (it serves more than one shape).

    Example:
        >>> is_symbolic(torch.fx.symbolic_trace(torch.nn.ReLU()))
        False
    """
    return bool(ShapeGuard.of(graph_module).symbols) if shape_env_of(graph_module) is not None else False


@dataclasses.dataclass
class ShapeGuard:
    """The calls a graph with symbolic sizes serves.

    Attributes:
        inputs: per flattened input leaf, ``(sizes, strides)`` as ints and sympy expressions, or None for a
            leaf that is not a tensor.
        ranges: each symbol's ``(lower, upper)`` bounds (upper may be ``math.inf``).
        assumptions: size relations rewrites assumed after capture (sympy booleans over the symbols).
        shape_env: the ``ShapeEnv`` the symbols live in (its guards past ``guards_at_capture`` are the
            rewrites' assumptions).
        guards_at_capture: how many guards the ``ShapeEnv`` held when the graph was captured.
        keywords: the keyword inputs' names in the graph's order (None: positional inputs only).
        excluded: symbol values at which the plan was found to differ from eager (see :meth:`exclude`).
    """

    inputs: list[tuple[tuple, tuple] | None]
    ranges: dict[Any, tuple[int, float]]
    assumptions: list[Any] = dataclasses.field(default_factory=list)
    shape_env: Any = None
    guards_at_capture: int = 0
    keywords: tuple[str, ...] | None = None
    excluded: list[frozenset] = dataclasses.field(default_factory=list)  # see :meth:`exclude`

    @classmethod
    def of(cls, graph_module: torch.fx.GraphModule, ranges: dict | None = None) -> ShapeGuard:
        """Read a graph's placeholders; ``ranges`` maps symbols to ``ValueRanges`` (torch.export's
        ``range_constraints``), else the ``ShapeEnv``'s ranges are used.

        Example:
            >>> ShapeGuard.of(torch.fx.symbolic_trace(torch.nn.ReLU())).symbols
            []
        """
        inputs: list[tuple[tuple, tuple] | None] = []
        for node in graph_module.graph.find_nodes(op="placeholder"):
            value = node.meta.get("val")
            if isinstance(value, torch.Tensor):
                inputs.append((tuple(size_expr(s) for s in value.shape), tuple(size_expr(s) for s in value.stride())))
            else:
                inputs.append(None)
        env = shape_env_of(graph_module)
        symbols = {s for entry in inputs if entry for e in (*entry[0], *entry[1]) if not isinstance(e, int)
                   for s in e.free_symbols}
        source = ranges if ranges is not None else (env.var_to_range if env is not None else {})
        bounds = {}
        for symbol in symbols:
            value_range = source.get(symbol)
            bounds[symbol] = (0, math.inf) if value_range is None else (
                _bound(value_range.lower, 0), _bound(value_range.upper, math.inf))
        in_spec = getattr(graph_module, "_in_spec", None)
        keywords = None
        if in_spec is not None and in_spec.num_children == 2 and in_spec.child(1).type is dict:
            keywords = tuple(in_spec.child(1).context)
        return cls(inputs, bounds, [], env, len(env.guards) if env is not None else 0, keywords)

    @property
    def symbols(self) -> list[Any]:
        """The symbols, sorted by name."""
        return sorted(self.ranges, key=str)

    def take_assumptions(self) -> list[str]:
        """Record the guards rewrites added to the ``ShapeEnv`` since capture as assumptions every call
        must meet; returns them as text (for the report).

        Example:
            >>> ShapeGuard([], {}).take_assumptions()
            []
        """
        if self.shape_env is None:
            return []
        new = [g.expr for g in self.shape_env.guards[self.guards_at_capture:]]
        self.guards_at_capture = len(self.shape_env.guards)
        symbols = set(self.ranges)
        new = [e for e in new if e.free_symbols and e.free_symbols <= symbols]
        self.assumptions.extend(new)
        return [str(e) for e in new]

    def bind(self, sizes: Sequence[Any]) -> dict[Any, int] | str:
        """The symbols' values for a call's input leaves (tensors, or their ``(shape, strides)``), or the
        reason the call does not fit (a static size that differs, two inputs disagreeing about one symbol)."""
        if len(sizes) != len(self.inputs):
            return f"the call has {len(sizes)} inputs; the graph takes {len(self.inputs)}"
        binding: dict[Any, int] = {}
        for position, (leaf, entry) in enumerate(zip(sizes, self.inputs)):
            if entry is None:
                continue
            shape = tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else leaf[0] if leaf is not None else None
            if shape is None or len(shape) != len(entry[0]):
                return f"input {position} is not a tensor of rank {len(entry[0])}"
            for dim, (size, expr) in enumerate(zip(shape, entry[0])):
                if isinstance(expr, int):
                    if size != expr:
                        return f"input {position} dim {dim} is {size}; the graph takes {expr}"
                elif isinstance(expr, sympy.Symbol) and binding.setdefault(expr, size) != size:
                    return f"input {position} dim {dim} is {size}, but {expr} is {binding[expr]} elsewhere"
        return binding

    def check(self, leaves: Sequence[Any]) -> str | None:
        """None when the graph serves a call with these flattened input leaves, else why not.

        Example:
            >>> ShapeGuard([((2,), (1,))], {}).check([torch.ones(3)])
            'input 0 dim 0 is 3; the graph takes 2'
        """
        return self.check_sizes([(tuple(t.shape), tuple(t.stride())) if isinstance(t, torch.Tensor) else None
                                 for t in leaves])

    def check_sizes(self, sizes: Sequence[tuple[tuple, tuple] | None]) -> str | None:
        """:meth:`check` for the leaves' ``(shape, strides)`` (None for a leaf that is not a tensor).

        Example:
            >>> ShapeGuard([((2,), (1,))], {}).check_sizes([((2,), (1,))]) is None
            True
        """
        binding = self.bind(sizes)
        if isinstance(binding, str):
            return binding
        for symbol, (lower, upper) in self.ranges.items():
            if symbol not in binding:
                return f"{symbol} is not an input size"
            if not lower <= binding[symbol] <= upper:
                return f"{symbol} = {binding[symbol]} is outside the graph's range [{lower}, {upper}]"
        for position, (leaf, entry) in enumerate(zip(sizes, self.inputs)):
            if entry is None:
                continue
            shape, strides = leaf
            for dim, (size, expr) in enumerate(zip(shape, entry[0])):
                if not isinstance(expr, (int, sympy.Symbol)) and evaluate(expr, binding) != size:
                    return f"input {position} dim {dim} is {size}; the graph takes {expr} = {evaluate(expr, binding)}"
            if math.prod(shape) > 1 and any(shape[d] > 1 and evaluate(expr, binding) != strides[d]
                                            for d, expr in enumerate(entry[1])):
                return f"input {position} has strides {strides}; the graph takes {entry[1]}"
        for assumption in self.assumptions:
            if not bool(assumption.xreplace({s: sympy.Integer(v) for s, v in binding.items()})):
                return f"a rewrite assumed {assumption}"
        for values in self.excluded:
            if all(binding.get(symbol) == value for symbol, value in values):
                return "the plan differed from eager at " + ", ".join(f"{s} = {v}" for s, v in sorted(values, key=str))
        return None

    def untraced(self, sizes: Sequence[tuple[tuple, tuple] | None]) -> frozenset:
        """The symbols a call (the leaves' ``(shape, strides)``, served by :meth:`check_sizes`) binds to 0 or
        1, with their values: sizes torch.export never traces at (it traces a dynamic dim at 2 or more and
        assumes the code takes the same path at 1, which code that branches on a size of 1 breaks).

        Example:
            >>> s0 = sympy.Symbol("s0")
            >>> guard = ShapeGuard([((s0, 4), (4, 1))], {s0: (1, math.inf)})
            >>> guard.untraced([((1, 4), (4, 1))]), guard.untraced([((3, 4), (4, 1))])
            (frozenset({(s0, 1)}), frozenset())
        """
        binding = self.bind(sizes)
        if isinstance(binding, str):
            return frozenset()
        return frozenset((symbol, value) for symbol, value in binding.items() if value <= 1)

    def exclude(self, values: frozenset) -> None:
        """Stop serving calls that bind the symbols to these values (pairs from :meth:`untraced`).

        Example:
            >>> s0 = sympy.Symbol("s0")
            >>> guard = ShapeGuard([((s0,), (1,))], {s0: (1, math.inf)})
            >>> guard.exclude(frozenset({(s0, 1)})); guard.check_sizes([((1,), (1,))])
            'the plan differed from eager at s0 = 1'
        """
        self.excluded.append(values)

    def excludes(self, sizes: Sequence[tuple[tuple, tuple] | None]) -> bool:
        """Whether a call (the leaves' ``(shape, strides)``) binds the symbols to values :meth:`exclude` took out.

        Example:
            >>> s0 = sympy.Symbol("s0")
            >>> guard = ShapeGuard([((s0,), (1,))], {s0: (1, math.inf)})
            >>> guard.exclude(frozenset({(s0, 1)})); guard.excludes([((1,), (1,))]), guard.excludes([((2,), (1,))])
            (True, False)
        """
        binding = self.bind(sizes)
        return not isinstance(binding, str) and any(all(binding.get(s) == v for s, v in values) for values in self.excluded)

    def describe(self) -> str:
        """The symbols and their ranges, for reports: ``s0 in [2, inf), s1 in [2, 512]``.

        Example:
            >>> ShapeGuard([], {sympy.Symbol("s0"): (2, math.inf)}).describe()
            's0 in [2, inf)'
        """
        parts = []
        for symbol in self.symbols:
            lower, upper = self.ranges[symbol]
            parts.append(f"{symbol} in [{lower}, {upper}]" if upper != math.inf else f"{symbol} in [{lower}, inf)")
        return ", ".join(parts)

    def leaves(self, args: tuple, kwargs: dict) -> list[Any]:
        """A call's input leaves in the order of the graph's placeholders (keyword inputs in the order the
        graph was captured with, whatever order the call gives them in).

        Example:
            >>> ShapeGuard([None, None], {}, keywords=("a", "b")).leaves((), {"b": 2, "a": 1})
            [1, 2]
        """
        if self.keywords is not None and set(kwargs) == set(self.keywords) and tuple(kwargs) != self.keywords:
            kwargs = {k: kwargs[k] for k in self.keywords}
        return pytree.tree_leaves((tuple(args), dict(kwargs)))


def hint(value: Any) -> int:
    """A size as an int: a symbolic size's value in the example the graph was captured with, read without
    adding a guard (for estimates such as memory planning, which must not pin the graph to that size).

    Example:
        >>> hint(3)
        3
    """
    if isinstance(value, torch.SymInt):
        node_hint = value.node.hint
        if node_hint is not None:
            return int(node_hint)
        return int(value.node.shape_env.size_hint(value.node.expr, allow_none=True) or 0)
    return int(value)


def _bound(value: Any, infinite: float) -> Any:
    """A range bound as an int, or ``infinite`` for sympy's infinities."""
    return infinite if value in (int_oo, -int_oo, sympy.oo, -sympy.oo) else int(value)


def evaluate(expr: Any, binding: dict[Any, int]) -> int:
    """An int or sympy size for the symbols' values.

    Example:
        >>> s = sympy.Symbol("s0")
        >>> evaluate(2 * s + 1, {s: 3})
        7
    """
    if isinstance(expr, int):
        return expr
    return int(expr.xreplace({s: sympy.Integer(v) for s, v in binding.items()}))


def concrete(values: Sequence[Any], binding: dict[Any, int]) -> tuple[int, ...]:
    """Sizes or strides (ints or ``SymInt``) with the symbols replaced by their values.

    Example:
        >>> concrete([2, 3], {})
        (2, 3)
    """
    return tuple(evaluate(size_expr(v), binding) for v in values)
