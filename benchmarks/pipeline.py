"""``python -m benchmarks --suite pipeline``: fxforge's pipeline split against the even-by-layer split
(torchtitan's) and parameter-size balancing (PiPPy's old ``split_into_equal_size``), issue 23.

For GPT-2, LLaMA (transformers, random weights), torchvision ResNet-50 and timm ViT-S/16 (in the zoo
environment) at 2, 4 and 8 stages with ``2k`` microbatches: each policy's bottleneck ratio (slowest /
mean stage cost) and simulated 1F1B and GPipe throughput, all under fxforge's one cost model (roofline
forward + backward per unit on this machine, bytes sent at 12.5 GB/s). Then, at 2 stages, a measured
step on CPU with gloo (one process per stage, one thread each) for fxforge's split, fxforge's split from
measured costs (``costs="measured"``, where it differs) and the even split, interleaved, with the single process (two threads) beside them, and the check that each run's outputs
and gradients equal the single process's: in float32 (within 1e-4 relative, 1e-5 absolute) and once more
in float64, where a pipeline error would stay and the rounding that train-mode batch norm over a few
samples per microbatch amplifies in float32 does not.

What the measurement can show on a 2-core machine: that the stages run on torch's engine and give the
single process's numbers, and how the two splits compare when each stage has one core. It cannot show a
speedup over one process (the single process has the same two cores, and gloo's copies cost more than
the pipeline saves on so few cores) nor anything about more than 2 stages.

Example::

    python -m benchmarks --suite pipeline                  # all models (zoo ones in .venv-zoo)
    python -m benchmarks --suite pipeline --quick --models gpt2 --no-markdown
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from typing import Any

import torch

from benchmarks import report
from benchmarks import training_models as models_mod
from benchmarks.log import error_text, log
from benchmarks.section import Section, UsageError, csv_list
from benchmarks.zoo_env import ZOO_PYTHON, run_in_zoo

NAME = "pipeline"

MODELS = ("gpt2", "llama", "resnet50", "vit_small")
STAGES = (2, 4, 8)
POLICIES = ("fxforge", "even-layers", "parameters")

FULL = {
    "gpt2": models_mod.Spec(batch=16, seq=256, hidden=768, layers=12, heads=12, vocab=50257),
    "llama": models_mod.Spec(batch=16, seq=256, hidden=512, layers=8, heads=8, kv_heads=4, vocab=32000),
    "resnet50": models_mod.Spec(batch=16, image=224),
    "vit_small": models_mod.Spec(batch=16, image=224),
}
"""The models planned at 2/4/8 stages (only their cost model runs, plus one microbatch through the stages)."""

MEASURED = {
    "gpt2": models_mod.Spec(batch=8, seq=128, hidden=256, layers=12, heads=4, vocab=8000),
    "llama": models_mod.Spec(batch=8, seq=128, hidden=256, layers=8, heads=4, kv_heads=2, vocab=8000),
    "resnet50": models_mod.Spec(batch=8, image=128),
    "vit_small": models_mod.Spec(batch=8, image=128),
}
"""The smaller configurations run for real at 2 stages (a step of GPT-2 small on 2 CPU cores takes minutes)."""
_TINY = models_mod.Spec(batch=16, seq=32, hidden=32, layers=2, heads=2, kv_heads=1, vocab=256, image=64)
QUICK = dict.fromkeys(MODELS, _TINY)


def env_name() -> str:
    return os.path.basename(os.path.dirname(os.path.dirname(sys.executable)))


# --------------------------------------------------------------------------------------------------
# the simulated comparison


def plan_rows(name: str, model: torch.nn.Module, inputs: tuple, stages: int) -> list[dict[str, Any]]:
    """One row per policy at ``stages`` stages and ``2 * stages`` microbatches."""
    from fxforge.parallel.partition import compare_policies, partition
    from fxforge.parallel.units import stage_units

    microbatches = 2 * stages
    start = time.perf_counter()
    units = stage_units(model, inputs, microbatches=microbatches)
    found = compare_policies(model, inputs, stages, microbatches=microbatches, validate=False, units=units)
    seconds = time.perf_counter() - start
    # fxforge's split as partition() returns it: checked on torch's engine (split points it cannot run are
    # refused). Where the engine cannot run the model at all, the unchecked split stays, marked.
    engine = "runs"
    try:
        found["fxforge"] = partition(model, inputs, stages, microbatches=microbatches, units=units)
    except RuntimeError as exc:
        engine = error_text(exc, 300, one_line=True)
    even = found.get("even-layers")
    rows = []
    for policy in POLICIES:
        part = found.get(policy)
        row = {"model": name, "stages": stages, "microbatches": microbatches, "policy": policy}
        if part is None:
            rows.append({**row, "status": "no split", "error": "fewer blocks than stages"})
            continue
        throughput = part.throughput
        row.update(status="ok", bottleneck=part.bottleneck_ratio, floor=part.floor_ratio, throughput_1f1b=throughput["1F1B"],
                   throughput_gpipe=throughput["GPipe"], slowest_ms=max(part.stage_costs) * 1e3,
                   max_memory_mib=max(part.stage_memory) / 2**20, split_points=part.split_points,
                   refused=dict(part.refused))
        if even is not None:
            row["gain_vs_even"] = throughput["1F1B"] / even.throughput["1F1B"]
        if policy == "fxforge":
            row.update(partition_s=seconds, engine=engine)
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------------
# the measured runs


def measured_rows(name: str, model: torch.nn.Module, inputs: tuple, rounds: int, steps: int) -> list[dict[str, Any]]:
    """fxforge's and the even split at 2 stages, run on gloo in turns (``rounds`` x ``steps`` steps each)."""
    from fxforge.parallel.launch import run_pipeline
    from fxforge.parallel.partition import partition
    from fxforge.parallel.units import stage_units

    units = stage_units(model, inputs, microbatches=4)
    parts = {"fxforge": partition(model, inputs, 2, microbatches=4, units=units)}
    try:
        parts["even-layers"] = partition(model, inputs, 2, microbatches=4, policy="even-layers", units=units)
    except ValueError as exc:
        log(f"[{name}] no even split: {exc}")
    # fxforge's split from measured costs: every node timed on one microbatch with one thread, as each
    # stage's process runs.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        measured_split = partition(model, inputs, 2, microbatches=4, costs="measured")
    finally:
        torch.set_num_threads(threads)
    if measured_split.split_points != parts["fxforge"].split_points:
        parts["fxforge-measured"] = measured_split
    else:
        log(f"[{name}] measured costs choose the roofline split too ({measured_split.split_points})")
    times: dict[str, list[float]] = {p: [] for p in parts}
    reference: list[float] = []
    checks: dict[str, list[bool]] = {p: [] for p in parts}
    errors: dict[str, float] = dict.fromkeys(parts, 0.0)
    failed: dict[str, str] = {}
    for r in range(rounds):
        for policy in (list(parts) if r % 2 == 0 else list(parts)[::-1]):
            if policy in failed:
                continue
            try:
                run = run_pipeline(parts[policy], inputs, steps=steps, worker_setup=_worker_setup(name))
            except (RuntimeError, ValueError) as exc:
                failed[policy] = error_text(exc, 400, one_line=True)
                log(f"[{name}] {policy} run failed: {failed[policy]}")
                continue
            times[policy] += list(run.step_seconds[1:])      # the first step warms up
            reference += list(run.reference_seconds[1:])
            checks[policy].append(run.ok)
            errors[policy] = max(errors[policy], run.output_error, run.gradient_error)
            log(f"[{name}] {policy}: {run}")
    exact: dict[str, Any] = {}
    for policy, part in parts.items():
        if policy in failed:
            continue
        try:  # the same check in float64: a pipeline error stays, float32 rounding goes
            run = run_pipeline(part, inputs, dtype=torch.float64, worker_setup=_worker_setup(name))
            exact[policy] = (run.ok, max(run.output_error, run.gradient_error))
        except (RuntimeError, ValueError) as exc:
            exact[policy] = (False, error_text(exc, 400, one_line=True))
    rows = []
    single = statistics.median(reference) if reference else None
    for policy, part in parts.items():
        row = {"model": name, "stages": 2, "microbatches": 4, "policy": policy,
               "split_points": part.split_points, "bottleneck": part.bottleneck_ratio}
        if policy in failed:
            rows.append({**row, "status": "failed", "error": failed[policy]})
            continue
        median = statistics.median(times[policy])
        q = statistics.quantiles(times[policy], n=4) if len(times[policy]) >= 2 else [median] * 3
        rows.append({**row, "status": "ok", "step_ms": median * 1e3, "iqr_ms": (q[2] - q[0]) * 1e3,
                     "samples": len(times[policy]), "single_process_ms": single * 1e3 if single else None,
                     "vs_single": single / median if single else None, "matches": all(checks[policy]),
                     "max_error": errors[policy], "float64_matches": exact[policy][0],
                     "float64_error": exact[policy][1]})
    ours = next((r for r in rows if r["policy"] == "fxforge" and r["status"] == "ok"), None)
    for row in rows:
        if ours and row["status"] == "ok":
            row["fxforge_speedup"] = row["step_ms"] / ours["step_ms"]
    return rows


# --------------------------------------------------------------------------------------------------
# a model, the zoo, the report


def run_model(name: str, spec: models_mod.Spec, opts: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    model, inputs = models_mod.build(name, spec, seed=opts.seed)
    _settle_batch_norm(name, model, inputs)
    plans = []
    for stages in opts.stages:
        try:
            plans += plan_rows(name, model, inputs, stages)
        except Exception as exc:  # noqa: BLE001 - a failing model fails its rows, not the run
            log(f"[{name}] {stages} stages failed: {error_text(exc, 400, one_line=True)}")
            plans.append({"model": name, "stages": stages, "policy": "fxforge", "status": "failed", "error": error_text(exc, 400, one_line=True)})
        log(f"[{name}] {stages} stages: " + ", ".join(
            f"{r['policy']} {r.get('bottleneck', float('nan')):.3f}" for r in plans if r["stages"] == stages))
    measured = []
    if opts.rounds > 0:
        try:
            if not opts.quick:
                model, inputs = models_mod.build(name, MEASURED[name], seed=opts.seed)
                _settle_batch_norm(name, model, inputs)
            measured = measured_rows(name, model, inputs, opts.rounds, opts.steps)
        except Exception as exc:  # noqa: BLE001
            log(f"[{name}] measured run failed: {error_text(exc, 400, one_line=True)}")
            measured = [{"model": name, "stages": 2, "policy": "fxforge", "status": "failed", "error": error_text(exc, 400, one_line=True)}]
    return plans, measured


def _worker_setup(name: str) -> Any:
    """What the workers call before unpickling a zoo model: torchvision's op schemas (see benchmarks.zoo)."""
    if name in models_mod.ZOO_MODELS:
        from benchmarks.zoo import define_torchvision_op_schemas

        return define_torchvision_op_schemas
    return None


def _settle_batch_norm(name: str, model: torch.nn.Module, inputs: tuple) -> None:
    """BatchNorm statistics from a few train-mode passes on random data, not random-init ones."""
    with torch.no_grad():
        for _ in range(2 if "resnet" in name else 0):
            model(torch.randn_like(inputs[0]))


def run_in_zoo_env(models: list[str], argv: list[str], python: str) -> dict[str, Any]:
    """This section for the zoo ``models`` in the zoo environment, given our arguments ``argv``; failed rows
    when it cannot run."""
    result, why = run_in_zoo(NAME, models, argv, python)
    if result is None:
        return {"meta": {}, "plans": [{"model": m, "status": "failed", "error": why} for m in models], "measured": []}
    return result


def _fmt(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    lines = [f"## {meta['title']}", "",
             f"- Command: `{meta['command']}`", f"- Commit: `{meta.get('commit')}`, {meta['date']}",
             f"- Machine: {meta['machine']}",
             "- Planned: " + "; ".join(f"{m}: {d}" for m, d in meta["models"].items()),
             "- Measured (2 stages): " + "; ".join(f"{m}: {d}" for m, d in meta.get("measured_models", {}).items()),
             ("- fxforge's split is checked on torch's engine (one microbatch through the stages) before it is "
             "used; split points the engine cannot run are refused and listed."),
             ("- Cost model: fxforge's roofline estimate of each unit's forward + backward on this CPU "
             "(`fxforge.partition`), the same for every policy; links at 12.5 GB/s; 1F1B with 2k microbatches."),
             ("- even-layers: the model's blocks split evenly by count (torchtitan); parameters: a new stage when "
             "the parameter bytes seen reach the next 1/k (PiPPy's old `split_into_equal_size`)."), "",
             ("| model | stages | policy | bottleneck | largest unit / mean stage | 1F1B samples/s | GPipe samples/s | 1F1B throughput / even's | "
             "slowest stage ms | max stage MiB | split points |"),
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in result["plans"]:
        if r.get("status") != "ok":
            lines.append(f"| {r['model']} | {r.get('stages', '-')} | {r.get('policy', '-')} | {r.get('status')}: "
                         f"{r.get('error', '')} | | | | | | | |")
            continue
        points = ", ".join(r["split_points"])
        refused = f" (refused: {', '.join(r['refused'])})" if r.get("refused") else ""
        lines.append(f"| {r['model']} | {r['stages']} | {r['policy']} | {r['bottleneck']:.3f} | {r['floor']:.3f} | "
                     f"{r['throughput_1f1b']:.1f} | {r['throughput_gpipe']:.1f} | {_fmt(r.get('gain_vs_even'), '.3f')} | "
                     f"{r['slowest_ms']:.2f} | {r['max_memory_mib']:.0f} | `{points}`{refused} |")
    blocked = {r["model"]: r["engine"] for r in result["plans"] if r.get("engine", "runs") != "runs"}
    for model, why in blocked.items():
        lines.append(f"\n{model}: torch.distributed.pipelining cannot run fxforge's split (nor, in our tries, any "
                     f"split): {why}. Its rows are the cost model's.")
    lines += ["", ("Measured at 2 stages on CPU with gloo (one process per stage, 1 thread each; the single process "
              "has 2 threads), 4 microbatches, 1F1B, steps after the first, policies in turns; fxforge-measured: "
              "the split from `costs=\"measured\"` (each node timed on one microbatch, one thread), shown where it "
              "differs from the roofline one; its bottleneck is by its own costs:"), "",
              ("| model | policy | bottleneck (model) | step ms (median) | IQR ms | steps | single process ms | "
              "single / pipeline | step / fxforge's (roofline split) | float32: outputs & gradients = single process | float64: the same |"),
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in result["measured"]:
        if r.get("status") != "ok":
            lines.append(f"| {r['model']} | {r.get('policy')} | | {r.get('status')}: {r.get('error', '')} | | | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['policy']} | {r['bottleneck']:.3f} | {r['step_ms']:.1f} | {r['iqr_ms']:.1f} | "
                     f"{r['samples']} | {_fmt(r.get('single_process_ms'), '.1f')} | {_fmt(r.get('vs_single'), '.2f')}x | "
                     f"{_fmt(r.get('fxforge_speedup'), '.2f')}x | {'yes' if r['matches'] else 'no'} "
                     f"(max abs error {r['max_error']:.1e}) | {_float64_cell(r)} |")
    lines += [""] + summary(result)
    return "\n".join(lines)


def _float64_cell(row: dict[str, Any]) -> str:
    error = row.get("float64_error")
    if isinstance(error, str):
        return f"failed: {error}"
    return f"{'yes' if row.get('float64_matches') else 'NO'} (max abs error {_fmt(error, '.1e')})"


def summary(result: dict[str, Any]) -> list[str]:
    """The done-when lines: per model and stage count, fxforge's bottleneck against the even split's, and
    the simulated 1F1B throughput gain."""
    out = ["Summary:", ""]
    plans = [r for r in result["plans"] if r.get("status") == "ok"]
    for model in dict.fromkeys(r["model"] for r in plans):
        parts = []
        for stages in sorted({r["stages"] for r in plans if r["model"] == model}):
            by = {r["policy"]: r for r in plans if r["model"] == model and r["stages"] == stages}
            ours, even = by.get("fxforge"), by.get("even-layers")
            if ours is None:
                continue
            text = f"k={stages}: fxforge {ours['bottleneck']:.3f}"
            if even is not None:
                text += f" vs even {even['bottleneck']:.3f}, 1F1B throughput x{ours['gain_vs_even']:.3f}"
            else:
                text += " (no even split: fewer blocks than stages)"
            parts.append(text)
        out.append(f"- {model}: " + "; ".join(parts))
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``--suite pipeline``."""
    p.add_argument("--models", type=csv_list, default=list(MODELS),
                   help=f"comma-separated, of {','.join(MODELS)} (default all; resnet50 and vit_small run in the "
                   "zoo environment)")
    p.add_argument("--stages", type=lambda s: [int(x) for x in s.split(",") if x], default=list(STAGES),
                   help="stage counts (default 2,4,8)")
    p.add_argument("--rounds", type=int, default=2, help="measured runs per split at 2 stages (0: none; default 2)")
    p.add_argument("--steps", type=int, default=4, help="steps per measured run, the first not counted (default 4)")
    p.add_argument("--quick", action="store_true", help="tiny models, one round of 2 steps: a smoke run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--zoo-python", default=ZOO_PYTHON)
    report.add_output_options(p, NAME)


def run(opts: argparse.Namespace) -> int:
    """Plan (and at 2 stages measure) every model; returns the exit status."""
    unknown = [m for m in opts.models if m not in MODELS]
    if unknown or opts.rounds < 0 or opts.steps < 2 or not opts.stages or min(opts.stages) < 1:
        raise UsageError(f"unknown model(s) {unknown}" if unknown else "--rounds >= 0, --steps >= 2, stages >= 1")
    if opts.quick:
        opts.rounds, opts.steps = min(opts.rounds, 1), 2
    specs = QUICK if opts.quick else FULL
    zoo_here = models_mod.zoo_available()
    here = [m for m in opts.models if m in models_mod.HF_MODELS or zoo_here]
    elsewhere = [m for m in opts.models if m not in here]
    if zoo_here:
        from benchmarks.zoo import define_torchvision_op_schemas

        define_torchvision_op_schemas()
    threads_before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        return _run(opts, specs, here, elsewhere)
    finally:
        torch.set_num_threads(threads_before)  # an in-process run (the tests) leaves the caller's threads


def _run(opts: argparse.Namespace, specs: dict[str, models_mod.Spec], here: list[str], elsewhere: list[str]) -> int:
    result: dict[str, Any] = {"meta": {
        "suite": NAME, "title": "Pipeline stages: fxforge's split against the even-by-layer and parameter-size "
        "splits (issue 23)", "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": opts.command, "commit": report.git_commit(),
        "machine": report.machine_info(torch.get_num_threads()), "env": env_name(),
        "models": {m: specs[m].describe(m) for m in opts.models},
        "measured_models": {m: (specs if opts.quick else MEASURED)[m].describe(m) for m in opts.models},
        "complete": False}, "plans": [], "measured": []}
    json_path = os.path.join(opts.out, f"results-{NAME}.json")
    for name in here:
        try:
            plans, measured = run_model(name, specs[name], opts)
        except Exception as exc:  # noqa: BLE001 - a model that fails to build fails its rows
            log(f"[{name}] failed: {error_text(exc, 400, one_line=True)}")
            plans, measured = [{"model": name, "status": "failed", "error": error_text(exc, 400, one_line=True)}], []
        result["plans"] += plans
        result["measured"] += measured
        report.write_json(json_path, result)
    if elsewhere:
        zoo = run_in_zoo_env(elsewhere, getattr(opts, "argv", []), opts.zoo_python)
        result["plans"] += zoo["plans"]
        result["measured"] += zoo["measured"]
    result["meta"]["complete"] = True
    report.write_json(json_path, result)
    return report.finish(opts, markdown(result), NAME)


SECTION = Section(NAME, "pipeline stages of GPT-2, LLaMA, ResNet-50 and ViT-S at 2/4/8 stages: fxforge's split "
                  "against the even-by-layer and parameter-size splits (bottleneck ratio, simulated 1F1B/GPipe "
                  "throughput), and 2 stages measured on gloo (issue 23)", add_arguments, run)
