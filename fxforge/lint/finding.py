"""``Finding`` (one suspected bug or cost at one source line) and ``Findings`` (all of them for one model: a
table, printable, drawn as HTML in Jupyter).

Example:
    >>> f = Finding("reduce-size-one", "warning", "net.py", 7, "y = x.sum(1)", "sums over dim 1 of size 1",
    ...             "drop the sum", "[4, 1] float32")
    >>> print(Findings([f]))
    net.py:7: warning [reduce-size-one] sums over dim 1 of size 1
        y = x.sum(1)
        involved: [4, 1] float32
        fix: drop the sum
    1 finding: 0 errors, 1 warning, 0 info
"""

from __future__ import annotations

import dataclasses
import html
from typing import Any

SEVERITIES = ("error", "warning", "info")
"""From worst to mildest: ``error`` (almost surely a wrong result), ``warning`` (likely a bug or a real cost),
``info`` (a cost or a pattern worth a look, often intended)."""

COLUMNS = ("rule", "severity", "file", "line", "code", "message", "fix", "involved", "bytes")


@dataclasses.dataclass(frozen=True)
class Finding:
    """One finding: which rule, how bad, where in the user's source, what and why, and the fix.

    Attributes:
        rule: the rule's name (``broadcast-blowup``).
        severity: ``"error"``, ``"warning"`` or ``"info"``.
        file: the user's source file ('' where the graph recorded none).
        line: the line in it (0 where unknown).
        code: that line's code.
        message: what was found and why it is likely a bug or a cost.
        fix: what to write instead.
        involved: the shapes, dtypes and sizes involved, in words.
        bytes: bytes the finding costs per call (a copy, a grown tensor), where it has a size.

    Example:
        >>> Finding("r", "info", "m.py", 3, "x", "msg", "fix").where
        'm.py:3'
    """

    rule: str
    severity: str
    file: str
    line: int
    code: str
    message: str
    fix: str
    involved: str = ""
    bytes: int | None = None

    @property
    def where(self) -> str:
        """``file:line``, or ``(no source line)``."""
        return f"{self.file}:{self.line}" if self.file else "(no source line)"

    def __str__(self) -> str:
        text = f"{self.where}: {self.severity} [{self.rule}] {self.message}"
        if self.code:
            text += f"\n    {self.code}"
        if self.involved:
            text += f"\n    involved: {self.involved}"
        return text + f"\n    fix: {self.fix}"


def rank(severity: str) -> int:
    """0 for ``error``, 1 for ``warning``, 2 for ``info`` (sorting worst first).

    Example:
        >>> sorted(["info", "error", "warning"], key=rank)
        ['error', 'warning', 'info']
    """
    return SEVERITIES.index(severity)


class Findings:
    """Every finding of :func:`fxforge.lint` for one model, worst first, notes on how it was linted, and ``method``:
    the graph the rules read (``"export"``; ``"fx"``, a symbolic trace; ``"dynamo"``, the graphs between breaks).

    ``table`` is a pandas DataFrame (one row per finding, columns ``rule, severity, file, line, code, message,
    fix, involved, bytes``); ``print(findings)`` lists them; in Jupyter they show as an HTML table.

    Example:
        >>> findings = Findings([Finding("r", "error", "m.py", 3, "x", "bad", "fix")], notes=["captured: export"])
        >>> len(findings), findings.has_errors, list(findings.table["line"])
        (1, True, [3])
    """

    def __init__(self, findings: list[Finding], notes: list[str] | None = None, model_name: str = "",
                 method: str = ""):
        self.findings = sorted(findings, key=lambda f: (rank(f.severity), f.file, f.line, f.rule))
        self.notes = list(notes or [])
        self.model_name = model_name
        self.method = method  # the graph the rules read: "export", "fx" (a symbolic trace) or "dynamo"

    def __len__(self) -> int:
        return len(self.findings)

    def __iter__(self) -> Any:
        return iter(self.findings)

    def __getitem__(self, index: int) -> Finding:
        return self.findings[index]

    @property
    def has_errors(self) -> bool:
        """Whether any finding is at ``error`` level (the CLI then exits 1)."""
        return any(f.severity == "error" for f in self.findings)

    def above(self, severity: str = "info") -> list[Finding]:
        """The findings strictly worse than ``severity``: ``above("info")`` is the errors and warnings.

        Example:
            >>> Findings([Finding("r", "info", "", 0, "", "m", "f")]).above("info")
            []
        """
        return [f for f in self.findings if rank(f.severity) < rank(severity)]

    def rules(self) -> list[str]:
        """The names of the rules that found something, once each, worst finding first.

        Example:
            >>> Findings([Finding("b", "info", "", 0, "", "m", "f"), Finding("a", "error", "", 0, "", "m", "f")]).rules()
            ['a', 'b']
        """
        return list(dict.fromkeys(f.rule for f in self.findings))

    @property
    def table(self) -> Any:
        """One row per finding, worst first (a pandas DataFrame; ``bytes`` is a nullable integer)."""
        import pandas as pd

        frame = pd.DataFrame([dataclasses.asdict(f) for f in self.findings], columns=list(COLUMNS))
        frame["line"] = frame["line"].astype("int64")
        frame["bytes"] = frame["bytes"].astype("Int64")
        return frame

    def summary(self) -> str:
        """``3 findings: 1 error, 1 warning, 1 info``.

        Example:
            >>> Findings([]).summary()
            'no findings'
        """
        if not self.findings:
            return "no findings"
        counts = {s: sum(f.severity == s for f in self.findings) for s in SEVERITIES}
        parts = [f"{counts['error']} error{'s' * (counts['error'] != 1)}",
                 f"{counts['warning']} warning{'s' * (counts['warning'] != 1)}", f"{counts['info']} info"]
        return f"{len(self.findings)} finding{'s' * (len(self.findings) != 1)}: " + ", ".join(parts)

    def __str__(self) -> str:
        return "\n".join([*map(str, self.findings), *(f"note: {n}" for n in self.notes), self.summary()])

    def __repr__(self) -> str:
        return f"<Findings {self.model_name + ': ' if self.model_name else ''}{self.summary()}>"

    def _repr_html_(self) -> str:
        colors = {"error": "#c0392b", "warning": "#b9770e", "info": "#566573"}
        rows = []
        for f in self.findings:
            rows.append(
                f"<tr><td style='color:{colors[f.severity]}'><b>{f.severity}</b></td><td>{html.escape(f.rule)}</td>"
                f"<td><code>{html.escape(f.where)}</code><br><code>{html.escape(f.code)}</code></td>"
                f"<td>{html.escape(f.message)}<br><small>{html.escape(f.involved)}</small></td>"
                f"<td>{html.escape(f.fix)}</td></tr>")
        head = "<tr><th>severity</th><th>rule</th><th>where</th><th>what and why</th><th>fix</th></tr>"
        notes = "".join(f"<p><small>note: {html.escape(n)}</small></p>" for n in self.notes)
        title = html.escape(f"{self.model_name}: {self.summary()}" if self.model_name else self.summary())
        return f"<div><p><b>{title}</b></p><table>{head}{''.join(rows)}</table>{notes}</div>"
