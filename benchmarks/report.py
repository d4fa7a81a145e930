"""Results output: ``results.json``, the harness block of ``RESULTS.md``, the machine description.

The markdown table is built from :data:`COLUMNS`, a list of :class:`Column` read left to right. A later
issue adds a column by appending one (its ``render`` reads a row dict; a contender can put whatever it
needs under ``row["info"]`` through :class:`benchmarks.contenders.Prepared`)::

    from benchmarks.report import COLUMNS, Column
    COLUMNS.insert(-1, Column("peak MiB", lambda row: fmt_float(row["info"].get("peak_mib"), 1)))

``RESULTS.md`` is shared with other sections written by hand or by other tools: the harness only replaces
the text between :data:`BEGIN` and :data:`END` and keeps everything else byte for byte. A section run
(``python -m benchmarks --suite conv``) has its own markers (:func:`markers`), so each run rewrites only
its own block.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks.log import log
from fxforge.core.disk_cache import cpu_model

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(PACKAGE_DIR)
DEFAULT_OUT = os.path.join(PACKAGE_DIR, "out")
"""Where the runners write their results-*.json."""
DEFAULT_MARKDOWN = os.path.join(PACKAGE_DIR, "RESULTS.md")
"""The results file whose blocks the runners replace."""


def add_output_options(parser, section: str) -> None:
    """A runner's ``--out``, ``--markdown`` and ``--no-markdown`` (its JSON and its block of RESULTS.md).

    Example:
        >>> import argparse; p = argparse.ArgumentParser(); add_output_options(p, "pipeline")
        >>> p.parse_args(["--no-markdown"]).out == DEFAULT_OUT
        True
    """
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help=f"directory for results-{section}.json (default benchmarks/out/)")
    add_markdown_options(parser, section)


def add_markdown_options(parser, section: str) -> None:
    """A section's ``--markdown`` and ``--no-markdown`` (its block of RESULTS.md; with ``--no-markdown`` the
    block is printed only).

    Example:
        >>> import argparse; p = argparse.ArgumentParser(); add_markdown_options(p, "zoo")
        >>> p.parse_args([]).markdown == DEFAULT_MARKDOWN
        True
    """
    parser.add_argument("--markdown", default=DEFAULT_MARKDOWN, help=f"markdown file whose {section} block is replaced "
                        "(default benchmarks/RESULTS.md)")
    parser.add_argument("--no-markdown", action="store_true", help="do not write the markdown file")

BEGIN = "<!-- harness:begin -->"
END = "<!-- harness:end -->"


def markers(section: str | None = None) -> tuple[str, str]:
    """The begin and end markers of a section's block (:data:`BEGIN`, :data:`END` for the main run)."""
    if not section:
        return BEGIN, END
    return f"<!-- harness:{section}:begin -->", f"<!-- harness:{section}:end -->"

SKELETON = f"""# fxforge benchmark results

Every number here is a ratio against a peer measured in the same run (interleaved repetitions, medians).
The block between the harness markers below is rewritten by `python -m benchmarks` (see
`benchmarks/timed.py`); text outside the markers is kept as is, so other sections can live here.

{BEGIN}
_No harness run recorded yet: run `python -m benchmarks`._
{END}
"""


# --------------------------------------------------------------------------------------------------
# formatting


def fmt_float(value: float | None, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{value:.{digits}f}"


def fmt_ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def fmt_err(value: float | None) -> str:
    if value is None:
        return "—"
    if value == 0:
        return "0"
    return f"{value:.1e}"


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def md_cell(text: str, limit: int = 160) -> str:
    """One line, no pipes, at most ``limit`` characters: safe inside a markdown table cell."""
    line = " ".join(str(text).split())
    if len(line) > limit:
        line = line[: limit - 1] + "…"
    return line.replace("|", "\\|")


def note_of(row: dict[str, Any]) -> str:
    if row.get("error"):
        first = str(row["error"]).strip().splitlines()[0] if str(row["error"]).strip() else "failed"
        return f"**failed** ({row.get('stage', '?')}): {first}"
    note = row.get("note") or ""
    median, iqr = row.get("median_ms"), row.get("iqr_ms")
    if median and iqr is not None and row.get("n_calls", 0) >= 8 and iqr > NOISY_IQR * median:
        note = f"{note}; noisy (IQR {100 * iqr / median:.0f}% of median)" if note else (
            f"noisy (IQR {100 * iqr / median:.0f}% of median)"
        )
    return note


NOISY_IQR = 0.25
"""A row whose inter-quartile range exceeds this fraction of its median gets a "noisy" note."""


@dataclass(frozen=True)
class Column:
    """A column of the markdown table: a header and ``render(row) -> str``."""

    header: str
    render: Callable[[dict[str, Any]], str]
    align: str = "left"  # "left" | "right"


COLUMNS: list[Column] = [
    Column("model", lambda r: r["model"]),
    Column("contender", lambda r: r["contender"]),
    Column("median ms", lambda r: fmt_float(r.get("median_ms"), 3), "right"),
    Column("× vs eager", lambda r: fmt_ratio(r.get("ratio_vs_eager")), "right"),
    Column("prepare s", lambda r: fmt_float(r.get("prepare_s"), 2), "right"),
    Column("max abs err", lambda r: fmt_err(r.get("max_abs_err")), "right"),
    Column("note", note_of),
]


def fmt_mib(nbytes: float | None, digits: int = 1) -> str:
    return "—" if nbytes is None else f"{nbytes / 2**20:.{digits}f}"


MEMORY_COLUMN = Column("peak MiB", lambda r: fmt_mib(r.get("peak_bytes")), "right")
"""Added before "note" in runs that measured memory (see :func:`table_columns`)."""


def table_columns(rows: list[dict[str, Any]], memory: bool | None = None) -> list[Column]:
    """:data:`COLUMNS`, with :data:`MEMORY_COLUMN` before the last one when the run measured memory.

    ``memory=None``: when any row has a ``peak_bytes`` figure.
    """
    if memory is None:
        memory = any("peak_bytes" in r for r in rows)
    return [*COLUMNS[:-1], MEMORY_COLUMN, COLUMNS[-1]] if memory else list(COLUMNS)


def markdown_table(rows: list[dict[str, Any]], columns: list[Column] | None = None) -> str:
    columns = COLUMNS if columns is None else columns
    head = "| " + " | ".join(c.header for c in columns) + " |"
    rule = "|" + "|".join("---:" if c.align == "right" else "---" for c in columns) + "|"
    body = ["| " + " | ".join(md_cell(c.render(r)) for c in columns) + " |" for r in rows]
    return "\n".join([head, rule, *body])


# --------------------------------------------------------------------------------------------------
# section summaries (lines under a section's table, computed from its rows)


def geometric_mean(values: Any) -> float | None:
    values = [v for v in values if v is not None and v > 0]
    return statistics.geometric_mean(values) if values else None


def row_models(rows: list[dict[str, Any]]) -> list[str]:
    """The models of ``rows``, in order of first appearance."""
    return list(dict.fromkeys(r["model"] for r in rows))


def timed_rows(rows: list[dict[str, Any]], contender: str) -> dict[str, dict[str, Any]]:
    """model -> the row of ``contender`` that ran and matched eager's outputs (status ok, with a median)."""
    return {
        r["model"]: r for r in rows
        if r["contender"] == contender and r.get("status") == "ok" and r.get("median_ms")
    }


def verdict(met: bool) -> str:
    return "met" if met else "**not met**"


def conv_summary(
    rows: list[dict[str, Any]],
    *,
    contender: str = "fxforge",
    peer: str = "optimize_for_inference",
    prepare_model: str = "hf_resnet50",
    min_geomean: float = 1.2,
    max_prepare_s: float = 2.0,
) -> list[str]:
    """The conv section's summary (issue 3's targets), one markdown bullet per line.

    1. geometric mean of ``contender``'s × vs eager over the models it was timed on (target
       ``>= min_geomean``); the models it was not timed on (failed, mismatched) are named;
    2. the models where it is slower than eager (× < 1), and those it was not timed on (target: none);
    3. geometric mean of ``peer ms / contender ms`` over the models where both were timed (target > 1);
    4. its prepare (optimize) time on ``prepare_model`` (target ``< max_prepare_s``).
    """
    models = row_models(rows)
    ours, theirs = timed_rows(rows, contender), timed_rows(rows, peer)
    ratios = {m: ours[m]["ratio_vs_eager"] for m in models if m in ours and ours[m].get("ratio_vs_eager")}
    untimed = [m for m in models if m not in ratios]
    return [
        _geomean_line(contender, ratios, untimed, len(models), min_geomean),
        _slower_line(contender, ratios, untimed),
        _peer_line(contender, peer, ours, theirs, models),
        _prepare_line(contender, rows, prepare_model, max_prepare_s),
    ]


def _geomean_line(
    contender: str, ratios: dict[str, float], untimed: list[str], n_models: int, target: float
) -> str:
    gm = geometric_mean(ratios.values())
    line = (
        f"- {contender} × vs eager, geometric mean over {len(ratios)} of {plural(n_models, 'model')}: "
        f"{fmt_ratio(gm)} (target ≥ {target:.2f}×: {verdict(gm is not None and gm >= target)})"
    )
    return line + (f"; not timed on {', '.join(untimed)}" if untimed else "")


def _slower_line(contender: str, ratios: dict[str, float], untimed: list[str]) -> str:
    slower = [f"{m} {fmt_ratio(r)}" for m, r in ratios.items() if r < 1.0]
    line = f"- {contender} slower than eager (× < 1.00) on: {', '.join(slower) or 'none'}"
    line += f"; not timed on {', '.join(untimed)}" if untimed else ""
    return line + f" (target: no model: {verdict(not slower and not untimed)})"


def _peer_line(
    contender: str,
    peer: str,
    ours: dict[str, dict[str, Any]],
    theirs: dict[str, dict[str, Any]],
    models: list[str],
) -> str:
    both = [m for m in models if m in ours and m in theirs]
    gm = geometric_mean(theirs[m]["median_ms"] / ours[m]["median_ms"] for m in both)
    line = (
        f"- {contender} vs {peer} ({peer} ms / {contender} ms), geometric mean over the "
        f"{plural(len(both), 'model')} where both ran: {fmt_ratio(gm)} "
        f"(target > 1.00×: {verdict(gm is not None and gm > 1.0)})"
    )
    no_peer = [m for m in models if m not in theirs]
    return line + (f"; {peer} did not run on {', '.join(no_peer)}" if no_peer else "")


COLD_CONTENDER = "fxforge (new process)"
"""The contender name of :func:`benchmarks.optimize_time.cold_row`'s row: a first-time optimize, new process."""


def _prepare_line(contender: str, rows: list[dict[str, Any]], model: str, target: float) -> str:
    """The optimize-time target's line: judged on the first-time optimize in new processes where the run has
    that row (the in-run prepare time, after other contenders grew the process, is quoted beside it)."""
    head = f"- {contender} optimize time (prepare s) on {model}:"
    row = next((r for r in rows if r["model"] == model and r["contender"] == contender), None)
    cold = next((r for r in rows if r["model"] == model and r["contender"] == COLD_CONTENDER), None)
    if row is None and cold is None:
        return f"{head} not in this run"
    in_run = row.get("prepare_s") if row is not None else None
    if cold is not None:
        runs = len(cold.get("cold_runs_s") or []) or "?"
        beside = f"; {in_run:.2f} s inside this run's process" if in_run is not None else ""
        return (f"{head} {cold['prepare_s']:.2f} s, first use in a new process (median of {runs}){beside} "
                f"(target < {target:g} s: {verdict(cold['prepare_s'] < target)})")
    if in_run is None:
        failed = f"{contender} failed ({row.get('stage') or '?'})"
        return f"{head} — {failed} (target < {target:g} s: {verdict(False)})"
    return f"{head} {in_run:.2f} s (target < {target:g} s: {verdict(in_run < target)})"


def seq_models(rows: list[dict[str, Any]], prefix: str) -> dict[int, str]:
    """Sequence length -> model name, for the models of ``rows`` named ``<prefix>_s<S>``, by S."""
    found = {}
    for model in row_models(rows):
        head, _, seq = model.rpartition("_s")
        if head == prefix and seq.isdigit():
            found[int(seq)] = model
    return dict(sorted(found.items()))


def growth_exponent(seq_a: int, peak_a: float | None, seq_b: int, peak_b: float | None) -> float | None:
    """``k`` such that peak ∝ S^k between two sequence lengths (1: linear, 2: quadratic); None if unknown.

    Example:
        >>> growth_exponent(1024, 10.0, 2048, 40.0)
        2.0
    """
    if not peak_a or not peak_b or seq_a == seq_b:
        return None
    return math.log(peak_b / peak_a) / math.log(seq_b / seq_a)


def quadratic_term(points: list[tuple[int, float]]) -> float | None:
    """The S² coefficient of ``peak = a + b·S + c·S²`` through the three longest ``(S, peak)`` points.

    Divided by 4 bytes it counts the float32 S x S matrices the peak holds (eager attention holds a few per
    head; a fused attention none). None with fewer than three points.

    Example:
        >>> quadratic_term([(1, 6.0), (2, 17.0), (4, 57.0)])  # 1 + 2 S + 3 S^2
        3.0
    """
    if len(points) < 3:
        return None
    (x1, y1), (x2, y2), (x3, y3) = sorted(points)[-3:]
    return ((y3 - y2) / (x3 - x2) - (y2 - y1) / (x2 - x1)) / (x3 - x1)


def _peak(rows_by_model: dict[str, dict[str, Any]], model: str) -> float | None:
    row = rows_by_model.get(model)
    return None if row is None else row.get("peak_bytes")


def attention_summary(
    rows: list[dict[str, Any]],
    *,
    contender: str = "fxforge",
    encoder: str = "bert",
    decoder: str = "llama",
    min_speedup: float = 2.0,
    max_matrices: float = 0.5,
    max_exponent: float = 1.5,
    memory_contender: str = "fxforge-attention",
) -> list[str]:
    """The attention section's summary (issue 4's targets), one markdown bullet per line.

    Models are named ``<encoder>_s<S>`` and ``<decoder>_s<S>``; figures come from rows that ran and matched
    eager's outputs (status ok).

    1. ``contender``'s × vs eager on the encoder at its longest S (target ``>= min_speedup``), and its
       speed against torch.compile there;
    2. one line per contender: the encoder's peak memory at every S, and its growth from one S to the next;
    3. whether attention memory is still O(S²), read off ``memory_contender`` where the run has it
       (fxforge with the attention rewrite alone, so autotune's other choices, which may differ from one
       S to the next, do not move the fit), else ``contender``: with three or more S, the S² term of its peak
       (:func:`quadratic_term`) counted in float32 S x S matrices (target ``< max_matrices``: no S x S
       matrix is held at the peak; kernels' block-sized buffers move the fit by ~0.1); with two, the
       exponent ``k`` of peak ∝ S^k between them (target ``k < max_exponent``). Also its growth between the
       two longest S against eager's, and its peak against eager's at the longest S;
    4. the decoder at each S: × vs eager and peak memory of every contender (the issue sets no target).
    """
    enc = seq_models(rows, encoder)
    if not enc:
        return [f"- no {encoder}_s<S> model in this run"]
    contenders = list(dict.fromkeys(r["contender"] for r in rows))
    ok = {c: timed_rows(rows, c) for c in contenders}
    lines = [_speedup_line(rows, ok, contender, enc[max(enc)], min_speedup)]
    lines += _peak_lines(ok, contenders, encoder, enc)
    memory = memory_contender if ok.get(memory_contender) else contender
    lines.append(_growth_line(ok, memory, enc, max_matrices, max_exponent))
    lines += [_decoder_line(ok, contenders, model) for model in seq_models(rows, decoder).values()]
    return lines


def onnx_summary(
    rows: list[dict[str, Any]],
    *,
    contender: str = "fxforge-ort",
    peer: str = "ort",
    attention_prefixes: tuple[str, ...] = ("bert", "llama"),
    min_attention_seq: int = 1024,
    min_attention_speedup: float = 1.2,
) -> list[str]:
    """The ONNX section's summary (issue 6's targets), one markdown bullet per line.

    1. per model: ``contender`` ms / ``peer`` ms as a speed ratio (> 1: fxforge's export runs faster in
       ORT), and against ORT's transformers optimizer where it ran;
    2. never slower than the plain export (every ratio >= 1, within the run's noise: rows the harness
       marks noisy are named);
    3. ``>= min_attention_speedup`` on the attention models (``<prefix>_s<S>``) at S >= ``min_attention_seq``.
    """
    ours, plain = timed_rows(rows, contender), timed_rows(rows, peer)
    optimizer = timed_rows(rows, "ort-transformers-optimizer")
    ratios: dict[str, float] = {}
    lines = []
    for model in row_models(rows):
        if model not in ours or model not in plain:
            lines.append(f"- {model}: {contender} or {peer} did not run")
            continue
        ratios[model] = plain[model]["median_ms"] / ours[model]["median_ms"]
        line = f"- {model}: {peer} ms / {contender} ms = {fmt_ratio(ratios[model])}"
        if model in optimizer:
            line += (f"; ORT transformers optimizer ms / {contender} ms = "
                     f"{fmt_ratio(optimizer[model]['median_ms'] / ours[model]['median_ms'])}")
        lines.append(line)
    if ratios:
        # Where ORT optimizes both exports into the same graph (same digest of ops, attributes, wiring and
        # shapes), it runs the same kernels: a ratio below 1 there is timing noise, not a slower export.
        def digest(row: dict[str, Any]) -> str | None:
            return (row.get("info") or {}).get("optimized_graph")

        same = {m for m in ratios if digest(ours[m]) is not None and digest(ours[m]) == digest(plain[m])}
        slower = {m: r for m, r in ratios.items() if r < 1.0 and m not in same}
        slowest = min(ratios, key=ratios.__getitem__)
        line = f"- {contender} never slower than {peer}: slowest {slowest} {fmt_ratio(ratios[slowest])}"
        level = sorted(m for m in same if ratios[m] < 1.0)
        if level:
            line += (f"; ORT optimizes both exports of {', '.join(level)} into the same graph (same kernels on the "
                     "same shapes), so its ratio below 1.00× is timing noise")
        lines.append(f"{line} ({verdict(not slower)})")
    attention = {m: r for m, r in ratios.items()
                 if any(m.startswith(p + "_s") for p in attention_prefixes)
                 and int(m.rpartition("_s")[2]) >= min_attention_seq}
    if attention:
        worst = min(attention, key=attention.__getitem__)
        lines.append(f"- attention models at S ≥ {min_attention_seq}: {contender} vs {peer} "
                     f"{', '.join(f'{m} {fmt_ratio(r)}' for m, r in attention.items())} "
                     f"(target ≥ {min_attention_speedup:.2f}×: {verdict(attention[worst] >= min_attention_speedup)})")
    return lines


def _speedup_line(rows: list[dict[str, Any]], ok: dict[str, dict[str, dict[str, Any]]], contender: str,
                  model: str, target: float) -> str:
    head = f"- {contender} × vs eager on {model}:"
    row = ok.get(contender, {}).get(model)
    if row is None or not row.get("ratio_vs_eager"):
        failed = next((r for r in rows if r["model"] == model and r["contender"] == contender), None)
        why = f"{contender} {failed.get('status')} ({failed.get('stage') or '?'})" if failed else "not in this run"
        return f"{head} — {why} (target ≥ {target:.2f}×: {verdict(False)})"
    ratio = row["ratio_vs_eager"]
    line = f"{head} {fmt_ratio(ratio)} (target ≥ {target:.2f}×: {verdict(ratio >= target)})"
    compiled = ok.get("torch.compile", {}).get(model)
    if compiled and contender != "torch.compile":
        line += f"; torch.compile ms / {contender} ms = {fmt_ratio(compiled['median_ms'] / row['median_ms'])}"
    return line


def _peak_lines(ok: dict[str, dict[str, dict[str, Any]]], contenders: list[str], encoder: str,
                enc: dict[int, str]) -> list[str]:
    lines = []
    for c in contenders:
        peaks = [_peak(ok[c], model) for model in enc.values()]
        if all(p is None for p in peaks):
            continue
        steps = [f"×{b / a:.2f}" if a and b else "—" for a, b in itertools.pairwise(peaks)]
        line = (f"- {c} peak memory on {encoder}, S = {' / '.join(map(str, enc))}: "
                f"{' / '.join(fmt_mib(p) for p in peaks)} MiB")
        lines.append(line + (f" (growth from one S to the next: {', '.join(steps)})" if steps else ""))
    return lines


def _growth_line(ok: dict[str, dict[str, dict[str, Any]]], contender: str, enc: dict[int, str],
                 max_matrices: float, max_exponent: float) -> str:
    head = f"- {contender} attention memory no longer O(S²):"
    if len(enc) < 2:
        return f"{head} one sequence length only, no growth to measure"
    ours, eager = ok.get(contender, {}), ok.get("eager", {})
    s_a, s_b = list(enc)[-2:]
    peak_a, peak_b = _peak(ours, enc[s_a]), _peak(ours, enc[s_b])
    k = growth_exponent(s_a, peak_a, s_b, peak_b)
    if k is None:
        return f"{head} — no peak memory at S = {s_a} and {s_b} ({verdict(False)})"

    def matrices(rows: dict[str, dict[str, Any]]) -> float | None:
        points = [(seq, _peak(rows, model)) for seq, model in enc.items()]
        points = [(seq, peak) for seq, peak in points if peak is not None]
        c = quadratic_term(points)
        return None if c is None else c / 4  # float32 S x S matrices

    ours_m, eager_m = matrices(ours), matrices(eager)
    growth = f"peak ×{peak_b / peak_a:.2f} from S = {s_a} to {s_b} (S^{k:.2f}"
    k_eager = growth_exponent(s_a, _peak(eager, enc[s_a]), s_b, _peak(eager, enc[s_b]))
    if k_eager is not None:
        growth += f"; eager ×{_peak(eager, enc[s_b]) / _peak(eager, enc[s_a]):.2f}, S^{k_eager:.2f}"
    growth += ")"
    if ours_m is None:
        line = f"{head} {growth[:-1]}; target k < {max_exponent:g}: {verdict(k < max_exponent)})"
    else:
        eager_part = f"eager {round(eager_m, 2) + 0.0:.2f}; " if eager_m is not None else ""
        line = (f"{head} quadratic term of the peak, fitted over S = {' / '.join(map(str, enc))}: "
                f"{round(ours_m, 2) + 0.0:.2f} float32 S×S matrices ({eager_part}"
                f"target < {max_matrices:g}: {verdict(ours_m < max_matrices)}); {growth}")
    eager_b = _peak(eager, enc[s_b])
    if eager_b:
        line += f"; {contender} peak / eager peak at S = {s_b}: {peak_b / eager_b:.2f}×"
    return line


def _decoder_line(ok: dict[str, dict[str, dict[str, Any]]], contenders: list[str], model: str) -> str:
    parts = []
    for c in contenders:
        row = ok[c].get(model)
        if row is None:
            parts.append(f"{c} not timed")
            continue
        text = f"{c} {fmt_ratio(row.get('ratio_vs_eager'))}"
        if row.get("peak_bytes") is not None:
            text += f", {fmt_mib(row['peak_bytes'])} MiB"
        parts.append(text)
    return f"- {model} (× vs eager, peak memory; no target): {'; '.join(parts)}"


# --------------------------------------------------------------------------------------------------
# machine


def _version(module: str) -> str | None:
    try:
        mod = __import__(module)
    except ImportError:
        return None
    return getattr(mod, "__version__", "?")


def machine_info(threads: int) -> dict[str, Any]:
    """What the header says about the machine and the software."""
    import torch

    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "onnxruntime": _version("onnxruntime"),
        "onnx": _version("onnx"),
        "transformers": _version("transformers"),
        "threads": threads,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        info["affinity"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        pass
    info["loadavg_start"] = load_average()
    return info


def git_commit() -> str | None:
    """The short commit of the repository, `` (dirty)`` when tracked files differ from it; None without git."""
    try:
        sha = subprocess.run(
            ["git", "-C", REPO_ROOT, "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", REPO_ROOT, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{sha}{' (dirty)' if dirty else ''}" if sha else None


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages: other work on the machine shows up as noise in the timings."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def load_line(machine: dict[str, Any], meta: dict[str, Any]) -> str:
    def fmt(load: list[float] | None) -> str:
        return "n/a" if not load else " / ".join(f"{x:.2f}" for x in load)

    line = f"- Load average (1/5/15 min): {fmt(machine.get('loadavg_start'))} at start"
    if meta.get("loadavg_end"):
        line += f", {fmt(meta['loadavg_end'])} at end"
    return line + " (other work on the machine is timing noise)"


def threads_line(machine: dict[str, Any], meta: dict[str, Any]) -> str:
    line = f"- Threads: torch.set_num_threads({machine['threads']})"
    contenders = meta.get("contenders")
    if contenders is None or "ort" in contenders:
        line += "; ONNX Runtime intra-op threads = the same, no spinning"
    return line


MEMORY_LINE = (
    "- Peak memory: one more call per contender after the timed rounds, with every allocation and free of "
    "PyTorch's {allocator} recorded (`benchmarks/memory.py`); peak MiB = the most bytes held at once during "
    "the call above the level at its start (weights and inputs excluded, outputs included)."
)


def machine_lines(m: dict[str, Any], *, with_gpu: bool) -> list[str]:
    """The "- Machine:" and "- Software:" lines of a results block, from a run's ``machine`` record.

    Example:
        >>> machine_lines({"cpu": "x86", "cores": 2, "python": "3.11", "torch": "2.13"}, with_gpu=False)
        ['- Machine: x86, 2 logical cores', '- Software: Python 3.11, torch 2.13, onnxruntime n/a']
    """
    cores = f"{m['cores']} logical cores"
    if m.get("affinity") and m["affinity"] != m["cores"]:
        cores += f" ({m['affinity']} usable)"
    versions = f"torch {m['torch']}, onnxruntime {m.get('onnxruntime') or 'n/a'}"
    if m.get("transformers"):
        versions += f", transformers {m['transformers']}"
    gpu = f", GPU {m['cuda']}" if with_gpu and m.get("cuda") else ""
    return [f"- Machine: {m['cpu']}, {cores}{gpu}", f"- Software: Python {m['python']}, {versions}"]


def markdown_block(result: dict[str, Any]) -> str:
    """The text between the harness markers for one run (without the markers).

    ``meta["title"]`` (default "Harness run") heads the block; ``result["summary"]``, a list of
    markdown lines (a section's summary), follows the table.
    """
    meta = result["meta"]
    m = meta["machine"]
    t = meta["timing"]
    lines = [
        f"## {meta.get('title') or 'Harness run'}",
        "",
        *machine_lines(m, with_gpu=True),
        threads_line(m, meta),
        load_line(m, meta),
        f"- Date: {meta['date']}" + (f", commit {meta['commit']}" if meta.get("commit") else ""),
        f"- Command: `{meta['command']}`",
        (
            f"- Timing: {plural(t['warmup'], 'warm-up call')} per contender, then "
            f"{plural(t['rounds'], 'round')} × {plural(t['reps'], 'call')} per contender, contenders "
            "interleaved in a rotating order; median over all timed calls. "
            "× vs eager = eager ms / contender ms (> 1 is faster). prepare s = prepare + first call "
            "(export / compile / optimize). max abs err = against eager's outputs."
        ),
    ]
    if meta.get("memory"):
        allocator = "CUDA caching allocator" if str(meta.get("device", "")).startswith("cuda") else (
            "CPU allocator (torch.profiler, profile_memory=True)")
        lines.append(MEMORY_LINE.format(allocator=allocator))
    lines += ["", markdown_table(result["rows"], table_columns(result["rows"], meta.get("memory"))), ""]
    if result.get("summary"):
        lines += [*result["summary"], ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# files


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to a temporary file next to ``path`` and rename it over ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def replace_block(text: str, block: str, section: str | None = None) -> str:
    """``text`` with the block of ``section`` (default: the main harness block) replaced by ``block``.

    The block is appended when its markers are not there yet; everything else is kept byte for byte.
    """
    begin, end_marker = markers(section)
    new = f"{begin}\n{block.rstrip()}\n{end_marker}"
    start = text.find(begin)
    end = text.find(end_marker, start + len(begin)) if start >= 0 else -1
    if start >= 0 and end >= 0:
        return text[:start] + new + text[end + len(end_marker):]
    if not text.strip():
        return replace_block(SKELETON, block, section)
    return text.rstrip("\n") + "\n\n" + new + "\n"


def write_block(path: str, block: str, section: str | None = None) -> None:
    """Replace the block of ``section`` (default: the main harness block) in ``path`` with the markdown
    ``block`` (appended if missing; a missing file starts from :data:`SKELETON`); the rest is kept byte for
    byte."""
    try:
        with open(path, encoding="utf-8") as f:
            old = f.read()
    except FileNotFoundError:
        old = SKELETON
    write_atomic(path, replace_block(old, block, section))


def publish(args: Any, section: str, out: Any, runs: Any, block: str) -> None:
    """A section's results written the one way: ``runs`` as JSON at ``out``, ``block`` printed and, unless
    ``--no-markdown``, put in ``args.markdown`` between ``section``'s markers."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(runs, indent=1))
    print(block)
    if not args.no_markdown:
        write_block(args.markdown, block, section)


def finish(args: Any, block: str, section: str) -> int:
    """A section's last step: ``block`` into ``args.markdown`` between ``section``'s markers (unless
    ``--no-markdown``), then printed; the exit status, 0."""
    if not args.no_markdown:
        write_block(args.markdown, block, section)
        log(f"wrote {args.markdown}")
    print(block)
    return 0


def write_markdown(path: str, result: dict[str, Any], section: str | None = None) -> None:
    """Replace the block of ``section`` (default: the main harness block) in ``path`` with ``result``."""
    write_block(path, markdown_block(result), section)


def _json_safe(value: Any) -> Any:
    """NaN / inf become strings (JSON has no such numbers); tuples become lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_json(path: str, result: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(_json_safe(result), indent=2, default=str, allow_nan=False) + "\n")


TARGETS_PEERS = ("eager", "torch.compile", "torch.compile-inference", "ort")


def targets_summary(rows: list[dict[str, Any]], *, contender: str = "fxforge-auto",
                    peers: tuple[str, ...] = TARGETS_PEERS, tie: float = 0.97, min_geomean: float = 1.1) -> list[str]:
    """The targets section's summary (issue 21), one markdown bullet per line.

    1. per model: the best peer in the same run, ``best peer ms / contender ms``, the target the race chose,
       and the second optimize's prepare time (the remembered choice) against the first;
    2. ``>= tie`` on every model (a tie is noise);
    3. the geometric mean of those ratios ``>= min_geomean``.
    """
    ours = timed_rows(rows, contender)
    theirs = {peer: timed_rows(rows, peer) for peer in peers}
    ratios: dict[str, float] = {}
    lines = []
    for model in row_models(rows):
        ran = {peer: theirs[peer][model]["median_ms"] for peer in peers if model in theirs[peer]}
        if model not in ours or not ran:
            lines.append(f"- {model}: {contender} or every peer did not run")
            continue
        best = min(ran, key=ran.__getitem__)
        row = ours[model]
        ratios[model] = ran[best] / row["median_ms"]
        info = row.get("info") or {}
        second = info.get("second_prepare_s")
        again = (f"; second optimize {second:.2f} s vs {row['prepare_s']:.1f} s"
                 + (" (remembered)" if info.get("second_remembered") else " (raced again)")) if second is not None else ""
        lines.append(f"- {model}: best peer {best}; {best} ms / {contender} ms = {fmt_ratio(ratios[model])}; "
                     f"chose {info.get('target', '?')}{again}")
    compiled, inductor = timed_rows(rows, "fxforge-inductor"), theirs.get("torch.compile", {})
    both = [m for m in row_models(rows) if m in compiled and m in inductor]
    if both:
        lines.append("- do fxforge's rewrites help Inductor? torch.compile ms / fxforge-inductor ms: " + ", ".join(
            f"{m} {fmt_ratio(inductor[m]['median_ms'] / compiled[m]['median_ms'])}" for m in both) + "; geometric mean "
            + fmt_ratio(geometric_mean(inductor[m]["median_ms"] / compiled[m]["median_ms"] for m in both)))
    if ratios:
        worst = min(ratios, key=ratios.__getitem__)
        lines.append(f"- {contender} vs the best peer on every model: lowest {worst} {fmt_ratio(ratios[worst])} "
                     f"(target ≥ {tie:.2f}×: {verdict(ratios[worst] >= tie)})")
        gm = geometric_mean(ratios.values())
        lines.append(f"- geometric mean over the best peer, {plural(len(ratios), 'model')}: {fmt_ratio(gm)} "
                     f"(target ≥ {min_geomean:.2f}×: {verdict(gm is not None and gm >= min_geomean)})")
    return lines
