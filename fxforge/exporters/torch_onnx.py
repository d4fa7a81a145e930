"""What fxforge asks of torch.onnx: an export of a program with fxforge's translations (torchlib's registry
built once per process, not once per export), the node being translated, torch.onnx's own translation of an
op, and a translation as the plain function it takes.

Example:
    >>> translating_node() is None   # outside a torch.onnx export
    True
"""

from __future__ import annotations

import copy
import functools
import sys
from collections.abc import Callable
from typing import Any

import torch


def translating_node() -> torch.fx.Node | None:
    """The fx node torch.onnx is translating right now (read from its frame), for notes and errors; None
    outside a translation.

    Example:
        >>> translating_node() is None
        True
    """
    frame = sys._getframe(1)
    while frame is not None:
        node = frame.f_locals.get("node")
        if isinstance(node, torch.fx.Node) and frame.f_code.co_name.startswith("_handle_call_function"):
            return node
        frame = frame.f_back
    return None


@functools.cache
def torchlib_registry(opset: int) -> Any:
    """torch.onnx's registry of torchlib's translations at ``opset`` (an ``ONNXRegistry``), built once per
    process: torch.onnx builds it on every export, about 1.4 s of a small model's 5 s export here.

    Example:
        >>> torchlib_registry(20) is torchlib_registry(20)
        True
    """
    from torch.onnx._internal.exporter import _constants, _registration

    return _registration.ONNXRegistry.from_torchlib(opset_version=max(opset, _constants.TORCHLIB_OPSET))


def registry_with(opset: int, table: dict[Any, Callable[..., Any]]) -> Any:
    """A copy of :func:`torchlib_registry` with ``table``'s translations registered first (as
    ``custom_translation_table`` registers them); the cached registry itself is left as it was.

    Example:
        >>> relu = torch.ops.aten.relu.default
        >>> registry = registry_with(20, {relu: as_function(" x ".strip)})
        >>> registry.get_decomps(relu)[0].is_custom, torchlib_registry(20).get_decomps(relu)[0].is_custom
        (True, False)
    """
    base = torchlib_registry(opset)
    registry = copy.copy(base)
    registry.functions = {target: list(metas) for target, metas in base.functions.items()}
    for target, translation in table.items():
        registry.register_op(target, translation, is_complex=False)
    return registry


def export_to_onnx(program: torch.export.ExportedProgram, opset: int, table: dict[Any, Callable[..., Any]],
                   verbose: bool | None = None) -> Any:
    """``torch.onnx.export(program, dynamo=True, opset_version=opset, optimize=True,
    custom_translation_table=table)`` with the registry of :func:`registry_with`: the same ``ONNXProgram``
    without building torchlib's registry again (``verbose=None`` prints torch.onnx's progress lines, as it does).

    Example:
        >>> program = torch.export.export(torch.nn.ReLU(), (torch.randn(2),))
        >>> [node.op_type for node in export_to_onnx(program, 20, {}, verbose=False).model.graph]
        ['Relu']
    """
    from torch.onnx._internal.exporter import _core

    return _core.export(program, (), None, registry=registry_with(opset, table), dynamic_shapes={},
                        optimize=True, opset_version=opset, verbose=verbose)


def torchlib_translation(target: Any, opset: int) -> Callable[..., Any]:
    """torch.onnx's own translation of ``target`` at ``opset`` (what a plain export uses).

    Example:
        >>> callable(torchlib_translation(torch.ops.aten.scaled_dot_product_attention.default, 20))
        True
    """
    candidates = [meta for meta in torchlib_registry(opset).get_decomps(target)
                  if not meta.is_complex and getattr(meta, "opset_introduced", 0) <= opset]
    if not candidates:
        raise RuntimeError(f"torch.onnx has no translation of {target} at opset {opset}")
    return max(candidates, key=lambda meta: getattr(meta, "opset_introduced", 0)).onnx_function


def as_function(method: Callable[..., Any]) -> Callable[..., Any]:
    """A plain function calling ``method`` with its signature (torch.onnx sets attributes on translations,
    which bound methods cannot take).

    Example:
        >>> as_function(" x ".strip)(), as_function(" x ".strip).__name__
        ('x', 'strip')
    """

    @functools.wraps(method)
    def translation(*args: Any, **kwargs: Any) -> Any:
        return method(*args, **kwargs)

    return translation
