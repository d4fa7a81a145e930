"""``--suite int8`` (issue 51): fxforge's int8, bf16 and ``precision="auto"`` plans against float32 (fxforge's
best float32 target) and against int8 peers, at batch 1 and 8.

Per model (BatchNorm statistics set by a few train-mode passes; each model in a cold process), timed in
interleaved rounds under ``torch.no_grad()``:

- ``eager``: the model in float32;
- ``fxforge-fp32``: ``fxforge.optimize(model, inputs)`` (``target="auto"``: the fastest float32 target, ONNX
  Runtime for most models here) — the float32 to beat;
- ``fxforge-bf16``, ``fxforge-int8``, ``fxforge-auto``: the native target with ``precision=`` that (tolerance
  0.05);
- ``fxforge-ort-int8``: ``target="onnxruntime", precision="int8"``: fxforge's file quantized by ONNX Runtime's
  quantizer, kept only where it keeps the tolerance and runs faster (else the float32 file);
- ``fxforge-inductor-int8``: ``target="inductor", precision="int8"``: fxforge's calibrated quantize/dequantize
  pairs around the layers that keep the tolerance, compiled by Inductor with freezing (oneDNN's int8 kernels),
  kept only where faster than the float32 compiled graph;
- ``fxforge-auto-target``: ``target="auto", precision="auto"``: the targets raced in the precision each serves
  (native bf16/int8, ONNX Runtime int8, Inductor int8), each held to the tolerance against eager;
- ``ort-int8``: the plain ``torch.onnx.export(dynamo=True)`` model through ONNX Runtime's quantizer —
  ``quantize_dynamic`` (per channel, int8 weights) for models without convolutions, ``quantize_static`` in the
  QDQ format (per channel, calibrated on the example and two random draws) for the ones with;
- ``ao-dynamic``: ``torch.ao.quantization.quantize_dynamic`` of the ``nn.Linear`` layers (eager, deprecated);
- ``pt2e-int8``: PT2E + Inductor, torch's own int8 recipe for the CPU (from torchao, the ``bench`` extra, as
  torch 2.13 no longer ships ``quantize_pt2e``): ``torch.export.export(model, example).module()``,
  ``prepare_pt2e`` with torchao's ``X86InductorQuantizer`` in its default global config (static: per-channel
  int8 weights, per-tensor uint8 activations, for every model, convolutions or not), calibrated on the calls
  ``ort-int8`` calibrates on, ``convert_pt2e``, then ``torch.compile``, compiled on its first call with
  Inductor's ``freezing`` on (Inductor's CPU int8 inference recipe; its prepare time counts all of these). Its
  row says "not run" where torchao is not installed, and the error where a step fails (e.g. the export).

Accuracy against eager float32 on fresh inputs: the relative error (``max|a - b| / max|b|``) of the first output
on one fresh call, and for classifiers the top-1 agreement over 8 fresh calls (random images of the example's
statistics).

Writes ``benchmarks/out/results-int8.json`` and the ``int8`` block of ``RESULTS.md``.

Example::

    python -m benchmarks --suite int8
    python -m benchmarks --suite int8 --models mlp_b8 --rounds 3 --reps 5 --no-markdown
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import report
from benchmarks.cold_section import cold_section, contender_lines, ratio, settled, time_contenders

HERE = Path(__file__).resolve().parents[1]
OUT = HERE / "benchmarks" / "out" / "results-int8.json"
BLOCK = "int8"
CONTENDERS = ("eager", "fxforge-fp32", "fxforge-bf16", "fxforge-int8", "fxforge-auto", "fxforge-ort-int8",
              "fxforge-inductor-int8", "fxforge-auto-target", "ort-int8", "ao-dynamic", "pt2e-int8")
REDUCED = ("fxforge-bf16", "fxforge-int8", "fxforge-auto", "fxforge-ort-int8", "fxforge-inductor-int8",
           "fxforge-auto-target")
MODELS = ("mlp_b8", "resnet_block_b8", "bert_small_b1", "bert_small_b8", "vit_small_b8", "vit_classifier_b8",
          "llama_small_b1", "resnet50_b1", "convnext_tiny_b1")
TOP1_CALLS = 8
PT2E_MISSING = "not run: torchao is not installed (pip install torchao)"


def _models() -> dict[str, Any]:
    """name -> (factory, batch -> example inputs, classifier?)."""
    import torch

    from benchmarks.precision import _models as precision_models

    def transformers_model(name: str) -> Any:
        import transformers as t

        if name == "vit_classifier":
            return t.ViTForImageClassification(t.ViTConfig(
                image_size=96, patch_size=16, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                intermediate_size=1024, num_labels=100))
        if name == "llama_small":
            return t.LlamaModel(t.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                              num_attention_heads=4, num_key_value_heads=4, vocab_size=32000))
        if name == "resnet50":  # transformers' ResNet-50 (the torchvision layout), 1000 classes
            return t.ResNetForImageClassification(t.ResNetConfig())
        return t.ConvNextForImageClassification(t.ConvNextConfig())  # ConvNeXt-T, 1000 classes

    base = precision_models()
    images = {"vit_classifier": 96, "resnet50": 224, "convnext_tiny": 224}
    models = {}
    for name in MODELS:
        family, batch = name.rsplit("_b", 1)
        batch = int(batch)
        if family in base:
            make, inputs = base[family]
            shape = list(inputs()[0].shape)
            draw = (lambda s=shape, b=batch: (torch.randint(0, 30000, (b, *s[1:])),)) if family == "bert_small" \
                else (lambda s=shape, b=batch: (torch.randn(b, *s[1:]),))
            models[name] = (make, draw, False)
        elif family == "llama_small":
            models[name] = (lambda f=family: transformers_model(f),
                            lambda b=batch: (torch.randint(0, 32000, (b, 128)),), False)
        else:
            size = images[family]
            models[name] = (lambda f=family: transformers_model(f),
                            lambda b=batch, s=size: (torch.randn(b, 3, s, s),), True)
    return models


def _first(out: Any) -> Any:
    import torch

    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict) or hasattr(out, "values"):
        return next(iter(out.values()))
    return out[0]


def _ort_int8(model: Any, example: tuple, calibration: list[tuple], tmp: str) -> Any:
    """ONNX Runtime's quantizer on the plain export (see the module docstring)."""
    import onnx
    import torch
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )

    from benchmarks.contenders import OrtCallable, ort_session, plain_onnx_export

    path, quantized = os.path.join(tmp, "plain.onnx"), os.path.join(tmp, "int8.onnx")
    plain_onnx_export(model, example, path)
    graph = onnx.load(path, load_external_data=False).graph
    names = [i.name for i in graph.input]
    if any(node.op_type == "Conv" for node in graph.node):
        class Reader(CalibrationDataReader):
            def __init__(self) -> None:
                self.calls = iter([{n: t.numpy() for n, t in zip(names, call)} for call in calibration])

            def get_next(self) -> dict | None:
                return next(self.calls, None)

        quantize_static(path, quantized, Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    else:
        quantize_dynamic(path, quantized, per_channel=True, weight_type=QuantType.QInt8)
    return OrtCallable(ort_session(quantized, torch.device("cpu")), torch.device("cpu"))


def _pt2e_int8(model: Any, example: tuple, calibration: list[tuple]) -> Any:
    """PT2E + Inductor int8 (see the module docstring); call it under ``torch.no_grad()`` (freezing)."""
    import torch
    import torch._inductor.config as inductor_config
    import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    quantizer = xiq.X86InductorQuantizer()
    quantizer.set_global(xiq.get_default_x86_inductor_quantization_config())
    prepared = prepare_pt2e(torch.export.export(model, example).module(), quantizer)
    for call in calibration:
        prepared(*call)
    compiled = torch.compile(convert_pt2e(prepared))
    with inductor_config.patch(freezing=True):  # compiled on this first call, weights frozen (Inductor's recipe)
        compiled(*example)
    return compiled


def _peers(model: Any, example: tuple, calibration: list[tuple], tmp: str) -> tuple[dict, dict]:
    """The peers' builders, and the entries (``{"skipped": why}``) of those that cannot run here."""
    import importlib.util

    import torch

    def ao_dynamic():
        import copy
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear},
                                                          dtype=torch.qint8)

    builders = {"ort-int8": lambda: _ort_int8(model, example, calibration, tmp), "ao-dynamic": ao_dynamic}
    skipped = {}
    if importlib.util.find_spec("torchao") is None:
        skipped["pt2e-int8"] = {"skipped": PT2E_MISSING}
    else:
        builders["pt2e-int8"] = lambda: _pt2e_int8(model, example, calibration)
    return builders, skipped


def measure(name: str, rounds: int, reps: int) -> dict[str, Any]:
    """One model's row (see the module docstring)."""
    import torch

    import fxforge
    from fxforge.core.accuracy import agreement
    from fxforge.core.verify import random_like

    make, inputs, classifier = _models()[name]
    torch.manual_seed(0)
    model = settled(make(), inputs)
    example, fresh = inputs(), inputs()
    calibration = [example] + [random_like(example, seed) for seed in (1, 2)]
    row: dict[str, Any] = {"model": name, "shape": list(example[0].shape), "contenders": {}}
    peers, skipped = _peers(model, example, calibration, tempfile.mkdtemp(prefix="fxforge-int8-"))

    with torch.no_grad():
        reference = _first(model(*fresh))
        builders = {"eager": lambda: model, "fxforge-fp32": lambda: fxforge.optimize(model, example, target="auto"),
                    **{f"fxforge-{p}": (lambda p=p: fxforge.optimize(model, example, target="native", precision=p,
                                                                   tolerance=0.05)) for p in ("bf16", "int8", "auto")},
                    "fxforge-ort-int8": lambda: fxforge.optimize(model, example, target="onnxruntime",
                                                                 precision="int8", tolerance=0.05),
                    "fxforge-inductor-int8": lambda: fxforge.optimize(model, example, target="inductor",
                                                                      precision="int8", tolerance=0.05),
                    "fxforge-auto-target": lambda: fxforge.optimize(model, example, target="auto", precision="auto",
                                                                    tolerance=0.05),
                    **peers}
        fns, row["contenders"] = time_contenders(
            builders, example, fresh, lambda out: agreement([reference], [_first(out).float()]).relative_error,
            rounds, reps)
        row["contenders"].update(skipped)
        if classifier:
            checks = [inputs() for _ in range(TOP1_CALLS)]
            wanted = [_first(model(*call)).argmax(-1) for call in checks]
            for contender, fn in fns.items():
                same = [(_first(fn(*call)).argmax(-1) == want).double().mean().item()
                        for call, want in zip(checks, wanted)]
                row["contenders"][contender]["top1"] = sum(same) / len(same)
        row["plans"] = {}
        for contender in REDUCED:
            built = fns.get(contender)
            rep = getattr(getattr(built, "onnx_export", None), "report", None) or getattr(built, "report", None)
            if rep is None:
                continue
            layers = [t for t in rep.tuning if t.rule == "precision" and t.subject != "graph"]
            graph = [t.choice for t in rep.tuning if t.rule == "precision" and t.subject == "graph"]
            export = getattr(built, "onnx_export", None)
            if export is not None:
                graph = [export.precision]
            race = getattr(built, "race", None)
            if contender == "fxforge-auto-target" and race is not None:
                graph = [f"{race.winner}: {graph[0] if graph else 'float32'}"]
            reduced = sum(t.choice != "float32" for t in layers)
            row["plans"][contender] = {"kept": graph[0] if graph else "float32",
                                       "layers": f"{reduced} of {len(layers)}",
                                       "notes": [n for n in rep.notes if n.startswith("precision")]}
    row["load"] = os.getloadavg()[0]
    return row


def _speedups(rows: list[dict], pick: Any) -> list[float]:
    found = []
    for row in rows:
        entries = row.get("contenders", {})
        fp32 = entries.get("fxforge-fp32", {}).get("ms")
        ms = pick(entries)
        if fp32 and ms:
            found.append(fp32 / ms)
    return found


def summary(rows: list[dict]) -> list[str]:
    """Geometric means over the models of each int8 way's speed-up on fxforge's float32 (``target="auto"``).

    Example:
        >>> rows = [{"contenders": {"fxforge-fp32": {"ms": 4.0}, "fxforge-int8": {"ms": 2.0},
        ...                         "fxforge-ort-int8": {"ms": 1.0}}}]
        >>> summary(rows)[2]
        '| fxforge-int8 (native) | 2.00x | 1 |'
        >>> summary(rows)[4]
        '| the fastest of those three | 4.00x | 1 |'
    """
    def ms(name: str):
        return lambda entries: entries.get(name, {}).get("ms")

    def best(entries: dict) -> float | None:
        times = [entries.get(n, {}).get("ms")
                 for n in ("fxforge-int8", "fxforge-ort-int8", "fxforge-inductor-int8")]
        return min((t for t in times if t), default=None)

    ways = [("fxforge-int8 (native)", ms("fxforge-int8")), ("fxforge-ort-int8", ms("fxforge-ort-int8")),
            ("fxforge-inductor-int8", ms("fxforge-inductor-int8")), ("the fastest of those three", best),
            ("fxforge-auto (native: bf16 or int8)", ms("fxforge-auto")),
            ("fxforge-auto-target (targets raced, precision auto)", ms("fxforge-auto-target")),
            ("ort-int8 (ONNX Runtime's quantizer, unchecked)", ms("ort-int8")),
            ("ao-dynamic (unchecked)", ms("ao-dynamic")),
            ("pt2e-int8 (PT2E + Inductor, torchao's X86 quantizer, unchecked)", ms("pt2e-int8"))]
    lines = ["| geometric mean over the models | vs fxforge fp32 | models |", "|---|---:|---:|"]
    for label, pick in ways:
        found = _speedups(rows, pick)
        if found:
            mean = math.exp(sum(math.log(x) for x in found) / len(found))
            lines.append(f"| {label} | {mean:.2f}x | {len(found)} |")
    return lines


def markdown(rows: list[dict], command: str) -> str:
    """The block: per model and contender, latency, its ratios against eager and fxforge float32, accuracy."""
    lines = ["## Int8: int8, bf16 and auto plans against float32 and int8 peers (issue 51)", "",
             (f"`{command}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} cores, CPU "
              "(AVX-512 BF16 and VNNI). Medians of interleaved rounds under `torch.no_grad()`, one process per model, "
              "cold caches. `vs fp32` is fxforge's float32 plan's latency (`target=\"auto\"`: its fastest float32 "
              "target) / the contender's. `rel err`: `max|a - b| / max|b|` against eager float32 on a fresh input; "
              "`top-1`: agreement with eager float32 over 8 fresh batches (classifiers). `load`: the 1-minute load "
              "average at the end. `pt2e-int8`: PT2E + Inductor (`torch.export`, torchao's `X86InductorQuantizer` "
              "in its default static config, calibrated on the calls `ort-int8` calibrates on, `torch.compile` "
              "with freezing)."),
             "", "| model (input) | contender | ms | vs eager | vs fp32 | prepare s | rel err | top-1 | load |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]

    def columns(entry: dict, row: dict, eager: float | None, fp32: float | None) -> str:
        if "skipped" in entry:  # a peer that cannot run here (pt2e-int8 without torchao): why, other cells empty
            return report.md_cell(entry["skipped"]) + " |" * 6
        top1 = f"{entry['top1']:.1%} |" if "top1" in entry else "|"
        return (f"{entry['ms']:.2f} | {ratio(eager, entry['ms'])} | {ratio(fp32, entry['ms'])} | "
                f"{entry['prepare_s']:.1f} | {entry['error']:.1e} | {top1} {row['load']:.1f}")

    for row in rows:
        shape = "x".join(map(str, row.get("shape", ())))
        eager, fp32 = (row.get("contenders", {}).get(c, {}).get("ms") for c in ("eager", "fxforge-fp32"))
        lines += contender_lines(row, f"{row['model']} ({shape})", CONTENDERS,
                                 lambda entry, row=row, e=eager, f=fp32: columns(entry, row, e, f), 7)
    lines += ["", *summary(rows)]
    lines += ["", "| model | plan | kept | layers reduced | fxforge's precision notes |", "|---|---|---|---|---|"]
    for row in rows:
        for contender, plan in row.get("plans", {}).items():
            notes = " / ".join(plan["notes"])
            lines.append(f"| {row['model']} | {contender} | {plan['kept']} | {plan['layers']} | "
                         f"{report.md_cell(notes, 600)} |")
    return "\n".join(lines)


SECTION = cold_section("int8", "int8, bf16 and auto plans against fxforge float32 and int8 peers (issue 51)",
                       "benchmarks.int8", MODELS, BLOCK, OUT, markdown)

if __name__ == "__main__":  # one model in this process (a cold_section child): its row as JSON
    print(json.dumps(measure(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
