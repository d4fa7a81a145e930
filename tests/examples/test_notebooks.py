"""The example notebooks (``examples/notebooks``) run top to bottom in a clean kernel and tell their story.

Each notebook is copied to a temporary folder and executed there with nbclient, in a fresh kernel started
from the ``python3`` kernel spec (jupyter_client runs it with this interpreter), with the working directory
set to the repository root for some notebooks and to ``examples/notebooks`` for the others (both must
work). A cell that raises fails the test. The last cell of every notebook prints one line
``NOTEBOOK_SUMMARY {json}`` with the figures it computed; the tests check those against the story the
notebook tells (counts of rewrites, equal outputs, lower memory), never against timings, which depend on
the machine's load.

The committed notebooks carry the outputs of a full run (``make notebooks``: examples/notebooks/execute.py),
so a reader sees the figures without running anything; ``test_stored_notebook`` checks that every code cell
ran, in order, without an error, and that the stored figures tell the same story as a fresh run must.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "examples" / "notebooks"
NAMES = ["01_cnn_conv_fusion.ipynb", "02_attention_sequence_length.ipynb", "03_memory_reorder_branchy.ipynb",
         "04_training_memory.ipynb"]
# Where each notebook's kernel starts: both places a user runs them from are covered.
WORKDIR = {
    "01_cnn_conv_fusion.ipynb": ROOT,
    "02_attention_sequence_length.ipynb": NOTEBOOKS,
    "03_memory_reorder_branchy.ipynb": ROOT,
    "04_training_memory.ipynb": NOTEBOOKS,
}
CELL_TIMEOUT_S = 300
MARKER = "NOTEBOOK_SUMMARY "


@pytest.fixture(autouse=True)
def _one_thread_per_kernel_under_xdist(monkeypatch):
    """Under pytest-xdist each kernel computes on one thread, as each worker does (conftest.py): a notebook's
    two threads (its default, the benchmarks') fought the other worker for the two cores. The kernel inherits
    the environment; the stored runs (``make notebooks``) keep the default."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        monkeypatch.setenv("FXFORGE_NOTEBOOK_THREADS", "1")


def _stream_text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")


def _count_outputs(nb, mime: str) -> int:
    return sum(mime in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def _execute(name: str, tmp_path: Path) -> tuple[object, dict]:
    """Run a temporary copy of notebook ``name``; return the executed notebook and its summary."""
    copy = tmp_path / name
    shutil.copyfile(NOTEBOOKS / name, copy)
    nb = nbformat.read(copy, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(WORKDIR[name])}})
    start = time.perf_counter()
    try:
        client.execute()
    finally:
        nbformat.write(nb, copy)  # the executed copy, outputs included, for a look after a failure
        print(f"{name}: executed in {time.perf_counter() - start:.1f} s ({copy})")
    setup = _stream_text(next(c for c in nb.cells if c.cell_type == "code"))
    assert f"python {sys.executable}" in setup, f"the kernel is not this interpreter: {setup!r}"
    return nb, _summary(nb)


def _summary(nb) -> dict:
    """The figures an executed notebook printed, after checking that it ran without an error."""
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.get("output_type") == "error"]
    assert not errors, errors
    lines = [line for c in nb.cells if c.cell_type == "code" for line in _stream_text(c).splitlines()
             if line.startswith(MARKER)]
    assert len(lines) == 1, f"expected one {MARKER.strip()} line, found {len(lines)}"
    return json.loads(lines[0][len(MARKER):])


def test_the_notebooks_are_these():
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_stored_notebook(name):
    """The committed notebook ran top to bottom (``make notebooks``) and its figures tell its story."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3", name
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, name
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), \
        f"{name}: not one run top to bottom; run `make notebooks`"
    for cell in code:
        assert "execution" not in cell.metadata, f"{name}: a code cell has execution timestamps"
    assert (NOTEBOOKS / name).stat().st_size < 1_000_000, f"{name}: its outputs are larger than a figure needs"
    CHECKS[name](nb, _summary(nb))


@pytest.mark.slow
def test_cnn_conv_fusion_notebook(tmp_path):
    check_cnn_conv_fusion_notebook(*_execute("01_cnn_conv_fusion.ipynb", tmp_path))


def check_cnn_conv_fusion_notebook(nb, s):
    # Every BatchNorm of the example ResNet is folded; the convolutions fuse with their activations, unless
    # autotune measured the fused graph no faster than the graph before (then it undoes the fusion).
    assert s["counts"].get("conv_bn_fold") == 9
    assert s["graph_choice"] in ("fused", "before")
    if s["graph_choice"] == "fused":
        assert s["counts"].get("conv_activation", 0) >= 6
    else:
        assert "conv_activation" not in s["counts"]
    assert s["autotune_choices"] >= 1
    assert s["optimized_nodes"] < s["eager_nodes"]
    assert 0 < s["eager_memory_bound_share"] < 1
    assert s["max_abs_err"] < 1e-4
    assert s["eager_ms"] > 0 and s["fxforge_ms"] > 0
    assert _count_outputs(nb, "image/png") >= 2  # the eager and the optimized profile plots
    assert _count_outputs(nb, "image/svg+xml") >= 1  # the coloured graph


@pytest.mark.slow
def test_attention_sequence_length_notebook(tmp_path):
    check_attention_sequence_length_notebook(*_execute("02_attention_sequence_length.ipynb", tmp_path))


def check_attention_sequence_length_notebook(nb, s):
    seqs = list(s["attention_counts"])
    assert len(seqs) >= 3
    for seq in seqs:
        assert s["attention_counts"][seq] == s["layers"], seq  # every layer's attention became SDPA
        assert s["max_abs_err"][seq] < 1e-4, seq
        assert s["fxforge_peak_mib"][seq] < s["eager_peak_mib"][seq], seq
        assert s["fxforge_simulated_mib"][seq] == pytest.approx(s["fxforge_peak_mib"][seq], rel=0.05), seq
    # Eager's peak grows faster than linearly (S x S scores); fxforge's stays about linear.
    assert s["fxforge_memory_exponent"] < 1.25
    assert s["eager_memory_exponent"] > s["fxforge_memory_exponent"] + 0.3
    assert s["profiled_nodes"]["fxforge"] < s["profiled_nodes"]["eager"]
    assert s["profiled_sdpa_nodes"] == s["layers"] == s["profiled_eager_softmax_nodes"]
    assert _count_outputs(nb, "image/png") >= 2  # latency and memory vs S; the profile plots


@pytest.mark.slow
def test_memory_reorder_branchy_notebook(tmp_path):
    check_memory_reorder_branchy_notebook(*_execute("03_memory_reorder_branchy.ipynb", tmp_path))


def check_memory_reorder_branchy_notebook(nb, s):
    assert s["counts"].get("memory_reorder", 0) >= 1
    assert s["segments"] >= 1 and s["proven_optimal"]
    assert s["simulated_after"] < s["simulated_before"]
    assert s["measured_after"] < s["measured_before"]
    assert s["measured_before"] == pytest.approx(s["simulated_before"], rel=0.05)
    assert s["measured_after"] == pytest.approx(s["simulated_after"], rel=0.05)
    assert s["outputs_equal"]
    assert s["others"], "the table of other graphs is empty"
    for name, row in s["others"].items():
        assert row["outputs_equal"] and row["sim_after_le_before"], name
    assert _count_outputs(nb, "image/png") >= 1  # the timeline plot


@pytest.mark.slow
def test_training_memory_notebook(tmp_path, monkeypatch):
    # Every cell, on a GPT-2 of 2 layers instead of the stored run's 4 (the kernel inherits the environment):
    # half the graphs to plan under the five budgets, the same story (the stored run's: test_stored_notebook).
    monkeypatch.setenv("FXFORGE_NOTEBOOK_LAYERS", "2")
    nb, summary = _execute("04_training_memory.ipynb", tmp_path)
    assert "2 layers" in "".join(_stream_text(c) for c in nb.cells if c.cell_type == "code")
    check_training_memory_notebook(nb, summary)


def check_training_memory_notebook(nb, s):
    # weights + gradients + AdamW's two moments: 16 bytes per fp32 parameter (plus a step count per tensor)
    assert s["bytes_per_param_fixed"] == pytest.approx(16, abs=0.01)
    assert abs(s["peak_error_percent"]) < 5
    assert s["predicted_peak"] == pytest.approx(s["measured_peak"], rel=0.05)
    assert all(abs(e) < 5 for e in s["sweep_peak_errors_percent"]), s["sweep_peak_errors_percent"]
    # the fixed part does not move; the activations grow with the batch (linearly) and the sequence (faster)
    assert len(s["fixed_by_point"]) == 1
    by_batch = [s["activations_by_batch"][k] for k in sorted(s["activations_by_batch"], key=int)]
    by_seq = [s["activations_by_seq"][k] for k in sorted(s["activations_by_seq"], key=int)]
    assert all(a < b for a, b in itertools.pairwise(by_batch)) and len(by_batch) >= 3
    assert all(a < b for a, b in itertools.pairwise(by_seq)) and len(by_seq) >= 3
    batches = sorted(map(int, s["activations_by_batch"]))
    assert by_batch[-1] / by_batch[0] == pytest.approx(batches[-1] / batches[0], rel=0.15)  # linear in B
    assert s["activations_by_seq"]["256"] > 2 * s["activations_by_seq"]["128"]  # faster than linear in S
    # checkpointing: nothing recomputed at 100 %; the measured peak falls as the budget falls (a budget below
    # what recomputation reaches is refused with a BudgetError, which the notebook reports)
    budgets = sorted(s["budgets"], key=int, reverse=True)
    assert budgets[:3] == ["100", "80", "60"], (budgets, s["unreachable_budgets"])
    assert s["budgets"]["100"]["recomputed"] == 0
    assert all(s["budgets"][b]["recomputed"] > 0 for b in budgets[1:])
    assert all(int(u) < int(budgets[-1]) for u in s["unreachable_budgets"])  # refused only below those met
    peaks = [s["budgets"][b]["measured_peak_mib"] for b in budgets]
    assert all(later <= earlier * 1.01 for earlier, later in itertools.pairwise(peaks)), peaks
    assert peaks[-1] < 0.8 * peaks[0], peaks
    for b in budgets:
        row = s["budgets"][b]
        assert row["measured_peak_mib"] == pytest.approx(row["predicted_peak_mib"], rel=0.05), (b, row)
        assert row["time_ratio"] > 0
    assert _count_outputs(nb, "image/png") >= 3  # the step's timeline, the sweep, memory against time


CHECKS = {
    "01_cnn_conv_fusion.ipynb": check_cnn_conv_fusion_notebook,
    "02_attention_sequence_length.ipynb": check_attention_sequence_length_notebook,
    "03_memory_reorder_branchy.ipynb": check_memory_reorder_branchy_notebook,
    "04_training_memory.ipynb": check_training_memory_notebook,
}
