"""``python -m benchmarks --suite parallel-scale``: ``fxforge.parallelize`` on paper (issue 52, item 5).

LLaMA-3-style 8B and 70B (torchtitan's llama3 configurations: 8B dim 4096, 32 layers, 32 heads, 8 key/value
heads, FFN 14336; 70B dim 8192, 80 layers, 64 heads, 8 key/value heads, FFN 28672; vocabulary 128256,
8192 tokens) and GPT-2 XL (1.5B: 1600 wide, 48 layers, 25 heads, 1024 tokens), built on the meta device
from transformers configs (no weights), planned for 8 to 1,024 H100s (:data:`~fxforge.parallel.cluster.
PUBLISHED_CLUSTERS`) in bf16 mixed precision with full activation checkpointing: the chosen mesh, memory
per GPU, tokens/s per GPU and MFU. Then torchtitan's published runs, each with its own mesh and batch
forced, the prediction beside the published figure (pytorch/torchtitan, the files named in each row).

Example::

    python -m benchmarks --suite parallel-scale
    python -m benchmarks --suite parallel-scale --models gpt2-xl --gpus 8,64 --no-markdown
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import datetime, timezone
from typing import Any

import torch

from benchmarks import report
from benchmarks.log import error_text, log
from benchmarks.section import Section, UsageError, csv_list

NAME = "parallel-scale"
MODELS = ("llama3-8b", "llama3-70b", "gpt2-xl")
GPUS = (8, 64, 128, 512, 1024)
H100_2024 = "benchmarks/llama3_h100_202412_torchtitan.md (torchtitan 9dec370, 500 W 96 GB HBM2e H100s)"
H100_2025 = "benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (torchtitan 820504e, same H100s)"
A100_DOC = "docs/performance.md at torchtitan 9dec370 (64 A100 80GB)"
PUBLISHED = (
    # model, cluster, gpus, mesh, local batch, tokens/s/GPU, GiB, MFU, conditions, source
    ("llama3-8b", "h100-sxm-8x", 8, {"fsdp": 8}, 2, 5762, 82.4, None,
     "Llama 3.1 8B, FSDP, bf16, selective AC, eager", H100_2024 + ", Table 1"),
    ("llama3-8b", "h100-sxm-8x", 128, {"fsdp": 128}, 2, 5605, 67.0, None,
     "Llama 3.1 8B, FSDP, bf16, selective AC, eager", H100_2024 + ", Table 3"),
    ("llama3-8b", "h100-sxm-8x", 64, {"fsdp": 8, "tp": 8}, 12, 4378, None, None,
     "Llama 3 8B, FSDP 8 x TP 8, bf16, per-op SAC, torch.compile, vanilla TP", H100_2025),
    ("llama3-70b", "h100-sxm-8x", 256, {"fsdp": 32, "tp": 8}, 16, 597.3, None, None,
     "Llama 3 70B, FSDP 32 x TP 8, bf16, full AC, torch.compile, vanilla TP", H100_2025),
    ("llama3-70b", "h100-sxm-8x", 256, {"fsdp": 32, "tp": 8}, 16, 829, 71.9, None,
     "the same with Float8 (not modelled: bf16 predicted)", H100_2024 + ", Table 4"),
    ("llama3-8b", "a100-sxm-8x", 64, {"fsdp": 64}, 1, 2973, None, 0.582,
     "Llama 3 8B, FSDP, bf16, selective op AC", A100_DOC),
    ("llama3-70b", "a100-sxm-8x", 64, {"fsdp": 64}, 1, 331, None, 0.517, "Llama 3 70B, FSDP, bf16, full AC",
     A100_DOC),
)
"""torchtitan's published runs: what each row forces, and what was measured."""
MODELLED = ("compute = the traced step's FLOPs (+ each block's forward again under full AC) at 40% of the bf16 "
            "dense peak; FSDP/DDP collectives overlap compute, TP's do not; memory: FSDP2 bf16 mixed precision "
            "(fp32 master weights, fp32 gradients, AdamW's two fp32 moments, sharded; bf16 blocks gathered), "
            "flash-attention activations, full AC keeps each block's input; MFU counts the forward and backward "
            "FLOPs, not the recompute (fxforge/parallel/paper.py)")


class Logits(torch.nn.Module):
    """A causal LM returning its logits only (transformers' cache object stays inside the graph)."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(ids).logits


def cross_entropy_like(logits: torch.Tensor, target: Any = None) -> torch.Tensor:
    """The loss's memory and FLOPs as torchtitan's: float32 log-softmax over the vocabulary."""
    return logits.float().log_softmax(-1).mean()


def build(name: str) -> tuple[torch.nn.Module, int]:
    """The model on the meta device and its sequence length.

    Example:
        >>> model, seq = build("gpt2-xl")
        >>> round(sum(p.numel() for p in model.parameters()) / 1e9, 2), seq
        (1.56, 1024)
    """
    import transformers

    transformers.logging.set_verbosity_error()
    if name == "gpt2-xl":
        config = transformers.GPT2Config(n_embd=1600, n_layer=48, n_head=25, n_positions=1024, vocab_size=50257)
        cls, seq = transformers.GPT2LMHeadModel, 1024
    else:
        dim, layers, heads, ffn = {"llama3-8b": (4096, 32, 32, 14336), "llama3-70b": (8192, 80, 64, 28672)}[name]
        config = transformers.LlamaConfig(hidden_size=dim, num_hidden_layers=layers, num_attention_heads=heads,
                                          num_key_value_heads=8, intermediate_size=ffn, vocab_size=128256,
                                          max_position_embeddings=8192, rope_theta=500000.0)
        cls, seq = transformers.LlamaForCausalLM, 8192
    with torch.device("meta"):
        return Logits(cls(config)), seq


def plan_row(name: str, model: torch.nn.Module, seq: int, cluster: Any, gpus: int, local_batch: int,
             mesh: dict | None = None) -> dict[str, Any]:
    """The chosen (or, with ``mesh``, the forced: priced whatever its memory) plan's figures."""
    import fxforge

    ids = torch.zeros(gpus * local_batch // (mesh or {}).get("tp", 1), seq, dtype=torch.long, device="meta")
    start = time.perf_counter()
    plan = fxforge.parallelize(model, (ids,), devices=gpus, cluster=cluster.scaled(gpus), mesh=mesh,
                               memory_per_device="1TiB" if mesh else None, loss=cross_entropy_like, optimizer="adamw", precision="bf16",
                               activation_checkpointing="full")
    c = plan.chosen
    return {"model": name, "gpus": gpus, "rows": int(ids.shape[0]), "mesh": c.name, "step_s": c.step_s,
            "memory_gib": c.memory_per_device / 2**30, "tokens_per_s": c.tokens_per_s, "mfu": c.mfu,
            "plan_s": time.perf_counter() - start, "fits": c.memory_per_device <= cluster.memory_bytes,
            "parts_gib": {k: round(v / 2**30, 2) for k, v in c.memory.items()}}


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    lines = [f"## {meta['title']}", "", f"- Command: `{meta['command']}`",
             f"- Commit: `{meta.get('commit')}`, {meta['date']}", f"- Machine (planning only): {meta['machine']}",
             f"- Cluster: {meta['cluster']}", f"- Modelled: {meta['modelled']}", "",
             "The planner's choice, local batch 1 per data-parallel rank (global batch = GPUs / TP rows):", "",
             "| model | GPUs | rows | chosen mesh | memory/GPU GiB | step s | tokens/s/GPU | MFU | planned in s |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in result["chosen"]:
        if r.get("status") == "failed":
            lines.append(f"| {r['model']} | {r['gpus']} | | failed: {report.md_cell(r['error'])} | | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['gpus']} | {r['rows']} | {r['mesh']} | {r['memory_gib']:.1f} | "
                     f"{r['step_s']:.2f} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {r['plan_s']:.1f} |")
    lines += ["", "torchtitan's published runs, their mesh and batch forced (predicted: bf16, full AC):", "",
              ("| model | cluster | GPUs | mesh | local batch | predicted tokens/s/GPU | published | predicted GiB "
               "| published GiB | predicted MFU | published MFU | published conditions | source |"),
              "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in result["published"]:
        if r.get("status") == "failed":
            lines.append(f"| {r['model']} | {r['cluster']} | {r['gpus']} | failed: {report.md_cell(r['error'])} "
                         "| | | | | | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['cluster']} | {r['gpus']} | {r['mesh']} | {r['local_batch']} | "
                     f"{r['tokens_per_s']:,.0f} | {r['published_tps']:,} | {r['memory_gib']:.1f}"
                     f"{'' if r['fits'] else ' (over 79.6)'} | "
                     f"{report.fmt_float(r['published_gib'])} | {r['mfu']:.1%} | "
                     f"{'-' if r['published_mfu'] is None else format(r['published_mfu'], '.1%')} | "
                     f"{r['conditions']} | {r['source']} |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", type=csv_list, default=list(MODELS), help=f"of {','.join(MODELS)} (default all)")
    p.add_argument("--gpus", type=lambda s: tuple(int(x) for x in s.split(",")), default=GPUS,
                   help="GPU counts (default 8,64,128,512,1024)")
    p.add_argument("--no-published", action="store_true", help="skip torchtitan's published runs")
    report.add_output_options(p, NAME)


def _failed(row: dict[str, Any], exc: Exception) -> dict[str, Any]:
    log(f"[{row.get('model')} {row.get('gpus')}] failed: {error_text(exc, 400, one_line=True)}")
    return {**row, "status": "failed", "error": error_text(exc, 400, one_line=True)}


def run(opts: argparse.Namespace) -> int:
    from fxforge.parallel.cluster import PUBLISHED_CLUSTERS

    unknown = [m for m in opts.models if m not in MODELS]
    if unknown:
        raise UsageError(f"unknown model(s) {unknown}")
    h100 = PUBLISHED_CLUSTERS["h100-sxm-8x"]
    result: dict[str, Any] = {"meta": {
        "suite": NAME, "title": "Parallel plans on paper: LLaMA 3 8B / 70B and GPT-2 XL on 8 to 1,024 H100s (issue 52)",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "command": opts.command,
        "commit": report.git_commit(), "machine": report.machine_info(torch.get_num_threads()),
        "cluster": h100.describe(),
        "modelled": MODELLED}, "chosen": [], "published": []}
    json_path = os.path.join(opts.out, f"results-{NAME}.json")
    models = {name: build(name) for name in opts.models}
    for name, (model, seq) in models.items():
        for gpus in opts.gpus:
            try:
                row = plan_row(name, model, seq, h100, gpus, 1)
            except Exception as exc:  # noqa: BLE001 - a failed plan fails its row
                row = _failed({"model": name, "gpus": gpus}, exc)
            log(str(row))
            result["chosen"].append(row)
            report.write_json(json_path, result)
    for name, cluster, gpus, mesh, local, tps, gib, mfu, conditions, source in (() if opts.no_published else PUBLISHED):
        if name not in models:
            continue
        base = {"model": name, "cluster": cluster, "gpus": gpus, "local_batch": local, "published_tps": tps,
                "published_gib": gib, "published_mfu": mfu, "conditions": conditions, "source": source}
        try:
            row = {**base, **plan_row(name, models[name][0], models[name][1], PUBLISHED_CLUSTERS[cluster], gpus,
                                      local, mesh)}
        except Exception as exc:  # noqa: BLE001
            row = _failed(base, exc)
        log(str(row))
        result["published"].append(row)
        report.write_json(json_path, result)
    return report.finish(opts, markdown(result), NAME)


SECTION = Section(NAME, "parallel plans on paper: LLaMA 3 8B/70B and GPT-2 XL on 8 to 1,024 H100s (mesh, memory "
                  "per GPU, tokens/s, MFU) beside torchtitan's published figures (issue 52)", add_arguments, run)
