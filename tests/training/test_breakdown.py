"""fxforge.training_memory: the predicted step against one measured on the same model (issue 22)."""

from __future__ import annotations

import pytest
import torch

import fxforge
from fxforge.training.measure import measure_step
from tests.training.models import MODELS, gpt2, ids

# The CPU allocator's records see every byte; the prediction models the ATen ops and the copies a matrix
# product makes, not the workspaces of oneDNN's and im2col's convolution backward: on this 0.4 MiB ResNet they
# are 16 % of the step's peak (on the benchmark's ResNet-50, 0.9 %).
PEAK_TOLERANCE = {"resnet": 0.2}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_predicted_step_matches_the_allocators_records(name):
    build, inputs = MODELS[name]
    model, x = build(), inputs(1)
    tm = fxforge.training_memory(model, (x,), optimizer=torch.optim.AdamW)
    m = tm.measure().measured
    assert abs(tm.peak_bytes - m.peak_bytes) <= PEAK_TOLERANCE.get(name, 0.002) * m.peak_bytes, tm.table
    assert abs(tm.activations_bytes - m.saved_bytes) <= 0.002 * m.saved_bytes, tm.table
    assert (tm.weights_bytes, tm.gradients_bytes, tm.optimizer_state_bytes) == \
        (m.weights_bytes, m.gradient_bytes, m.optimizer_state_bytes)
    assert tm.peak_bytes == max(tm.forward_peak_bytes, tm.backward_peak_bytes, tm.optimizer_peak_bytes)
    table = tm.table
    assert list(table.columns) == ["predicted_MiB", "measured_MiB", "error_%"]
    assert abs(table.loc["peak", "error_%"]) <= 100 * PEAK_TOLERANCE.get(name, 0.002)


def test_a_longer_sequence_grows_the_activations_and_nothing_else():
    model = gpt2(dropout=0.0)
    short = fxforge.training_memory(model, (ids(0, seq=32),))
    long = fxforge.training_memory(model, (ids(0, seq=128),))
    assert long.activations_bytes > 3.5 * short.activations_bytes
    assert (long.weights_bytes, long.gradients_bytes, long.optimizer_state_bytes) == \
        (short.weights_bytes, short.gradients_bytes, short.optimizer_state_bytes)


def test_frozen_layers_have_no_gradients_and_no_optimizer_state():
    model = gpt2(dropout=0.0)
    for p in model.transformer.wte.parameters():
        p.requires_grad_(False)
    full = gpt2(dropout=0.0)
    tm, tm_full = (fxforge.training_memory(m, (ids(2),)) for m in (model, full))
    frozen = model.transformer.wte.weight
    nbytes = frozen.numel() * frozen.element_size()
    assert tm_full.gradients_bytes - tm.gradients_bytes == nbytes
    assert tm_full.optimizer_state_bytes - tm.optimizer_state_bytes == 2 * nbytes + 4  # exp_avg, exp_avg_sq, step
    m = tm.measure().measured
    assert (m.gradient_bytes, m.optimizer_state_bytes) == (tm.gradients_bytes, tm.optimizer_state_bytes)
    assert abs(tm.peak_bytes - m.peak_bytes) <= 0.01 * m.peak_bytes


def test_bf16_autocast_is_predicted_as_measured():
    model = gpt2(dropout=0.0)
    tm = fxforge.training_memory(model, (ids(3),), autocast=torch.bfloat16)
    fp32 = fxforge.training_memory(model, (ids(3),))
    m = tm.measure().measured
    assert abs(tm.peak_bytes - m.peak_bytes) <= 0.05 * m.peak_bytes, tm.table
    assert abs(tm.activations_bytes - m.saved_bytes) <= 0.05 * m.saved_bytes, tm.table
    assert tm.activations_bytes != fp32.activations_bytes  # the casts and bf16 values are what is saved


@pytest.mark.parametrize("optimizer, factor", [(None, 0), ("sgd", 1), (torch.optim.Adam, 2),
                                               (lambda params: torch.optim.RMSprop(params), 1)])
def test_optimizer_state_follows_the_optimizer(optimizer, factor):
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    tm = fxforge.training_memory(model, (torch.randn(16, 32),), optimizer=optimizer)
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert factor * weights <= tm.optimizer_state_bytes <= factor * weights + 4 * 4  # + a step counter each
    m = tm.measure().measured
    assert m.optimizer_state_bytes == tm.optimizer_state_bytes
    assert abs(tm.peak_bytes - m.peak_bytes) <= 0.01 * m.peak_bytes


def test_keyword_inputs_and_a_loss_of_ones_own():
    model = gpt2(dropout=0.0)
    x = ids(4)
    loss = lambda out: torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), x.flatten())
    tm = fxforge.training_memory(model, {"input_ids": x}, loss=loss)
    m = tm.measure().measured
    assert abs(tm.peak_bytes - m.peak_bytes) <= 0.01 * m.peak_bytes, tm.table


def test_per_module_table_adds_up_and_names_the_blocks():
    model = gpt2(dropout=0.0)
    tm = fxforge.training_memory(model, (ids(5),))
    table = tm.by_module(depth=None)
    assert table["weights_MiB"].sum() * 2**20 == pytest.approx(tm.weights_bytes, rel=1e-6)
    assert table["activations_MiB"].sum() * 2**20 == pytest.approx(tm.activations_bytes, rel=1e-6)
    blocks = tm.by_module(depth=3)
    assert {"transformer.h.0", "transformer.h.1"} <= set(blocks.index)
    assert blocks.loc["transformer.h.0", "activations_MiB"] > 0
    # Keyword inputs (a tokenizer's dict) name the same modules: the step's ops keep their module records.
    by_keyword = fxforge.training_memory(model, {"input_ids": ids(5)}).by_module(depth=3)
    assert by_keyword["activations_MiB"].to_dict() == pytest.approx(blocks["activations_MiB"].to_dict())


def test_measuring_leaves_the_model_as_it_was():
    model = gpt2(dropout=0.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fxforge.training_memory(model, (ids(6),)).measure()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_html_and_plot():
    import matplotlib

    matplotlib.use("Agg")
    tm = fxforge.training_memory(torch.nn.Linear(8, 8), (torch.randn(4, 8),))
    assert "Training step memory" in tm._repr_html_() and "predicted_MiB" in tm._repr_html_()
    tm.measure()
    assert "measured_MiB" in tm._repr_html_()
    ax = tm.plot()
    assert ax.get_ylabel() == "MiB" and len(ax.get_legend().get_texts()) == 5


def test_a_model_without_a_backward_is_refused():
    model = torch.nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(RuntimeError, match="no parameter or input that requires grad"):
        fxforge.training_memory(model, (torch.randn(2, 4),))


def test_measure_step_on_a_plain_model_matches_the_dispatch_count():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    m = measure_step(model, (torch.randn(32, 64),), {}, optimizer=None)
    assert (m.saved_bytes, m.gradient_bytes) == (32 * 64 * 4, (64 * 64 + 64 + 64 + 1) * 4)
