"""Every command on models TorchDynamo cuts into graphs (tests/user_models/with_breaks.py), in-process: what works
graph by graph (optimize without -o, show, profile, memory) exits 0 and names each break; what needs one whole graph
(-o files, export, memory --budget, partition) exits 1 with one line naming each break and its fix, and leaves no
file behind."""

import csv
import html
import inspect
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "user_models"))
from with_breaks import BREAK_LINES, BREAK_MODELS

from fxforge.cli import main
from fxforge.cli.breaks import WHOLE_GRAPH
from fxforge.cli.graphs import draw_available

CORPUS = Path(__file__).resolve().parents[1] / "user_models" / "with_breaks.py"
MODELS = ["data_branch", "masked_pool"]  # a branch on a tensor's value (a conv net); boolean indexing (an MLP)


def _args(name):
    """MODEL and its inputs on the command line."""
    case = BREAK_MODELS[name]()
    return [f"{CORPUS}:break_model", "--model-args", f'{{"name": "{name}"}}',
            *[part for shape in case.cli_inputs for part in ("--input", shape)]]


def _where(name):
    """``file.py:LINE (code)`` of the line the model breaks at, as a Break prints it."""
    model = BREAK_MODELS[name]().model
    path = Path(inspect.getsourcefile(type(model)))
    code = BREAK_LINES[name]
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if text.strip() == code)
    return f"{path.name}:{line} ({code})"


def _break_at(name, text):
    """Where ``text`` says ``break at .../file.py:LINE (code)`` of the model's break (-1 where it does not)."""
    found = re.search(r"break( \(in code dynamo ran in Python\))? at \S*" + re.escape(_where(name)), text)
    return found.start() if found else -1


def _one_line(capsys):
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return out, lines[0]


@pytest.mark.parametrize("name", MODELS)
def test_optimize_runs_the_graphs_between_breaks(name, capsys, out, monkeypatch):
    monkeypatch.chdir(out)
    assert main(["optimize", *_args(name), "--target", "native", "--bench-reps", "2", "--report", "r.html"]) == 0
    text = capsys.readouterr().out
    assert "captured with dynamo" in text and "nothing was rewritten" not in text
    row = re.search(r"graphs\s+│ (\d+) graphs between (\d+) break", text)
    assert row and (row[1], row[2]) == ("2", "1"), text
    assert "of the model's FLOPs" in text and "inside optimized graphs" in text
    assert "latency" in text and "max abs error vs eager" in text
    error = float(re.search(r"max abs error vs eager\s+│ (\S+)", text)[1])
    assert error < 1e-4, text
    assert _break_at(name, " ".join(text.split())) >= 0 and "fix: " in text
    assert "graph 1 (" in text and "graph 2 (" in text
    assert html.escape(BREAK_LINES[name]) in (out / "r.html").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["r.html"]


def test_optimize_with_auto_names_the_graphs_whoever_wins(capsys, out, monkeypatch):
    monkeypatch.setenv("FXFORGE_CACHE_DIR", str(out / "cache"))
    assert main(["optimize", *_args("data_branch"), "--bench-reps", "2"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "captured with dynamo" in text and "2 graphs between 1 break" in text, text
    assert _break_at("data_branch", text) >= 0
    assert "auto: " in text and "not captured" not in text


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("command, output", [("optimize", "m.pt2"), ("optimize", "m.onnx"), ("export", "m.onnx"),
                                             ("export", "m.pt2")])
def test_a_file_needs_one_graph(name, command, output, capsys, out, monkeypatch):
    monkeypatch.chdir(out)
    assert main([command, *_args(name), "-o", output, "--report", "r.html"]) == 1
    _, line = _one_line(capsys)
    assert line.startswith(f"fxforge: error: -o {output}: ") and "holds one graph" in line, line
    assert _where(name) in line and "fix: " in line, line
    assert not list(out.iterdir())  # no partial file, no report


def test_a_target_running_one_graph_is_refused_naming_the_break(capsys):
    assert main(["optimize", *_args("masked_pool"), "--target", "onnxruntime", "--no-bench"]) == 1
    _, line = _one_line(capsys)
    assert "--target onnxruntime" in line and _where("masked_pool") in line and "--target native" in line, line


@pytest.mark.parametrize("name", MODELS)
def test_show_lists_every_graph_and_the_breaks_between_them(name, capsys):
    assert main(["show", *_args(name)]) == 0
    text = capsys.readouterr().out
    assert "graph 1 of 2" in text and "graph 2 of 2" in text
    assert text.count("captured: ") == 2 and text.count("rewritten (* = made by a rewrite): ") == 2
    first, second = text.index("graph 1 of 2"), text.index("graph 2 of 2")
    cut = _break_at(name, text)
    assert first < cut < second  # the break falls between the graphs
    assert "fix: " in text[cut:second]


@pytest.mark.skipif(not draw_available(), reason="fxforge.core.draw is not available")
def test_show_draws_every_graph(capsys, out):
    svg, page = out / "g.svg", out / "g.html"
    assert main(["show", *_args("data_branch"), "-o", str(svg)]) == 0
    assert main(["show", *_args("data_branch"), "-o", str(page)]) == 0
    assert "wrote" in capsys.readouterr().out
    root = ET.parse(svg).getroot()
    assert sum(child.tag.endswith("svg") for child in root) == 2  # one picture per graph
    assert _where("data_branch").split(" ")[0] in svg.read_text()
    text = page.read_text()
    assert "graph 1: rewritten" in text and "graph 2: rewritten" in text and html.escape(BREAK_LINES["data_branch"]) in text


def test_show_names_a_break_dynamo_met_inside_a_loop(capsys):
    assert main(["show", *_args("greedy_decoder"), "--no-verify", "--rewrites", "none"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "graph 1 of " in text and _break_at("greedy_decoder", text) >= 0


@pytest.mark.parametrize("name", MODELS)
def test_profile_times_each_graphs_nodes(name, capsys, out):
    table = out / "t.csv"
    assert main(["profile", *_args(name), "--warmup", "0", "--repeat", "1", "--csv", str(table)]) == 0
    text = capsys.readouterr().out
    assert "across 2 graphs" in text and "graph 1 (" in text and "graph 2 (" in text
    assert _break_at(name, " ".join(text.split())) >= 0
    assert "eager, by module" not in text
    rows = list(csv.DictReader(table.open()))
    assert {row["graph"] for row in rows} == {"1", "2"}
    assert all(float(row["time_ms"]) >= 0 for row in rows)
    # every computing node of the model's forward is in one graph or the other: its layers' modules show up
    modules = {row["module"] for row in rows}
    expected = {"data_branch": {"body.0", "body.1", "pos"}, "masked_pool": {"proj", "head.0", "head.2"}}[name]
    assert expected <= modules, modules


def test_profile_optimized_times_each_graphs_plan(capsys):
    assert main(["profile", *_args("data_branch"), "--optimized", "--warmup", "0", "--repeat", "1"]) == 0
    text = capsys.readouterr().out
    assert "across 2 graphs" in text and _break_at("data_branch", " ".join(text.split())) >= 0
    assert "batch_norm" not in text  # the lowered graphs: the batch norm folded into its convolution


@pytest.mark.parametrize("name", MODELS)
def test_memory_measures_one_real_step(name, capsys, out):
    table = out / "m.csv"
    assert main(["memory", *_args(name), "--optimizer", "sgd", "--csv", str(table)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "measured" in text and "peak: " in text
    assert "need one graph of the training step" in text and _where(name) in text
    figures = {row["figure"]: int(row["measured_bytes"]) for row in csv.DictReader(table.open())}
    model = BREAK_MODELS[name]().model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert figures["weights"] == weights and 0 < figures["gradients"] <= weights  # (a branch not taken: no gradient)
    assert figures["optimizer_state"] == figures["gradients"]  # SGD's momentum: one buffer per gradient
    assert figures["peak"] >= figures["weights"] + figures["inputs"] + figures["optimizer_state"]


def test_memory_budget_needs_one_graph(capsys, out):
    table = out / "m.csv"
    assert main(["memory", *_args("data_branch"), "--budget", "60%", "--csv", str(table)]) == 1
    printed, line = _one_line(capsys)
    assert "measured" in printed  # the measured step is printed first
    assert line.startswith("fxforge: error: --budget 60%: ") and _where("data_branch") in line, line
    assert not table.exists()


@pytest.mark.parametrize("name", MODELS)
def test_partition_prints_the_graphs_and_refuses_stages(name, capsys):
    assert main(["partition", *_args(name), "--stages", "2"]) == 1
    printed, line = _one_line(capsys)
    assert "graph 1 of 2" in printed and _break_at(name, " ".join(printed.split())) >= 0
    assert line.startswith("fxforge: error: pipeline stages need one graph") and _where(name) in line, line


def test_help_says_which_commands_need_one_graph(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    assert WHOLE_GRAPH in " ".join(capsys.readouterr().out.split())

