"""``python -m benchmarks --suite fusions``: binary folding and the new post-ops on conv blocks written as users
write them, fxforge against eager, ``torch.compile`` (also with freezing) and ONNX Runtime (issue 50).

Models (random weights, BatchNorm statistics set by train-mode passes), each a stack of one block kind:

- ``resnet_layerscale``: ResNet bottlenecks (conv-BN-ReLU x2, conv-BN, a per-channel layer scale ``gamma * y``,
  ``relu(y + x)``): BN fold, binary fold of the scale, conv + add + ReLU;
- ``mobilenet_v3``: inverted residuals (1x1 expand-BN-hardswish, 3x3 depthwise-BN-hardswish, squeeze-excite gate
  with ``hardsigmoid``, 1x1 project-BN, ``+ x``), channels-last input: conv + hardsigmoid, conv + add;
- ``convnext``: ConvNeXt blocks (7x7 depthwise conv, LayerNorm over channels, linear-GELU-linear, the layer scale
  ``gamma * y`` folded into the last linear, ``x + y`` as linear + residual add);
- ``unet_up``: a decoder (transposed conv + ReLU, conv - a broadcast mean, conv + bias constant ``+ 0.1``):
  conv_transpose + activation, conv + broadcast sub, a constant folded into the bias;
- ``beit_small``, ``levit_small``: transformers' BEiT (4 layers, hidden 128) and LeViT (3 stages) on 64x64 images,
  whose native plans ran slower than eager (issue 50: a native plan never slower than eager).

Per model, in a new process with cold caches: contenders ``eager``, ``fxforge`` (``fxforge.optimize``, the native
target), ``compile`` (``torch.compile``), ``compile-freezing`` (``options={"freezing": True}``), ``ort`` (plain
``torch.onnx.export(dynamo=True)`` in ONNX Runtime) and ``fxforge-ort`` (``target="onnxruntime"``); medians of
interleaved rounds under ``torch.no_grad()`` (``benchmarks.rounds.time_interleaved``), ratios against eager and
against compile-freezing in the same run; fxforge's rewrite counts.

Writes ``benchmarks/out/results-fusions.json`` and the ``fusions`` block of ``RESULTS.md``.

Example::

    python -m benchmarks --suite fusions
    python -m benchmarks --suite fusions --models convnext --rounds 3 --reps 5 --no-markdown
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import report
from benchmarks.cold_section import cold_section, contender_lines, ratio, settled, time_contenders

HERE = Path(__file__).resolve().parents[1]
OUT = HERE / "benchmarks" / "out" / "results-fusions.json"
BLOCK = "fusions"
CONTENDERS = ("eager", "fxforge", "compile", "compile-freezing", "ort", "fxforge-ort")
MODELS = ("resnet_layerscale", "mobilenet_v3", "convnext", "unet_up", "beit_small", "levit_small")


def _models() -> dict[str, Any]:
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Bottleneck(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.c1, self.b1 = nn.Conv2d(c, c // 4, 1, bias=False), nn.BatchNorm2d(c // 4)
            self.c2, self.b2 = nn.Conv2d(c // 4, c // 4, 3, padding=1, bias=False), nn.BatchNorm2d(c // 4)
            self.c3, self.b3 = nn.Conv2d(c // 4, c, 1, bias=False), nn.BatchNorm2d(c)
            self.gamma = nn.Parameter(torch.rand(c) + 0.5)

        def forward(self, x):
            y = F.relu(self.b1(self.c1(x)))
            y = F.relu(self.b2(self.c2(y)))
            y = self.b3(self.c3(y)) * self.gamma.view(1, -1, 1, 1)
            return F.relu(y + x)

    class InvertedResidual(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            e = 4 * c
            self.expand = nn.Sequential(nn.Conv2d(c, e, 1, bias=False), nn.BatchNorm2d(e), nn.Hardswish())
            self.dw = nn.Sequential(nn.Conv2d(e, e, 3, padding=1, groups=e, bias=False), nn.BatchNorm2d(e),
                                    nn.Hardswish())
            self.se1, self.se2 = nn.Conv2d(e, e // 4, 1), nn.Conv2d(e // 4, e, 1)
            self.project = nn.Sequential(nn.Conv2d(e, c, 1, bias=False), nn.BatchNorm2d(c))

        def forward(self, x):
            y = self.dw(self.expand(x))
            gate = F.hardsigmoid(self.se2(F.relu(self.se1(y.mean((2, 3), keepdim=True)))))
            return self.project(y * gate) + x

    class ConvNeXtBlock(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
            self.norm = nn.LayerNorm(c)
            self.fc1, self.fc2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
            self.gamma = nn.Parameter(torch.full((c,), 0.5))

        def forward(self, x):
            y = self.dw(x).permute(0, 2, 3, 1)
            y = self.gamma * self.fc2(F.gelu(self.fc1(self.norm(y))))
            return x + y.permute(0, 3, 1, 2)

    class UpBlock(nn.Module):
        def __init__(self, c: int) -> None:
            super().__init__()
            self.up = nn.ConvTranspose2d(c, c // 2, 2, stride=2)
            self.conv = nn.Conv2d(c // 2, c // 2, 3, padding=1)

        def forward(self, x):
            y = torch.relu(self.up(x))
            y = torch.relu(self.conv(y) - y.mean((2, 3), keepdim=True))
            return y + 0.1

    def stack(block: Any, widths: list[int]) -> nn.Module:
        return nn.Sequential(*(block(c) for c in widths))

    def transformers_model(name: str) -> nn.Module:
        import transformers

        if name == "beit":
            return transformers.BeitModel(transformers.BeitConfig(
                image_size=64, patch_size=8, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                intermediate_size=256, use_relative_position_bias=True))
        return transformers.LevitModel(transformers.LevitConfig(
            image_size=64, hidden_sizes=[64, 96, 128], num_attention_heads=[2, 3, 4], depths=[1, 1, 1],
            key_dim=[16, 16, 16]))

    return {
        "beit_small": (lambda: transformers_model("beit"), (2, 3, 64, 64), False),
        "levit_small": (lambda: transformers_model("levit"), (2, 3, 64, 64), False),
        "resnet_layerscale": (lambda: stack(Bottleneck, [256] * 6), (8, 256, 28, 28), False),
        "mobilenet_v3": (lambda: stack(InvertedResidual, [40] * 6), (8, 40, 28, 28), True),
        "convnext": (lambda: stack(ConvNeXtBlock, [96] * 6), (8, 96, 28, 28), False),
        "unet_up": (lambda: stack(UpBlock, [256, 128, 64]), (4, 256, 14, 14), False),
    }


def measure(name: str, rounds: int, reps: int) -> dict[str, Any]:
    """One model's row (see the module docstring)."""
    import torch

    import fxforge
    from benchmarks.contenders import OrtCallable, ort_session, plain_onnx_export
    from benchmarks.rounds import max_abs_error

    make, shape, channels_last = _models()[name]
    torch.manual_seed(0)
    model = settled(make(), lambda: (torch.randn(*shape),))
    x = torch.randn(*shape)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    example = (x,)
    row: dict[str, Any] = {"model": name, "shape": list(shape), "channels_last": channels_last, "contenders": {}}
    tmp = tempfile.mkdtemp(prefix="fxforge-fusions-")

    def plain_ort():
        path = os.path.join(tmp, "plain.onnx")
        plain_onnx_export(model, example, path)
        return OrtCallable(ort_session(path, torch.device("cpu")), torch.device("cpu"))

    with torch.no_grad():
        reference = model(*example)
        builders = {"eager": lambda: model, "fxforge": lambda: fxforge.optimize(model, example),
                    "compile": lambda: torch.compile(model),
                    "compile-freezing": lambda: torch.compile(model, options={"freezing": True}),
                    "ort": plain_ort,
                    "fxforge-ort": lambda: fxforge.optimize(model, example, target="onnxruntime")}
        fns, row["contenders"] = time_contenders(builders, example, example,
                                                 lambda out: max_abs_error(reference, out), rounds, reps)
        rep = fns["fxforge"].report if "fxforge" in fns else None
        row["counts"] = rep.counts if rep is not None else {}
        row["misses"] = sorted({f"{m.rule}: {m.reason}" for m in rep.near_misses
                                if m.rule in ("binary_fold", "conv_activation")})[:4] if rep is not None else []
    row["load"] = os.getloadavg()[0]
    return row


def markdown(rows: list[dict], command: str) -> str:
    """The block: per model and contender, latency and its ratios, prepare seconds, max error; fxforge's counts."""
    lines = ["## Fusions: binary folding and the new post-ops on conv blocks (issue 50)", "",
             (f"`{command}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} cores, CPU. "
              "Medians of interleaved rounds under `torch.no_grad()`, one process per model, cold caches; "
              "`vs eager` is eager's latency / the contender's (above 1: faster), `vs freezing` the same against "
              "`torch.compile(model, options={'freezing': True})`. `load`: the 1-minute load average at the end."),
             "", "| model (input) | contender | ms | vs eager | vs freezing | prepare s | max abs err | load |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        shape = "x".join(map(str, row.get("shape", ()))) + (", channels-last" if row.get("channels_last") else "")
        eager, frozen = (row.get("contenders", {}).get(c, {}).get("ms") for c in ("eager", "compile-freezing"))
        lines += contender_lines(row, f"{row['model']} ({shape})", CONTENDERS, lambda entry, row=row, e=eager, f=frozen: (
            f"{entry['ms']:.2f} | {ratio(e, entry['ms'])} | {ratio(f, entry['ms'])} | {entry['prepare_s']:.1f} | "
            f"{entry['error']:.1e} | {row['load']:.1f}"), 6)
    lines += ["", "| model | fxforge's rewrites | fusion refusals |", "|---|---|---|"]
    for row in rows:
        if "error" not in row:
            counts = ", ".join(f"{k} x{v}" for k, v in sorted(row["counts"].items())) or "none"
            lines.append(f"| {row['model']} | {counts} | {report.md_cell('; '.join(row['misses']) or 'none', 400)} |")
    return "\n".join(lines)


SECTION = cold_section("fusions", "conv blocks with binary folding and the new post-ops: fxforge against eager, "
                       "torch.compile (also with freezing) and ONNX Runtime (issue 50)", "benchmarks.fusions", MODELS,
                       BLOCK, OUT, markdown)

if __name__ == "__main__":  # one model in this process (a cold_section child): its row as JSON
    print(json.dumps(measure(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
