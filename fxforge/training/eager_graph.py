"""The graph a training step is planned on: the model captured, then made to run as eager runs it.

A capture is the model's computation, but not always eager's way of computing it, and a training step's
memory and random numbers depend on the way:

- transformers models take other paths under tracing: an S x S causal mask built as a tensor and K/V
  repeated per head, where eager passes ``is_causal=True`` and ``enable_gqa=True`` to SDPA
  (:func:`~fxforge.rewrites.attention.sdpa_calls.simplify_sdpa_calls` gives SDPA eager's inputs);
- AOTAutograd turns ``dropout`` into ``native_dropout`` (a bool mask, the kernel eager uses on CUDA), while
  eager's CPU ``dropout`` draws a float noise tensor with ``bernoulli_`` and multiplies: 4x the mask's
  bytes, and other random numbers. On CPU each dropout becomes :func:`eager_cpu_dropout`, eager's own
  formula, so the step saves what eager saves and draws the numbers eager draws for the same seed; SDPA with
  dropout (which eager runs on CPU by its math path) becomes :func:`eager_cpu_sdpa`, that path written out
  with eager's dropout (bitwise eager's outputs for the same seed);
- torch.export's metadata assertions are not eager ops (and the partitioner refuses to recompute around an
  op with effects); they check what the capture already proved, and are dropped.

Example:
    >>> _ = torch.manual_seed(0); a = torch.nn.functional.dropout(torch.ones(4, 4), 0.5, True)
    >>> _ = torch.manual_seed(0); b = eager_cpu_dropout(torch.ones(4, 4), 0.5, True)
    >>> torch.equal(a, b)
    True
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fxforge.capture import capture
from fxforge.rewrites.attention.sdpa_calls import SDPA_TARGETS, simplify_sdpa_calls

_ASSERTIONS = (torch.ops.aten._assert_tensor_metadata.default, torch.ops.aten._assert_scalar.default)
_DROPOUTS = (torch.ops.aten.dropout.default, torch.nn.functional.dropout, torch.dropout)


def eager_cpu_dropout(x: torch.Tensor, p: float = 0.5, train: bool = True, inplace: bool = False) -> torch.Tensor:
    """Dropout as eager computes it on CPU: ``x * (bernoulli(1 - p) / (1 - p))`` with a noise tensor like x.

    Example:
        >>> eager_cpu_dropout(torch.ones(3), 0.0).tolist()
        [1.0, 1.0, 1.0]
    """
    if not train or p == 0 or x.numel() == 0:
        return x
    if p == 1:
        return x * torch.zeros((), dtype=x.dtype, device=x.device)
    noise = torch.empty_like(x).bernoulli_(1 - p)
    noise.div_(1 - p)
    return x * noise


def eager_cpu_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                   dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                   enable_gqa: bool = False) -> torch.Tensor:
    """``scaled_dot_product_attention`` as eager computes it on CPU when it drops: its math path.

    The scale is split as ``sqrt(scale)`` on q and on k, a bool mask (or the causal one) fills with ``-inf``,
    the softmax is the safe one (a row with every key masked gives zeros), then :func:`eager_cpu_dropout`.

    Example:
        >>> q = torch.randn(1, 2, 4, 8)
        >>> _ = torch.manual_seed(0); a = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
        >>> _ = torch.manual_seed(0); torch.equal(a, eager_cpu_sdpa(q, q, q, dropout_p=0.5))
        True
    """
    if dropout_p == 0:
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    factor = math.sqrt(1 / math.sqrt(query.size(-1)) if scale is None else scale)
    if enable_gqa:
        key = key.repeat_interleave(query.size(-3) // key.size(-3), -3)
        value = value.repeat_interleave(query.size(-3) // value.size(-3), -3)
    attn = (query * factor) @ (key.transpose(-2, -1) * factor)
    if is_causal:
        attn_mask = torch.ones(query.size(-2), key.size(-2), dtype=torch.bool, device=query.device).tril()
    if attn_mask is not None:
        attn = attn.masked_fill(attn_mask.logical_not(), float("-inf")) if attn_mask.dtype == torch.bool \
            else attn + attn_mask
    attn = torch.ops.aten._safe_softmax(attn, -1)
    return eager_cpu_dropout(attn, dropout_p, True) @ value


def _dropout_arguments(node: torch.fx.Node) -> tuple[Any, Any, Any] | None:
    names = ("input", "p", "train") if node.target is not torch.nn.functional.dropout else ("input", "p", "training")
    values = dict(zip(names, node.args))
    values.update(node.kwargs)
    if node.kwargs.get("inplace") or (len(node.args) > 3 and node.args[3]):
        return None
    default_train = node.target is torch.nn.functional.dropout  # F.dropout trains by default, aten has no default
    return values.get("input"), values.get("p", 0.5), values.get(names[2], default_train)


def _drops_on_cpu(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    p = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
    return isinstance(value, torch.Tensor) and value.device.type == "cpu" and not isinstance(p, torch.fx.Node) \
        and p > 0


def eager_like_graph(model: torch.nn.Module, example_inputs: Any,
                     example_kwargs: dict[str, Any] | None = None) -> torch.fx.GraphModule:
    """``model`` captured on ``example_inputs`` and made to compute as eager does (module docstring).

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1)).train()
        >>> gm = eager_like_graph(model, (torch.randn(2, 4),))
        >>> [getattr(n.target, "__name__", n.target) for n in gm.graph.nodes if n.op.startswith("call")]
        ['0', 'eager_cpu_dropout']
    """
    graph_module = capture(model, example_inputs, example_kwargs=example_kwargs or None).graph_module
    simplify_sdpa_calls(graph_module)
    for node in list(graph_module.graph.nodes):
        if node.op == "call_module" and type(graph_module.get_submodule(node.target)) is torch.nn.Dropout:
            module = graph_module.get_submodule(node.target)
            value = node.meta.get("val")
            if isinstance(value, torch.Tensor) and value.device.type == "cpu" and not module.inplace and node.args:
                node.op, node.target = "call_function", eager_cpu_dropout
                node.args, node.kwargs = (node.args[0], module.p, module.training), {}
            continue
        if node.op != "call_function":
            continue
        if node.target in _ASSERTIONS and not node.users:
            graph_module.graph.erase_node(node)
        elif node.target in SDPA_TARGETS and _drops_on_cpu(node):
            node.target = eager_cpu_sdpa
        elif node.target in _DROPOUTS:
            value = node.meta.get("val")
            arguments = _dropout_arguments(node)
            if isinstance(value, torch.Tensor) and value.device.type == "cpu" and arguments is not None:
                node.target, node.args, node.kwargs = eager_cpu_dropout, arguments, {}
    graph_module.graph.eliminate_dead_code()
    graph_module.graph.lint()
    graph_module.recompile()
    return graph_module
