"""The attention section (issue 4): ``python -m benchmarks --suite attention``.

One quick in-process section run on tiny BERT / LLaMA models (the real section's take many minutes), then
the pieces: the peak-memory column and header line, the summary lines (computed from hand-made rows) and
the suite entries.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from benchmarks import report, suite
from benchmarks.harness import main
from benchmarks.timed import TIMED

BEGIN, END = report.markers("attention")
CONV_BLOCK = "<!-- harness:conv:begin -->\nconv table | keep | me |\n<!-- harness:conv:end -->"
PROSE = "# Results\n\nHand-written text.\n\n"
TINY = {"hidden": 32, "layers": 1, "heads": 2, "vocab": 128}
# The section's 2 threads; under pytest-xdist the worker's one (conftest.py): two threads beside the other
# worker's fight it for the two cores.
THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2
SEQS = (128, 256)  # two lengths are enough to see eager's peak grow ~4x when S doubles


@pytest.fixture(scope="module")
def section_run(tmp_path_factory):
    """``--suite attention --quick`` on tiny models, with the section's contenders minus torch.compile (slow)."""
    tmp = tmp_path_factory.mktemp("attention")
    md = tmp / "RESULTS.md"
    md.write_text(f"{PROSE}{CONV_BLOCK}\n\n{BEGIN}\nstale attention table\n{END}\n", encoding="utf-8")
    by_name = {e.name: e for e in suite.SUITE}

    def tagged(name, factory):
        return suite.SuiteEntry(name, factory, "test", default=False, tags=("attention",))

    test_suite = [
        by_name["tiny_mlp"],  # not tagged: must not run
        *(tagged(f"bert_s{s}", suite.bert_encoder(s, **TINY)) for s in SEQS),
        tagged("llama_s128", suite.llama_decoder(128, kv_heads=1, **TINY)),
    ]
    section = TIMED["attention"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(TIMED, "attention", dataclasses.replace(
            section, contenders=tuple(c for c in section.contenders if c != "torch.compile")))
        patch.setattr(suite, "SUITE", test_suite)
        rc = main(["--suite", "attention", "--quick", "--threads", str(THREADS), "--out", str(tmp / "out"),
                   "--markdown", str(md)])
    data = json.loads((tmp / "out" / "results-attention.json").read_text(encoding="utf-8"))
    return rc, data, md.read_text(encoding="utf-8")


def _row(data, model, contender):
    rows = [r for r in data["rows"] if r["model"] == model and r["contender"] == contender]
    assert len(rows) == 1, (model, contender, data["rows"])
    return rows[0]


def test_section_runs_tagged_models_with_memory(section_run):
    rc, data, _ = section_run
    assert rc == 0 and data["meta"]["complete"] is True
    assert data["meta"]["suite"] == "attention" and data["meta"]["memory"] is True
    assert data["meta"]["models"] == ["bert_s128", "bert_s256", "llama_s128"]
    assert list(data["meta"]["contenders"]) == ["eager", "fxforge", "fxforge-attention"]
    assert data["summary"] == report.attention_summary(data["rows"])


def test_every_timed_row_has_its_peak_memory(section_run):
    _, data, _ = section_run
    for row in data["rows"]:
        if row["contender"] == "eager":
            assert row["status"] == "ok", row.get("error")
        if row["status"] == "ok":
            assert row["peak_bytes"] > 0 and row["allocations"] > 0, row
            assert row["allocated_bytes"] >= row["peak_bytes"]
            assert "memory_error" not in row["info"]


def test_eager_memory_is_quadratic_in_sequence(section_run):
    """The measurement sees eager's S x S scores: from S = 128 to 256 its peak grows nearly 4x."""
    _, data, _ = section_run
    peaks = {s: _row(data, f"bert_s{s}", "eager")["peak_bytes"] for s in SEQS}
    scores = TINY["heads"] * SEQS[-1] ** 2 * 4  # one float32 scores matrix at S = 256
    assert peaks[SEQS[-1]] >= 2 * scores  # the scores and the probabilities, at least
    assert report.growth_exponent(SEQS[-2], peaks[SEQS[-2]], SEQS[-1], peaks[SEQS[-1]]) > 1.6


def test_fxforge_with_attention_rewrite_holds_no_scores(section_run):
    _, data, _ = section_run
    row = _row(data, f"bert_s{SEQS[-1]}", "fxforge")
    if row["status"] != "ok" or not row["info"].get("rewrite_counts", {}).get("attention"):
        pytest.skip(f"the attention rewrite did not run in fxforge's default rewrites: {row.get('note')}")
    eager = _row(data, f"bert_s{SEQS[-1]}", "eager")
    assert row["peak_bytes"] < eager["peak_bytes"] / 2


def test_section_block(section_run):
    _, data, text = section_run
    assert text.startswith(f"{PROSE}{CONV_BLOCK}\n\n{BEGIN}\n")
    assert text.count(BEGIN) == 1 and "stale attention table" not in text
    block = text[text.index(BEGIN): text.index(END)]
    assert f"## {TIMED['attention'].title}" in block
    assert "- Command: `python -m benchmarks --suite attention --quick" in block
    assert "- Peak memory: one more call per contender after the timed rounds" in block
    assert "| model | contender | median ms | × vs eager | prepare s | max abs err | peak MiB | note |" in block
    eager = _row(data, "bert_s256", "eager")
    assert f"| {report.fmt_mib(eager['peak_bytes'])} |" in block
    assert "tiny_mlp" not in block
    table_end = block.index("| llama_s128 | fxforge |")
    assert data["summary"] and all(block.index(line) > table_end for line in data["summary"])


def test_memory_flag(tmp_path, monkeypatch):
    """``--memory`` adds the measurement to any run; ``--no-memory`` takes it off a section."""
    rc = main(["--quick", "--models", "tiny_mlp", "--contenders", "eager", "--memory",
               "--out", str(tmp_path), "--markdown", str(tmp_path / "R.md")])
    data = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))
    assert rc == 0 and data["meta"]["memory"] is True and data["rows"][0]["peak_bytes"] > 0
    assert "| peak MiB |" in (tmp_path / "R.md").read_text(encoding="utf-8")

    entry = suite.SuiteEntry("bert_s16", suite.bert_encoder(16, **TINY), tags=("attention",), default=False)
    monkeypatch.setattr(suite, "SUITE", [entry])
    rc = main(["--suite", "attention", "--quick", "--contenders", "eager", "--no-memory",
               "--out", str(tmp_path), "--no-markdown"])
    data = json.loads((tmp_path / "results-attention.json").read_text(encoding="utf-8"))
    assert rc == 0 and data["meta"]["memory"] is False and "peak_bytes" not in data["rows"][0]


def test_no_memory_column_without_memory():
    rows = [{"model": "m", "contender": "eager", "median_ms": 1.0}]
    assert report.table_columns(rows) == report.COLUMNS
    assert "peak MiB" not in report.markdown_table(rows, report.table_columns(rows))
    headers = [c.header for c in report.table_columns(rows, memory=True)]
    assert headers[-2:] == ["peak MiB", "note"]


# --------------------------------------------------------------------------------------------------
# summary lines, from hand-made rows

MIB = 2**20


def _r(model, contender, median_ms=None, *, eager_ms=100.0, peak_mib=None, status="ok", stage=None):
    row = {"model": model, "contender": contender, "status": status, "median_ms": median_ms,
           "ratio_vs_eager": eager_ms / median_ms if median_ms else None, "stage": stage}
    if peak_mib is not None:
        row["peak_bytes"] = int(peak_mib * MIB)
    return row


def summary_rows(fxforge_s2048_ms=40.0):
    return [
        _r("bert_s512", "eager", 10.0, eager_ms=10.0, peak_mib=20.0),
        _r("bert_s512", "torch.compile", 8.0, eager_ms=10.0, peak_mib=10.0),
        _r("bert_s512", "fxforge", 8.0, eager_ms=10.0, peak_mib=5.0),
        _r("bert_s1024", "eager", 30.0, eager_ms=30.0, peak_mib=60.0),
        _r("bert_s1024", "torch.compile", 20.0, eager_ms=30.0, peak_mib=20.0),
        _r("bert_s1024", "fxforge", 15.0, eager_ms=30.0, peak_mib=10.0),
        _r("bert_s2048", "eager", 100.0, peak_mib=240.0),
        _r("bert_s2048", "torch.compile", 60.0, peak_mib=40.0),
        _r("bert_s2048", "fxforge", fxforge_s2048_ms, peak_mib=20.0),
        _r("llama_s2048", "eager", 200.0, eager_ms=200.0, peak_mib=300.0),
        _r("llama_s2048", "torch.compile", None, status="failed", stage="prepare"),
        _r("llama_s2048", "fxforge", 100.0, eager_ms=200.0, peak_mib=50.0),
    ]


def test_attention_summary_lines():
    assert report.attention_summary(summary_rows()) == [
        "- fxforge × vs eager on bert_s2048: 2.50× (target ≥ 2.00×: met); torch.compile ms / fxforge ms = 1.50×",
        ("- eager peak memory on bert, S = 512 / 1024 / 2048: 20.0 / 60.0 / 240.0 MiB "
         "(growth from one S to the next: ×3.00, ×4.00)"),
        ("- torch.compile peak memory on bert, S = 512 / 1024 / 2048: 10.0 / 20.0 / 40.0 MiB "
         "(growth from one S to the next: ×2.00, ×2.00)"),
        ("- fxforge peak memory on bert, S = 512 / 1024 / 2048: 5.0 / 10.0 / 20.0 MiB "
         "(growth from one S to the next: ×2.00, ×2.00)"),
        # eager: ((240 - 60) / 1024 - (60 - 20) / 512) / 1536 MiB per S^2 = 66.7 bytes = 16.67 float32 matrices
        ("- fxforge attention memory no longer O(S²): quadratic term of the peak, fitted over "
         "S = 512 / 1024 / 2048: 0.00 float32 S×S matrices (eager 16.67; target < 0.5: met); "
         "peak ×2.00 from S = 1024 to 2048 (S^1.00; eager ×4.00, S^2.00); "
         "fxforge peak / eager peak at S = 2048: 0.08×"),
        ("- llama_s2048 (× vs eager, peak memory; no target): eager 1.00×, 300.0 MiB; "
         "torch.compile not timed; fxforge 2.00×, 50.0 MiB"),
    ]


def test_attention_summary_targets_not_met():
    rows = [r for r in summary_rows(fxforge_s2048_ms=80.0) if not r["model"].startswith("llama")]
    for r in rows:
        if r["contender"] == "fxforge" and r["model"] == "bert_s2048":
            r["peak_bytes"] = 35 * MIB  # 3.5x the 10 MiB at S = 1024
    lines = report.attention_summary(rows)
    assert lines[0] == (
        "- fxforge × vs eager on bert_s2048: 1.25× (target ≥ 2.00×: **not met**); "
        "torch.compile ms / fxforge ms = 0.75×"
    )
    # fxforge 5 / 10 / 35 MiB: ((35 - 10) / 1024 - 5 / 512) / 1536 MiB per S^2 = 10 bytes = 2.5 matrices
    assert lines[4] == (
        "- fxforge attention memory no longer O(S²): quadratic term of the peak, fitted over "
        "S = 512 / 1024 / 2048: 2.50 float32 S×S matrices (eager 16.67; target < 0.5: **not met**); "
        "peak ×3.50 from S = 1024 to 2048 (S^1.81; eager ×4.00, S^2.00); "
        "fxforge peak / eager peak at S = 2048: 0.15×"
    )
    assert len(lines) == 5  # no decoder in this run, no decoder line
    # Two lengths only: the exponent decides.
    two = [r for r in rows if r["model"] != "bert_s512"]
    assert report.attention_summary(two)[4] == (
        "- fxforge attention memory no longer O(S²): peak ×3.50 from S = 1024 to 2048 (S^1.81; eager ×4.00, "
        "S^2.00; target k < 1.5: **not met**); fxforge peak / eager peak at S = 2048: 0.15×"
    )


def test_attention_summary_fxforge_failed():
    rows = [r for r in summary_rows() if not (r["contender"] == "fxforge" and r["model"] == "bert_s2048")]
    rows.append(_r("bert_s2048", "fxforge", None, status="failed", stage="prepare"))
    lines = report.attention_summary(rows)
    assert lines[0] == "- fxforge × vs eager on bert_s2048: — fxforge failed (prepare) (target ≥ 2.00×: **not met**)"
    assert lines[3] == ("- fxforge peak memory on bert, S = 512 / 1024 / 2048: 5.0 / 10.0 / — MiB "
                        "(growth from one S to the next: ×2.00, —)")
    assert lines[4] == "- fxforge attention memory no longer O(S²): — no peak memory at S = 1024 and 2048 (**not met**)"
    assert report.attention_summary([_r("x", "eager", 1.0)]) == ["- no bert_s<S> model in this run"]


def test_quadratic_term():
    assert report.quadratic_term([(512, 5.0), (1024, 10.0), (2048, 20.0)]) == pytest.approx(0.0)
    # 3 + 2 S + 0.5 S^2, and a shorter point that is not used
    points = [(s, 3 + 2 * s + 0.5 * s * s) for s in (256, 512, 1024)] + [(1, 1e9)]
    assert report.quadratic_term(points) == pytest.approx(0.5)
    assert report.quadratic_term([(512, 1.0), (1024, 2.0)]) is None


def test_growth_exponent():
    assert report.growth_exponent(512, 1.0, 2048, 16.0) == pytest.approx(2.0)
    assert report.growth_exponent(1024, 3.0, 2048, 6.0) == pytest.approx(1.0)
    assert report.growth_exponent(1024, None, 2048, 6.0) is None
    assert report.seq_models([_r("bert_s2048", "eager"), _r("bert_s512", "eager"), _r("bertx_s1", "eager"),
                              _r("llama_s2048", "eager")], "bert") == {512: "bert_s512", 2048: "bert_s2048"}


# --------------------------------------------------------------------------------------------------
# suite entries


def test_attention_entries_selected_together_and_not_by_default():
    names = ["bert_s512", "bert_s1024", "bert_s2048", "llama_s2048"]
    assert [e.name for e in suite.select(None, tag="attention")] == names
    assert not set(names) & {e.name for e in suite.select(None)}
    assert TIMED["attention"].contenders == ("eager", "torch.compile", "fxforge", "fxforge-attention")
    assert TIMED["attention"].memory and not TIMED["conv"].memory


@pytest.mark.parametrize("name, seq", [("bert_s2048", 2048), ("llama_s2048", 2048), ("bert_s512", 512)])
def test_attention_entry_inputs_and_config(name, seq):
    """The real entries (built, not run): eager attention, batch 1, the sequence length in the name."""
    entry = next(e for e in suite.SUITE if e.name == name)
    model, args = suite.build(entry)
    assert not model.training
    assert model.config._attn_implementation == "eager"
    assert model.config.hidden_size == 256 and model.config.num_hidden_layers == 4
    assert model.config.max_position_embeddings >= seq
    assert tuple(args[0].shape) == (1, seq)
    if name.startswith("bert"):
        assert tuple(args[1].shape) == (1, seq) and bool(args[1].all())
    else:
        assert model.config.num_key_value_heads < model.config.num_attention_heads
        assert model.config.use_cache is False
