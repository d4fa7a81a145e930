"""Matrix products and convolutions of a rewritten graph run in a reduced precision (bfloat16 or float16).

A layer is *reduced* by casting what it reads to the reduced dtype and its result back to the graph's float32:
oneDNN's and cuBLAS's reduced-precision kernels accumulate in float32 and round the result once, so each layer
adds one rounding of its inputs and one of its output. Its weights are not cast on every call: each becomes a
folded constant (:func:`~fxforge.rewrites.folding.fold_constants`), a reduced copy with a recipe that the plan
runs again from the live weight when it changes, as a folded BatchNorm is. Everything else (norms, softmax,
reductions, elementwise ops) stays in float32.

:func:`reducible` lists the layers (linear layers, convolutions 1d-3d and transposed, ``matmul``/``bmm`` and the
fused ops ``conv_activation`` makes of them) and :func:`reduce_layers` reduces the chosen ones in place.

Example:
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).eval()
    >>> gm = torch.fx.symbolic_trace(model)
    >>> [n.name for n in reducible(gm)]
    ['_0', '_2']
    >>> reduce_layers(gm, reducible(gm)[:1], torch.bfloat16)
    >>> x = torch.randn(3, 4)
    >>> (gm(x) - model(x)).abs().max().item() < 0.05, gm(x).dtype
    (True, torch.float32)
    >>> from fxforge.lowering.lower import derived_values
    >>> values = derived_values(gm, gm)        # what a plan checks on every call
    >>> with torch.no_grad():
    ...     _ = model[0].weight.mul_(2)       # the reduced copy follows the live weight
    >>> values.refresh_if_stale(), (gm(x) - model(x)).abs().max().item() < 0.1
    (True, True)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import Node

from fxforge.core.vocabulary import op_name
from fxforge.rewrites.folding import fold_constants

REDUCED = (torch.bfloat16, torch.float16)

# Ops whose work is a matrix product or a convolution, by their vocabulary name or as fxforge's fused ops.
_LAYER_OPS = frozenset({"linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                        "conv_transpose3d", "matmul", "bmm", "mm", "addmm", "baddbmm"})
_FUSED = ("fxforge.conv_pointwise", "fxforge.linear_pointwise", "fxforge.conv_transpose_pointwise")
_MODULES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _float32(node: Node) -> bool:
    value = node.meta.get("val", node.meta.get("tensor_meta"))
    dtype = getattr(value, "dtype", None)
    return dtype is None or dtype == torch.float32  # (a traced graph without shape meta: checked when run)


def _is_layer(node: Node, gm: torch.fx.GraphModule) -> bool:
    if node.op == "call_module":  # (a transposed conv module, or a padding mode other than zeros, stays as it is)
        module = gm.get_submodule(str(node.target))
        return isinstance(module, _MODULES) and getattr(module, "padding_mode", "zeros") == "zeros"
    if node.op != "call_function":
        return False
    if str(node.target).startswith(_FUSED):
        return True
    return op_name(node, gm) in _LAYER_OPS


def reducible(gm: torch.fx.GraphModule) -> list[Node]:
    """The nodes of ``gm`` that are matrix products or convolutions computing in float32, in graph order.

    Example:
        >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Conv2d(1, 2, 1), torch.nn.Tanh()))
        >>> [n.name for n in reducible(gm)]
        ['_0']
    """
    return [n for n in gm.graph.nodes if _is_layer(n, gm) and _float32(n)]


def _module_call_as_function(gm: torch.fx.GraphModule, node: Node) -> Node:
    """A ``call_module`` of a linear or conv layer as the functional call of its weights (get_attr nodes) with the
    module's own settings (stride, padding, ...)."""
    module = gm.get_submodule(str(node.target))
    with gm.graph.inserting_before(node):
        weight = gm.graph.get_attr(f"{node.target}.weight")
        bias = gm.graph.get_attr(f"{node.target}.bias") if module.bias is not None else None
        x = node.args[0]
        if isinstance(module, nn.Linear):
            call = gm.graph.call_function(F.linear, (x, weight, bias))
        else:
            fn = getattr(F, f"conv{module.weight.dim() - 2}d")
            call = gm.graph.call_function(fn, (x, weight, bias, module.stride, module.padding, module.dilation,
                                               module.groups))
    call.meta.update(node.meta)
    node.replace_all_uses_with(call)
    gm.graph.erase_node(node)
    return call


def _meta_in(node: Node, like: Node, dtype: torch.dtype) -> None:
    """``node``'s value meta: ``like``'s in ``dtype`` (what lowering reads of a kernel's inputs)."""
    value = like.meta.get("val")
    if isinstance(value, torch.Tensor):
        with torch.no_grad():
            node.meta["val"] = value.to(dtype)
    else:
        node.meta.pop("val", None)
    node.meta.pop("tensor_meta", None)


def reduce_layers(gm: torch.fx.GraphModule, layers: list[Node], dtype: torch.dtype) -> None:
    """Run each of ``layers`` (from :func:`reducible`) in ``dtype``: its tensor inputs cast to it (weights as
    folded copies that follow the live weights), its result cast back to float32. ``gm`` is changed in place and
    recompiled."""
    if dtype not in REDUCED:
        raise ValueError(f"precision {dtype} is not a reduced floating-point dtype (one of bfloat16, float16)")
    for layer in layers:
        if layer.op == "call_module":
            layer = _module_call_as_function(gm, layer)
        casts: dict[Node, Node] = {}
        weights: list[Node] = []
        for source in layer.all_input_nodes:
            if source in casts or not _float32(source):
                continue
            with gm.graph.inserting_before(layer):
                cast = gm.graph.call_method("to", (source, dtype))
            _meta_in(cast, source, dtype)
            casts[source] = cast
            if source.op == "get_attr":
                weights.append(cast)
        for source, cast in casts.items():
            layer.replace_input_with(source, cast)
        with gm.graph.inserting_after(layer):
            back = gm.graph.call_method("to", (layer, torch.float32))
        layer.replace_all_uses_with(back, delete_user_cb=lambda user, back=back: user is not back)
        back.meta.update(layer.meta)
        back.meta["reduced_from"] = dtype  # (for share_casts: it casts the layer's result, in dtype, back)
        _meta_in(layer, back, dtype)  # (the layer's own result is in dtype now: its float32 meta is the cast's)
        for cast in weights:
            fold_constants(gm, [cast.args[0], cast])
    share_casts(gm)
    gm.graph.lint()
    gm.recompile()


def _cast_to(node: Node) -> torch.dtype | None:
    """The dtype ``node`` casts to, where it is a ``.to(dtype)`` call this module makes."""
    if node.op == "call_method" and node.target == "to" and len(node.args) == 2 and not node.kwargs \
            and isinstance(node.args[1], torch.dtype):
        return node.args[1]
    return None


def share_casts(gm: torch.fx.GraphModule) -> int:
    """Drop the casts reduced layers do not need (both exact, so the results do not change by a bit): a layer
    that reads another's result gets it in the reduced dtype, not cast to float32 and back; layers that read the
    same float32 value (a transformer's q, k and v projections) share one cast of it. Returns how many casts were
    removed. :func:`reduce_layers` calls it.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)).eval()
        >>> gm = torch.fx.symbolic_trace(model)
        >>> reduce_layers(gm, reducible(gm), torch.bfloat16)   # (shares them)
        >>> [n.args[1] for n in gm.graph.nodes if _cast_to(n) and n.args[0].op != "get_attr"]
        [torch.bfloat16, torch.float32]
    """
    removed, seen = 0, {}
    for node in list(gm.graph.nodes):
        dtype = _cast_to(node)
        if dtype not in REDUCED:
            continue
        source = node.args[0]
        if isinstance(source, Node) and source.meta.get("reduced_from") == dtype:
            replacement = source.args[0]  # (a layer's result in dtype, cast to float32 and back: the result)
        else:
            replacement = seen.setdefault((source, dtype), node)
        if replacement is node:
            continue
        node.replace_all_uses_with(replacement)
        gm.graph.erase_node(node)
        removed += 1
        if _cast_to(source) == torch.float32 and not source.users:
            gm.graph.erase_node(source)
            removed += 1
    return removed
