"""Matrix products on oneDNN where they measure faster than torch's BLAS on this machine.

torch's float32 ``mm`` and ``addmm`` on CPU call the BLAS torch was built with (MKL in the official wheels).
oneDNN, which torch also ships, runs the same product in its inner-product primitive, and on some CPUs far
faster: on the AMD EPYC of ``benchmarks/RESULTS.md`` (2 threads) MKL's sgemm reaches about 225 GFLOP/s on
ViT-S's and BERT's shapes and oneDNN 360-520 (MKL takes a slower path on CPUs that are not Intel's); on
others MKL wins. So nothing is assumed: :func:`onednn_faster` times both on random matrices of a call's
shapes and strides (interleaved, medians), remembers the answer in the autotune cache, and
:func:`route_matmuls` rewrites a graph's ``aten.mm`` / ``aten.addmm`` to :func:`onednn_mm` only where oneDNN
won by :data:`MARGIN`.

``fxforge::onednn_mm`` is a torch.library op with a fake kernel, so AOTAutograd and Inductor treat it as one
opaque call (Inductor runs it as an extern kernel, as it runs ``mm``). It takes either operand row- or
column-major without a copy (a transposed weight, a gradient's transpose), keeps NaN and infinities as
``mm`` does, and rounds differently only in the order it sums (float32 results agree to about 1e-6
relative, as Inductor's fused kernels do, not bitwise), which is why only graphs already compiled by
Inductor are routed (``target="inductor"`` training steps), never the op-by-op runner that promises eager's
exact numbers.

Example:
    >>> a, b = torch.randn(8, 4), torch.randn(4, 3)
    >>> torch.allclose(onednn_mm(a, b), a @ b, atol=1e-6) if onednn_available() else True
    True
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import Tensor

from fxforge.core.disk_cache import BUSY_LOAD, machine_key, machine_load
from fxforge.lowering.timing import DECISIVE, autotune_cache, time_interleaved

aten = torch.ops.aten

# oneDNN must beat BLAS by this fraction (medians) to be routed: closer calls stay on BLAS.
MARGIN = 0.05
# Products of fewer multiply-adds are not timed nor routed: call overhead, not arithmetic, decides them.
MIN_MACS = 1 << 20
# Seconds of timing per distinct product, roughly (at least three rounds).
BUDGET_S = 0.05


@functools.cache
def onednn_available() -> bool:
    """Whether this torch build has oneDNN's linear op (CPU builds with MKLDNN).

    Example:
        >>> isinstance(onednn_available(), bool)
        True
    """
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@torch.library.custom_op("fxforge::onednn_mm", mutates_args=())
def onednn_mm(a: Tensor, b: Tensor, bias: Tensor | None = None) -> Tensor:
    """``a @ b`` (plus a bias row of ``b.shape[1]`` values) on oneDNN's inner product, float32 on CPU.

    Example:
        >>> a, b, bias = torch.randn(8, 4), torch.randn(3, 4).t(), torch.randn(3)
        >>> torch.allclose(onednn_mm(a, b, bias), torch.addmm(bias, a, b), atol=1e-6) if onednn_available() else True
        True
    """
    a, b = (t if layout_of(t) is not None else t.contiguous() for t in (a, b))
    return torch.ops.mkldnn._linear_pointwise(a, b.t(), bias, "none", [], "")


@onednn_mm.register_fake
def _onednn_mm_fake(a: Tensor, b: Tensor, bias: Tensor | None = None) -> Tensor:
    return a.new_empty((a.shape[0], b.shape[1]))


def _setup(ctx, inputs, output) -> None:
    a, b, bias = inputs
    ctx.save_for_backward(a, b)
    ctx.has_bias = bias is not None


def _backward(ctx, grad):
    a, b = ctx.saved_tensors
    return grad @ b.t(), a.t() @ grad, grad.sum(0) if ctx.has_bias else None


onednn_mm.register_autograd(_backward, setup_context=_setup)


def layout_of(t: Tensor) -> str | None:
    """``"row"`` for a row-major matrix, ``"col"`` for a column-major one (a transposed row-major matrix),
    None for any other strides (oneDNN would copy it first).

    Example:
        >>> x = torch.ones(3, 4)
        >>> layout_of(x), layout_of(x.t()), layout_of(x[:, ::2])
        ('row', 'col', None)
    """
    rows, cols = t.shape
    if t.stride(1) == 1 and (rows <= 1 or t.stride(0) >= cols):
        return "row"
    if t.stride(0) == 1 and (cols <= 1 or t.stride(1) >= rows):
        return "col"
    return None


@dataclasses.dataclass(frozen=True)
class Product:
    """One matrix product as it is timed: ``m x k`` times ``k x n``, each operand's layout, with a bias.

    Example:
        >>> Product(1576, 384, 1152, "row", "col", True).macs
        697171968
    """

    m: int
    k: int
    n: int
    a: str
    b: str
    bias: bool

    @property
    def macs(self) -> int:
        return self.m * self.k * self.n

    def key(self) -> str:
        """The cache key of its timing on this machine."""
        return (f"{machine_key(torch.device('cpu'))} | onednn_mm {self.m}x{self.k}x{self.n} "
                f"{self.a}/{self.b}{' +bias' if self.bias else ''} float32")

    def operands(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """Random operands of its shapes and layouts."""
        a = torch.randn(self.m, self.k) if self.a == "row" else torch.randn(self.k, self.m).t()
        b = torch.randn(self.k, self.n) if self.b == "row" else torch.randn(self.n, self.k).t()
        return a, b, torch.randn(self.n) if self.bias else None


def time_product(product: Product) -> dict[str, float]:
    """Median milliseconds of ``product`` on torch's BLAS (``"blas"``) and on oneDNN (``"onednn"``).

    Example:
        >>> sorted(time_product(Product(64, 64, 64, "row", "row", False))) if onednn_available() else ['blas', 'onednn']
        ['blas', 'onednn']
    """
    a, b, bias = product.operands()
    blas = (lambda: torch.addmm(bias, a, b)) if bias is not None else (lambda: torch.mm(a, b))
    with torch.no_grad():
        return time_interleaved({"blas": blas, "onednn": lambda: onednn_mm(a, b, bias)}, BUDGET_S,
                                decisive=DECISIVE)


def onednn_faster(product: Product, memo: dict[Product, bool] | None = None) -> bool:
    """Whether oneDNN runs ``product`` faster than BLAS by :data:`MARGIN`, measured on this machine (or read
    from the autotune cache, where a timing taken on a quiet machine is put; :func:`route_matmuls` writes the
    file once per graph).

    Example:
        >>> isinstance(onednn_faster(Product(256, 256, 256, "row", "col", False)), bool)
        True
    """
    if memo is not None and product in memo:
        return memo[product]
    faster = False
    if onednn_available() and product.macs >= MIN_MACS:
        cache = autotune_cache()
        timings = cache.get(product.key()) if cache is not None else None
        if timings is None:
            timings = time_product(product)
            if cache is not None and (load := machine_load()) <= BUSY_LOAD:  # a busy moment: not remembered
                cache.put(product.key(), {**timings, "load": round(load, 2)})  # written by route_matmuls
        faster = timings["onednn"] < timings["blas"] * (1 - MARGIN)
    if memo is not None:
        memo[product] = faster
    return faster


def product_of(node: torch.fx.Node) -> tuple[Product, tuple] | None:
    """The product a graph's ``aten.mm`` / ``aten.addmm`` node computes and the arguments of
    :func:`onednn_mm` for it, or None where oneDNN cannot take it as it is: not float32 on CPU, symbolic
    sizes, an operand neither row- nor column-major, an ``addmm`` with scaling or a bias that is not one
    row of ``n`` values."""
    if node.op != "call_function" or node.target not in (aten.mm.default, aten.addmm.default) or node.kwargs:
        return None
    if node.target == aten.addmm.default:
        bias, a, b = node.args
    else:
        (a, b), bias = node.args, None
    values = [x.meta.get("val") if isinstance(x, torch.fx.Node) else None for x in (a, b, bias)]
    if not all(isinstance(v, Tensor) for v in values[:2]) or (bias is not None and not isinstance(values[2], Tensor)):
        return None
    if any(v.dtype != torch.float32 or v.device.type != "cpu" for v in values if v is not None):
        return None
    if any(isinstance(s, torch.SymInt) for v in values if v is not None for s in (*v.shape, *v.stride())):
        return None
    va, vb, vbias = values
    m, k, n = va.shape[0], va.shape[1], vb.shape[1]
    if vbias is not None and (vbias.dim() != 1 or vbias.shape[0] != n or vbias.stride(0) != 1):
        return None
    la, lb = layout_of(va), layout_of(vb)
    if la is None or lb is None or 0 in (m, k, n):
        return None
    return Product(m, k, n, la, lb, bias is not None), (a, b, bias)


def route_matmuls(gm: torch.fx.GraphModule, memo: dict[Product, bool] | None = None) -> int:
    """Rewrite each ``aten.mm`` / ``aten.addmm`` of ``gm`` that oneDNN runs faster here
    (:func:`onednn_faster`) into :func:`onednn_mm`; returns how many were rewritten.

    Example:
        >>> g = torch.fx.Graph(); x, w = g.placeholder("x"), g.placeholder("w")
        >>> x.meta["val"], w.meta["val"] = torch.empty(4, 4), torch.empty(4, 4)
        >>> _ = g.output(g.call_function(aten.mm.default, (x, w)))
        >>> route_matmuls(torch.fx.GraphModule({}, g))  # too small to be timed: left on BLAS
        0
    """
    memo = {} if memo is None else memo
    routed = 0
    for node in list(gm.graph.nodes):
        found = product_of(node)
        if found is None or not onednn_faster(found[0], memo):
            continue
        with gm.graph.inserting_after(node):
            new = gm.graph.call_function(torch.ops.fxforge.onednn_mm.default, found[1])
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        routed += 1
    cache = autotune_cache()
    if cache is not None:
        cache.save()  # what this graph's products measured, written once
    if routed:
        gm.recompile()
    return routed
