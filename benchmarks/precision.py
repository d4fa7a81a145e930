"""``--suite precision`` (issue 51): fxforge's bfloat16 plans against float32 and against bfloat16 peers.

Per model (BatchNorm statistics set by a few train-mode passes; each model in a cold process): eager float32,
fxforge native float32, fxforge native ``precision="bf16"`` (tolerance 0.05), eager under
``torch.autocast("cpu", torch.bfloat16)`` and ``torch.compile`` of that autocast model, timed in interleaved
rounds under ``torch.no_grad()`` (``benchmarks.rounds.time_interleaved``). Accuracy: each contender's relative
error (``max|a - b| / max|b|``) against eager float32 on a fresh input; fxforge's layers in bfloat16 of those it
could reduce.

Writes ``benchmarks/out/results-precision.json`` and the ``precision`` block of ``RESULTS.md``.

Example::

    python -m benchmarks --suite precision
    python -m benchmarks --suite precision --models mlp --rounds 3 --reps 5 --no-markdown
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import report
from benchmarks.cold_section import cold_section, contender_lines, ratio, settled, time_contenders

HERE = Path(__file__).resolve().parents[1]
OUT = HERE / "benchmarks" / "out" / "results-precision.json"
BLOCK = "precision"
CONTENDERS = ("eager", "fxforge", "fxforge-bf16", "autocast-bf16", "compile-autocast-bf16")
MODELS = ("mlp", "resnet_block", "bert_small", "vit_small")


def _models() -> dict[str, Any]:
    import torch
    from torch import nn

    from benchmarks.fusions import _models as fusion_models

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(512, 2048), nn.Linear(2048, 512)

        def forward(self, x):
            return x + self.down(nn.functional.gelu(self.up(x)))

    def transformers_model(name: str) -> nn.Module:
        import transformers

        if name == "bert":
            return transformers.BertModel(transformers.BertConfig(
                hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024))
        return transformers.ViTModel(transformers.ViTConfig(
            image_size=96, patch_size=16, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
            intermediate_size=1024))

    return {
        "mlp": (MLP, lambda: (torch.randn(8, 128, 512),)),
        "resnet_block": (fusion_models()["resnet_layerscale"][0], lambda: (torch.randn(8, 256, 28, 28),)),
        "bert_small": (lambda: transformers_model("bert"), lambda: (torch.randint(0, 30000, (8, 128)),)),
        "vit_small": (lambda: transformers_model("vit"), lambda: (torch.randn(8, 3, 96, 96),)),
    }


def _first(out: Any) -> Any:
    import torch

    if isinstance(out, torch.Tensor):
        return out
    return out[0] if isinstance(out, (tuple, list)) else next(iter(out.values()))


def measure(name: str, rounds: int, reps: int) -> dict[str, Any]:
    """One model's row (see the module docstring)."""
    import torch

    import fxforge
    from fxforge.core.accuracy import agreement

    make, inputs = _models()[name]
    torch.manual_seed(0)
    model = settled(make(), inputs)
    example, fresh = inputs(), inputs()
    row: dict[str, Any] = {"model": name, "shape": list(example[0].shape), "contenders": {}}

    def autocast(fn):
        def run(*args):
            with torch.autocast("cpu", torch.bfloat16):
                return fn(*args)
        return run

    with torch.no_grad():
        reference = _first(model(*fresh))
        builders = {"eager": lambda: model, "fxforge": lambda: fxforge.optimize(model, example),
                    "fxforge-bf16": lambda: fxforge.optimize(model, example, precision="bf16", tolerance=0.05),
                    "autocast-bf16": lambda: autocast(model),
                    "compile-autocast-bf16": lambda: autocast(torch.compile(model))}
        fns, row["contenders"] = time_contenders(
            builders, example, fresh, lambda out: agreement([reference], [_first(out).float()]).relative_error,
            rounds, reps)
        reduced = fns.get("fxforge-bf16")
        rep = reduced.report if reduced is not None else None
        layers = [t for t in rep.tuning if t.rule == "precision" and t.subject != "graph"] if rep else []
        row["layers"] = f"{sum(t.choice != 'float32' for t in layers)} of {len(layers)}"
        row["note"] = next((n for n in rep.notes if n.startswith("precision")), "") if rep else ""
    row["load"] = os.getloadavg()[0]
    return row


def markdown(rows: list[dict], command: str) -> str:
    """The block: per model and contender, latency, its ratios against eager and fxforge float32, relative error."""
    lines = ["## Precision: bfloat16 plans against float32 and bfloat16 peers (issue 51)", "",
             (f"`{command}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} cores, CPU "
              "(AVX-512 BF16). Medians of interleaved rounds under `torch.no_grad()`, one process per model, cold "
              "caches; `vs eager` is eager float32's latency / the contender's, `vs fxforge fp32` the same against "
              "fxforge's float32 plan. `rel err`: `max|a - b| / max|b|` against eager float32 on a fresh input. "
              "`load`: the 1-minute load average at the end."),
             "", "| model (input) | contender | ms | vs eager | vs fxforge fp32 | prepare s | rel err | load |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        shape = "x".join(map(str, row.get("shape", ())))
        eager, fp32 = (row.get("contenders", {}).get(c, {}).get("ms") for c in ("eager", "fxforge"))
        lines += contender_lines(row, f"{row['model']} ({shape})", CONTENDERS, lambda entry, row=row, e=eager, f=fp32: (
            f"{entry['ms']:.2f} | {ratio(e, entry['ms'])} | {ratio(f, entry['ms'])} | {entry['prepare_s']:.1f} | "
            f"{entry['error']:.1e} | {row['load']:.1f}"), 6)
    lines += ["", "| model | fxforge layers in bf16 | fxforge's precision note |", "|---|---|---|"]
    for row in rows:
        if "error" not in row:
            lines.append(f"| {row['model']} | {row['layers']} | {report.md_cell(row['note'], 500)} |")
    return "\n".join(lines)


SECTION = cold_section("precision", "bfloat16 plans against fxforge float32, eager and torch.compile under "
                       "autocast (issue 51)", "benchmarks.precision", MODELS, BLOCK, OUT, markdown)

if __name__ == "__main__":  # one model in this process (a cold_section child): its row as JSON
    print(json.dumps(measure(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
