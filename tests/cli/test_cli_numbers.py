"""Honest numbers (issue 48 item 5): timings under load say so in the summary and the HTML; a ratio taken in
different conditions is not shown; the HTML's counts, units and graphs agree; GradientsWarning names the
rewrite and the fusion that gradients cost, at the user's line."""

import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import fxforge
import fxforge.core.disk_cache
from fxforge.cli import summary as summary_module
from fxforge.cli.graphs import pictures
from fxforge.cli.html import render_html
from fxforge.cli.summary import Latency, Summary, measure_latency, race_latency
from fxforge.core.nodes import count_calls
from fxforge.core.report import Contender, Race, Report, Tuning
from fxforge.runtime.fallbacks import GradientsWarning

sys.path.insert(0, str(Path(__file__).parents[1] / "user_models"))
from hand_written import USER_MODELS


def test_a_busy_timing_is_retimed_then_marked(monkeypatch):
    loads = iter([3.0, 3.0])
    monkeypatch.setattr(fxforge.core.disk_cache, "machine_load", lambda: next(loads))
    latency = measure_latency(torch.relu, torch.relu, (torch.ones(8),), reps=4, warmup=1)
    assert latency.retimed and latency.busy.startswith("load 3.00 per core")
    assert latency.how == "median of 12, interleaved"  # taken again with three times the repetitions
    text = Summary("Net", "8", Report(method="fx"), latency=latency).rows()[-1][1]
    assert "machine busy" in text and "not a result" in text and "~" in text
    assert not re.search(r"\d\.\d\dx faster", text)  # no plain ratio


def test_a_quiet_retiming_is_a_result(monkeypatch):
    loads = iter([3.0, 0.0])
    monkeypatch.setattr(fxforge.core.disk_cache, "machine_load", lambda: next(loads))
    monkeypatch.setattr(summary_module, "_disturbance",
                        lambda times, load: "load 3.00 per core" if load > 0.5 else "")
    latency = measure_latency(torch.relu, torch.relu, (torch.ones(8),), reps=2, warmup=1)
    assert latency.retimed and not latency.busy
    assert "timed twice, the first was disturbed" in latency.text()


def test_a_ratio_taken_in_different_conditions_is_not_shown():
    # the LSTM's "1509.29x faster": eager's median disturbed, its fastest call 2 ms
    text = Latency(301.8, 0.2, fastest=(2.0, 0.19), how="median of 10, interleaved").text()
    assert "no ratio" in text and "1509" not in text and "faster" not in text
    assert "x faster" in Latency(2.1, 1.0, fastest=(2.0, 0.95), how="median of 10").text()


def test_summary_and_race_read_the_same_numbers():
    race = Race("native", "0.5 ms: 4.00x eager", [Contender("eager", 2.0, vs_eager=1.0, busy="load 2 per core"),
                                                    Contender("native", 0.5, 1.0, 0.0, vs_eager=4.0,
                                                              busy="load 2 per core")], eager_ms=2.0)
    latency = race_latency(race)
    assert (latency.eager_ms, latency.optimized_ms) == (2.0, 0.5)
    report = Report(method="fx", race=race)
    page = render_html(Summary("Net", "2x8", report, latency=latency), {})
    assert "Timings on this page are not results" in page and "machine busy" in page
    assert "not a result" in dict(Summary("Net", "2x8", report, latency=latency).rows())["latency"]
    assert "the race's timings are not results (eager: load 2 per core)" in str(report)
    assert "The race's timings are not results" in report._repr_html_()


def test_html_memory_figures_are_in_a_memory_column():
    report = Report(method="fx", tuning=[
        Tuning("conv_activation", "conv_1", "mkldnn", {"mkldnn": 0.5, "composite": 0.75}),
        Tuning("memory_reorder", "graph", "capture order kept", {"capture order": 2.0}, unit="MiB", kind="schedule")])
    page = report._repr_html_()
    header = re.search(r"<h4>Autotune and schedules</h4><table><thead><tr>(.*?)</tr>", page).group(1)
    assert re.findall(r"<th>(.*?)</th>", header) == ["rule", "subject", "choice", "timings", "memory", "note"]
    rows = re.findall(r"<tr>(<td>.*?)</tr>", page)
    cells = [re.findall(r"<td>(.*?)</td>", row) for row in rows]
    assert cells[0][3:5] == ["mkldnn 0.5 ms, composite 0.75 ms", ""]
    assert cells[1][3:5] == ["", "capture order 2 MiB"]


def test_html_node_counts_are_those_of_its_graphs():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(144, 2)).eval()
    cap = fxforge.capture(model, (torch.randn(2, 3, 8, 8),))
    new = fxforge.rewrite(cap, ["cleanup", "conv_bn_fold"])
    nodes = (count_calls(cap.graph_module.graph), count_calls(new.graph_module.graph))
    summary = Summary("Net", "2x3x8x8", new.report, nodes=nodes)
    drawn = pictures(cap.graph_module, new.graph_module, "Net")
    if not drawn:
        pytest.skip("fxforge.core.draw is not available")
    page = render_html(summary, drawn)
    assert f"<td>nodes</td><td>{nodes[0]} -&gt; {nodes[1]}</td>" in page
    assert f"captured ({nodes[0]} nodes that compute" in page and f"rewritten ({nodes[1]} nodes that compute" in page
    assert len(new.graph_module.graph.nodes) != nodes[1]  # the picture draws more (inputs, weights, output)


@pytest.mark.parametrize("case", ["mlp", "gpt"])
def test_gradients_warning_names_the_fusion_and_the_users_line(case):
    if case == "mlp":
        model, inputs = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval(), (torch.randn(2, 8),)
        expected = "relu(linear)"
    else:
        user = USER_MODELS["gpt"]()
        model, inputs, expected = user.model, user.inputs, "gelu(linear) at gelu ("
    opt = fxforge.optimize(model, inputs, target="native")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt(*inputs)  # gradients recorded
    found = [w for w in caught if issubclass(w.category, GradientsWarning)]
    assert len(found) == 1, [str(w.message) for w in caught]
    message = str(found[0].message)
    assert expected in message and "conv2d" not in message and "no_grad" in message, message
    assert case == "mlp" or "hand_written.py:" in message  # where, in the user's file
    assert found[0].filename == __file__, found[0].filename


def test_fallback_warning_names_the_data_dependent_branch():
    user = USER_MODELS["data_branch"]()
    line = next(i for i, text in enumerate(Path(sys.modules["hand_written"].__file__).read_text().splitlines(), 1)
                if "if h.sum() > 0:" in text)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # one graph asked for (method="fx"): no dynamo, so it runs eagerly and warns here
        opt = fxforge.optimize(user.model, user.inputs, target="native", method="fx")
        with torch.no_grad():
            opt(*user.inputs)
    messages = [str(w.message) for w in caught if issubclass(w.category, fxforge.runtime.fallbacks.FallbackWarning)]
    assert messages, [str(w.message) for w in caught]
    assert "branches on a tensor's value at " in messages[0], messages[0]
    assert f"hand_written.py:{line} (if h.sum() > 0:)" in messages[0], messages[0]
    assert "torch.where" in messages[0] and "GuardOnDataDependentSymNode" not in messages[0]
