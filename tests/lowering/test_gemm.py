"""fxforge.lowering.gemm: matrix products on oneDNN where they measure faster than torch's BLAS, with mm's
results (float32 rounding), specials and strides, and a graph rewritten only where oneDNN won."""

from __future__ import annotations

import pytest
import torch

from fxforge.lowering import gemm
from fxforge.lowering.gemm import Product, layout_of, onednn_mm, product_of, route_matmuls

aten = torch.ops.aten
pytestmark = pytest.mark.skipif(not gemm.onednn_available(), reason="this torch build has no oneDNN linear")


def _operand(rows: int, cols: int, layout: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) if layout == "row" else torch.randn(cols, rows, generator=g).t()


@pytest.mark.parametrize("a_layout", ["row", "col"])
@pytest.mark.parametrize("b_layout", ["row", "col"])
@pytest.mark.parametrize("bias", [False, True])
def test_the_product_is_mms_in_every_layout(a_layout, b_layout, bias):
    a, b = _operand(37, 53, a_layout, 0), _operand(53, 29, b_layout, 1)
    c = torch.randn(29) if bias else None
    want = torch.addmm(c, a, b) if bias else torch.mm(a, b)
    got = onednn_mm(a, b, c)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_an_operand_of_other_strides_is_copied_first():
    a = torch.randn(16, 64)[:, ::2]  # strides (64, 2): neither row- nor column-major
    b = torch.randn(32, 8)
    assert layout_of(a) is None
    torch.testing.assert_close(onednn_mm(a, b), a @ b, rtol=1e-5, atol=1e-5)


def test_nan_and_infinities_propagate_as_in_mm():
    a = torch.tensor([[float("nan"), 1.0], [float("inf"), 0.0], [1.0, -float("inf")], [2.0, 3.0]])
    b = torch.tensor([[0.0, 1.0, 2.0], [1.0, 0.0, -1.0]])
    torch.testing.assert_close(onednn_mm(a, b), a @ b, equal_nan=True)


def test_the_op_passes_torch_librarys_checks():
    a, b, c = torch.randn(6, 5, requires_grad=True), torch.randn(4, 5).t().requires_grad_(), torch.randn(4)
    torch.library.opcheck(torch.ops.fxforge.onednn_mm.default, (a.detach(), b.detach(), c))
    torch.library.opcheck(torch.ops.fxforge.onednn_mm.default, (a, b, None))


def test_gradients_through_the_op_are_mms():
    a, b = torch.randn(6, 5, requires_grad=True), torch.randn(5, 4, requires_grad=True)
    bias = torch.randn(4, requires_grad=True)
    onednn_mm(a, b, bias).pow(2).sum().backward()
    want = [t.grad.clone() for t in (a, b, bias)]
    for t in (a, b, bias):
        t.grad = None
    torch.addmm(bias, a, b).pow(2).sum().backward()
    for got, expected in zip(want, (a.grad, b.grad, bias.grad)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _graph(target, *metas):
    g = torch.fx.Graph()
    args = []
    for i, meta in enumerate(metas):
        p = g.placeholder(f"x{i}")
        p.meta["val"] = meta
        args.append(p)
    node = g.call_function(target, tuple(args))
    g.output(node)
    return torch.fx.GraphModule({}, g), node


def test_which_calls_onednn_can_take():
    a, bt = torch.empty(64, 32), torch.empty(16, 32).t()
    node = _graph(aten.addmm.default, torch.empty(16), a, bt)[1]
    assert product_of(node)[0] == Product(64, 32, 16, "row", "col", True)
    assert product_of(_graph(aten.mm.default, a.double(), bt.double())[1]) is None  # float64
    assert product_of(_graph(aten.addmm.default, torch.empty(64, 16), a, bt)[1]) is None  # a bias per row
    assert product_of(_graph(aten.mm.default, torch.empty(64, 64)[:, ::2], bt)[1]) is None  # strided operand
    scaled = _graph(aten.addmm.default, torch.empty(16), a, bt)[1]
    scaled.kwargs = {"beta": 2}
    assert product_of(scaled) is None
    assert product_of(_graph(aten.bmm.default, torch.empty(2, 4, 4), torch.empty(2, 4, 4))[1]) is None


@pytest.mark.parametrize("onednn_wins", [True, False])
def test_a_graph_is_routed_only_where_onednn_measured_faster(monkeypatch, onednn_wins):
    timed = []

    def timings(product):
        timed.append(product)
        return {"blas": 2.0, "onednn": 1.0 if onednn_wins else 1.95}  # 1.95: within the margin, stays on BLAS

    monkeypatch.setattr(gemm, "time_product", timings)
    a, w, bias = torch.randn(128, 96), torch.randn(112, 96), torch.randn(112)

    def f(a, w, bias, g):
        return torch.addmm(bias, a, w.t()), torch.mm(g.t(), a), torch.mm(g, w)

    g = torch.randn(128, 112)
    gm = torch.fx.experimental.proxy_tensor.make_fx(f, tracing_mode="fake")(a, w, bias, g)
    want = gm(a, w, bias, g)
    routed = route_matmuls(gm)
    assert len(timed) == 3  # three distinct products, each timed once
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert routed == (3 if onednn_wins else 0)
    assert ops.count(torch.ops.fxforge.onednn_mm.default) == routed
    for got, expected in zip(gm(a, w, bias, g), want):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_a_remembered_timing_is_not_measured_again(monkeypatch, tmp_path):
    monkeypatch.setenv("FXFORGE_AUTOTUNE_CACHE", "1")
    monkeypatch.setenv("FXFORGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gemm, "machine_load", lambda: 0.0)
    calls = []
    monkeypatch.setattr(gemm, "time_product", lambda p: calls.append(p) or {"blas": 2.0, "onednn": 1.0})
    product = Product(256, 128, 64, "row", "col", False)
    assert gemm.onednn_faster(product) and gemm.onednn_faster(product)
    assert len(calls) == 1


def test_products_too_small_to_matter_are_not_timed(monkeypatch):
    monkeypatch.setattr(gemm, "time_product", lambda p: pytest.fail("timed a tiny product"))
    assert not gemm.onednn_faster(Product(8, 8, 8, "row", "row", False))


def test_timing_a_real_product_names_both_kernels():
    timings = gemm.time_product(Product(64, 64, 64, "row", "col", True))
    assert set(timings) == {"blas", "onednn"} and all(t > 0 for t in timings.values())


def test_routing_a_graph_writes_its_timings_to_the_autotune_file(monkeypatch, tmp_path):
    from fxforge.core.disk_cache import TuningCache

    monkeypatch.setenv("FXFORGE_AUTOTUNE_CACHE", "1")
    monkeypatch.setenv("FXFORGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gemm, "machine_load", lambda: 0.0)
    monkeypatch.setattr(gemm, "time_product", lambda p: {"blas": 2.0, "onednn": 1.0})
    a, w = torch.randn(128, 96), torch.randn(112, 96)
    gm = torch.fx.experimental.proxy_tensor.make_fx(lambda a, w: torch.mm(a, w.t()), tracing_mode="fake")(a, w)
    assert route_matmuls(gm) == 1
    stored = TuningCache(tmp_path / "autotune.json").get(Product(128, 96, 112, "row", "col", False).key())
    assert stored["blas"] == 2.0 and stored["onednn"] == 1.0
