"""One vocabulary of call forms: every way user code and exported graphs reach the ops fxforge reads.

User code reaches one op in many ways: ``nn.ReLU()``, ``F.relu``, ``torch.relu``, ``x.relu()``, ``relu_``,
operators, and ``aten.*`` ops in exported graphs. :data:`OPS` lists them once per canonical op, read top
to bottom; every stage asks :func:`calls` ("is this node a softmax?") or :func:`op_name` instead of
keeping a table of its own, so the rewrites, the memory model and the profiler agree on what a node is.

One name per op: the profiler's ``op`` column, the pattern engine's canonical ops
(:data:`SIGNATURES`) and the rewrites' readers all use the names of :data:`OPS`. ``nn.ReLU6``, ``F.relu6``
and ``aten.relu6`` are ``hardtanh`` (with ``min_val=0, max_val=6``: :data:`FIXED_ARGUMENTS`): torch itself
defines ReLU6 as ``Hardtanh(0, 6)`` (``nn.ReLU6`` subclasses ``nn.Hardtanh``, ``aten.relu6`` decomposes to
``hardtanh``, and a profile of eager PyTorch shows the ``hardtanh`` kernel), so one pattern with the bounds as
arguments matches both, and a profile groups them as the one kernel they run.

A function form is a callable (``torch.softmax``, ``F.dropout``, ``operator.add``), an ATen overload
(``aten.to.dtype``: that overload only) or an ATen packet (``aten.relu``: any of its overloads). A module
form is an ``nn.Module`` class; a subclass counts only if it keeps the class's ``forward``.

Example:
    >>> g = torch.fx.Graph(); x = g.placeholder("x")
    >>> [op_name(g.call_function(f, (x, 0.1, False))) for f in (torch.dropout, torch.nn.functional.dropout)]
    ['dropout', 'dropout']
    >>> calls(g.call_method("softmax", (x, -1)), "softmax")
    True
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import operator
from typing import Any

import torch
from torch import nn
from torch.fx import Node

F = nn.functional
aten = torch.ops.aten


def _some(owner: Any, *names: str) -> tuple:
    return tuple(getattr(owner, n) for n in names if hasattr(owner, n))


@dataclasses.dataclass(frozen=True)
class CallForms:
    """Every form of one op: functions (callables, ATen overloads or packets), Tensor methods, module classes.

    Example:
        >>> sorted(OPS["relu"].methods)
        ['relu', 'relu_']
    """

    functions: frozenset = frozenset()
    methods: frozenset = frozenset()
    modules: tuple[type, ...] = ()

    def called_by(self, node: Node, gm: torch.nn.Module | None = None) -> bool:
        """Whether ``node`` calls this op (a ``call_module`` node needs ``gm`` to find its module)."""
        if node.op == "call_method":
            return node.target in self.methods
        if node.op == "call_function":
            target = node.target
            try:
                if target in self.functions:
                    return True
            except TypeError:  # an unhashable target
                return False
            return getattr(target, "overloadpacket", None) in self.functions
        if node.op == "call_module" and gm is not None and self.modules:
            return module_form(_submodule(node, gm), self.modules) is not None
        return False


# The hook tables of a module that torch's ``__call__`` runs around its forward.
HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
              "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


def has_hooks(module: Any) -> bool:
    """Whether calling ``module`` runs forward or backward hooks of its own (calling it does more than its
    forward: no rewrite may replace the call).

    Example:
        >>> relu = nn.ReLU(); before = has_hooks(relu)
        >>> _ = relu.register_forward_hook(lambda m, args, out: None)
        >>> before, has_hooks(relu)
        (False, True)
    """
    return any(getattr(module, table, None) for table in HOOK_DICTS)


def module_form(module: Any, classes: tuple[type, ...]) -> type | None:
    """The class among ``classes`` that ``module`` is an instance of without overriding its ``forward`` (and
    without hooks: a hooked module is a call of its own, never one of the ops).

    Example:
        >>> module_form(nn.ReLU6(), (nn.Hardtanh,)) is nn.Hardtanh, module_form(nn.ReLU(), (nn.Hardtanh,))
        (True, None)
    """
    if not isinstance(module, nn.Module) or has_hooks(module):
        return None
    for cls in type(module).__mro__:
        if cls in classes and type(module).forward is cls.forward:
            return cls
    return None


def _submodule(node: Node, gm: torch.nn.Module) -> Any:
    try:
        return gm.get_submodule(node.target)
    except AttributeError:
        return None


def forms(functions: tuple = (), methods: tuple = (), modules: tuple = ()) -> CallForms:
    """A :class:`CallForms` from tuples (functions missing from this torch are left out by :func:`_some`).

    Example:
        >>> forms((torch.relu,), ("relu",)).called_by(torch.fx.Graph().call_method("relu", ()))
        True
    """
    return CallForms(frozenset(functions), frozenset(methods), tuple(modules))


_DROPOUT_FUNCTIONS = (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
                      torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout,
                      aten.dropout.default, aten.feature_dropout.default, aten.alpha_dropout.default,
                      aten.feature_alpha_dropout.default)

# canonical op -> its forms, read top to bottom.
OPS: dict[str, CallForms] = {
    # activations
    "relu": forms((F.relu, F.relu_, torch.relu, torch.relu_, aten.relu, aten.relu_), ("relu", "relu_"), (nn.ReLU,)),
    "hardtanh": forms((F.hardtanh, F.hardtanh_, F.relu6, aten.hardtanh, aten.hardtanh_, aten.relu6), (),
                      (nn.Hardtanh,)),  # nn.ReLU6 is a Hardtanh(0, 6)
    "leaky_relu": forms((F.leaky_relu, F.leaky_relu_, aten.leaky_relu, aten.leaky_relu_), (), (nn.LeakyReLU,)),
    "gelu": forms((F.gelu, aten.gelu, aten.gelu_), (), (nn.GELU,)),
    "silu": forms((F.silu, aten.silu, aten.silu_), (), (nn.SiLU,)),
    "sigmoid": forms((F.sigmoid, torch.sigmoid, torch.sigmoid_, aten.sigmoid, aten.sigmoid_), ("sigmoid", "sigmoid_"),
                     (nn.Sigmoid,)),
    "tanh": forms((F.tanh, torch.tanh, torch.tanh_, aten.tanh, aten.tanh_), ("tanh", "tanh_"), (nn.Tanh,)),
    "hardswish": forms((F.hardswish, aten.hardswish, aten.hardswish_), (), (nn.Hardswish,)),
    "hardsigmoid": forms((F.hardsigmoid, aten.hardsigmoid, aten.hardsigmoid_), (), (nn.Hardsigmoid,)),
    "elu": forms((F.elu, F.elu_, aten.elu, aten.elu_), (), (nn.ELU,)),
    "selu": forms((F.selu, F.selu_, torch.selu, torch.selu_, aten.selu, aten.selu_), (), (nn.SELU,)),
    "celu": forms((F.celu, F.celu_, torch.celu, torch.celu_, aten.celu, aten.celu_), (), (nn.CELU,)),
    "prelu": forms((F.prelu, torch.prelu, aten.prelu, aten._prelu_kernel), (), (nn.PReLU,)),
    "glu": forms((F.glu, aten.glu), (), (nn.GLU,)),
    "softmax": forms((F.softmax, torch.softmax, torch.special.softmax, aten.softmax.int, aten._softmax.default),
                     ("softmax",), (nn.Softmax,)),
    # arithmetic
    "add": forms((operator.add, operator.iadd, torch.add, aten.add, aten.add_), ("add", "add_", "__add__", "__iadd__")),
    "sub": forms((operator.sub, operator.isub, torch.sub, aten.sub, aten.sub_), ("sub", "sub_", "__sub__", "__isub__")),
    "mul": forms((operator.mul, operator.imul, torch.mul, aten.mul, aten.mul_), ("mul", "mul_", "__mul__", "__imul__")),
    "div": forms((operator.truediv, operator.itruediv, torch.div, torch.true_divide, aten.div, aten.div_,
                  aten.true_divide), ("div", "div_", "true_divide", "__truediv__", "__itruediv__")),
    "pow": forms((operator.pow, operator.ipow, torch.pow, aten.pow, aten.pow_), ("pow", "pow_", "__pow__", "__ipow__")),
    "neg": forms((operator.neg, torch.neg, torch.negative, aten.neg, aten.neg_),
                 ("neg", "neg_", "negative", "__neg__")),
    "floor_divide": forms((operator.floordiv, operator.ifloordiv, torch.floor_divide, aten.floor_divide,
                           aten.floor_divide_), ("floor_divide", "floor_divide_", "__floordiv__", "__ifloordiv__")),
    "remainder": forms((operator.mod, operator.imod, torch.remainder, aten.remainder, aten.remainder_),
                       ("remainder", "remainder_", "__mod__", "__imod__")),
    "matmul": forms((operator.matmul, operator.imatmul, torch.matmul, torch.bmm, aten.matmul, aten.mm, aten.bmm),
                    ("matmul", "mm", "bmm", "__matmul__")),  # mm and bmm are matmul on the inputs they accept
    "einsum": forms((torch.einsum, torch.functional.einsum, aten.einsum.default)),
    # boolean masks (``&`` and ``~`` of bool tensors are their logical forms)
    "logical_and": forms((operator.and_, torch.logical_and, torch.bitwise_and, aten.__and__.Tensor,
                          aten.bitwise_and.Tensor, aten.logical_and.default)),
    "logical_not": forms((operator.invert, torch.logical_not, torch.bitwise_not, aten.logical_not.default,
                          aten.bitwise_not.default), ("logical_not", "bitwise_not", "__invert__")),
    **{op: forms((getattr(operator, op), getattr(torch, op), getattr(aten, op).Tensor, getattr(aten, op).Scalar),
                 (op, f"__{op}__")) for op in ("le", "lt", "ge", "gt", "eq", "ne")},
    # layers
    "linear": forms((F.linear, aten.linear), (), (nn.Linear,)),
    "conv1d": forms((F.conv1d, aten.conv1d), (), (nn.Conv1d,)),
    "conv2d": forms((F.conv2d, aten.conv2d), (), (nn.Conv2d,)),
    "conv3d": forms((F.conv3d, aten.conv3d), (), (nn.Conv3d,)),
    **{f"conv_transpose{n}d": forms((getattr(F, f"conv_transpose{n}d"), getattr(aten, f"conv_transpose{n}d")), (),
                                    (getattr(nn, f"ConvTranspose{n}d"),)) for n in (1, 2, 3)},
    "addmm": forms((torch.addmm, aten.addmm), ("addmm",)),
    "batch_norm": forms((F.batch_norm, torch.batch_norm, aten.batch_norm), (),
                        (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)),
    "layer_norm": forms((F.layer_norm, aten.layer_norm.default), (), (nn.LayerNorm,)),
    "group_norm": forms((F.group_norm, aten.group_norm.default), (), (nn.GroupNorm,)),
    "max_pool": forms((F.max_pool2d, F.max_pool3d, torch.max_pool2d, torch.max_pool3d, aten.max_pool2d.default,
                       aten.max_pool3d.default, F.adaptive_max_pool2d, F.adaptive_max_pool3d), (),
                      (nn.MaxPool2d, nn.MaxPool3d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)),
    "dropout": forms(_DROPOUT_FUNCTIONS, (),
                     (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)),
    "identity": forms((aten.alias.default,), (), (nn.Identity,)),
    "multi_head_attention": forms((F.multi_head_attention_forward,), (), (nn.MultiheadAttention,)),
    # dtype, device and memory-format copies
    "to": forms((aten.to.dtype, aten.to.device, aten.to.dtype_layout, aten.to.other, aten._to_copy.default,
                 aten.type_as.default),
                ("to", "type", "type_as", "float", "double", "half", "bfloat16", "int", "long", "short", "bool", "byte",
                 "char", "cpu", "cuda")),
    "contiguous": forms((aten.contiguous.default, torch.Tensor.contiguous), ("contiguous",)),
    "clone": forms((torch.clone, aten.clone.default, aten.lift_fresh_copy.default), ("clone",)),
    "detach": forms((torch.detach, torch.Tensor.detach, aten.detach.default), ("detach",)),
    # shapes and layouts
    "view": forms((aten.view.default, aten._unsafe_view.default), ("view", "view_as")),
    "reshape": forms((torch.reshape, aten.reshape.default, aten.reshape_as.default), ("reshape", "reshape_as")),
    "flatten": forms((torch.flatten, aten.flatten.using_ints), ("flatten",)),
    "unsqueeze": forms((torch.unsqueeze, aten.unsqueeze.default), ("unsqueeze",)),
    "expand": forms((aten.expand.default, aten.expand_as.default, torch.broadcast_to), ("expand", "expand_as")),
    "transpose": forms((torch.transpose, torch.swapaxes, torch.swapdims, aten.transpose.int, aten.swapaxes.default,
                        aten.swapdims.default), ("transpose", "swapaxes", "swapdims")),
    "permute": forms((torch.permute, aten.permute.default), ("permute",)),
    "t": forms((torch.t, aten.t.default), ("t",)),
    "mT": forms((aten.mT.default,)),  # the last two dims swapped, at any rank
    "squeeze": forms((torch.squeeze, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims), ("squeeze",)),
    # selections: a part of the input's values
    "getitem": forms((operator.getitem,), ("__getitem__",)),
    "slice": forms((aten.slice.Tensor,)),
    "select": forms((torch.select, aten.select.int), ("select",)),
    "narrow": forms((torch.narrow, aten.narrow.default), ("narrow",)),
    "index": forms((aten.index.Tensor,)),
    "index_select": forms((torch.index_select, aten.index_select.default), ("index_select",)),
    "repeat_interleave": forms((torch.repeat_interleave, aten.repeat_interleave.self_int), ("repeat_interleave",)),
    # masks
    "masked_fill": forms((torch.masked_fill, aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.masked_fill_.Scalar,
                          aten.masked_fill_.Tensor), ("masked_fill", "masked_fill_")),
    "where": forms((torch.where, aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar),
                   ("where",)),
    # constructors (a ``*_like`` or ``new_*`` one is named by what it fills: ``zeros_like`` is ``zeros``)
    "arange": forms((torch.arange, aten.arange.default, aten.arange.start, aten.arange.start_step)),
    "zeros": forms((torch.zeros, torch.zeros_like, aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default),
                   ("new_zeros", "zero_")),
    "ones": forms((torch.ones, torch.ones_like, aten.ones.default, aten.ones_like.default, aten.new_ones.default),
                  ("new_ones",)),
    # constructors that read only the shape, dtype and device of their first argument, never its values
    "new_like": forms((torch.zeros_like, torch.ones_like, torch.full_like, aten.new_ones.default, aten.new_zeros.default,
                       aten.new_full.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default),
                      ("new_ones", "new_zeros", "new_full")),
    # ``c - x`` as exported graphs write it when ``c`` is a number: ``aten.rsub.Scalar(x, c)`` (other - input)
    "rsub": forms((torch.rsub, aten.rsub)),
}

# The ops that keep their input's values and only change how they are viewed (one group of OPS).
RESHAPES = ("view", "reshape", "flatten", "unsqueeze", "expand")
# The two forms of scaled_dot_product_attention (functional and ATen), and its parameters in order.
SDPA_TARGETS = (F.scaled_dot_product_attention, aten.scaled_dot_product_attention.default)
SDPA_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
# dtype, device and memory-format copies that keep shape and values (as far as the dtype holds them).
CASTS = ("to", "contiguous", "clone")
# Copies of the input as it is: the same shape, dtype and values.
COPIES = ("contiguous", "clone", "identity", "detach")
# Ops whose result holds only values of their first input: views, copies and selections.
SAME_VALUES = (*RESHAPES, "transpose", "permute", "t", "mT", "squeeze", *COPIES, "getitem", "slice", "select", "narrow",
               "index", "index_select")
# Elementwise comparisons, by the name of their operator.
COMPARISONS = ("le", "lt", "ge", "gt", "eq", "ne")



class _Required:
    """The default of a parameter that has none (its value must be given)."""

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED = _Required()

# The ops the pattern engine binds (fxforge.rewrites.canonical): their parameters in order, with defaults
# (REQUIRED: none). Every call form of one of these ops is bound to these names.
SIGNATURES: dict[str, tuple[tuple[str, Any], ...]] = {
    "relu": (("input", REQUIRED),),
    "hardtanh": (("input", REQUIRED), ("min_val", -1.0), ("max_val", 1.0)),
    "leaky_relu": (("input", REQUIRED), ("negative_slope", 0.01)),
    "gelu": (("input", REQUIRED), ("approximate", "none")),
    "silu": (("input", REQUIRED),),
    "sigmoid": (("input", REQUIRED),),
    "tanh": (("input", REQUIRED),),
    "hardswish": (("input", REQUIRED),),
    "hardsigmoid": (("input", REQUIRED),),
    "add": (("input", REQUIRED), ("other", REQUIRED), ("alpha", 1)),
    "sub": (("input", REQUIRED), ("other", REQUIRED), ("alpha", 1)),
    "mul": (("input", REQUIRED), ("other", REQUIRED)),
    "div": (("input", REQUIRED), ("other", REQUIRED), ("rounding_mode", None)),
    "pow": (("input", REQUIRED), ("exponent", REQUIRED)),
    "matmul": (("input", REQUIRED), ("other", REQUIRED)),
    "linear": (("input", REQUIRED), ("weight", REQUIRED), ("bias", None)),
    "addmm": (("input", REQUIRED), ("mat1", REQUIRED), ("other", REQUIRED), ("beta", 1), ("alpha", 1)),  # mat2: other
    "t": (("input", REQUIRED),),
    "flatten": (("input", REQUIRED), ("start_dim", 0), ("end_dim", -1)),
    "where": (("condition", REQUIRED), ("input", REQUIRED), ("other", REQUIRED)),
    "gt": (("input", REQUIRED), ("other", REQUIRED)),
    "batch_norm": (("input", REQUIRED), ("running_mean", REQUIRED), ("running_var", REQUIRED), ("weight", None),
                   ("bias", None), ("training", False), ("momentum", 0.1), ("eps", 1e-5)),
    **{f"conv{n}d": (("input", REQUIRED), ("weight", REQUIRED), ("bias", None), ("stride", 1), ("padding", 0),
                     ("dilation", 1), ("groups", 1)) for n in (1, 2, 3)},
    **{f"conv_transpose{n}d": (("input", REQUIRED), ("weight", REQUIRED), ("bias", None), ("stride", 1), ("padding", 0),
                               ("output_padding", 0), ("groups", 1), ("dilation", 1)) for n in (1, 2, 3)},
    "rsub": (("input", REQUIRED), ("other", REQUIRED), ("alpha", 1)),
}
# Binary ops whose two operands may be swapped.
COMMUTATIVE = frozenset({"add", "mul"})
# Forms that are their op with some arguments fixed: ReLU6 is hardtanh(0, 6) (see the module docstring).
FIXED_ARGUMENTS: dict[Any, dict[str, Any]] = {F.relu6: {"min_val": 0.0, "max_val": 6.0},
                                              aten.relu6: {"min_val": 0.0, "max_val": 6.0}}

# What reads only a tensor's metadata, never its values: attributes, methods and ATen ops.
METADATA_ATTRIBUTES = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "layout"})
METADATA_METHODS = frozenset({"size", "dim", "numel", "get_device"})
METADATA_FUNCTIONS = frozenset({aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int})


def sdpa_arguments(node: Node) -> dict[str, Any]:
    """An SDPA call's arguments by parameter name (positional and keyword alike).

    Example:
        >>> g = torch.fx.Graph(); q = g.placeholder("q")
        >>> sorted(sdpa_arguments(g.call_function(F.scaled_dot_product_attention, (q, q, q), {"is_causal": True})))
        ['is_causal', 'key', 'query', 'value']
    """
    values = dict(zip(SDPA_PARAMETERS, node.args))
    values.update(node.kwargs)
    return values


def calls(node: Any, *names: str, gm: torch.nn.Module | None = None) -> bool:
    """Whether ``node`` calls one of the canonical ops ``names`` in any of its forms.

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x")
        >>> calls(g.call_function(torch.ops.aten.permute.default, (x, [1, 0])), "transpose", "permute")
        True
    """
    return isinstance(node, Node) and any(OPS[name].called_by(node, gm) for name in names)


def op_name(node: Any, gm: torch.nn.Module | None = None) -> str | None:
    """The canonical op ``node`` calls (the first of :data:`OPS` whose forms it uses), or None.

    Example:
        >>> gm = torch.fx.symbolic_trace(nn.Sequential(nn.ReLU6()))
        >>> [op_name(n, gm) for n in gm.graph.nodes if n.op == "call_module"]
        ['hardtanh']
    """
    if not isinstance(node, Node):
        return None
    if node.op == "call_method":
        return _by_method().get(node.target)
    if node.op == "call_function":
        table = _by_function()
        try:
            found = table.get(node.target)
        except TypeError:
            return None
        return found if found is not None else table.get(getattr(node.target, "overloadpacket", None))
    return module_op_name(_submodule(node, gm)) if node.op == "call_module" and gm is not None else None


def module_op_name(module: Any) -> str | None:
    """The canonical op an ``nn.Module`` instance computes (a subclass counts only if it keeps the
    ``forward`` of the class :data:`OPS` lists; a module with hooks computes none), or None.

    Example:
        >>> module_op_name(nn.ReLU6()), module_op_name(nn.Sequential())
        ('hardtanh', None)
    """
    if not isinstance(module, nn.Module) or has_hooks(module):
        return None
    return class_op_name(type(module))


def class_op_name(cls: type) -> str | None:
    """The canonical op instances of the module class ``cls`` compute (a subclass counts only if it keeps the
    ``forward`` of the class :data:`OPS` lists), or None; unlike :func:`module_op_name`, hooks an instance
    may have are not looked at.

    Example:
        >>> class Mine(nn.Linear): pass
        >>> class Other(nn.Linear):
        ...     def forward(self, x): return x
        >>> class_op_name(nn.ReLU6), class_op_name(Mine), class_op_name(Other)
        ('hardtanh', 'linear', None)
    """
    table = _by_module_class()
    found = next((c for c in cls.__mro__ if c in table), None)
    return table[found] if found is not None and cls.forward is found.forward else None


def _by_function() -> dict[Any, str]:
    return _index("functions")


def _by_method() -> dict[str, str]:
    return _index("methods")


def _by_module_class() -> dict[type, str]:
    return _index("modules")


@functools.cache
def _index(kind: str) -> dict[Any, str]:
    """Form -> the first canonical op of :data:`OPS` that lists it, for one kind of form."""
    table: dict[Any, str] = {}
    for name, f in OPS.items():
        for form in getattr(f, kind):
            table.setdefault(form, name)
    return table


def argument(node: Node, index: int, name: str, default: Any = None) -> Any:
    """A call's argument given by keyword ``name`` or at position ``index``, else ``default``.

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x")
        >>> argument(g.call_function(torch.dropout, (x, 0.2), {"train": True}), 2, "train")
        True
    """
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[index] if len(node.args) > index else default


@dataclasses.dataclass(frozen=True)
class Dropout:
    """A dropout call read in its canonical form.

    Attributes:
        input: the value dropped out.
        p: the drop probability (a number, or a node computing it).
        drops: whether it drops anything: training on and p not 0.
    """

    input: Any
    p: Any
    drops: bool


# function -> (the name of its training flag, where it stands, whether it trains when the flag is left out:
# F.dropout does, F.alpha_dropout does not; torch.dropout and ATen's take the flag as a required argument)
_DROPOUT_TRAINING = {fn: ("training", 2, inspect.signature(fn).parameters["training"].default)
                     for fn in (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
                                F.feature_alpha_dropout)}


def read_dropout(node: Node, gm: torch.nn.Module | None = None) -> Dropout | None:
    """``node`` as a :class:`Dropout` (any of its forms), or None when it is no dropout.

    Functional forms train by default only where their signature says so (``F.dropout``); ``torch.dropout``
    and ATen's take the flag as a required argument.

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x")
        >>> read_dropout(g.call_function(torch.dropout, (x, 0.1, False)))
        Dropout(input=x, p=0.1, drops=False)
    """
    if not calls(node, "dropout", gm=gm):
        return None
    if node.op == "call_module":
        module = _submodule(node, gm)
        source = node.args[0] if len(node.args) == 1 and not node.kwargs else None
        return Dropout(source, module.p, bool(module.training and module.p != 0))
    name, index, default = _DROPOUT_TRAINING.get(node.target, ("train", 2, True))
    training = argument(node, index, name, default)
    p = argument(node, 1, "p", 0.5)
    source = argument(node, 0, "input")
    drops = not (training is False or (isinstance(p, (int, float)) and p == 0))
    return Dropout(source, p, drops)


def reads_metadata(node: Node) -> bool:
    """Whether ``node`` reads only its input's metadata (``x.shape``, ``x.size(1)``, ``x.dtype``...).

    Example:
        >>> g = torch.fx.Graph(); x = g.placeholder("x")
        >>> reads_metadata(g.call_function(getattr, (x, "shape"))), reads_metadata(g.call_method("sum", (x,)))
        (True, False)
    """
    if node.op == "call_function" and node.target is getattr:
        return node.args[1] in METADATA_ATTRIBUTES
    if node.op == "call_method":
        return node.target in METADATA_METHODS
    return node.op == "call_function" and node.target in METADATA_FUNCTIONS
