"""Reduced precision on a GPU (issue 51): fxforge's bf16, fp16, int8 and ``precision="auto"`` plans against
``torch.compile`` in the same precision, in one process on one CUDA device.

Per model (built from a transformers config with random weights, BatchNorm statistics set by a few train-mode
passes; seeded; eval mode), under ``torch.no_grad()``:

- ``eager``: float32 (cuDNN's default TensorFloat-32 convolutions, float32 matrix products);
- ``compile-bf16``, ``compile-fp16``: ``torch.compile(model)`` called under ``torch.autocast("cuda", dtype)``
  (PyTorch's recommended mixed precision, Inductor's kernels);
- ``compile-int8``: where torchao is importable, its ``Int8DynamicActivationInt8WeightConfig`` (int8 weights,
  activations quantized per token at call time) on a copy of the model, then ``torch.compile``;
- ``fxforge-bf16``, ``fxforge-fp16``, ``fxforge-int8``, ``fxforge-auto``: ``fxforge.optimize(model, inputs,
  precision=...)`` on the native target (default tolerance: relative error 0.05, cosine 0.999, top-1 99 %).

Timing: CUDA-synchronised, ``rounds`` rounds of ``reps`` calls per contender in a rotated order, the median of
all calls. Accuracy against eager float32: the relative error (``max|a - b| / max|b|``) of the first output on a
fresh input, and for classifiers the top-1 agreement over 8 fresh batches. ``prepare s``: building the contender
and its first call (compiles included).

Writes ``OUT/gpu-precision.json`` and ``OUT/gpu-precision.md`` (the table, pasted into ``RESULTS.md``), each
after every model, so a run stopped early keeps what it measured.

Example::

    python -m benchmarks.gpu_precision --out /tmp/out
    python -m benchmarks.gpu_precision --models mlp --rounds 2 --reps 3 --out /tmp/out   # (needs CUDA)
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.int8 import _first

MODELS = ("bert_base_b8", "llama_b1", "vit_b16_b8", "resnet50_b8")
CONTENDERS = ("eager", "compile-bf16", "compile-fp16", "compile-int8", "fxforge-bf16", "fxforge-fp16",
              "fxforge-int8", "fxforge-auto")
CLASSIFIERS = ("vit_b16_b8", "resnet50_b8")
TOP1_CALLS = 8


def _model(name: str) -> tuple[Any, Any]:
    """(model on the GPU in eval mode, seed -> inputs)."""
    import torch
    import transformers as t

    torch.manual_seed(0)
    if name == "mlp":  # (a quick check of the script)
        model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512))
        return model.cuda().eval(), lambda seed: (torch.randn(8, 128, 512, device="cuda",
                                                              generator=_gen(seed)),)
    if name == "bert_base_b8":
        model = t.BertModel(t.BertConfig())
        return model.cuda().eval(), lambda seed: (_ids(8, 128, 30522, seed),)
    if name == "llama_b1":
        model = t.LlamaModel(t.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                           num_attention_heads=16, num_key_value_heads=16, vocab_size=32000))
        return model.cuda().eval(), lambda seed: (_ids(1, 512, 32000, seed),)
    if name == "vit_b16_b8":
        model = t.ViTForImageClassification(t.ViTConfig(num_labels=1000))
        return model.cuda().eval(), lambda seed: (torch.randn(8, 3, 224, 224, device="cuda", generator=_gen(seed)),)
    model = t.ResNetForImageClassification(t.ResNetConfig()).cuda()
    images = lambda seed: (torch.randn(8, 3, 224, 224, device="cuda", generator=_gen(seed)),)
    model.train()
    with torch.no_grad():
        for seed in range(100, 103):
            model(*images(seed))
    return model.eval(), images


def _gen(seed: int) -> Any:
    import torch

    return torch.Generator(device="cuda").manual_seed(seed)


def _ids(batch: int, length: int, vocab: int, seed: int) -> Any:
    import torch

    return torch.randint(0, vocab, (batch, length), device="cuda", generator=_gen(seed))


def _autocast(run: Any, dtype: Any) -> Any:
    import torch

    def call(*args: Any) -> Any:
        with torch.autocast("cuda", dtype=dtype):
            return run(*args)
    return call


def _builders(model: Any, example: tuple) -> dict[str, Any]:
    import torch

    import fxforge

    def compiled(dtype: Any) -> Any:
        return _autocast(torch.compile(model), dtype)

    def torchao_int8() -> Any:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

        copied = copy.deepcopy(model)
        quantize_(copied, Int8DynamicActivationInt8WeightConfig())
        return torch.compile(copied)

    builders = {"eager": lambda: model, "compile-bf16": lambda: compiled(torch.bfloat16),
                "compile-fp16": lambda: compiled(torch.float16), "compile-int8": torchao_int8}
    for precision in ("bf16", "fp16", "int8", "auto"):
        builders[f"fxforge-{precision}"] = lambda p=precision: fxforge.optimize(model, example, precision=p)
    return builders


def _notes(run: Any) -> str:
    report = getattr(run, "report", None)
    return " / ".join(n for n in report.notes if n.startswith("precision ")) if report is not None else ""


def _measure(name: str, contenders: tuple[str, ...], rounds: int, reps: int) -> dict[str, Any]:
    import torch

    from fxforge.core.accuracy import agreement

    model, inputs = _model(name)
    example, fresh = inputs(0), inputs(1)
    row: dict[str, Any] = {"model": name, "input": "x".join(map(str, example[0].shape)), "contenders": {}}
    with torch.no_grad():
        reference = _first(model(*fresh))
        scores = [model(*inputs(10 + k)).logits for k in range(TOP1_CALLS)] if name in CLASSIFIERS else []
        runs = {}
        for contender in contenders:
            entry = row["contenders"][contender] = {}
            try:
                start = time.perf_counter()
                run = _builders(model, example)[contender]()
                run(*example)
                torch.cuda.synchronize()
                entry["prepare_s"] = time.perf_counter() - start
                out = _first(run(*fresh)).float()
                entry["rel_err"] = float((out - reference).abs().max() / reference.abs().max())
                if scores:
                    found = [float((run(*inputs(10 + k)).logits.float().argmax(1) == s.argmax(1)).float().mean())
                             for k, s in enumerate(scores)]
                    entry["top1"] = sum(found) / len(found)
                    entry["top1_expected"] = agreement(scores, [run(*inputs(10 + k)).logits.float()
                                                                for k in range(TOP1_CALLS)]).top1_expected
                entry["notes"] = _notes(run)
                runs[contender] = run
            except Exception as exc:  # noqa: BLE001  (a contender that fails is a row saying why)
                entry["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
                entry["traceback"] = "".join(traceback.format_exception(exc))[-3000:]
                print(f"{name} {contender} failed:\n{entry['traceback']}", file=sys.stderr, flush=True)
        times: dict[str, list[float]] = {c: [] for c in runs}
        for run in runs.values():
            for _ in range(3):
                run(*example)
        torch.cuda.synchronize()
        order = list(runs)
        for r in range(rounds):
            for contender in order[r % len(order):] + order[:r % len(order)]:
                for _ in range(reps):
                    start = time.perf_counter()
                    runs[contender](*example)
                    torch.cuda.synchronize()
                    times[contender].append((time.perf_counter() - start) * 1e3)
        for contender, found in times.items():
            row["contenders"][contender]["ms"] = statistics.median(found)
    del runs
    torch.cuda.empty_cache()
    return row


def markdown(rows: list[dict[str, Any]], device: str, versions: str) -> str:
    """The table of ``rows`` (one line per model and contender)."""
    lines = [f"Device: {device}; {versions}.", "",
             ("| model (input) | contender | ms | vs eager | vs compile, same precision | prepare s | rel err | "
              "top-1 (expected) |"), "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        entries = row["contenders"]
        eager = entries.get("eager", {}).get("ms")
        for contender, entry in entries.items():
            label = f"{row['model']} ({row['input']})"
            if "error" in entry:
                lines.append(f"| {label} | {contender} | failed: {entry['error'][:160]} | | | | | |")
                continue
            if "ms" not in entry:
                continue
            peer = entries.get("compile-" + contender.removeprefix("fxforge-"), {}).get("ms") \
                if contender.startswith("fxforge-") and contender != "fxforge-auto" else None
            if contender == "fxforge-auto":
                peer = min((entries.get(c, {}).get("ms") or math.inf) for c in ("compile-bf16", "compile-fp16"))
            top1 = f"{entry['top1']:.1%} ({entry['top1_expected']:.1%})" if "top1" in entry else ""
            lines.append(f"| {label} | {contender} | {entry['ms']:.3f} | {eager / entry['ms']:.2f}x | "
                         + (f"{peer / entry['ms']:.2f}x" if peer and math.isfinite(peer) else "")
                         + f" | {entry['prepare_s']:.1f} | {entry['rel_err']:.1e} | {top1} |")
    notes = [f"- {row['model']} {c}: {e['notes']}" for row in rows for c, e in row["contenders"].items()
             if e.get("notes")]
    return "\n".join(lines + [""] + notes) + "\n"


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_precision: no CUDA device", file=sys.stderr)
        return 1
    import transformers

    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    try:
        import torchao
        versions += f", torchao {torchao.__version__}"
    except ImportError:
        versions += ", no torchao (compile-int8 not run)"
    rows = []
    for name in args.models.split(","):
        started = time.perf_counter()
        rows.append(_measure(name, tuple(args.contenders.split(",")), args.rounds, args.reps))
        print(f"{name}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        (args.out / "gpu-precision.json").write_text(json.dumps(
            {"device": device, "versions": versions, "rows": rows}, indent=1, default=str))
        (args.out / "gpu-precision.md").write_text(markdown(rows, device, versions))
        print(markdown(rows[-1:], device, versions), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
