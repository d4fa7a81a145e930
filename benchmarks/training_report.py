"""The training benchmark's results as markdown: its tables, its summary lines, its block of ``RESULTS.md``.

:mod:`benchmarks.training` makes the rows (one per model and contender) and the prediction rows (one per
model); this module renders them: :data:`PREDICTION_COLUMNS`, :data:`COLUMNS`, :func:`summary` (is fxforge
faster than each peer at an equal or lower measured peak) and :func:`write_markdown`, which replaces the block
between ``<!-- harness:training:begin -->`` and ``<!-- harness:training:end -->`` and keeps the rest of the file
byte for byte.

Example:
    >>> _fits_text({"fits": {"0.8": True, "0.6": True, "0.4": False}})
    '≤ 0.6'
"""

from __future__ import annotations

from typing import Any

from benchmarks import report

NAME = "training"

def _mib(nbytes: float | None, digits: int = 1) -> str:
    return report.fmt_mib(nbytes, digits)


def _fits_text(row: dict[str, Any]) -> str:
    fits = row.get("fits")
    if fits is None:
        return "—"
    if isinstance(fits, dict):
        yes = [f for f, ok in fits.items() if ok]
        return f"≤ {min(yes, key=float)}" if yes else "no"
    return "yes" if fits else "**no**"


def _grad_err(row: dict[str, Any], key: str) -> str:
    """A contender's gradient error against eager; eager's own against float64, marked "f64"."""
    text = report.fmt_err(row.get(key))
    return f"f64: {text}" if row["kind"] == "eager" and row.get(key) is not None else text


def _budget_text(row: dict[str, Any]) -> str:
    if row.get("budget_bytes") is not None:
        return f"{_mib(row['budget_bytes'])} MiB step"
    if row.get("fraction") is not None:
        unconstrained = row.get("unconstrained_activation_bytes")
        act = f" ({_mib(row['fraction'] * unconstrained)} MiB)" if unconstrained else ""
        return f"{row['fraction']:g}{act}"
    return "—"


def _note(row: dict[str, Any]) -> str:
    if row.get("status") == "refused":
        return f"refused: {row['error']}"
    if row.get("error"):
        return f"**failed** ({row.get('stage') or '?'}): {row['error']}"
    info = row.get("info") or {}
    parts = []
    if row["kind"] == "checkpoint" and info.get("blocks"):
        parts.append(f"blocks of {', '.join(info['blocks'])}")
    if "predicted_peak_bytes" in info:
        parts.append(f"plan: peak {_mib(info['predicted_peak_bytes'])} MiB predicted")
    if "recomputed_nodes" in info:
        parts.append(f"{info['recomputed_nodes']} nodes recomputed")
    if info.get("overhead") is not None:
        parts.append(f"overhead {100 * info['overhead']:.0f} % predicted")
    if info.get("solver"):
        parts.append(f"solver {info['solver']}")
    median, iqr = row.get("median_ms"), row.get("iqr_ms")
    if median and iqr is not None and len(row.get("times_ms") or ()) >= 3 and iqr > report.NOISY_IQR * median:
        parts.append(f"noisy (IQR {100 * iqr / median:.0f} % of the median)")
    if info.get("profiler_vs_tracker_pct") is not None:
        parts.append(f"profiler {_mib(info['profiler_peak_bytes'])} MiB vs dispatch tracker "
                     f"{_mib(info['tracker_peak_bytes'])} MiB above the start "
                     f"({info['profiler_vs_tracker_pct']:+.1f} %)")
    return "; ".join(parts)


COLUMNS: list[report.Column] = [
    report.Column("model", lambda r: r["model"]),
    report.Column("env", lambda r: r.get("env", "")),
    report.Column("contender", lambda r: r["contender"]),
    report.Column("budget", _budget_text, "right"),
    report.Column("step peak MiB", lambda r: _mib(r.get("peak_bytes")), "right"),
    report.Column("act. peak MiB", lambda r: _mib(r.get("activation_peak_bytes")), "right"),
    report.Column("step time ÷ eager", lambda r: report.fmt_ratio(r.get("step_vs_eager")), "right"),
    report.Column("fastest ÷ eager's", lambda r: report.fmt_ratio(r.get("min_vs_eager")), "right"),
    report.Column("fits", _fits_text),
    report.Column("max abs grad err", lambda r: _grad_err(r, "max_grad_err"), "right"),
    report.Column("÷ max grad", lambda r: _grad_err(r, "rel_grad_err"), "right"),
    report.Column("prepare s", lambda r: report.fmt_float(r.get("prepare_s"), 1), "right"),
    report.Column("note", _note),
]


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:+.2f} %"


def _pred_figure(row: dict[str, Any], figure: str, column: str) -> str:
    value = (row.get("table") or {}).get(figure, {}).get(column)
    return "—" if value is None else f"{value:.1f}"


PREDICTION_COLUMNS: list[report.Column] = [
    report.Column("model", lambda r: r["model"]),
    report.Column("env", lambda r: r.get("env", "")),
    report.Column("size", lambda r: r.get("spec", "")),
    report.Column("predicted peak MiB", lambda r: _mib(r.get("predicted_peak_bytes")), "right"),
    report.Column("measured peak MiB", lambda r: _mib(r.get("measured_peak_bytes")), "right"),
    report.Column("peak error", lambda r: _pct(r.get("peak_error_pct")), "right"),
    report.Column("activations predicted / measured MiB", lambda r: (
        f"{_pred_figure(r, 'activations', 'predicted_MiB')} / {_pred_figure(r, 'activations', 'measured_MiB')}"),
        "right"),
    report.Column("activations error", lambda r: _pct(r.get("activations_error_pct")), "right"),
    report.Column("peak in", lambda r: r.get("peak_phase") or "—"),
    report.Column("prediction s", lambda r: report.fmt_float(r.get("predict_s"), 1), "right"),
    report.Column("eager step peak / act. peak MiB (profiler)", lambda r: (
        f"{_mib(r.get('eager_peak_bytes'))} / {_mib(r.get('eager_activation_peak_bytes'))}"), "right"),
    report.Column("unconstrained activations MiB", lambda r: (
        f"{_mib(r.get('unconstrained_activation_bytes'))} ({r.get('unconstrained_source')})"
        if r.get("unconstrained_activation_bytes") else "—"), "right"),
    report.Column("note", lambda r: f"**failed**: {r['error']}" if r.get("error") else ""),
]


def _rows_of(rows: list[dict[str, Any]], model: str) -> list[dict[str, Any]]:
    return [r for r in rows if r["model"] == model]


def _timed(row: dict[str, Any]) -> bool:
    return row["status"] == "ok" and row.get("step_vs_eager") is not None and row.get("peak_bytes") is not None


FIGURES = (("step_vs_eager", "median"), ("min_vs_eager", "fastest"))
"""The two step-time figures the summary judges by: the medians (the figure of record) and the fastest steps
(less sensitive to other work on the machine, which only ever adds time)."""


def _verdict(ours: list[dict[str, Any]], peer: dict[str, Any], key: str) -> tuple[dict[str, Any] | None, bool]:
    """fxforge's row at or under ``peer``'s measured peak that is fastest by ``key``, and whether it beats the peer."""
    under = [r for r in ours if r["peak_bytes"] <= peer["peak_bytes"] and r.get(key) is not None]
    if not under or peer.get(key) is None:
        return None, False
    best = min(under, key=lambda r: r[key])
    return best, best[key] < peer[key]


def _times(row: dict[str, Any]) -> str:
    return ", ".join(f"{label} {report.fmt_ratio(row.get(key))}" for key, label in FIGURES if row.get(key) is not None)


FAMILIES = (("fxforge", ("fxforge", "fxforge-peer")), ("fxforge-inductor", ("fxforge-inductor", "fxforge-inductor-peer")))
"""fxforge's rows, judged apart: the plan's graphs run op by op, and the same plans compiled by Inductor (judged only
where the run has such rows)."""


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """Per model and peer (per-block checkpointing, each Inductor budget): fxforge's fastest row whose measured
    whole-step peak is at most the peer's, against the peer's step time, by medians and by fastest steps; then
    one line per model. The same for ``fxforge-inductor`` rows (:data:`FAMILIES`), where there are any.

    Example:
        >>> rows = [{"model": "m", "contender": "per-block checkpoint", "kind": "checkpoint", "status": "ok",
        ...          "peak_bytes": 2**20, "step_vs_eager": 1.3, "min_vs_eager": 1.2},
        ...         {"model": "m", "contender": "fxforge 0.6", "kind": "fxforge", "status": "ok",
        ...          "peak_bytes": 2**20, "step_vs_eager": 1.1, "min_vs_eager": 1.25}]
        >>> print(summary(rows)[0])
        - m vs per-block checkpoint (1.0 MiB; median 1.30×, fastest 1.20× eager): fxforge 0.6 at 1.0 MiB (median 1.10×, fastest 1.25×): faster at ≤ its peak by median: yes, by fastest step: **no**
    """
    lines = []
    for model in report.row_models(rows):
        mine = _rows_of(rows, model)
        families = [(name, [r for r in mine if r["kind"] in kinds and _timed(r)]) for name, kinds in FAMILIES
                    if name == "fxforge" or any(r["kind"] in kinds for r in mine)]
        verdicts: dict[str, dict[str, list[tuple[str, bool]]]] = {
            name: {label: [] for _, label in FIGURES} for name, _ in families}
        for peer in (r for r in mine if r["kind"] in ("checkpoint", "inductor")):
            if not _timed(peer):
                lines.append(f"- {model} vs {peer['contender']}: the peer did not run ({peer.get('stage') or '?'})")
                continue
            head = f"- {model} vs {peer['contender']} ({_mib(peer['peak_bytes'])} MiB; {_times(peer)} eager)"
            for name, ours in families:
                found, parts = [], []
                for key, label in FIGURES:
                    best, faster = _verdict(ours, peer, key)
                    verdicts[name][label].append((peer["contender"], faster))
                    if best is not None and best not in found:
                        found.append(best)
                    parts.append(f"by {'fastest step' if label == 'fastest' else label}: {'yes' if faster else '**no**'}")
                if not found:
                    lines.append(f"{head}: no {name} row at ≤ its peak: **no**")
                    continue
                rows_text = "; ".join(f"{r['contender']} at {_mib(r['peak_bytes'])} MiB ({_times(r)})" for r in found)
                lines.append(f"{head}: {rows_text}: faster at ≤ its peak {', '.join(parts)}")
        for name, _ in families:
            judged = verdicts[name]
            if judged["median"]:
                counts = {label: sum(ok for _, ok in v) for label, v in judged.items()}
                total = len(judged["median"])
                not_beaten = [p for p, ok in judged["median"] if not ok]
                lines.append(f"- **{model}**: {name} is faster at an equal or lower peak than {counts['median']} of "
                             f"{total} peers by medians" + (f" (not: {', '.join(not_beaten)})" if not_beaten else "")
                             + f", {counts['fastest']} of {total} by fastest steps")
        refused = [r["contender"] for r in mine if r["status"] == "refused"]
        if refused:
            lines.append(f"- {model}: budgets fxforge refused as out of reach: {', '.join(refused)}")
        failed = [r["contender"] for r in mine if r["status"] == "failed"]
        if failed:
            lines.append(f"- {model}: **failed**: {', '.join(failed)}")
    return lines


def markdown_block(result: dict[str, Any]) -> str:
    meta, m = result["meta"], result["meta"]["machine"]
    zoo = meta.get("zoo_env")
    lines = [
        f"## {meta['title']}",
        "",
        *report.machine_lines(m, with_gpu=False),
        f"- Environments: {meta['env']} ({', '.join(meta.get('env_models', []))})" + (
            f"; {zoo['env']} ({', '.join(zoo['models'])}: torch {zoo.get('torch')}, torchvision "
            f"{zoo.get('torchvision')}, timm {zoo.get('timm')})" if zoo else ""),
        f"- Threads: torch.set_num_threads({m['threads']})",
        report.load_line(m, meta),
        f"- Date: {meta['date']}" + (f", commit {meta['commit']}" if meta.get("commit") else ""),
        f"- Command: `{meta['command']}`",
        ("- Step: `loss(fn(*inputs)).backward(); AdamW(lr=1e-5).step(); zero_grad(set_to_none=True)`, loss = sum of "
         "the float outputs (the LM heads' logits), train mode, dropout 0, seeded random weights; the outputs are "
         "not held past the loss (a loop that keeps `outputs` through the backward and the optimizer step also "
         "keeps the logits: 125 MiB more for the LM models)."),
        ("- Memory: in the steady state (code compiled by the gradient check, optimizer state created by a warm-up "
         "step), one step under `torch.profiler` (`profile_memory=True`: every "
         "allocation and free of PyTorch's CPU allocator, Inductor's buffers included; `benchmarks/step_memory.py`), "
         "the same for every contender. step peak = weights + buffers + optimizer state + inputs + the most held "
         "above them during the step; act. peak = the most held during forward and backward beyond those and the "
         "parameter gradients allocated so far (a gradient counts from the allocation of its storage, found by its "
         "address when autograd accumulates it: a compiled backward hands every gradient over only at its end). "
         "fits: act. peak ≤ fraction × the unconstrained activation peak (of "
         "fxforge's plan), or step peak ≤ the byte budget (`fxforge ≤ peer`: memory_budget = the peer's measured "
         "step peak); for per-block checkpointing, the smallest fraction it fits."),
        (f"- Time: one untimed step per contender, then {meta['timing']['rounds']} round(s) × "
         f"{meta['timing']['reps']} step(s) per contender, contenders rotated each round, each step timed alone; "
         "median; step time ÷ eager = contender median / eager median "
         "(< 1 is faster); fastest ÷ eager's = the same with each contender's fastest step (less sensitive to other "
         "work on the machine). prepare s = optimize / compile + the first forward and backward (fxforge with a "
         "fresh cache directory; Inductor with its on-disk caches as found, warm where an earlier run compiled "
         "the same graph)."),
        ("- Gradients: one forward and backward of each contender at the initial weights against eager's; max abs "
         "difference over all parameters, and that over the largest eager gradient. Eager's row (f64): eager's own "
         "float32 gradients against a float64 copy of the model, the scale at which the others are read."),
        ("- Peers: per-block checkpoint = `torch.utils.checkpoint.checkpoint(block, use_reentrant=False)` around "
         "every repeated block (children of a ModuleList/Sequential of one block class: transformer layers, "
         "ResNet bottlenecks, ViT blocks); inductor f = `torch.compile` with Inductor's `compile_fx` under "
         "`torch._functorch.config.activation_memory_budget = f` (one backend object per budget so that dynamo "
         "does not reuse one budget's graph for another). fxforge-inductor = fxforge's plan for the same budget "
         "(`target=\"inductor\"`), its forward and backward graphs compiled by Inductor (`compile_fx_inner`, "
         "random ops on ATen's kernels; layout optimization on where the plan's check measures its step, the CPU; "
         "off before commit 30d7319; float32 matrix products on oneDNN where they measured faster than torch's "
         "BLAS, from commit d728014)."),
        "",
        ("Prediction (`fxforge.training_memory(model, inputs, optimizer=torch.optim.AdamW)`) against its measured "
         "step (`tm.measure()`: the CPU allocator's records; fxforge's dispatch tracker before 2026-11-25):"),
        "",
        report.markdown_table(result.get("predictions", []), PREDICTION_COLUMNS),
        "",
        "Contenders under budgets:",
        "",
        report.markdown_table(result["rows"], COLUMNS),
        "",
    ]
    if result.get("summary"):
        lines += [*result["summary"], ""]
    return "\n".join(lines)


def write_markdown(path: str, result: dict[str, Any]) -> None:
    """Replace this section's block of ``path`` (appended if missing); the rest is kept byte for byte."""
    report.write_block(path, markdown_block(result), NAME)
