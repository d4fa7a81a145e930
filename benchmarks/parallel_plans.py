"""``python -m benchmarks --suite parallel``: ``fxforge.parallelize`` on LLaMA, GPT-2 (tied embeddings), BERT,
T5 and ViT built from transformers configs (random weights, dropout off), issue 52.

For each model on 2 devices: every candidate mesh priced (predicted step time, per-device memory, bytes of
every collective), then the three fastest that fit **run for real** on gloo (one process per device, one
thread each; forward + backward + AdamW), in turns over ``--rounds`` rounds, each run's steady steps timed
(medians), its collectives counted and its memory measured, beside the prediction. Then the derived
tensor-parallel plan alone at 2 and 4 ranks in float64 on a small configuration of the same model: outputs
and gradients against the model in one process, collectives counted against predicted.

What a 2-core machine can show: that each plan runs and gives the single process's numbers, whether the
cost model ranks the meshes as the runs do, and how close its figures are. Not the speed-up of more
devices (each rank has one core).

Example::

    python -m benchmarks --suite parallel
    python -m benchmarks --suite parallel --models llama --rounds 1 --no-markdown
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
from datetime import datetime, timezone
from typing import Any

import torch

from benchmarks import report
from benchmarks.log import error_text, log
from benchmarks.section import Section, UsageError, csv_list

NAME = "parallel"
MODELS = ("llama", "gpt2", "bert", "t5", "vit")


def build(name: str, *, hidden: int = 256, layers: int = 4, heads: int = 8, batch: int = 8, seq: int = 128,
          vocab: int = 8000, seed: int = 0) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """One model from its transformers config, dropout off, in eval mode (gradients flow), with its inputs.

    Example:
        >>> model, inputs = build("vit", hidden=32, layers=1, heads=4, batch=2, seq=64)
        >>> type(model).__name__, tuple(inputs["pixel_values"].shape)
        ('ViTForImageClassification', (2, 3, 32, 32))
    """
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    if name == "llama":
        config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 8 * 8,
                                          num_hidden_layers=layers, num_attention_heads=heads,
                                          num_key_value_heads=max(1, heads // 2), vocab_size=vocab, use_cache=False)
        return transformers.LlamaForCausalLM(config).eval(), {"input_ids": ids}
    if name == "gpt2":
        config = transformers.GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, vocab_size=vocab,
                                         n_positions=max(seq, 256), resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0, use_cache=False)
        return transformers.GPT2LMHeadModel(config).eval(), {"input_ids": ids}
    if name == "bert":
        config = transformers.BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                         intermediate_size=4 * hidden, vocab_size=vocab, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0)
        return transformers.BertModel(config).eval(), {"input_ids": ids}
    if name == "t5":
        config = transformers.T5Config(d_model=hidden, d_kv=hidden // heads, d_ff=4 * hidden, num_layers=layers,
                                       num_heads=heads, vocab_size=vocab, dropout_rate=0.0, use_cache=False)
        return transformers.T5ForConditionalGeneration(config).eval(), {"input_ids": ids, "decoder_input_ids": ids}
    if name == "vit":
        image = max(32, seq // 2)
        config = transformers.ViTConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                        intermediate_size=4 * hidden, image_size=image, patch_size=8,
                                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=10)
        return (transformers.ViTForImageClassification(config).eval(),
                {"pixel_values": torch.randn(batch, 3, image, image, generator=g)})
    raise ValueError(f"unknown model {name!r}")


def measured_rows(name: str, plan: Any, inputs: dict, rounds: int, steps: int, top: int) -> list[dict[str, Any]]:
    """The ``top`` fastest fitting candidates run in turns; one row each, predicted beside measured."""
    import fxforge

    chosen = [c for c in plan.options if c.fits][:top]
    runs: dict[str, list[Any]] = {c.name: [] for c in chosen}
    failed: dict[str, str] = {}
    for r in range(rounds):
        for candidate in chosen if r % 2 == 0 else chosen[::-1]:
            if candidate.name in failed:
                continue
            try:
                result = fxforge.parallel.run(plan.choose(candidate.name), inputs, steps=steps)
            except (RuntimeError, ValueError) as exc:
                failed[candidate.name] = error_text(exc, 300, one_line=True)
                log(f"[{name}] {candidate.name} failed: {failed[candidate.name]}")
                continue
            runs[candidate.name].append(result)
            log(f"[{name}] {result}")
    rows = []
    for rank, candidate in enumerate(chosen):
        row = {"model": name, "rank": rank + 1, "strategy": candidate.name, "predicted_ms": candidate.step_s * 1e3,
               "predicted_mib": candidate.memory_per_device / 2**20, "predicted_bytes": candidate.comm_bytes}
        done = runs[candidate.name]
        if not done:
            rows.append({**row, "status": "failed", "error": failed.get(candidate.name, "not run")})
            continue
        steps_s = [s for result in done for s in result.step_seconds]
        memory = [r.memory_per_device for r in done if r.memory_per_device is not None]
        rows.append({**row, "status": "ok", "measured_ms": statistics.median(steps_s) * 1e3,
                     "measured_mib": statistics.median(memory) / 2**20 if memory else None,
                     "counted_bytes": done[0].comm_bytes, "collectives_match": done[0].collectives_match,
                     "ok": all(r.ok for r in done), "max_error": max(max(r.max_error, r.grad_error) for r in done)})
    ok = [r for r in rows if r["status"] == "ok"]
    if ok:
        fastest = min(ok, key=lambda r: r["measured_ms"])
        for r in rows:
            r["fastest_measured"] = r is fastest
    return rows


def exact_rows(name: str, degrees: tuple[int, ...]) -> list[dict[str, Any]]:
    """The derived tensor-parallel plan alone at each degree, in float64 on a small configuration."""
    import fxforge

    rows = []
    for degree in degrees:
        model, inputs = build(name, hidden=64, layers=2, heads=4, batch=2, seq=16, vocab=256)
        model = model.double()
        inputs = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
        row = {"model": name, "degree": degree}
        try:
            plan = fxforge.parallelize(model, inputs, mesh={"tp": degree})
            result = fxforge.parallel.run(plan, inputs)
        except (RuntimeError, ValueError) as exc:
            rows.append({**row, "status": "failed", "error": error_text(exc, 300, one_line=True)})
            continue
        styles = plan.tp.styles
        rows.append({**row, "status": "ok", "output_error": result.max_error, "grad_error": result.grad_error,
                     "collectives_match": result.collectives_match, "counted_bytes": result.comm_bytes,
                     "split": sum(s in ("colwise", "rowwise", "vocab") for s in styles.values()),
                     "replicated": sum(s == "replicate" for s in styles.values()),
                     "sequence_parallel": plan.tp.sequence_parallel})
        log(f"[{name}] float64 tp{degree}: {result}")
    return rows


def plan_row(name: str, model: torch.nn.Module, inputs: dict, devices: int) -> tuple[Any, dict[str, Any]]:
    import time

    import fxforge

    start = time.perf_counter()
    plan = fxforge.parallelize(model, inputs, devices=devices)
    seconds = time.perf_counter() - start
    table = plan.candidates
    return plan, {"model": name, "plan_s": seconds, "chosen": plan.chosen.name,
                  "candidates": [{k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()}
                                 for row in table.to_dict("records")],
                  "replicated": dict(plan.tp.reasons) if plan.tp is not None else {}}


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    lines = [f"## {meta['title']}", "", f"- Command: `{meta['command']}`",
             f"- Commit: `{meta.get('commit')}`, {meta['date']}", f"- Machine: {meta['machine']}",
             f"- Load average before / after: {meta.get('load_before')} / {meta.get('load_after')}",
             f"- Models: {meta['models']}", f"- Link: {meta.get('link')}", "",
             ("Candidates on 2 devices, the three fastest that fit run for real (gloo, one thread per rank, "
             "forward + backward + AdamW, steps after two warm-up steps, runs in turns):"), "",
             ("| model | rank | mesh | predicted ms | measured ms | measured / predicted | predicted MiB | measured MiB "
             "| collective bytes predicted | counted | equal | outputs & gradients = one process | fastest measured |"),
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for r in result["measured"]:
        if r.get("status") != "ok":
            lines.append(f"| {r['model']} | {r.get('rank')} | {r.get('strategy')} | {r.get('predicted_ms', 0):.1f} "
                         f"| failed: {report.md_cell(r.get('error', ''))} | | | | | | | | |")
            continue
        ratio = r["measured_ms"] / r["predicted_ms"] if r["predicted_ms"] else None
        mib = "-" if r["measured_mib"] is None else f"{r['measured_mib']:.1f}"
        counted = "-" if r["counted_bytes"] is None else f"{r['counted_bytes']:,}"
        equal = {True: "yes", False: "NO", None: "-"}[r["collectives_match"]]
        # A model whose outputs are NaN in one process and in the run "matches" vacuously: say so.
        same = ("yes" if math.isfinite(r["max_error"]) else "NaN in both") if r["ok"] else "NO"
        lines.append(f"| {r['model']} | {r['rank']} | {r['strategy']} | {r['predicted_ms']:.1f} | {r['measured_ms']:.1f} "
                     f"| {report.fmt_float(ratio)} | {r['predicted_mib']:.1f} | {mib} | {r['predicted_bytes']:,} "
                     f"| {counted} | {equal} | {same} ({r['max_error']:.1e}) "
                     f"| {'yes' if r.get('fastest_measured') else ''} |")
    lines += ["", ("The derived tensor-parallel plan alone, float64, small configurations (hidden 64, 2 layers, "
              "4 heads, batch 2, 16 tokens):"), "",
              ("| model | ranks | layers split | replicated | sequence parallel | output error | gradient error "
              "| collectives predicted = counted |"), "|---|---:|---:|---:|---|---:|---:|---|"]
    for r in result["exact"]:
        if r.get("status") != "ok":
            lines.append(f"| {r['model']} | {r['degree']} | failed: {report.md_cell(r.get('error', ''))} | | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['degree']} | {r['split']} | {r['replicated']} | "
                     f"{'yes' if r['sequence_parallel'] else 'no'} | {r['output_error']:.1e} | {r['grad_error']:.1e} "
                     f"| {'yes' if r['collectives_match'] else 'NO'} |")
    lines += ["", *summary(result)]
    return "\n".join(lines)


def summary(result: dict[str, Any]) -> list[str]:
    """The done-when lines: ranking, step-time and memory error, collective bytes, exactness."""
    out = ["Summary:", ""]
    ok = [r for r in result["measured"] if r.get("status") == "ok"]
    for model in dict.fromkeys(r["model"] for r in result["measured"]):
        rows = [r for r in ok if r["model"] == model]
        if not rows:
            out.append(f"- {model}: no candidate ran")
            continue
        first = next((r for r in rows if r["rank"] == 1), None)
        errors = [abs(r["measured_ms"] / r["predicted_ms"] - 1) for r in rows]
        mem = [abs(r["measured_mib"] / r["predicted_mib"] - 1) for r in rows if r["measured_mib"]]
        memory_text = f"memory within {max(mem):.0%}" if mem else "memory not measured"
        verdict = "is" if first and first.get("fastest_measured") else "is NOT"
        equal = all(r["collectives_match"] in (True, None) for r in rows)
        out.append(f"- {model}: first choice {first['strategy'] if first else '-'} {verdict} the fastest of those "
                   f"run; step time within {max(errors):.0%} (worst), {memory_text}; collectives predicted = "
                   f"counted: {'yes' if equal else 'NO'}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", type=csv_list, default=list(MODELS), help=f"of {','.join(MODELS)} (default all)")
    p.add_argument("--rounds", type=int, default=2, help="runs per candidate, in turns (default 2)")
    p.add_argument("--steps", type=int, default=3, help="measured steps per run (default 3)")
    p.add_argument("--top", type=int, default=3, help="candidates run per model (default 3)")
    p.add_argument("--degrees", type=lambda s: tuple(int(x) for x in s.split(",")), default=(2, 4),
                   help="tensor-parallel degrees of the float64 check (default 2,4)")
    p.add_argument("--quick", action="store_true", help="tiny models (a smoke run)")
    report.add_output_options(p, NAME)


QUICK = {"hidden": 64, "layers": 2, "heads": 4, "batch": 4, "seq": 16, "vocab": 256}
"""The ``--quick`` size."""


def run(opts: argparse.Namespace) -> int:
    unknown = [m for m in opts.models if m not in MODELS]
    if unknown or opts.rounds < 1 or opts.steps < 1 or opts.top < 1:
        raise UsageError(f"unknown model(s) {unknown}" if unknown else "--rounds, --steps and --top are at least 1")
    from fxforge.runtime.link_measure import measured_link

    link = measured_link("gloo", 2)
    result: dict[str, Any] = {"meta": {
        "suite": NAME, "title": "Parallel plans: every mesh priced, the top three run on gloo (issue 52)",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "command": opts.command,
        "commit": report.git_commit(), "machine": report.machine_info(torch.get_num_threads()),
        "load_before": report.load_average(), "link": f"{link.name}: {link.source}",
        "models": ("hidden 64, 2 layers, 4 heads, vocab 256, batch 4, 16 tokens (--quick)" if opts.quick else
                   "hidden 256, 4 layers, 8 heads (LLaMA 4 key/value heads), vocab 8000, batch 8, 128 tokens "
                   "(ViT: 64x64 images, patch 8)")}, "plans": [], "measured": [], "exact": []}
    json_path = os.path.join(opts.out, f"results-{NAME}.json")
    for name in opts.models:
        try:
            model, inputs = build(name, **(QUICK if opts.quick else {}))
            plan, row = plan_row(name, model, inputs, 2)
            result["plans"].append(row)
            log(f"[{name}]\n{plan}")
            result["measured"] += measured_rows(name, plan, inputs, opts.rounds, opts.steps, opts.top)
        except Exception as exc:  # noqa: BLE001 - a model that fails fails its rows, not the run
            log(f"[{name}] failed: {error_text(exc, 400, one_line=True)}")
            result["measured"].append({"model": name, "status": "failed", "error": error_text(exc, 400, one_line=True)})
        result["exact"] += exact_rows(name, opts.degrees)
        report.write_json(json_path, result)
    result["meta"]["load_after"] = report.load_average()
    report.write_json(json_path, result)
    return report.finish(opts, markdown(result), NAME)


SECTION = Section(NAME, "parallel plans of LLaMA, GPT-2, BERT, T5 and ViT on 2 gloo ranks: every mesh priced, the "
                  "top three run (step, memory, collectives predicted vs measured), the TP plan exact in float64 "
                  "at 2 and 4 ranks (issue 52)", add_arguments, run)
