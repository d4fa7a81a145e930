"""ONNX translations for the ops fxforge's rewrites put in graphs, in the form ONNX Runtime runs fastest.

``torch.onnx.export(..., custom_translation_table=Translations(opset).table())`` uses them. Each choice
was measured in ONNX Runtime 1.31 (CPU, 2 shared threads, ``session.intra_op.allow_spinning = "0"``,
interleaved rounds, medians; two runs, ranges over shapes and activations below);
``python -m benchmarks --suite onnx-forms`` repeats the measurement on this machine. Figures are speeds
relative to a baseline (baseline time / time): for conv and linear, the ``com.microsoft`` alternative's
relative to the chosen standard ops (> 1: the alternative ran faster); for attention, each fused form's
relative to the plain MatMul/Softmax export.

=========================  ===========================================  ==========================================
fxforge op                 translation                                  why (measured)
=========================  ===========================================  ==========================================
``conv_pointwise``         ``Conv`` (+ ``Add``) + the activation's      ORT fuses Conv + activation itself (its
                           standard op                                  NCHWc Conv with the activation inside),
                                                                        so ``com.microsoft.FusedConv`` alone is
                                                                        the same kernel: 0.82-1.16x, noise. With
                                                                        the residual input, FusedConv keeps ORT
                                                                        from its blocked NCHWc layout: 0.67-1.14x,
                                                                        median 0.88x, slower on 3x3 convs
``linear_pointwise``       ``Gemm`` (2-d input) or ``MatMul`` + ``Add``,   ORT fuses Gemm + activation itself
                           + the activation's standard op               (``FusedGemm``); emitting ``FusedGemm``:
                                                                        0.74-1.09x
``scaled_dot_product_      ``com.microsoft.MultiHeadAttention``          vs the decomposed MatMul/Softmax graph,
attention``                (q, k, v as [B, S, N*H]; masks as            attention layer (hidden 256, 4 heads,
                           ``attention_bias``; GQA by repeating k, v)   B=1), padding mask: S=1024 1.09x,
                                                                        S=2048 1.05x (``key_padding_mask`` would
                                                                        be 1.13-1.14x but cannot carry an
                                                                        arbitrary additive mask). ONNX
                                                                        ``Attention`` (opset 23): 0.98-1.07x,
                                                                        needs opset 23 for the whole model
(with a key padding mask,  ``If`` the mask masks nothing (all 0 / all   ORT's CPU MultiHeadAttention runs flash
[B, 1, 1, L]: one that     True, checked at run time on the mask        attention only with no mask, no causal
broadcasts over queries)   before it is expanded): MultiHeadAttention   flag: 1.38-1.56x faster than with an
                           without it, else with it. Full [.., S, L]    all-zero ``attention_bias`` (S=1024,
                           masks are not checked (S x L reads a call,   2048); the check reads B x L values
                           and causal ones never mask nothing)
(causal, q and k of one    ``com.microsoft.GroupQueryAttention``        vs MultiHeadAttention ``unidirectional``
length, head size a        (causal, ``kv_num_heads`` = the key/value    (its CPU kernel adds a full S x S causal
multiple of 8)             heads read in place, no past)                mask; GQA's softmax runs over each row's
                                                                        prefix only): 1.55x (S=1024), 1.89x
                                                                        (S=2048, 4 q / 2 kv heads)
=========================  ===========================================  ==========================================

Whole models (``python -m benchmarks --suite onnx``, fxforge -> ORT vs plain export -> ORT): attention and the
layer norms after residual adds are where the two differ; linear layers and GELU are the same ORT kernels in
both. After the translations, :data:`fxforge.exporters.onnx_rules.ONNX_RULES` rewrite the ONNX graph.
Packing the q, k, v projections into one ``MatMul`` (+ ``Split``) measured 0.86-0.90x at long sequences
(ORT 1.31's CPU MultiHeadAttention does not take packed QKV); over few rows it pays
(:mod:`~fxforge.exporters.pack_projections`), and over at most 512 keys the projections and the attention
become ORT's ``Attention``, which projects q, k and v itself (:mod:`~fxforge.exporters.projected_attention`).

Activations (:data:`fxforge.rewrites.fused_ops.ACTIVATIONS`): ``relu`` -> ``Relu``; ``hardtanh`` -> ``Clip``;
``leaky_relu`` -> ``LeakyRelu``; ``gelu``/``gelu_tanh`` -> ``Gelu`` (opset >= 20; below, its erf / tanh
formula, which ORT fuses back into one Gelu); ``silu`` -> ``x * Sigmoid(x)`` (ORT fuses it); ``sigmoid``
-> ``Sigmoid``; ``tanh`` -> ``Tanh``; ``hardswish`` -> ``HardSwish``.

Attention that ``MultiHeadAttention`` cannot carry keeps torch.onnx's own translation, and the reason is
recorded (see :class:`Translations`): dropout, inputs that are neither 4-d nor 3-d (3-d is one head), a
causal mask on a non-square score matrix, head counts or sizes not known at export time, a scale
computed at run time. Causal attention that ``GroupQueryAttention`` cannot carry (head sizes not a
multiple of 8, or q and v head sizes that differ) stays ``MultiHeadAttention`` with ``unidirectional``,
with a note saying why.

The masked form runs one branch per call; export-time validation runs the branch of the example's mask
(the other one is the same kernel call with or without ``attention_bias``; the tests run both).

Example:
    >>> table = Translations(opset=20).table()
    >>> torch.ops.fxforge.conv_pointwise.default in table
    True
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
from onnx.defs import OpSchema
from onnxscript import ir, values

from fxforge.core.source import node_source
from fxforge.exporters.attention_guards import multi_head_attention_keeps_nan_rows
from fxforge.exporters.onnx_ir import same_dim
from fxforge.exporters.torch_onnx import as_function, torchlib_translation, translating_node
from fxforge.rewrites import fused_ops  # noqa: F401 - registers torch.ops.fxforge.*
from fxforge.rewrites.attention.guards import NAN_ROWS

MIN_OPSET = 18
DEFAULT_OPSET = 20  # torch.onnx's default, and the first with Gelu

CONV_POINTWISE = torch.ops.fxforge.conv_pointwise.default
LINEAR_POINTWISE = torch.ops.fxforge.linear_pointwise.default
CONV_TRANSPOSE_POINTWISE = torch.ops.fxforge.conv_transpose_pointwise.default
SDPA = torch.ops.aten.scaled_dot_product_attention.default

_MSFT = values.Opset("com.microsoft", 1)


def _multi_head_attention_op() -> values.Op:
    """``com.microsoft.MultiHeadAttention`` as an onnxscript op (onnx itself has no schema for it)."""
    param, optional = OpSchema.FormalParameter, OpSchema.FormalParameterOption.Optional
    attr, kind = OpSchema.Attribute, OpSchema.AttrType
    inputs = [param("query", "T")]
    inputs += [param(name, "M" if name == "key_padding_mask" else "T", param_option=optional)
               for name in ("key", "value", "bias", "key_padding_mask", "attention_bias")]
    schema = OpSchema(
        "MultiHeadAttention", "com.microsoft", 1, "ONNX Runtime's multi-head attention (contrib op)",
        inputs=inputs, outputs=[param("output", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], ""),
                          ("M", ["tensor(int32)"], "")],
        attributes=[attr("num_heads", kind.INT, "heads", required=True),
                    attr("scale", kind.FLOAT, "scale of q @ k^T", required=False),
                    attr("unidirectional", kind.INT, "causal", required=False),
                    attr("mask_filter_value", kind.FLOAT, "fill of key_padding_mask", required=False)])
    return values.Op(_MSFT, "MultiHeadAttention", schema)


MULTI_HEAD_ATTENTION = _multi_head_attention_op()


def _group_query_attention_op() -> values.Op:
    """``com.microsoft.GroupQueryAttention`` (its first seven inputs, three outputs) as an onnxscript op."""
    param, optional = OpSchema.FormalParameter, OpSchema.FormalParameterOption.Optional
    attr, kind = OpSchema.Attribute, OpSchema.AttrType
    inputs = [param("query", "T")]
    inputs += [param(name, "T", param_option=optional) for name in ("key", "value", "past_key", "past_value")]
    inputs += [param("seqlens_k", "M"), param("total_sequence_length", "M")]
    schema = OpSchema(
        "GroupQueryAttention", "com.microsoft", 1, "ONNX Runtime's grouped-query attention (contrib op)",
        inputs=inputs, outputs=[param("output", "T"), param("present_key", "T"), param("present_value", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], ""),
                          ("M", ["tensor(int32)"], "")],
        attributes=[attr("num_heads", kind.INT, "query heads", required=True),
                    attr("kv_num_heads", kind.INT, "key/value heads", required=True),
                    attr("scale", kind.FLOAT, "scale of q @ k^T", required=False)])
    return values.Op(_MSFT, "GroupQueryAttention", schema)


GROUP_QUERY_ATTENTION = _group_query_attention_op()


# ---------------------------------------------------------------------------------------------- activations

def _constant(op: Any, value: float, like: Any) -> Any:
    return op.CastLike(op.Constant(value_float=float(value)), like)


def _gelu_formula(op: Any, y: Any, approximate: str) -> Any:
    """Gelu as its formula, for opsets before Gelu existed (ORT's optimizer fuses it back)."""
    half = op.Mul(y, _constant(op, 0.5, y))
    if approximate == "tanh":
        cube = op.Mul(op.Mul(y, y), y)
        inner = op.Mul(op.Add(y, op.Mul(cube, _constant(op, 0.044715, y))), _constant(op, math.sqrt(2 / math.pi), y))
        return op.Mul(half, op.Add(op.Tanh(inner), _constant(op, 1.0, y)))
    return op.Mul(half, op.Add(op.Erf(op.Div(y, _constant(op, math.sqrt(2.0), y))), _constant(op, 1.0, y)))


def activation(op: Any, opset: int, y: Any, name: str, scalars: Any) -> Any:
    """``y`` through the activation ``name`` of :data:`fxforge.rewrites.fused_ops.ACTIVATIONS`, in ONNX ops.

    Raises:
        ValueError: an activation without a translation here.
    """
    scalars = list(scalars or [])
    simple = {"relu": op.Relu, "sigmoid": op.Sigmoid, "tanh": op.Tanh, "hardswish": op.HardSwish,
              "hardsigmoid": lambda v: op.HardSigmoid(v, alpha=1.0 / 6.0, beta=0.5)}
    if name == "none":
        return y
    if name in simple:
        return simple[name](y)
    if name == "hardtanh":
        return op.Clip(y, _constant(op, scalars[0], y), _constant(op, scalars[1], y))
    if name == "leaky_relu":
        return op.LeakyRelu(y, alpha=float(scalars[0]))
    if name in ("gelu", "gelu_tanh"):
        approximate = "tanh" if name == "gelu_tanh" else "none"
        return op.Gelu(y, approximate=approximate) if opset >= 20 else _gelu_formula(op, y, approximate)
    if name == "silu":
        return op.Mul(y, op.Sigmoid(y))
    raise ValueError(f"no ONNX translation for the fused activation {name!r}")


# ---------------------------------------------------------------------------------------------- helpers

def _rank(value: Any) -> int | None:
    shape = getattr(value, "shape", None)
    return None if shape is None else len(shape)


def _dims(value: Any) -> list[Any]:
    """The dims of a traced value: ints where static, ``ir.SymbolicDim`` otherwise."""
    return list(value.shape) if getattr(value, "shape", None) is not None else []


def _static(dim: Any) -> int | None:
    return dim if isinstance(dim, int) else None


def _per_dim(values: Any, dims: int) -> list[int]:
    values = [int(v) for v in (values if isinstance(values, (list, tuple)) else [values])]
    return values * dims if len(values) == 1 else values


# ---------------------------------------------------------------------------------------------- the table

@dataclasses.dataclass
class Translations:
    """The custom translation table for one export, and what it did.

    Attributes:
        opset: the ONNX opset of the export.
        attention: ``"MultiHeadAttention"`` (translate SDPA to ORT's kernel, where it can carry the call)
            or ``"plain"`` (torch.onnx's own translation).
        used: how many nodes each translation produced (``{"fxforge::conv_pointwise -> Conv": 3}``).
        kept_plain: for each attention left to torch.onnx's translation, why (with its source line).
        cpu: the file is for ONNX Runtime's CPU provider (whose ``MultiHeadAttention`` keeps NaN rows).
        multi_head_outputs: the values SDPA calls were translated into through ``MultiHeadAttention``.
        notes: other lines for the summary (causal attention kept ``MultiHeadAttention``, and why).

    Example:
        >>> t = Translations(opset=20, attention="plain")
        >>> SDPA in t.table()
        False
    """

    opset: int = DEFAULT_OPSET
    attention: str = "MultiHeadAttention"
    used: dict[str, int] = dataclasses.field(default_factory=dict)
    kept_plain: list[str] = dataclasses.field(default_factory=list)
    cpu: bool = True
    multi_head_outputs: list = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def op(self) -> values.Opset:
        """The default-domain opset the translations emit."""
        return values.Opset("", self.opset)

    def table(self) -> dict[Any, Callable[..., Any]]:
        """``custom_translation_table`` for ``torch.onnx.export``."""
        table: dict[Any, Callable[..., Any]] = {NAN_ROWS: as_function(self.nan_rows),
                                                CONV_POINTWISE: as_function(self.conv_pointwise),
                                                LINEAR_POINTWISE: as_function(self.linear_pointwise),
                                                CONV_TRANSPOSE_POINTWISE: as_function(self.conv_transpose_pointwise)}
        if self.attention == "MultiHeadAttention":
            table[SDPA] = as_function(self.scaled_dot_product_attention)
        return table

    def _count(self, what: str) -> None:
        self.used[what] = self.used.get(what, 0) + 1

    def conv_pointwise(self, input, weight, bias, stride, padding, dilation, groups, other, binary, activation_name,
                       scalars, kernel):
        """``fxforge::conv_pointwise`` -> ``Conv`` (+ ``Add``) + activation (``kernel`` is PyTorch's concern)."""
        op = self.op
        dims = (_rank(weight) or len(stride) + 2) - 2
        conv_inputs = [input, weight] + ([bias] if bias is not None else [])
        kernel_shape = _dims(weight)[2:]  # spelled out as torch.onnx's own Conv does (same optimized graph)
        extra = {"kernel_shape": kernel_shape} if all(isinstance(d, int) for d in kernel_shape) else {}
        y = op.Conv(*conv_inputs, strides=_per_dim(stride, dims), pads=_per_dim(padding, dims) * 2,
                    dilations=_per_dim(dilation, dims), group=int(groups), **extra)
        if other is not None:
            y = op.Add(y, other) if binary == "add" else op.Sub(y, other)
        self._count(f"fxforge::conv_pointwise -> Conv{' + ' + binary.capitalize() if other is not None else ''}"
                    f"{'' if activation_name == 'none' else ' + ' + activation_name}")
        return activation(op, self.opset, y, activation_name, scalars)

    def linear_pointwise(self, input, weight, bias, other, binary, activation_name, scalars, kernel):
        """``fxforge::linear_pointwise`` -> ``Gemm`` (2-d input) or ``MatMul`` + ``Add``, + activation."""
        op = self.op
        if _rank(input) == 2:
            y = op.Gemm(*([input, weight] + ([bias] if bias is not None else [])), transB=1)
            form = "Gemm"
        else:
            y = op.MatMul(input, op.Transpose(weight, perm=[1, 0]))
            if bias is not None:
                y = op.Add(y, bias)
            form = "MatMul + Add" if bias is not None else "MatMul"
        if other is not None:
            y = op.Add(y, other) if binary == "add" else op.Sub(y, other)
            form += f" + {binary.capitalize()}"
        self._count(f"fxforge::linear_pointwise -> {form}{'' if activation_name == 'none' else ' + ' + activation_name}")
        return activation(op, self.opset, y, activation_name, scalars)

    def conv_transpose_pointwise(self, input, weight, bias, stride, padding, output_padding, groups, dilation,
                                 activation_name, scalars, kernel):
        """``fxforge::conv_transpose_pointwise`` -> ``ConvTranspose`` + activation."""
        op, dims = self.op, (_rank(weight) or len(stride) + 2) - 2
        y = op.ConvTranspose(*([input, weight] + ([bias] if bias is not None else [])), strides=_per_dim(stride, dims),
                             pads=_per_dim(padding, dims) * 2, output_padding=_per_dim(output_padding, dims),
                             dilations=_per_dim(dilation, dims), group=int(groups))
        self._count("fxforge::conv_transpose_pointwise -> ConvTranspose" + ("" if activation_name == "none" else
                                                                          f" + {activation_name}"))
        return activation(op, self.opset, y, activation_name, scalars)

    # ------------------------------------------------------------------------------------------ attention

    def attention_refusal(self, query, key, value, attn_mask, dropout_p, is_causal, scale=None) -> str | None:
        """Why ``MultiHeadAttention`` cannot carry this SDPA call, or None."""
        if scale is not None and not isinstance(scale, (int, float)):
            return "a scale computed at run time"
        if dropout_p:
            return f"dropout_p={dropout_p} (MultiHeadAttention has no dropout)"
        if not (_rank(query) == _rank(key) == _rank(value) and _rank(query) in (3, 4)):
            return "query, key and value are not all 4-d [batch, heads, seq, head_size] or all 3-d"
        q, k, v = (_dims(t) if _rank(t) == 4 else [_dims(t)[0], 1, *_dims(t)[1:]] for t in (query, key, value))
        static = [_static(q[1]), _static(k[1]), _static(q[3]), _static(v[3])]
        if any(d is None for d in static):
            return "head counts or head sizes are not known at export time"
        if _static(q[1]) % _static(k[1]):
            return f"{q[1]} query heads are not a multiple of {k[1]} key/value heads"
        if is_causal and not same_dim(q[2], k[2]):
            return "is_causal with query and key lengths that may differ (SDPA's causal mask is top-left aligned)"
        if attn_mask is not None and (_rank(attn_mask) or 5) > 4:
            return "a mask of more than 4 dims"
        return None

    def scaled_dot_product_attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                     scale=None, enable_gqa=False):
        """``aten.scaled_dot_product_attention`` -> ``com.microsoft.GroupQueryAttention`` (causal
        self-attention) or ``com.microsoft.MultiHeadAttention``, or torch.onnx's own translation (reason
        recorded) where those kernels cannot carry the call."""
        reason = self.attention_refusal(query, key, value, attn_mask, dropout_p, is_causal, scale)
        if reason is not None:
            node = translating_node()
            where = node_source(node) if node is not None else None
            self.kept_plain.append(f"{reason}{f'  ({where})' if where else ''}")
            self._count("attention -> torch.onnx's translation (MatMul, Softmax, MatMul)")
            plain = torchlib_translation(SDPA, self.opset)
            return plain(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        op = self.op
        one = op.Constant(value_ints=[1])
        dtype, mask_dtype = query.dtype, None if attn_mask is None else attn_mask.dtype  # before any Unsqueeze
        three_d = _rank(query) == 3
        if three_d:  # [B, S, H] is one head: [B, 1, S, H]
            q, k, v = ([d[0], 1, *d[1:]] for d in (_dims(query), _dims(key), _dims(value)))
            query, key, value = (op.Unsqueeze(t, one) for t in (query, key, value))
            if attn_mask is not None and _rank(attn_mask) == 3:  # [B, S, L] -> [B, 1, S, L]
                attn_mask, mask_dims = op.Unsqueeze(attn_mask, one), [_dims(attn_mask)[0], 1, *_dims(attn_mask)[1:]]
            else:
                mask_dims = None if attn_mask is None else _dims(attn_mask)
        else:
            q, k, v = _dims(query), _dims(key), _dims(value)
            mask_dims = None if attn_mask is None else _dims(attn_mask)
        heads, kv_heads, head_size, v_head_size = q[1], k[1], q[3], v[3]
        scale = 1.0 / math.sqrt(head_size) if scale is None else float(scale)

        def bsd(t):  # [B, N, S, H] -> [B, S, N*H]
            return op.Reshape(op.Transpose(t, perm=[0, 2, 1, 3]), op.Constant(value_ints=[0, 0, -1]))

        group_query = is_causal and attn_mask is None and self.group_query_refusal(q, k, v) is None
        if group_query:
            out = self._causal_group_query(bsd(query), bsd(key), bsd(value), heads, kv_heads, scale)
            self._count("attention -> com.microsoft.GroupQueryAttention (causal)")
        else:
            if is_causal and attn_mask is None:
                self.notes.append(f"causal attention as MultiHeadAttention: {self.group_query_refusal(q, k, v)}")
            out = self._multi_head(query, q, key, k, value, bsd, attn_mask, mask_dims, heads, kv_heads, scale,
                                   is_causal, v_head_size, dtype, mask_dtype)
            self._count("attention -> com.microsoft.MultiHeadAttention")
        # onnx infers no shape through a contrib op: typed here, the shape computations after it fold to
        # constants and the transposes that follow are seen to move only size-1 dims where they do
        out.dtype, out.shape = dtype, ir.Shape([q[0], q[2], heads * v_head_size])
        if not three_d:  # else [B, S, 1 * Hv] is the answer
            split = op.Concat(op.Shape(out, start=0, end=2), op.Constant(value_ints=[heads, v_head_size]), axis=0)
            out = op.Transpose(op.Reshape(out, split), perm=[0, 2, 1, 3])
        if not group_query:  # ORT's MultiHeadAttention: NaN in query rows with a NaN, where the kernel keeps them
            self.multi_head_outputs.append(out)
        return out

    def nan_rows(self, out, q):
        """``fxforge::nan_rows`` (:mod:`fxforge.rewrites.attention.guards`): ``out`` itself where ``out``
        is what this table translated an SDPA to ``MultiHeadAttention`` into and the installed ONNX Runtime's
        CPU kernel (``cpu``) gives NaN in those rows itself (:func:`~fxforge.exporters.attention_guards.multi_head_attention_keeps_nan_rows`);
        elsewhere the guard, ``Where(IsNaN(ReduceSum(Mul(q, 0), [-1])), NaN, out)``."""
        op = self.op
        if self.cpu and any(out is value for value in self.multi_head_outputs) and multi_head_attention_keeps_nan_rows():
            self._count("NaN-row guard left to MultiHeadAttention, which gives NaN there itself")
            return out  # the value itself: nothing is computed
        rows = op.ReduceSum(op.Mul(q, _constant(op, 0.0, q)), op.Constant(value_ints=[-1]), keepdims=1)
        return op.Where(op.IsNaN(rows), _constant(op, math.nan, out), out)

    @staticmethod
    def group_query_refusal(q: list, k: list, v: list) -> str | None:
        """Why ``GroupQueryAttention`` cannot carry a causal self-attention with these [B, N, S, H] dims, or
        None (its CPU kernel's checks: head sizes equal and a multiple of 8; fewer than 2**31 elements)."""
        if q[3] != v[3]:
            return f"value head size {v[3]} differs from query head size {q[3]}"
        if q[3] % 8:
            return f"head size {q[3]} is not a multiple of 8 (GroupQueryAttention's CPU kernel needs that)"
        if all(isinstance(d, int) for d in (q[0], q[2])) and q[0] * q[2] * (q[1] + 2 * k[1]) * q[3] >= 2**31:
            return "more than 2**31 elements in q, k and v"
        return None

    def _causal_group_query(self, query: Any, key: Any, value: Any, heads: int, kv_heads: int, scale: float) -> Any:
        """Causal self-attention (query and key lengths equal) on [B, S, N*H] inputs as ``GroupQueryAttention``:
        its CPU kernel runs the softmax only over each row's causal prefix and reads the ``kv_heads`` key/value
        heads in place (no repeat). No past: ``seqlens_k`` is S - 1 for every batch row, the total length S."""
        op = self.op
        length = op.Cast(op.Shape(query, start=1, end=2), to=ir.DataType.INT32)
        seqlens_k = op.Expand(op.Sub(length, op.CastLike(op.Constant(value_ints=[1]), length)),
                              op.Shape(query, start=0, end=1))
        total = op.Squeeze(length, op.Constant(value_ints=[0]))
        out, _, _ = GROUP_QUERY_ATTENTION(query, key, value, None, None, seqlens_k, total, num_heads=heads,
                                          kv_num_heads=kv_heads, scale=scale)
        return out

    def _multi_head(self, query, q, key, k, value, bsd, attn_mask, mask_dims, heads, kv_heads, scale, is_causal,
                    v_head_size, dtype, mask_dtype):
        """``MultiHeadAttention`` on [B, S, N*H] inputs; the output is [B, S, N*Hv].

        With a key padding mask (one that broadcasts over the query dim), two ``MultiHeadAttention`` calls
        under an ``If``: ORT's CPU kernel runs flash attention only without a mask, so a mask that masks
        nothing (all zeros, or all True: a batch without padding) is checked at run time, on the mask before
        it is expanded to [.., S, L], and the kernel is called without it; any other mask goes to the kernel
        as ``attention_bias``.
        """
        op = self.op
        mask, target = (None, None) if attn_mask is None else self._attention_bias(attn_mask, mask_dtype, mask_dims,
                                                                                      dtype, query, q, key, k)
        if kv_heads != heads:  # grouped-query attention: each key/value head serves heads // kv_heads queries
            key, value = (self._repeat_heads(t, kv_heads, heads // kv_heads) for t in (key, value))
        query, key, value = bsd(query), bsd(key), bsd(value)
        # Only a mask that broadcasts over the query dim (a key padding mask, [B, 1, 1, L]) is checked: a full
        # [.., S, L] mask (causal, relative positions) costs S x L reads a call and rarely masks nothing.
        padding = mask_dims is not None and (len(mask_dims) < 2 or mask_dims[-2] == 1)
        if mask is None or is_causal or not padding:
            bias = mask if target is None else op.Expand(mask, target)
            return MULTI_HEAD_ATTENTION(query, key, value, None, None, bias, num_heads=heads, scale=scale,
                                        unidirectional=int(bool(is_causal)))
        keeps_all = op.Cast(op.ReduceMin(op.Cast(op.Equal(mask, _constant(op, 0.0, mask)), to=ir.DataType.INT32),
                                         keepdims=0), to=ir.DataType.BOOL)
        self._count("attention mask checked at run time (a mask that masks nothing: flash attention)")
        # onnx infers no type through a contrib op: the branch outputs and the If's are typed here
        shape = ir.Shape([q[0], q[2], heads * v_head_size])
        out = op.If(keeps_all, then_branch=self._branch(query, key, value, None, None, heads, scale, dtype, shape),
                    else_branch=self._branch(query, key, value, mask, target, heads, scale, dtype, shape))
        out.dtype, out.shape = dtype, shape
        return out

    @staticmethod
    def _branch(query: Any, key: Any, value: Any, mask: Any, target: Any, heads: int, scale: float, dtype: Any,
                shape: ir.Shape) -> ir.Graph:
        """A subgraph running ``MultiHeadAttention`` on the outer graph's values: without a mask (``mask``
        None), or with ``mask`` (expanded to ``target`` first, unless None) as its ``attention_bias``."""
        nodes = []
        if mask is not None and target is not None:
            nodes.append(ir.Node("", "Expand", [mask, target], outputs=[ir.Value(name=None, type=ir.TensorType(dtype))]))
            mask = nodes[-1].outputs[0]
        output = ir.Value(name=None, type=ir.TensorType(dtype), shape=shape)
        inputs = [query, key, value] + ([None, None, mask] if mask is not None else [])
        nodes.append(ir.Node("com.microsoft", "MultiHeadAttention", inputs, attributes=[
            ir.AttrInt64("num_heads", heads), ir.AttrFloat32("scale", scale)], outputs=[output]))
        return ir.Graph([], [output], nodes=nodes, name="attention_masked" if mask is not None else "attention")

    def _repeat_heads(self, t: Any, kv_heads: int, times: int) -> Any:
        """[B, Nk, L, H] -> [B, Nk * times, L, H], each head repeated ``times`` times in place (as SDPA's GQA)."""
        op = self.op
        expanded = op.Expand(op.Unsqueeze(t, op.Constant(value_ints=[2])),
                             op.Concat(op.Shape(t, start=0, end=2), op.Constant(value_ints=[times]),
                                       op.Shape(t, start=2, end=4), axis=0))
        return op.Reshape(expanded, op.Concat(op.Shape(t, start=0, end=1), op.Constant(value_ints=[kv_heads * times]),
                                              op.Shape(t, start=2, end=4), axis=0))

    def _attention_bias(self, mask: Any, mask_dtype: Any, mask_dims: list, dtype: Any, query: Any, q: list, key: Any,
                        k: list) -> tuple[Any, Any]:
        """SDPA's mask as MultiHeadAttention's ``attention_bias``: additive, same dtype as q, 4-d, and the shape
        to expand it to (None: none needed) so that the query and key dims are spelled out (ORT broadcasts
        batch and heads only). ``*_dims``: static dims; ``mask_dtype``, ``dtype``: the mask's and the query's
        dtypes (an Unsqueeze's output has none while tracing)."""
        op = self.op
        if mask_dtype == ir.DataType.BOOL:  # True keeps a key (as torch.onnx's own translation does it)
            mask = op.Where(mask, _constant(op, 0.0, query), _constant(op, -math.inf, query))
        elif mask_dtype != dtype:
            mask = op.CastLike(mask, query)
        if len(mask_dims) < 4:
            mask = op.Unsqueeze(mask, op.Constant(value_ints=list(range(4 - len(mask_dims)))))
            mask_dims = [1] * (4 - len(mask_dims)) + list(mask_dims)
        target = None
        if not (same_dim(mask_dims[2], q[2]) and same_dim(mask_dims[3], k[2])):
            target = op.Concat(op.Shape(mask, start=0, end=2), op.Shape(query, start=2, end=3),
                               op.Shape(key, start=2, end=3), axis=0)
        return mask, target

    def summary(self) -> list[str]:
        """One line per translation used, and one per attention kept plain.

        Example:
            >>> t = Translations(); t.used["fxforge::conv_pointwise -> Conv + relu"] = 2
            >>> t.summary()
            ['fxforge::conv_pointwise -> Conv + relu: 2']
        """
        lines = [f"{what}: {count}" for what, count in sorted(self.used.items())]
        lines += [f"attention kept torch.onnx's translation: {reason}" for reason in self.kept_plain]
        lines += sorted(set(self.notes))
        return lines
