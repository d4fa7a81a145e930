"""The fxforge command's happy paths, driven as a subprocess the way a user runs it: on a model file
written outside the repository and on the bundled examples."""

import importlib.util
import re

import numpy as np
import pytest
import torch
from cli_helpers import REPO, run_cli

import fxforge
from fxforge.cli.graphs import draw_available


def _import(path):
    spec = importlib.util.spec_from_file_location(f"user_model_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help_lists_every_command():
    result = run_cli("--help")
    assert result.returncode == 0
    for command in ("optimize", "export", "profile", "show", "memory", "rewrites"):
        assert command in result.stdout
    rewrites = run_cli("rewrites")
    assert rewrites.returncode == 0 and rewrites.stdout.startswith("cleanup")
    from fxforge.rewrites.registry import BUILTIN
    assert [line.split()[0] for line in rewrites.stdout.strip().splitlines()] == list(BUILTIN)


def test_optimize_a_model_file_outside_the_repo_to_pt2_with_report(user_model, out, tmp_path):
    model = _import(user_model).Net(width=8).eval()
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    result = run_cli("optimize", f"{user_model}:Net", "--input", "2x8", "--model-args", '{"width": 8}',
                     "--weights", tmp_path / "weights.pt", "-o", "net.pt2", "--report", "report.html",
                     "--bench-reps", "3", cwd=out)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    text = result.stdout
    for step in ("load model", "optimize for native", "fx capture, cleanup x1", "write .pt2, load back, check",
                 "time eager"):
        assert step in text
    for row in ("rewrites applied", "cleanup x1", "2 -> 1", "peak memory (simulated)", "latency", "interleaved",
                "max abs error vs eager"):
        assert row in text
    assert "cleanup: dropout in eval removed [drop]" in text
    assert "user_model.py:9: return self.drop(self.lin(x))" in text
    assert sorted(p.name for p in out.iterdir()) == ["net.pt2", "report.html"]

    page = (out / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "user_model.py:9: return self.drop(self.lin(x))" in page
    # self-contained: nothing to fetch (SVG's namespace URI and in-page url(#id) references are not fetches)
    assert "<script" not in page and "<link" not in page and "src=" not in page
    assert not re.search(r"url\((?!#)", page) and not re.search(r"https?://(?!www\.w3\.org/)", page)
    if draw_available():
        assert page.count("<svg") == 2

    x = torch.randn(5, 8)
    assert torch.allclose(fxforge.load(out / "net.pt2")(x[:2]), model(x[:2]), atol=1e-6)


def test_optimize_a_factory_to_onnx_with_a_dynamic_batch(user_model, out):
    import onnxruntime

    result = run_cli("optimize", f"{user_model}:build", "--input", "3x8", "-o", "net.onnx", "--dynamic-batch",
                     "--no-bench", cwd=out)
    assert result.returncode == 0, result.stderr
    assert "write .onnx, load back, check" in result.stdout and "batch 1 max abs error" in result.stdout
    assert "onnxruntime" not in result.stderr
    assert [p.name for p in out.iterdir()] == ["net.onnx"]
    session = onnxruntime.InferenceSession(str(out / "net.onnx"), providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {session.get_inputs()[0].name: np.ones((5, 8), np.float32)})
    assert y.shape == (5, 8)


def test_optimize_without_output_races_the_targets_by_default(user_model, out, tmp_path):
    env_cache = {"FXFORGE_CACHE_DIR": str(tmp_path / "cache")}
    result = run_cli("optimize", f"{user_model}:Net", "--input", "2x8", "--model-args", '{"width": 8}',
                     "--bench-reps", "2", cwd=out, env=env_cache)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "race native, onnxruntime, inductor; keep the fastest" in text
    winner = re.search(r"│ target\s+│ auto: (eager|native|onnxruntime|inductor)", text)
    assert winner, text
    race = re.search(r"target auto: (\w+) \(", text)
    assert race and race.group(1) == winner.group(1)
    for target in ("native", "onnxruntime", "inductor"):  # timed, or refused with the reason
        assert re.search(rf"^    {target}: ([0-9.e-]+ ms( \([0-9.]+x eager\))?, prepared in |\w+)", text, re.MULTILINE), text
    latency = re.search(r"│ latency\s+│ eager ~?([0-9.e-]+) ms", text)
    assert latency and f"; eager {latency.group(1)} ms" in text, text  # the race's own eager figure
    assert list(out.iterdir()) == []  # nothing written without -o


def test_export_writes_onnx_without_rewrites(user_model, out):
    result = run_cli("export", f"{user_model}:Net", "--input", "2x4", "-o", "plain.onnx", cwd=out)
    assert result.returncode == 0, result.stderr
    assert "│ rewrites applied        │ none" in result.stdout
    assert "cleanup x1" not in result.stdout
    assert [p.name for p in out.iterdir()] == ["plain.onnx"]


def test_bundled_example_factory_to_pt2_loads_and_matches_eager(out):
    from examples.models.resnet_cnn import example

    # example() returns (model, inputs), with seeded weights: the CLI takes the model from the pair
    result = run_cli("optimize", REPO / "examples/models/resnet_cnn.py:example", "--input", "1x3x32x32",
                     "-o", "resnet.pt2", "--bench-reps", "2", cwd=out)
    assert result.returncode == 0, result.stderr
    assert "conv_bn_fold x9" in result.stdout and "speed" not in result.stderr
    model, _ = example()
    x = torch.randn(1, 3, 32, 32)
    assert torch.allclose(fxforge.load(out / "resnet.pt2")(x), model(x), atol=1e-5)


def test_show_prints_both_graphs_with_rewritten_nodes_marked(out):
    spec = f"{REPO / 'examples/models/resnet_cnn.py'}:ResNetCNN"
    result = run_cli("show", spec, "--input", "1x3x16x16", "--model-args", '{"width": 4, "blocks": [1]}', cwd=out)
    assert result.returncode == 0, result.stderr
    assert "captured: " in result.stdout and "rewritten (* = made by a rewrite)" in result.stdout
    captured, rewritten = result.stdout.split("rewritten (* = made by a rewrite)")
    assert " *  " not in captured
    # the convolutions with BatchNorm folded in (or fused with their ReLU, as autotune decides) are marked
    assert re.search(r"^  \w+ \*  call_function (conv2d|fxforge::conv_pointwise)  1x4x16x16 float32$", rewritten, re.MULTILINE)
    if draw_available():
        drawn = run_cli("show", spec, "--input", "1x3x16x16", "--model-args", '{"width": 4, "blocks": [1]}',
                        "-o", "graph.svg", cwd=out)
        assert drawn.returncode == 0, drawn.stderr
        svg = (out / "graph.svg").read_text()
        assert svg.startswith("<svg") and 'class="node marked"' in svg


@pytest.mark.skipif(not hasattr(fxforge, "profile"), reason="fxforge.profile is not in this checkout")
def test_profile_prints_the_slowest_nodes_and_saves_the_table(user_model, out):
    result = run_cli("profile", f"{user_model}:Net", "--input", "2x4", "--repeat", "2", "--csv", "table.csv",
                     "--optimized", "--by-op", cwd=out)
    assert result.returncode == 0, result.stderr
    assert "optimize (capture, rewrite): cleanup x1" in result.stdout and "by op" in result.stdout
    assert "time_ms" in result.stdout and "lin" in result.stdout
    header = (out / "table.csv").read_text().splitlines()[0].split(",")
    assert {"node", "op", "time_ms", "flops", "bytes", "bound"} <= set(header)


@pytest.mark.parametrize("precision", ["bf16", "int8", "auto"])
def test_optimize_in_reduced_precision_reports_each_layers_precision(tmp_path, precision):
    model = tmp_path / "mlp.py"
    model.write_text("import torch\n\nclass MLP(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                     "        self.a, self.b = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)\n\n"
                     "    def forward(self, x):\n        return self.b(torch.relu(self.a(x)))\n")
    result = run_cli("optimize", f"{model}:MLP", "--input", "4x8x64", "--target", "native", "--precision", precision,
                     "--tolerance", "0.03", "--no-bench", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    # Each layer's line: its precision by accuracy, or (int8, where the machine times a layer of this size as
    # faster in float32) by speed, with both timings.
    assert "precision accuracy" in result.stdout or "precision speed" in result.stdout, result.stdout
    for raced in (["bf16", "int8"] if precision == "auto" else [precision]):
        assert f"note: precision {raced}: " in result.stdout, result.stdout
    assert "tolerance: relative error 0.03" in result.stdout or "no layer is faster in int8" in result.stdout


def test_optimize_for_inductor_in_int8_reports_each_layer_and_the_race(tmp_path):
    model = tmp_path / "mlp.py"
    model.write_text("import torch\n\nclass MLP(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                     "        self.a, self.b = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)\n\n"
                     "    def forward(self, x):\n        return self.b(torch.relu(self.a(x)))\n")
    result = run_cli("optimize", f"{model}:MLP", "--input", "4x8x64", "--target", "inductor", "--precision", "int8",
                     "--tolerance", "0.03", "--no-bench", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "precision accuracy" in result.stdout, result.stdout
    # Kept where it timed faster than the float32 compiled graph, else float32 with both timings.
    note = re.search(r"note: precision int8: (\d+ of 2 layers in int8|float32 kept: not faster)", result.stdout)
    assert note, result.stdout


def test_optimize_for_onnxruntime_in_int8_writes_the_file_it_judged(tmp_path):
    model = tmp_path / "cnn.py"
    model.write_text("import torch\n\nclass Net(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                     "        self.c = torch.nn.Conv2d(3, 32, 3, padding=1)\n        self.f = torch.nn.Linear(32, 10)\n\n"
                     "    def forward(self, x):\n        return self.f(torch.relu(self.c(x)).mean((2, 3)))\n")
    out = tmp_path / "net.onnx"
    result = run_cli("optimize", f"{model}:Net", "--input", "8x3x32x32", "--target", "onnxruntime", "--precision",
                     "int8", "-o", str(out), "--no-bench", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "note: precision int8: " in result.stdout, result.stdout
    quantized = "precision int8: static QDQ" in result.stdout
    ops = {node.op_type for node in __import__("onnx").load(str(out)).graph.node}
    assert ("QuantizeLinear" in ops) == quantized, (ops, result.stdout)
