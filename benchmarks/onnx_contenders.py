"""ONNX Runtime contenders for the harness: fxforge -> ORT, plain torch.onnx -> ORT, ORT's transformers optimizer.

Importing this module registers two contenders in :data:`benchmarks.contenders.CONTENDERS` (the plain
``torch.onnx.export(model, args, dynamo=True)`` -> ORT peer is the harness's own ``ort``):

- ``fxforge-ort``: ``fxforge.optimize(model, args, target="onnxruntime")``: fxforge's rewrites, its
  ONNX translations (attention -> ``com.microsoft.MultiHeadAttention``, causal self-attention ->
  ``com.microsoft.GroupQueryAttention``), run in an ORT session;
- ``ort-transformers-optimizer``: that plain export, then ``onnxruntime.transformers.optimizer`` for the
  model's architecture (transformers models whose ``config.model_type`` the optimizer knows; it refuses
  other models with the reason, and that row fails with it).

Every session: CPU unless the inputs are on CUDA, ``intra_op_num_threads`` = torch's thread count,
one inter-op thread, ``session.intra_op.allow_spinning = "0"``
(:func:`benchmarks.contenders.ort_session_options`), so the ORT contenders and torch use the same cores the
same way. Each contender's note names what it ran (translations used, or the optimizer's fused ops).
"""

from __future__ import annotations

import os
import tempfile
import traceback
from collections import Counter

from torch import nn

from benchmarks.contenders import (
    OrtCallable,
    Prepared,
    _device_of,
    optimized_graph_digest,
    ort_providers,
    ort_session,
    ort_session_options,
    plain_onnx_export,
    register,
    report_info,
    report_note,
)
from fxforge.exporters.onnx_rules import ONNX_RULES
from fxforge.exporters.residual_norm import residual_norm

# config.model_type (transformers) -> the transformers optimizer's model_type.
OPTIMIZER_MODEL_TYPES = {
    "bert": "bert", "roberta": "bert", "distilbert": "bert", "deit": "vit", "vit": "vit", "gpt2": "gpt2",
    "llama": "gpt2", "mistral": "gpt2", "qwen2": "gpt2", "phi": "phi", "t5": "t5", "bart": "bart",
    "swin": "swin", "clip": "clip",
}


def _op_counts(path: str) -> dict[str, int]:
    import onnx

    model = onnx.load(path, load_external_data=False)
    return dict(Counter(f"{n.domain + '.' if n.domain else ''}{n.op_type}" for n in model.graph.node))


@register("fxforge-ort", "fxforge.optimize(model, args, target='onnxruntime'): fxforge's rewrites and ONNX "
          "translations, in an onnxruntime session")
def _fxforge_ort(model: nn.Module, args: tuple) -> Prepared:
    import fxforge

    device = _device_of(args)
    module = fxforge.optimize(model, example_inputs=args, target="onnxruntime",
                              session_options=ort_session_options(), providers=ort_providers(device))
    translations = module.onnx_export.translations if module.onnx_export is not None else []
    note = report_note(module.report)
    note += "".join(f", {kernel}×{count}" for kernel, count in ort_kernels(translations, module.report.counts).items())
    info = report_info(module.report)
    info.update(translations=translations, providers=module.providers, ops=_op_counts(module.path))
    return Prepared(module, note=note, info=info,
                    describe=lambda: {"optimized_graph": optimized_graph_digest(module.path, device)})


# The ONNX rule that keeps the residual Add apart from LayerNormalization (its applications are counted as
# "onnx <name>" in a report).
RESIDUAL_NORM_RULE = next(rule.name for rule in ONNX_RULES if rule.run is residual_norm)


def ort_kernels(translations: list[str], counts: dict[str, int]) -> dict[str, int]:
    """How many calls each ORT kernel form fxforge chose carries: the attention kernels (from an export's
    translation lines), and the residual ``Sum`` + ``LayerNormalization`` kept apart from ORT's
    SkipLayerNormalization (the ``onnx residual_norm`` rule's applications in the report's ``counts``).

    Example:
        >>> ort_kernels(["attention -> com.microsoft.GroupQueryAttention (causal): 4",
        ...              "attention -> com.microsoft.MultiHeadAttention: 2", "fxforge::linear_pointwise -> Gemm: 1"],
        ...             {"onnx residual_norm": 9, "cleanup": 3})
        {'GroupQueryAttention': 4, 'MultiHeadAttention': 2, 'Sum+LayerNormalization': 9}
    """
    kernels: dict[str, int] = {}
    for line in translations:
        what, _, count = line.rpartition(": ")
        if what.startswith("attention -> com.microsoft."):
            kernel = what.removeprefix("attention -> com.microsoft.").split(" ")[0]
            kernels[kernel] = kernels.get(kernel, 0) + int(count)
    if counts.get(f"onnx {RESIDUAL_NORM_RULE}"):
        kernels["Sum+LayerNormalization"] = counts[f"onnx {RESIDUAL_NORM_RULE}"]
    return kernels


def optimizer_model_type(model: nn.Module) -> str:
    """The transformers optimizer's ``model_type`` for ``model``.

    Raises:
        RuntimeError: the optimizer does not apply (not a transformers model, or an architecture it has
            no fusions for); the message says which.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise RuntimeError("onnxruntime.transformers.optimizer applies to transformers models; "
                           f"{type(model).__name__} has no config.model_type")
    if model_type not in OPTIMIZER_MODEL_TYPES:
        raise RuntimeError(f"onnxruntime.transformers.optimizer has no fusions for model_type {model_type!r}")
    return OPTIMIZER_MODEL_TYPES[model_type]


@register("ort-transformers-optimizer", "torch.onnx.export(dynamo=True), then onnxruntime.transformers.optimizer "
          "(transformers models only), in an onnxruntime session")
def _ort_transformers_optimizer(model: nn.Module, args: tuple) -> Prepared:
    from onnxruntime.transformers import optimizer

    from fxforge.exporters.program import quiet

    model_type = optimizer_model_type(model)
    config = model.config
    heads = int(getattr(config, "num_attention_heads", 0) or getattr(config, "n_head", 0) or 0)
    hidden = int(getattr(config, "hidden_size", 0) or getattr(config, "n_embd", 0) or 0)
    device = _device_of(args)
    with tempfile.TemporaryDirectory(prefix="fxforge-bench-") as tmp:
        path = os.path.join(tmp, "model.onnx")
        plain_onnx_export(model, args, path)
        try:
            with quiet():
                optimized = optimizer.optimize_model(path, model_type=model_type, num_heads=heads,
                                                     hidden_size=hidden, use_gpu=device.type == "cuda")
                fused = {k: v for k, v in optimized.get_fused_operator_statistics().items() if v}
                optimized_path = os.path.join(tmp, "optimized.onnx")
                optimized.save_model_to_file(optimized_path)
        except Exception as exc:
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            where = f"{os.path.basename(frame.filename)}:{frame.lineno}"
            raise RuntimeError(f"onnxruntime.transformers.optimizer (model_type={model_type!r}) failed on the plain "
                               f"export: {type(exc).__name__}: {exc} (at {where})") from exc
        session = ort_session(optimized_path, device)
    note = ", ".join(f"{k}×{v}" for k, v in sorted(fused.items())) or "no fusion applied"
    return Prepared(OrtCallable(session, device), note=f"{model_type}: {note}",
                    info={"model_type": model_type, "fused": fused, "providers": session.get_providers()})
