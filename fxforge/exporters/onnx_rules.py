"""The rules fxforge applies to an exported ONNX graph, as one list read top to bottom.

:func:`fxforge.exporters.onnx.write_checked` runs :data:`ONNX_RULES` in this order on the graph torch.onnx
wrote (:func:`~fxforge.exporters.onnx_engine.run_onnx_rules`), the CPU-provider-only ones where the file is
for ONNX Runtime's CPU provider; each application and refusal is an ``Applied``/``NearMiss`` of the
export's report, named ``"onnx <rule>"``. Adding a rule is one :class:`~fxforge.exporters.onnx_engine.OnnxRule`
in the list: a pattern as an onnxscript rule (:class:`~fxforge.exporters.onnx_engine.PatternRule` made a
function by :func:`~fxforge.exporters.onnx_engine.pattern_pass`), anything else as a function
``(model, ctx) -> None``. Each module named below says what its rule does and why (with measurements).

Example:
    >>> [rule.name for rule in ONNX_RULES if not rule.cpu_only]
    ['transpose_pairs', 'unit_transposes']
    >>> len({rule.name for rule in ONNX_RULES}) == len(ONNX_RULES)
    True
"""

from __future__ import annotations

import io

from onnxscript import ir
from onnxscript.ir.passes.common import RemoveUnusedNodesPass

from fxforge.exporters.attention_guards import drop_attention_guards, fold_mask_constants
from fxforge.exporters.channel_gates import keep_gates_blocked
from fxforge.exporters.gathers import gather_moved_rows
from fxforge.exporters.onnx_engine import OnnxContext, OnnxRule
from fxforge.exporters.pack_projections import PACK_PROJECTIONS, pack_projections
from fxforge.exporters.program import quiet
from fxforge.exporters.projected_attention import PROJECTED_ATTENTION, project_attention
from fxforge.exporters.qkv_slices import read_qkv_as_slices
from fxforge.exporters.residual_norm import residual_norm
from fxforge.exporters.rms_norm import rms_norm
from fxforge.exporters.rotary import ROTARY, fuse_rotary_embeddings
from fxforge.exporters.split_projections import SPLIT_PROJECTIONS, split_projections
from fxforge.exporters.transpose_pairs import transpose_pairs, unit_transposes


def attention_guards(model: ir.Model, ctx: OnnxContext) -> None:
    """Fold the masks computed from constants, then drop the attention guards ONNX Runtime's kernel makes
    redundant (:mod:`~fxforge.exporters.attention_guards`).

    Example:
        >>> ctx = OnnxContext("attention_guards")
        >>> attention_guards(ir.Model(ir.Graph([], [], nodes=[], opset_imports={"": 20}), ir_version=10), ctx)
        >>> ctx.matches
        []
    """
    with quiet(io.StringIO()):  # the folder logs each node it could not evaluate (ORT evaluates those at run time)
        fold_mask_constants(model)
    for what, count in drop_attention_guards(model.graph).items():
        ctx.applied(f"dropped: {what}", count=count)


def qkv_slices(model: ir.Model, ctx: OnnxContext) -> None:
    """q, k and v unpacked from one projection read as slices of it (:mod:`~fxforge.exporters.qkv_slices`);
    the unpackings the slices replaced, which still read the product, are removed.

    Example:
        >>> ctx = OnnxContext("qkv_slices")
        >>> qkv_slices(ir.Model(ir.Graph([], [], nodes=[], opset_imports={"": 20}), ir_version=10), ctx)
        >>> ctx.matches
        []
    """
    for what, count in read_qkv_as_slices(model.graph).items():
        ctx.applied(what, count=count)
    RemoveUnusedNodesPass()(model)


def split_projections_rule(model: ir.Model, ctx: OnnxContext) -> None:
    """A projection read only in slices becomes one per slice (:mod:`~fxforge.exporters.split_projections`).

    Example:
        >>> ctx = OnnxContext("split_projections")
        >>> split_projections_rule(ir.Model(ir.Graph([], [], nodes=[]), ir_version=10), ctx); ctx.matches
        []
    """
    ctx.applied(SPLIT_PROJECTIONS, count=split_projections(model.graph))


def gathers(model: ir.Model, ctx: OnnxContext) -> None:
    """Rows moved by several copies are gathered once (:mod:`~fxforge.exporters.gathers`).

    Example:
        >>> ctx = OnnxContext("gathers"); gathers(ir.Model(ir.Graph([], [], nodes=[]), ir_version=10), ctx)
        >>> ctx.matches
        []
    """
    for what, count in gather_moved_rows(model.graph).items():
        ctx.applied(what, count=count)


def rotary(model: ir.Model, ctx: OnnxContext) -> None:
    """Rotary embeddings of a GroupQueryAttention move into it (:mod:`~fxforge.exporters.rotary`); each one
    left is a near miss with its reason.

    Example:
        >>> ctx = OnnxContext("rotary"); rotary(ir.Model(ir.Graph([], [], nodes=[]), ir_version=10), ctx)
        >>> ctx.matches, ctx.near_misses
        ([], [])
    """
    done, refused = fuse_rotary_embeddings(model.graph)
    ctx.applied(ROTARY, count=done)
    for reason in refused:
        ctx.refused(None, reason)


def channel_gates(model: ir.Model, ctx: OnnxContext) -> None:
    """Squeeze-and-excitation gates take the form ORT keeps in its blocked layout
    (:mod:`~fxforge.exporters.channel_gates`); each gate left is a near miss with its reason.

    Example:
        >>> ctx = OnnxContext("channel_gates"); channel_gates(ir.Model(ir.Graph([], [], nodes=[]), ir_version=10), ctx)
        >>> ctx.matches, ctx.near_misses
        ([], [])
    """
    done, kept = keep_gates_blocked(model.graph)
    for what, count in done.items():
        ctx.applied(what, count=count)
    for reason in kept:
        ctx.refused(None, f"channel gate kept as torch wrote it: {reason}")


def pack_projections_rule(model: ir.Model, ctx: OnnxContext) -> None:
    """Projections of one input over few rows become one product (:mod:`~fxforge.exporters.pack_projections`).

    Example:
        >>> ctx = OnnxContext("pack_projections")
        >>> pack_projections_rule(ir.Model(ir.Graph([], [], nodes=[]), ir_version=10), ctx); ctx.matches
        []
    """
    ctx.applied(PACK_PROJECTIONS, count=pack_projections(model.graph))


def projected_attention(model: ir.Model, ctx: OnnxContext) -> None:
    """Attention over q, k, v projected from one input becomes ORT's ``Attention``
    (:mod:`~fxforge.exporters.projected_attention`).

    Example:
        >>> ctx = OnnxContext("projected_attention")
        >>> projected_attention(ir.Model(ir.Graph([], [], nodes=[]), ir_version=10), ctx); ctx.matches
        []
    """
    ctx.applied(PROJECTED_ATTENTION, count=project_attention(model.graph))


# The rules, in the order they run. cpu_only: for ONNX Runtime's CPU provider alone (what each module measured).
ONNX_RULES: list[OnnxRule] = [
    OnnxRule("residual_norm", residual_norm, "residual Add before a LayerNormalization -> Sum (ORT's CPU "
             "SkipLayerNormalization is slower)", cpu_only=True),
    OnnxRule("attention_guards", attention_guards, "fold constant masks; drop the attention guards ORT's "
             "MultiHeadAttention makes redundant", cpu_only=True),
    OnnxRule("qkv_slices", qkv_slices, "q, k, v unpacked from one projection -> slices of it", cpu_only=True),
    OnnxRule("split_projections", split_projections_rule, "projection read only in slices -> one per slice",
             cpu_only=True),
    OnnxRule("gathers", gathers, "rows moved by several copies -> one Gather", cpu_only=True),
    OnnxRule("rms_norm", rms_norm, "RMS norm -> the form ORT fuses (SimplifiedLayerNormalization)", cpu_only=True),
    OnnxRule("rotary", rotary, "rotary embedding -> GroupQueryAttention's do_rotary", cpu_only=True),
    OnnxRule("channel_gates", channel_gates, "squeeze-and-excitation gates -> ORT's blocked layout", cpu_only=True),
    OnnxRule("pack_projections", pack_projections_rule, "projections of one input over few rows -> one MatMul",
             cpu_only=True),
    OnnxRule("projected_attention", projected_attention, "attention over q, k, v projected from one input -> "
             "com.microsoft.Attention", cpu_only=True),
    OnnxRule("transpose_pairs", transpose_pairs, "Transpose + Reshape (size-1 dims) + Transpose -> one"),
    OnnxRule("unit_transposes", unit_transposes, "Transpose moving only size-1 dims -> Reshape"),
]
