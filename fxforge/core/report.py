"""What the pipeline did, and why: applied matches, near misses, rolled-back passes.

Example:
    >>> r = Report(method="fx")
    >>> r.matches.append(Applied("cleanup", "dropout in eval", ["dropout"], "m.py:3: x = self.drop(x)"))
    >>> r.counts
    {'cleanup': 1}
"""

from __future__ import annotations

import dataclasses
import html
from collections import Counter
from typing import Any

from fxforge.core.breaks import GraphPart, share_line


@dataclasses.dataclass(frozen=True)
class Applied:
    """One application of a rewrite (the pattern engine's :class:`~fxforge.rewrites.pattern.Match` is where a
    pattern matched; this is what a pass changed).

    Attributes:
        rule: the rewrite's name (with ``stage``, a key of ``Report.counts``).
        what: a short description of the change ("dropout in eval removed").
        nodes: the names of the nodes it replaced.
        source: the user's source line of the first replaced node, where known.
        stage: the graph it was applied to: ``"fx"`` (the captured graph) or ``"onnx"`` (the exported
            ONNX graph, :mod:`fxforge.exporters.onnx_rules`).
        count: how many applications this entry stands for (an ONNX rule that says only how many).

    Example:
        >>> str(Applied("cleanup", "identity removed", ["id_1"], None))
        'cleanup: identity removed [id_1]'
        >>> str(Applied("residual_norm", "Add -> Sum", [], stage="onnx", count=9))
        'onnx residual_norm: Add -> Sum x9'
    """

    rule: str
    what: str
    nodes: list[str]
    source: str | None = None
    stage: str = "fx"
    count: int = 1

    @property
    def key(self) -> str:
        """The rule as ``Report.counts`` names it: ``rule`` for fx rewrites, ``"onnx residual_norm"`` for
        the others.

        Example:
            >>> Applied("cleanup", "x", []).key, Applied("rotary", "x", [], stage="onnx").key
            ('cleanup', 'onnx rotary')
        """
        return stage_key(self.rule, self.stage)

    def __str__(self) -> str:
        where = f"  ({self.source})" if self.source else ""
        nodes = f" [{', '.join(self.nodes)}]" if self.nodes or self.stage == "fx" else ""
        times = f" x{self.count}" if self.count != 1 else ""
        return f"{self.key}: {self.what}{nodes}{times}{where}"


def collapsed_matches(matches: list[Applied]) -> list[str]:
    """One line per change and source line: the changes a rule made at one line of the user's code (each block
    of a U-Net's ``F.relu(self.bn1(self.conv1(x)))``) on one line, with how many and the nodes of each;
    in the order of each group's first change.

    Example:
        >>> same = [Applied("conv_bn_fold", "conv2d + batch_norm", [f"conv{i}", f"bn{i}"], "m.py:3: y = f(x)")
        ...         for i in range(3)]
        >>> collapsed_matches(same + [Applied("cleanup", "identity removed", ["id_1"])])
        ['conv_bn_fold: conv2d + batch_norm x3 [conv0, bn0; conv1, bn1; conv2, bn2]  (m.py:3: y = f(x))', 'cleanup: identity removed [id_1]']
    """
    groups: dict[tuple, list[Applied]] = {}
    for match in matches:
        groups.setdefault((match.key, match.what, match.source), []).append(match)
    lines = []
    for group in groups.values():
        if len(group) == 1:
            lines.append(str(group[0]))
            continue
        first = group[0]
        where = f"  ({first.source})" if first.source else ""
        nodes = f" [{'; '.join(', '.join(m.nodes) for m in group)}]" if any(m.nodes for m in group) else ""
        lines.append(f"{first.key}: {first.what} x{sum(m.count for m in group)}{nodes}{where}")
    return lines


def stage_key(rule: str, stage: str) -> str:
    """How a rule of ``stage`` is named in the report: fx rewrites by their name, others prefixed with the
    stage.

    Example:
        >>> stage_key("attention", "fx"), stage_key("transpose_pairs", "onnx")
        ('attention', 'onnx transpose_pairs')
    """
    return rule if stage == "fx" else f"{stage} {rule}"


@dataclasses.dataclass(frozen=True)
class NearMiss:
    """A place where a rewrite almost applied, and the reason it refused.

    Attributes:
        rule, node, reason, source: the rule, the node it refused at (may be empty), why, the user's line.
        stage: as :attr:`Applied.stage`.

    Example:
        >>> str(NearMiss("cleanup", "to", "dtype changes", None))
        'cleanup refused at to: dtype changes'
        >>> str(NearMiss("rotary", "", "head size 8", stage="onnx"))
        'onnx rotary refused: head size 8'
    """

    rule: str
    node: str
    reason: str
    source: str | None = None
    stage: str = "fx"

    def __str__(self) -> str:
        where = f"  ({self.source})" if self.source else ""
        at = f" at {self.node}" if self.node else ""
        return f"{stage_key(self.rule, self.stage)} refused{at}: {self.reason}{where}"


@dataclasses.dataclass(frozen=True)
class RolledBack:
    """A pass whose output differed from the graph before it, so it was undone.

    Example:
        >>> str(RolledBack("bad", 3, "on example inputs: output: max abs error 2 exceeds tolerance 1e-05"))
        'bad rolled back (3 matches): on example inputs: output: max abs error 2 exceeds tolerance 1e-05'
    """

    rule: str
    matches: int
    error: str

    def __str__(self) -> str:
        return f"{self.rule} rolled back ({self.matches} matches): {self.error}"


@dataclasses.dataclass(frozen=True)
class Tuning:
    """One choice autotune made (a fused op's kernel, the layout, or keeping the fused graph at all).

    Attributes:
        rule: the pass that asked (``"conv_activation"``).
        subject: a node name, ``"layout"`` or ``"graph"``.
        choice: what was kept (``"mkldnn"``, ``"channels-last"``, ``"fused"``, ``"before"``...).
        timings: candidate -> median milliseconds, measured in the same run (or another figure, in ``unit``).
        note: why, or why some candidates could not run.
        unit: the unit of ``timings`` (``"ms"``; ``memory_reorder`` records simulated peaks in ``"MiB"``).
        kind: what made the choice (``"autotune"``; ``"schedule"`` for ``memory_reorder``).

    Example:
        >>> str(Tuning("conv_activation", "conv_1", "mkldnn", {"mkldnn": 0.5, "composite": 0.75}))
        'conv_activation autotune conv_1: mkldnn (mkldnn 0.5 ms, composite 0.75 ms)'
        >>> str(Tuning("memory_reorder", "graph", "exact search", {"before": 2.0}, unit="MiB", kind="schedule"))
        'memory_reorder schedule graph: exact search (before 2 MiB)'
    """

    rule: str
    subject: str
    choice: str
    timings: dict = dataclasses.field(default_factory=dict)
    note: str = ""
    unit: str = "ms"
    kind: str = "autotune"

    def __str__(self) -> str:
        times = ", ".join(f"{k} {v:.3g} {self.unit}" for k, v in self.timings.items())
        note = f"; {self.note}" if self.note else ""
        return f"{self.rule} {self.kind} {self.subject}: {self.choice} ({times}){note}"


@dataclasses.dataclass
class Contender:
    """One contender of ``target="auto"``'s race: a target (built, checked against eager on fresh inputs and on
    inputs of new sizes eager serves, timed), or ``"eager"`` itself (the model as it is, timed in the same
    rounds).

    Attributes:
        target: ``"eager"``, ``"native"``, ``"inductor"`` or ``"onnxruntime"``.
        latency_ms: its median milliseconds per call on the example inputs (None: not timed).
        prepare_s: seconds its build took (capture, rewrites, lowering, compile or export).
        max_abs_err: its largest difference from eager on the fresh inputs.
        refused: why it did not take part (failed to build, differed from eager, served fewer inputs than
            eager, skipped by the budget or because it could not pay back its build); empty when it did.
        vs_eager: eager's latency over its own (2.0: twice as fast as eager; below 1: slower); None where
            either was not timed.
        busy: why its timing is not to be trusted as a result (the machine was busy, or its samples varied
            more than the race allows), after a re-timing; empty for a steady timing.

    Example:
        >>> str(Contender("native", 1.5, 2.0, 1e-6, vs_eager=2.0))
        'native: 1.5 ms, prepared in 2 s, max abs error 1e-06 (2.00x eager)'
        >>> str(Contender("inductor", refused="skipped: compiling would take about 90 s"))
        'inductor: skipped: compiling would take about 90 s'
        >>> str(Contender("eager", 3.0, vs_eager=1.0, busy="load 2.5 per core while timing"))
        'eager: 3 ms [busy: load 2.5 per core while timing]'
    """

    target: str
    latency_ms: float | None = None
    prepare_s: float | None = None
    max_abs_err: float | None = None
    refused: str = ""
    vs_eager: float | None = None
    busy: str = ""

    def __str__(self) -> str:
        if self.refused:
            spent = f" (after {self.prepare_s:.2g} s)" if self.prepare_s is not None else ""
            return f"{self.target}: {self.refused}{spent}"
        parts = [f"{self.latency_ms:.3g} ms" if self.latency_ms is not None else "not timed"]
        if self.prepare_s is not None:
            parts.append(f"prepared in {self.prepare_s:.2g} s")
        if self.max_abs_err is not None:
            parts.append(f"max abs error {self.max_abs_err:.3g}")
        ratio = f" ({self.vs_eager:.2f}x eager)" if self.vs_eager and self.target != "eager" else ""
        return f"{self.target}: " + ", ".join(parts) + ratio + (f" [busy: {self.busy}]" if self.busy else "")


@dataclasses.dataclass
class Race:
    """What ``target="auto"`` measured and why it chose its winner.

    Attributes:
        winner: the contender chosen: a target, or ``"eager"`` when no target was faster than eager (the
            model then runs as it is).
        why: the evidence in one sentence (its latency against eager's and the runner-up's).
        contenders: every contender, eager first, then the targets in the order built (refused ones with
            their reason).
        eager_ms: eager's median milliseconds in the same interleaved rounds.
        remembered: the choice was read from the target cache (only the winner was built and re-timed).
        load: the machine's load average per core while timing (busy timings are not remembered).
        notes: what else the race did (a remembered choice contradicted and re-raced, a timing not stored).

    Example:
        >>> race = Race("native", "fastest", [Contender("native", 1.0, 0.5, 0.0)], eager_ms=2.0)
        >>> print(race)
        target auto: native (fastest); eager 2 ms
          native: 1 ms, prepared in 0.5 s, max abs error 0
        >>> race.busy, [c.target for c in race.refused]
        ('', [])
    """

    winner: str
    why: str
    contenders: list[Contender] = dataclasses.field(default_factory=list)
    eager_ms: float | None = None
    remembered: bool = False
    load: float | None = None
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def busy(self) -> str:
        """Why the race's timings are not to be trusted as results (the first busy contender's mark, eager's
        included), or ""."""
        return next((f"{c.target}: {c.busy}" for c in self.contenders if c.busy), "")

    @property
    def refused(self) -> list[Contender]:
        """The contenders that did not take part, each with its reason."""
        return [c for c in self.contenders if c.refused]

    def __str__(self) -> str:
        head = f"target auto: {self.winner} ({self.why})"
        if self.eager_ms is not None:
            head += f"; eager {self.eager_ms:.3g} ms"
        return "\n".join([head, *(f"  {c}" for c in self.contenders), *(f"  note: {n}" for n in self.notes)])


_MEMORY_UNITS = ("B", "KiB", "MiB", "GiB", "kB", "MB", "GB")


def _figures(tuning: Tuning) -> tuple[str, str]:
    """A choice's figures as ``(timings, memory)`` table cells, each with its unit: times go in the first,
    bytes (``memory_reorder``'s simulated peaks) in the second.

    Example:
        >>> _figures(Tuning("conv_activation", "conv_1", "mkldnn", {"mkldnn": 0.5}))
        ('mkldnn 0.5 ms', '')
        >>> _figures(Tuning("memory_reorder", "graph", "kept", {"before": 2.0}, unit="MiB", kind="schedule"))
        ('', 'before 2 MiB')
    """
    text = ", ".join(f"{k} {v:.3g} {tuning.unit}" for k, v in tuning.timings.items())
    return ("", text) if tuning.unit in _MEMORY_UNITS else (text, "")


def grouped_opaque(opaque: list) -> list[tuple[Any, list[str]]]:
    """Opaque modules grouped by type, reason and source line, in first-seen order: ``(the first, every
    name)`` (a model with fifty layers of one kind opaque for one reason gets one line, not fifty).

    Example:
        >>> from types import SimpleNamespace as M
        >>> [(o.name, names) for o, names in grouped_opaque([M(name="a", type="T", reason="r", source=None),
        ...                                                  M(name="b", type="T", reason="r", source=None)])]
        [('a', ['a', 'b'])]
    """
    groups: dict[tuple, tuple[Any, list[str]]] = {}
    for item in opaque:
        key = (item.type, item.reason, item.source)
        groups.setdefault(key, (item, []))[1].append(item.name)
    return list(groups.values())


def _names(names: list[str], shown: int = 3) -> str:
    """``a, b, c and 4 more``."""
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


@dataclasses.dataclass
class Report:
    """Everything the capture and the rewrites did to a model, in order.

    ``counts`` maps rule names to applications that were kept; ``str()`` is a readable summary and
    ``_repr_html_`` renders tables in Jupyter.

    Example:
        >>> print(Report(method="export", nodes_before=10, nodes_after=8))
        fxforge report: captured with export; 10 -> 8 nodes
          no rewrite applied
    """

    method: str = ""
    opaque: list = dataclasses.field(default_factory=list)
    meta_source: str = ""
    matches: list[Applied] = dataclasses.field(default_factory=list)
    near_misses: list[NearMiss] = dataclasses.field(default_factory=list)
    rolled_back: list[RolledBack] = dataclasses.field(default_factory=list)
    verified: list[str] = dataclasses.field(default_factory=list)
    tuning: list[Tuning] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    nodes_before: int = 0
    nodes_after: int = 0
    race: Race | None = None
    breaks: list = dataclasses.field(default_factory=list)
    graphs: list = dataclasses.field(default_factory=list)
    flop_share: float | None = None
    time_share: float | None = None
    throughput: Any = None  # a ThroughputTable (fxforge.core.throughput) where objective="throughput" chose

    @property
    def counts(self) -> dict[str, int]:
        """Applications kept per rule, e.g. ``{"cleanup": 3}``; ONNX rules prefixed: ``{"onnx residual_norm": 9}``."""
        counts: Counter[str] = Counter()
        for m in self.matches:
            counts[m.key] += m.count
        return dict(counts)

    def add_graph(self, part: Report, lines: str, ends: Any = None, calls: int = 1, flops: int = 0) -> None:
        """Add one graph between breaks to this (``method="dynamo"``) report: its rewrites, refusals, tuning and
        notes (numbered by graph) join this report's, and a :class:`~fxforge.core.breaks.GraphPart` says what it
        holds (``lines``), what ends it (``ends``: a Break or None), how often it runs per call and its FLOPs.

        Example:
            >>> whole = Report(method="dynamo")
            >>> whole.add_graph(Report(method="fx", nodes_before=5, nodes_after=4, notes=["n"]), "m.py:3-4")
            >>> print(whole.graphs[0]), whole.notes, whole.nodes_after
            graph 1 (m.py:3-4): 5 -> 4 nodes; no rewrite applied
            (None, ['graph 1: n'], 4)
        """
        number = len(self.graphs) + 1
        self.matches.extend(part.matches)
        self.near_misses.extend(part.near_misses)
        self.rolled_back.extend(part.rolled_back)
        self.verified.extend(part.verified)
        self.tuning.extend(part.tuning)
        self.notes.extend(f"graph {number}: {note}" for note in part.notes)
        self.nodes_before += part.nodes_before
        self.nodes_after += part.nodes_after
        self.graphs.append(GraphPart(number, lines, part.nodes_before, part.nodes_after, part.counts, ends, calls,
                                     flops))

    def copy(self) -> Report:
        """A copy whose lists can be extended without touching this report."""
        return dataclasses.replace(
            self,
            opaque=list(self.opaque),
            matches=list(self.matches),
            near_misses=list(self.near_misses),
            rolled_back=list(self.rolled_back),
            verified=list(self.verified),
            tuning=list(self.tuning),
            notes=list(self.notes),
            breaks=list(self.breaks),
            graphs=list(self.graphs),
            race=dataclasses.replace(self.race, contenders=list(self.race.contenders), notes=list(self.race.notes))
            if self.race is not None else None,
        )

    def __str__(self) -> str:
        lines = [f"fxforge report: captured with {self.method or '?'}; {self.nodes_before} -> {self.nodes_after} nodes"]
        for item, names in grouped_opaque(self.opaque):
            where = f" at {item.source}" if item.source else ""
            lines.append(f"  opaque: {item}" if len(names) == 1 else
                         f"  opaque: {len(names)} {item.type} modules ({_names(names)}): {item.reason}{where}")
        if self.meta_source == "real":
            lines.append("  shapes from one real run (fake propagation was impossible)")
        if self.counts:
            lines.append("  applied: " + ", ".join(f"{k} x{v}" for k, v in sorted(self.counts.items())))
        else:
            lines.append("  no rewrite applied")
        lines.extend(f"  {line}" for line in collapsed_matches(self.matches))
        if self.method == "dynamo":
            lines.append(f"  {len(self.graphs)} graphs, {len(self.breaks)} breaks"
                         + (f"; {share_line(self.flop_share, self.time_share)}" if self.flop_share is not None else ""))
            lines.extend(f"  {part}" for part in self.graphs)
            lines.extend(f"  break at {item}" for item in self.breaks)
        lines.extend(f"  {t}" for t in self.tuning)
        lines.extend(f"  ROLLED BACK {r}" for r in self.rolled_back)
        lines.extend(f"  near miss: {n}" for n in self.near_misses)
        lines.extend(f"  note: {n}" for n in self.notes)
        if self.race is not None:
            lines.extend(f"  {line}" for line in str(self.race).splitlines())
            if self.race.busy:
                lines.append(f"  the race's timings are not results ({self.race.busy}): its ratios are marks, not "
                             "measurements")
        if self.throughput is not None:
            lines.extend(f"  {line}" for line in str(self.throughput).splitlines())
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        esc = html.escape

        def table(title: str, header: list[str], rows: list[list[str]]) -> str:
            if not rows:
                return ""
            head = "".join(f"<th>{esc(h)}</th>" for h in header)
            body = "".join("<tr>" + "".join(f"<td>{esc(str(c))}</td>" for c in row) + "</tr>" for row in rows)
            return f"<h4>{esc(title)}</h4><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

        counts = ", ".join(f"{k}: {v}" for k, v in sorted(self.counts.items())) or "none"
        parts = [
            (f"<div class='fxforge-report'><b>fxforge</b>: captured with {esc(self.method)}; "
            f"{self.nodes_before} &rarr; {self.nodes_after} nodes; applied: {esc(counts)}"),
            table("Applied", ["rule", "change", "nodes", "source"],
                  [[m.key, m.what + (f" (x{m.count})" if m.count != 1 else ""), ", ".join(m.nodes), m.source or ""]
                   for m in self.matches]),
            table("Autotune and schedules", ["rule", "subject", "choice", "timings", "memory", "note"],
                  [[t.rule, t.subject, t.choice, *_figures(t), t.note] for t in self.tuning]),
            table("Rolled back", ["rule", "matches", "error"],
                  [[r.rule, r.matches, r.error] for r in self.rolled_back]),
            table("Graph breaks", ["line", "code", "reason", "fix"],
                  [[b.line, b.code, b.reason, b.fix] for b in self.breaks]),
            table("Graphs between breaks", ["graph", "lines", "nodes", "applied", "runs per call"],
                  [[g.index, g.lines, f"{g.nodes_before} -> {g.nodes_after}",
                    ", ".join(f"{k} x{v}" for k, v in sorted(g.counts.items())) or "none", g.calls]
                   for g in self.graphs]),
            table("Near misses", ["rule", "node", "reason", "source"],
                  [[stage_key(n.rule, n.stage), n.node, n.reason, n.source or ""] for n in self.near_misses]),
            "" if self.race is None or not self.race.busy else
            f"<p><b>The race's timings are not results</b> ({esc(self.race.busy)}).</p>",
            table(f"Target race: {self.race.winner} ({self.race.why})" if self.race else "",
                  ["target", "latency (ms)", "x eager", "prepare (s)", "max abs error", "refused", "busy"],
                  [[c.target, "" if c.latency_ms is None else f"{c.latency_ms:.3g}",
                    "" if c.vs_eager is None else f"{c.vs_eager:.2f}",
                    "" if c.prepare_s is None else f"{c.prepare_s:.2g}",
                    "" if c.max_abs_err is None else f"{c.max_abs_err:.3g}", c.refused, c.busy]
                   for c in (self.race.contenders if self.race else [])]),
            "" if self.race is None or not self.race.notes else
            "<ul>" + "".join(f"<li>{esc(n)}</li>" for n in self.race.notes) + "</ul>",
            table("Opaque modules", ["modules", "type", "reason", "source"],
                  [[_names(names), o.type, o.reason, o.source or ""] for o, names in grouped_opaque(self.opaque)]),
            "" if self.throughput is None else self.throughput.html(),
            "</div>",
        ]
        return "".join(parts)
