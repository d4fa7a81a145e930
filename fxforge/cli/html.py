"""``--report report.html``: one self-contained HTML file (inline CSS and SVG; nothing fetched).

It holds the summary table, the refusals, the rewrite report (every match with the user's source line,
autotune's choices, near misses: :meth:`fxforge.Report._repr_html_`) and the graph pictures.

Example:
    >>> from fxforge.cli.summary import Summary
    >>> from fxforge.core.report import Report
    >>> page = render_html(Summary("Net", "2x8", Report(method="fx")), {"captured": "<svg></svg>"})
    >>> page.startswith("<!DOCTYPE html>"), "<svg></svg>" in page, "http" in page
    (True, True, False)
"""

from __future__ import annotations

import datetime
import html

from fxforge.cli.summary import Summary

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: left; vertical-align: top; font-size: 14px; }
th { background: #f3f3f3; }
td:first-child { white-space: nowrap; }
h1 { font-size: 1.4em; } h2 { font-size: 1.2em; margin-top: 1.5em; }
.graph { overflow: auto; border: 1px solid #ddd; padding: 0.5em; margin-bottom: 1em; }
.graph svg { max-width: none; }
pre { background: #f7f7f7; padding: 0.5em; overflow: auto; }
.busy { background: #fff3cd; border: 1px solid #e0c060; padding: 0.5em; }
"""


def _table(header: list[str] | None, rows: list[tuple[str, ...]]) -> str:
    esc = html.escape
    head = "<thead><tr>" + "".join(f"<th>{esc(h)}</th>" for h in header) + "</tr></thead>" if header else ""
    body = "".join("<tr>" + "".join(f"<td>{esc(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table>{head}<tbody>{body}</tbody></table>"


def render_html(summary: Summary, pictures: dict[str, str], *, graph_text: str | None = None) -> str:
    """The report page.

    Args:
        summary: what the command did.
        pictures: caption -> SVG markup (inlined as it is).
        graph_text: a text listing of the graph, shown when there are no pictures.
    """
    esc = html.escape
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    parts = ["<!DOCTYPE html>", "<html lang='en'><head><meta charset='utf-8'>",
             f"<title>fxforge report: {esc(summary.model)}</title><style>{_STYLE}</style></head><body>",
             f"<h1>fxforge report: {esc(summary.model)}</h1><p>{esc(when)}</p>",
             *([f"<p class='busy'><b>Timings on this page are not results</b>: {esc(busy)}.</p>"]
               if (busy := summary.busy()) else []),
             "<h2>Summary</h2>", _table(None, summary.rows())]
    refused = summary.refused()
    if refused:
        parts += ["<h2>Refused</h2>", _table(["rewrite", "where", "reason"], refused)]
    if summary.notes:
        parts += ["<h2>Notes</h2><ul>", *(f"<li>{esc(n)}</li>" for n in summary.notes), "</ul>"]
    parts += ["<h2>Rewrites</h2>", summary.report._repr_html_()]
    parts.append("<h2>Graph</h2>")
    if pictures:
        parts.append("<p>Nodes the rewrites made (new nodes, fused ops, attention) are marked. Node counts are "
                     "those of the summary: nodes that compute (calls), counted in these graphs.</p>")
        for caption, svg in pictures.items():
            parts.append(f"<h3>{esc(caption)}</h3><div class='graph'>{svg}</div>")
    elif graph_text:
        parts.append(f"<p>Rewritten graph (* marks nodes the rewrites made):</p><pre>{esc(graph_text)}</pre>")
    parts.append("</body></html>")
    return "\n".join(parts)
