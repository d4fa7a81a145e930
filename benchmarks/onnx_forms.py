"""``python -m benchmarks --suite onnx-forms``: which ONNX form ONNX Runtime runs fastest for each op fxforge
translates.

This is the measurement behind the choices in :mod:`fxforge.exporters.translations`; run it again on
another machine or ONNX Runtime build with::

    python -m benchmarks --suite onnx-forms            # the shapes the choices were made on
    python -m benchmarks --suite onnx-forms --quick    # tiny shapes, one round (a smoke test)
    python -m benchmarks --suite onnx-forms --only residual_norm

Each comparison builds both forms, checks they agree, and times them in interleaved rounds (the order
rotates every round) with medians, in sessions with torch's thread count and
``session.intra_op.allow_spinning = "0"``. Printed: one line per case with ``A/B``, the ratio of the
first form's median time to the second's (> 1: the second is faster).

- conv: ``Conv`` (+ ``Add``) + activation (what fxforge emits; ORT fuses it) vs ``com.microsoft.FusedConv``;
- linear: ``Gemm``/``MatMul`` + activation vs ``com.microsoft.FusedGemm``;
- attention (a BERT-base attention layer, batch 1): torch.onnx's MatMul/Softmax graph vs
  ``com.microsoft.MultiHeadAttention`` vs ONNX ``Attention`` (opset 23), with a padding mask and with one
  that masks nothing; a causal layer: ``MultiHeadAttention`` (``unidirectional``) vs
  ``com.microsoft.GroupQueryAttention``;
- residual_norm: a residual ``Add`` + ``LayerNormalization`` (ORT fuses it into
  ``com.microsoft.SkipLayerNormalization``) vs ``Sum`` + ``LayerNormalization`` (ORT keeps both kernels).

Example:
    >>> rows = measure(["linear"], quick=True)
    >>> rows[0]["forms"]
    ('standard', 'FusedGemm')
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
from typing import Any

import numpy as np
import torch
from torch import nn

from benchmarks.section import Section
from fxforge.lowering.timing import time_in_blocks

FUSED_CONV_ACTIVATIONS = {"relu": ("Relu", []), "sigmoid": ("Sigmoid", []), "tanh": ("Tanh", []),
                          "leaky_relu": ("LeakyRelu", [0.1]), "hardtanh": ("Clip", [0.0, 6.0])}
CONV_SHAPES = [((1, 64, 56, 56), 64, 3), ((4, 128, 28, 28), 128, 3), ((1, 256, 14, 14), 1024, 1)]
LINEAR_SHAPES = [((64, 768), 3072), ((1, 256, 768), 3072), ((4, 128, 256), 1024)]
ATTENTION_LENGTHS = [1024, 2048]
RESIDUAL_NORM_SHAPES = [(1, 128, 768), (1, 1024, 256), (1, 1024, 768), (1, 2048, 256), (8, 128, 1024)]


def _session(model_bytes: bytes) -> Any:
    import onnxruntime as ort

    from fxforge.exporters.ort_module import session_options

    return ort.InferenceSession(model_bytes, session_options(), providers=["CPUExecutionProvider"])


# ---------------------------------------------------------------------------------------------- conv, linear

def _conv_model(form: str, activation: str, x_shape, out_channels: int, kernel: int, residual: bool) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    n, c, h, w = x_shape
    y_shape = [n, out_channels, h, w]
    inits = [numpy_helper.from_array((rng.standard_normal((out_channels, c, kernel, kernel)) * 0.05).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal(out_channels).astype(np.float32), "B")]
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, list(x_shape))]
    if residual:
        inputs.append(helper.make_tensor_value_info("Z", TensorProto.FLOAT, y_shape))
    conv = {"pads": [kernel // 2] * 4, "strides": [1, 1], "dilations": [1, 1], "group": 1}
    name, params = FUSED_CONV_ACTIVATIONS[activation]
    if form == "FusedConv":
        extra = {"activation_params": params} if params else {}
        nodes = [helper.make_node("FusedConv", ["X", "W", "B"] + (["Z"] if residual else []), ["Y"],
                                  domain="com.microsoft", activation=name, kernel_shape=[kernel, kernel], **conv, **extra)]
    else:
        nodes = [helper.make_node("Conv", ["X", "W", "B"], ["C"], **conv)]
        current = "C"
        if residual:
            nodes.append(helper.make_node("Add", ["C", "Z"], ["S"]))
            current = "S"
        if name == "Clip":
            inits += [numpy_helper.from_array(np.array(v, np.float32), n_) for v, n_ in zip(params, ("lo", "hi"))]
            nodes.append(helper.make_node("Clip", [current, "lo", "hi"], ["Y"]))
        else:
            attrs = {"alpha": params[0]} if params else {}
            nodes.append(helper.make_node(name, [current], ["Y"], **attrs))
    graph = helper.make_graph(nodes, "conv", inputs, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, y_shape)],
                              inits)
    opsets = [helper.make_opsetid("", 20), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10).SerializeToString()


def _linear_model(form: str, activation: str, x_shape, out_features: int) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    in_features = x_shape[-1]
    y_shape = [*x_shape[:-1], out_features]
    inits = [numpy_helper.from_array((rng.standard_normal((out_features, in_features)) * 0.05).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal(out_features).astype(np.float32), "B")]
    name, params = FUSED_CONV_ACTIVATIONS[activation]
    attrs = {"alpha": params[0]} if params else {}
    if form == "FusedGemm":
        inits += [numpy_helper.from_array(np.array([-1, in_features], np.int64), "flat"),
                  numpy_helper.from_array(np.array(y_shape, np.int64), "shape")]
        nodes = [helper.make_node("Reshape", ["X", "flat"], ["X2"]),
                 helper.make_node("FusedGemm", ["X2", "W", "B"], ["Y2"], domain="com.microsoft", transB=1,
                                  activation=name, **({"activation_alpha": params[0]} if params else {})),
                 helper.make_node("Reshape", ["Y2", "shape"], ["Y"])]
    elif len(x_shape) == 2:
        nodes = [helper.make_node("Gemm", ["X", "W", "B"], ["L"], transB=1), helper.make_node(name, ["L"], ["Y"], **attrs)]
    else:
        nodes = [helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]), helper.make_node("MatMul", ["X", "Wt"], ["M"]),
                 helper.make_node("Add", ["M", "B"], ["L"]), helper.make_node(name, ["L"], ["Y"], **attrs)]
    graph = helper.make_graph(nodes, "linear", [helper.make_tensor_value_info("X", TensorProto.FLOAT, list(x_shape))],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, y_shape)], inits)
    opsets = [helper.make_opsetid("", 20), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10).SerializeToString()


def _compare(case: str, forms: tuple[str, str], sessions: list, feeds: dict, rounds: int, reps: int) -> dict:
    a, b = (s.run(None, feeds)[0] for s in sessions)
    error = float(np.abs(a - b).max())
    medians = time_in_blocks({forms[0]: lambda: sessions[0].run(None, feeds),
                              forms[1]: lambda: sessions[1].run(None, feeds)}, rounds, reps, discard_first=False)
    return {"case": case, "forms": forms, "ms": medians, "ratio": medians[forms[0]] / medians[forms[1]],
            "max_abs_diff": error}


def measure_conv(shapes=CONV_SHAPES, activations=tuple(FUSED_CONV_ACTIVATIONS), rounds: int = 15, reps: int = 5):
    """Conv (+ Add) + activation vs FusedConv, per shape, residual or not, activation."""
    rows = []
    rng = np.random.default_rng(1)
    for x_shape, out_channels, kernel in shapes:
        for residual in (False, True):
            feeds = {"X": rng.standard_normal(x_shape).astype(np.float32)}
            if residual:
                feeds["Z"] = rng.standard_normal((x_shape[0], out_channels, *x_shape[2:])).astype(np.float32)
            for activation in activations:
                sessions = [_session(_conv_model(f, activation, x_shape, out_channels, kernel, residual))
                            for f in ("standard", "FusedConv")]
                case = f"conv {x_shape} k{kernel}->{out_channels}{' +residual' if residual else ''} {activation}"
                rows.append(_compare(case, ("standard", "FusedConv"), sessions, feeds, rounds, reps))
    return rows


def measure_linear(shapes=LINEAR_SHAPES, activations=("relu", "tanh", "leaky_relu"), rounds: int = 15, reps: int = 5):
    """Gemm/MatMul + activation vs FusedGemm, per shape and activation."""
    rows = []
    rng = np.random.default_rng(1)
    for x_shape, out_features in shapes:
        feeds = {"X": rng.standard_normal(x_shape).astype(np.float32)}
        for activation in activations:
            sessions = [_session(_linear_model(f, activation, x_shape, out_features)) for f in ("standard", "FusedGemm")]
            case = f"linear {x_shape}->{out_features} {activation}"
            rows.append(_compare(case, ("standard", "FusedGemm"), sessions, feeds, rounds, reps))
    return rows


def _residual_norm_model(form: str, shape) -> bytes:
    """``form`` (``"Add"`` or ``"Sum"``) of two [batch, rows, hidden] inputs, then ``LayerNormalization``."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    hidden = shape[-1]
    inits = [numpy_helper.from_array(rng.standard_normal(hidden).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal(hidden).astype(np.float32), "B")]
    nodes = [helper.make_node(form, ["X", "R"], ["S"]),
             helper.make_node("LayerNormalization", ["S", "W", "B"], ["Y"], axis=-1, epsilon=1e-12)]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(shape)) for n in ("X", "R")]
    graph = helper.make_graph(nodes, "residual_norm", inputs,
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, list(shape))], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10).SerializeToString()


def measure_residual_norm(shapes=RESIDUAL_NORM_SHAPES, rounds: int = 15, reps: int = 10):
    """Residual ``Add`` + ``LayerNormalization`` (fused by ORT into ``SkipLayerNormalization``) vs ``Sum`` +
    ``LayerNormalization`` (not fused), per [batch, rows, hidden] shape."""
    rows = []
    rng = np.random.default_rng(1)
    for shape in shapes:
        feeds = {n: rng.standard_normal(shape).astype(np.float32) for n in ("X", "R")}
        sessions = [_session(_residual_norm_model(f, shape)) for f in ("Add", "Sum")]
        rows.append(_compare(f"residual + layer norm {shape}", ("Add", "Sum"), sessions, feeds, rounds, reps))
    return rows


# ---------------------------------------------------------------------------------------------- attention

class AttentionLayer(nn.Module):
    """A BERT attention layer: q, k, v and output projections around SDPA with a padding mask; or (``causal``)
    a decoder's, with ``kv_heads`` key/value heads and no mask."""

    def __init__(self, hidden: int = 768, heads: int = 12, kv_heads: int | None = None, causal: bool = False):
        super().__init__()
        self.heads, self.kv_heads, self.causal = heads, kv_heads or heads, causal
        size = hidden // heads
        self.q, self.o = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.k, self.v = (nn.Linear(hidden, self.kv_heads * size) for _ in range(2))

    def forward(self, x, mask=None):
        b, s, d = x.shape

        def split(t):
            return t.view(b, s, -1, d // self.heads).transpose(1, 2)

        y = nn.functional.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)),
                                                       attn_mask=mask, is_causal=self.causal,
                                                       enable_gqa=self.kv_heads != self.heads)
        return self.o(y.transpose(1, 2).reshape(b, s, d))


def _attention23(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA as ONNX Attention (opset 23), the mask spelled out to [.., S, L] (ORT 1.31's CPU kernel does not
    broadcast the query dim)."""
    from onnxscript import opset23 as op

    if attn_mask is not None:
        shape = op.Concat(op.Shape(attn_mask, start=0, end=-2), op.Shape(query, start=2, end=3),
                          op.Shape(key, start=2, end=3), axis=0)
        attn_mask = op.Expand(attn_mask, shape)
    y, _, _, _ = op.Attention(query, key, value, attn_mask, scale=scale, is_causal=int(is_causal))
    return y


def _export_attention(model: nn.Module, inputs: tuple, form: str) -> bytes:
    from fxforge.exporters.onnx import quiet
    from fxforge.exporters.translations import SDPA, Translations

    class NoGroupQuery(Translations):  # causal attention as MultiHeadAttention(unidirectional), as before GQA
        @staticmethod
        def group_query_refusal(q, k, v):
            return "measuring MultiHeadAttention"

    opset = 23 if form == "Attention-23" else 20
    if form == "Attention-23":
        table = {SDPA: _attention23}
    elif form == "MultiHeadAttention-unidirectional":
        table = NoGroupQuery(opset).table()
    else:
        table = Translations(opset, attention="plain" if form == "plain" else "MultiHeadAttention").table()
    with tempfile.TemporaryDirectory() as folder, quiet(io.StringIO()):
        path = os.path.join(folder, "attention.onnx")
        torch.onnx.export(model, inputs, path, dynamo=True, opset_version=opset, custom_translation_table=table,
                          external_data=False)
        with open(path, "rb") as file:
            return file.read()


def _time_forms(case: str, model: nn.Module, inputs: tuple, forms: tuple[str, ...], rounds: int, reps: int) -> list:
    """Rows comparing each of ``forms[1:]`` with ``forms[0]`` on ``model``'s export at ``inputs``."""
    sessions = {f: _session(_export_attention(model, inputs, f)) for f in forms}
    names = [i.name for i in sessions[forms[0]].get_inputs()]
    feeds = dict(zip(names, (t.numpy() for t in inputs)))
    reference = sessions[forms[0]].run(None, feeds)[0]
    error = max(float(np.abs(s.run(None, feeds)[0] - reference).max()) for s in sessions.values())
    medians = time_in_blocks({f: (lambda s=s: s.run(None, feeds)) for f, s in sessions.items()}, rounds, reps,
                             discard_first=False)
    return [{"case": case, "forms": (forms[0], form), "ms": {forms[0]: medians[forms[0]], form: medians[form]},
             "ratio": medians[forms[0]] / medians[form], "max_abs_diff": error} for form in forms[1:]]


def measure_attention(lengths=ATTENTION_LENGTHS, hidden: int = 768, heads: int = 12, rounds: int = 10, reps: int = 1):
    """The plain export vs MultiHeadAttention vs Attention-23 on a BERT attention layer, per sequence length,
    with padding (the last eighth) and without (an all-zero mask: fxforge's run-time check sends it to
    flash attention); and a causal decoder layer (``heads // 2`` key/value heads): MultiHeadAttention
    ``unidirectional`` vs GroupQueryAttention."""
    rows = []
    torch.manual_seed(0)
    model = AttentionLayer(hidden, heads).eval()
    causal = AttentionLayer(hidden, heads, kv_heads=max(heads // 2, 1), causal=True).eval()
    for length in lengths:
        x = torch.randn(1, length, hidden)
        mask = torch.zeros(1, 1, 1, length)
        mask[..., -length // 8:] = float("-inf")  # the last eighth is padding
        rows += _time_forms(f"attention layer S={length} D={hidden} H={heads}, padded", model, (x, mask),
                            ("plain", "MultiHeadAttention", "Attention-23"), rounds, reps)
        rows += _time_forms(f"attention layer S={length} D={hidden} H={heads}, no padding", model,
                            (x, torch.zeros(1, 1, 1, length)), ("plain", "MultiHeadAttention"), rounds, reps)
        rows += _time_forms(f"causal layer S={length} D={hidden} H={heads}/{causal.kv_heads}", causal, (x,),
                            ("MultiHeadAttention-unidirectional", "GroupQueryAttention"), rounds, reps)
    return rows


# ---------------------------------------------------------------------------------------------- main

KINDS = ("conv", "linear", "attention", "residual_norm")


def measure(only: list[str] | tuple[str, ...] = KINDS, quick: bool = False) -> list[dict]:
    """The comparison rows of the kinds in ``only``, on the shapes the choices were made on, or (``quick``)
    on tiny shapes with one round."""
    rows: list[dict] = []
    if quick:
        if "conv" in only:
            rows += measure_conv([((1, 4, 8, 8), 4, 3)], ("relu",), rounds=1, reps=1)
        if "linear" in only:
            rows += measure_linear([((2, 8), 4)], ("relu",), rounds=1, reps=1)
        if "attention" in only:
            rows += measure_attention([16], hidden=32, heads=2, rounds=1)
        if "residual_norm" in only:
            rows += measure_residual_norm([(1, 4, 8)], rounds=1, reps=1)
    else:
        rows += measure_conv() if "conv" in only else []
        rows += measure_linear() if "linear" in only else []
        rows += measure_attention() if "attention" in only else []
        rows += measure_residual_norm() if "residual_norm" in only else []
    return rows


def print_rows(rows: list[dict], out: Any = None) -> None:
    """One line per case: both forms' medians and the ratio."""
    out = sys.stdout if out is None else out
    print(f"onnxruntime, CPU, {torch.get_num_threads()} threads, allow_spinning=0; ratio = "
          "first form's median / second's (> 1: the second is faster)", file=out)
    for row in rows:
        a, b = row["forms"]
        print(f"{row['case']:55} {a} {row['ms'][a]:8.3f} ms  {b} {row['ms'][b]:8.3f} ms  "
              f"{a}/{b} {row['ratio']:.3f}  (max diff {row['max_abs_diff']:.2g})", file=out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``--suite onnx-forms``."""
    parser.add_argument("--quick", action="store_true", help="tiny shapes and one round (a smoke test)")
    parser.add_argument("--only", choices=KINDS, action="append", help="measure only these (repeatable)")


def run(args: argparse.Namespace) -> int:
    """Measure, print one line per case; returns the exit status."""
    print_rows(measure(args.only or KINDS, args.quick))
    return 0


SECTION = Section("onnx-forms", "which ONNX form ONNX Runtime runs fastest for each op fxforge translates (Conv / "
                  "Gemm + activation vs the fused contrib ops, attention kernels, residual + LayerNormalization): "
                  "the measurement behind fxforge.exporters.translations", add_arguments, run)
