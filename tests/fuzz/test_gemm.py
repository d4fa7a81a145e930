"""The differential fuzz suite for oneDNN's matrix product (:mod:`fxforge.lowering.gemm`): random shapes,
operand layouts, biases and special values (NaN, infinities, zeros) give ``mm``'s / ``addmm``'s results,
in float32 rounding, and the graph rewrite keeps a traced program's outputs.

``make test`` runs the ``short`` profile; ``make fuzz`` runs ``long`` (``FXFORGE_FUZZ=long``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fxforge.lowering import gemm

pytestmark = pytest.mark.skipif(not gemm.onednn_available(), reason="this torch build has no oneDNN linear")

SPECIALS = [float("nan"), float("inf"), -float("inf"), 0.0]


def _matrix(rows, cols, layout, seed, specials):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, cols, generator=g) if layout == "row" else torch.randn(cols, rows, generator=g).t()
    for i, value in enumerate(specials):
        t[(seed + 7 * i) % rows, (seed + 3 * i) % cols] = value
    return t


@given(m=st.integers(1, 70), k=st.integers(1, 70), n=st.integers(1, 70),
       layouts=st.tuples(st.sampled_from(["row", "col"]), st.sampled_from(["row", "col"])),
       bias=st.booleans(), specials=st.lists(st.sampled_from(SPECIALS), max_size=3), seed=st.integers(0, 2**16))
def test_onednn_product_is_mms(m, k, n, layouts, bias, specials, seed):
    a = _matrix(m, k, layouts[0], seed, specials)
    b = _matrix(k, n, layouts[1], seed + 1, [])
    c = torch.randn(n, generator=torch.Generator().manual_seed(seed + 2)) if bias else None
    want = torch.addmm(c, a, b) if bias else torch.mm(a, b)
    got = gemm.onednn_mm(a, b, c)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * k, equal_nan=True)


@given(m=st.integers(16, 160), k=st.integers(16, 160), n=st.integers(16, 160), seed=st.integers(0, 2**16))
def test_a_routed_linear_step_is_the_traced_one(m, k, n, seed):
    g = torch.Generator().manual_seed(seed)
    x, w, bias, grad = (torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g),
                        torch.randn(m, n, generator=g))

    def step(x, w, bias, grad):  # a linear layer's forward and both of its backward products
        return torch.addmm(bias, x, w.t()), torch.mm(grad, w), torch.mm(grad.t(), x)

    gm = torch.fx.experimental.proxy_tensor.make_fx(step, tracing_mode="fake")(x, w, bias, grad)
    want = gm(x, w, bias, grad)
    products = [found[0] for found in map(gemm.product_of, gm.graph.nodes) if found is not None]
    memo = dict.fromkeys(products, True)  # routed as if oneDNN measured faster
    assert gemm.route_matmuls(gm, memo) == 3
    for got, expected in zip(gm(x, w, bias, grad), want):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * max(m, k))
