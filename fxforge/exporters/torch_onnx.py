"""What fxforge's ONNX translations ask of torch.onnx while it translates: the node being translated, its own
translation of an op, and a translation as the plain function it takes.

Example:
    >>> translating_node() is None   # outside a torch.onnx export
    True
"""

from __future__ import annotations

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
def torchlib_translation(target: Any, opset: int) -> Callable[..., Any]:
    """torch.onnx's own translation of ``target`` at ``opset`` (what a plain export uses).

    Example:
        >>> callable(torchlib_translation(torch.ops.aten.scaled_dot_product_attention.default, 20))
        True
    """
    from torch.onnx._internal.exporter import _registration

    registry = _registration.ONNXRegistry.from_torchlib(opset_version=opset)
    candidates = [meta for meta in registry.get_decomps(target)
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
