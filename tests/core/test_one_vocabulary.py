"""One op vocabulary (issue 47): the pattern engine's canonical ops, the profiler's op names and the attention
readers' tables are all read from fxforge.core.vocabulary, so every call form has the same name everywhere."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from fxforge.core import vocabulary
from fxforge.core.vocabulary import COMPARISONS, COPIES, OPS, SAME_VALUES, SIGNATURES, class_op_name, op_name
from fxforge.rewrites import canonical
from fxforge.rewrites.attention.finite import never_infinite
from fxforge.rewrites.attention.index_masks import Index, Keep, read
from fxforge.rewrites.canonical import canonicalize
from fxforge.runtime.profile import op_names
from fxforge.runtime.profile.op_names import op_type

F = nn.functional
aten = torch.ops.aten


def _in_order(forms) -> list:
    """A vocabulary entry's forms (a frozenset) in an order every pytest-xdist worker agrees on: by module,
    qualified name and name, which do not depend on the process (a set's order of functions does). The name
    matters: torch's ``boolean_dispatch`` makes ``max_pool2d``, ``adaptive_max_pool2d`` and their kin functions
    that share one module and qualified name, and ``repr`` tells them apart only by address, which differs
    between workers (a fresh-clone run's workers collected them in two orders and refused to start)."""
    def key(f) -> tuple[str, ...]:
        return (str(getattr(f, "__module__", "")), str(getattr(f, "__qualname__", f)),
                str(getattr(f, "__name__", "")), re.sub(r" at 0x[0-9a-f]+", "", repr(f)))

    return sorted(forms, key=key)


def _forms():
    """(op, kind, form) for every form the vocabulary lists."""
    for name, forms in OPS.items():
        for f in _in_order(forms.functions):
            yield name, "function", f
        for m in _in_order(forms.methods):
            yield name, "method", m
        for cls in _in_order(forms.modules):
            yield name, "module", cls


def _module(cls: type) -> nn.Module:
    """An instance of ``cls`` without calling its constructor (whose arguments differ from class to class)."""
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    return module


def test_the_canonical_signatures_are_the_vocabularys():
    assert set(SIGNATURES) <= set(OPS)
    assert canonical.SIGNATURES is vocabulary.SIGNATURES


@pytest.mark.parametrize("name, kind, form", list(_forms()), ids=lambda v: getattr(v, "__name__", str(v)))
def test_the_profiler_names_every_form_as_the_vocabulary_does(name, kind, form):
    root = nn.Module()
    g = torch.fx.Graph()
    x = g.placeholder("x")
    if kind == "module":
        root.m = _module(form)
        node = g.call_module("m", (x,))
    elif kind == "method":
        node = g.call_method(form, (x, x))  # (the arguments are not read: binary operators need two to print)
    else:
        node = g.call_function(form, (x, x))
    gm = torch.fx.GraphModule(root, g)
    expected = class_op_name(form) if kind == "module" else op_name(node)
    assert expected is not None and (expected == name or expected in OPS)  # an earlier op may list it too
    assert op_type(node, gm) == expected == op_name(node, gm)


def test_a_hooked_module_is_still_named_by_what_it_computes_in_a_profile():
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.ReLU()))
    gm.get_submodule("0").register_forward_hook(lambda *a: None)
    node = next(n for n in gm.graph.nodes if n.op == "call_module")
    assert op_name(node, gm) is None  # no rewrite may replace the call: it runs a hook
    assert op_type(node, gm) == "relu"


def test_the_profiler_keeps_no_op_table_of_its_own():
    tables = sorted(k for k, v in vars(op_names).items() if isinstance(v, dict) and not k.startswith("__"))
    assert tables == ["FUSED"]  # fxforge's fused kernels, which the vocabulary does not list


@pytest.mark.parametrize("fn", [nn.ReLU6(), nn.Hardtanh(0.0, 6.0), lambda x: F.relu6(x),
                                lambda x: F.hardtanh(x, 0.0, 6.0)])
def test_relu6_is_hardtanh_0_6_for_the_pattern_engine_and_the_profiler(fn):
    gm = torch.fx.symbolic_trace(fn if isinstance(fn, nn.Module) else nn.Sequential(_Lambda(fn)))
    node = next(n for n in gm.graph.nodes if n.op.startswith("call"))
    op = canonicalize(node, gm)
    assert (op.name, op.args["min_val"], op.args["max_val"]) == ("hardtanh", 0.0, 6.0)
    assert op_type(node, gm) == op_name(node, gm) == "hardtanh"


def test_aten_relu6_is_hardtanh_0_6():
    g = torch.fx.Graph()
    node = g.call_function(aten.relu6.default, (g.placeholder("x"),))
    gm = torch.fx.GraphModule(nn.Module(), g)
    op = canonicalize(node, gm)
    assert (op.name, op.args["min_val"], op.args["max_val"]) == ("hardtanh", 0.0, 6.0)
    assert op_type(node, gm) == "hardtanh"


class _Lambda(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _value_forms(names):
    """(op, node maker) for every function and method form of the ops ``names``."""
    for name in names:
        for f in _in_order(OPS[name].functions):
            yield name, lambda g, a, f=f: g.call_function(f, (a,))
        for m in _in_order(OPS[name].methods):
            yield name, lambda g, a, m=m: g.call_method(m, (a,))


@pytest.mark.parametrize("name, make", list(_value_forms(SAME_VALUES)))
def test_every_form_of_the_vocabularys_same_values_keeps_a_mask_finite(name, make):
    g = torch.fx.Graph()
    keep = g.placeholder("keep")
    keep.meta["val"] = torch.ones(3, dtype=torch.bool)  # holds no infinity
    assert never_infinite(make(g, keep))
    assert not never_infinite(g.call_function(torch.exp, (keep,)))  # an op outside the group proves nothing


@pytest.mark.parametrize("name, make", list(_value_forms(COPIES)))
def test_every_form_of_the_vocabularys_copies_keeps_an_index_formula(name, make):
    g = torch.fx.Graph()
    positions = g.call_function(torch.arange, (g.placeholder("n"),))
    positions.meta["val"] = torch.arange(4)
    assert read(make(g, positions)) == read(positions) == Index(1, ((-1, 1),), 0)


def _comparison_nodes(op):
    for form in [*OPS[op].functions, *OPS[op].methods]:
        g = torch.fx.Graph()
        n = g.placeholder("n")
        query = g.call_function(torch.arange, (n,))
        query.meta["val"] = torch.arange(4)
        column = g.call_method("__getitem__", (query, (slice(None), None)))
        column.meta["val"] = torch.arange(4)[:, None]
        if isinstance(form, str):
            node = g.call_method(form, (query, column))
        else:
            node = g.call_function(form, (query, column))
        node.meta["val"] = torch.ones(4, 4, dtype=torch.bool)
        yield form, node


@pytest.mark.parametrize("op", COMPARISONS)
def test_every_form_of_a_comparison_reads_as_that_condition(op):
    for form, node in _comparison_nodes(op):
        keep = read(node)
        assert isinstance(keep, Keep) and [o for _, o in keep.conditions] == [op], form
