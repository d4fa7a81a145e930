"""Partitioned models run on torch.distributed.pipelining with gloo, one local process per stage, and
give the single process's outputs and gradients (fxforge/parallel/launch.py, worker.py).

Each run starts k Python processes (about 10-25 s on two cores), so each runs distinct code: GPT-2 over 4 stages
with GPipe and the default loss (its tied embedding on the first and the last stage); LLaMA over 2 with 1F1B and a
loss of the user's (its rotary embedding as GradFree); ResNet in train mode (batch-norm statistics per microbatch, a
residual's skip sent between stages); a loss failing on the last stage."""

from __future__ import annotations

import functools

import pytest
import torch

import fxforge
from fxforge.parallel.collectives import comparable
from fxforge.parallel.launch import microbatches_of, reference_step, run_pipeline, square_mean_loss
from fxforge.parallel.restructure import GradFree, no_grad_forward
from fxforge.parallel.stage_sends import predicted_sends
from fxforge.runtime.roofline import Machine
from tests.parallel.mesh_models import RecordingSGD
from tests.training import models


@pytest.fixture(scope="module")
def small_gpt2():
    """Two-layer GPT-2, a batch of 4 and its 2-stage partition (2 microbatches), for the tests that check errors."""
    model = models.gpt2(dropout=0.0, layers=2).eval()
    batch = {"input_ids": models.ids(batch=4)}
    return model, batch, fxforge.partition(model, batch, 2, microbatches=2)


def test_gpt2_through_gloo_equals_one_process():
    model = models.gpt2(dropout=0.0, layers=4).eval()
    batch = {"input_ids": models.ids(seed=7, batch=8)}              # fresh inputs, not the planning ones
    part = fxforge.partition(model, {"input_ids": models.ids(batch=8)}, 4, microbatches=4, schedule="GPipe")
    run = run_pipeline(part, batch, steps=2)                        # the tied embedding on the first and last stage
    assert run.backend == "gloo" and run.stages == 4 and run.schedule == "GPipe"
    assert run.outputs_match and run.gradients_match, str(run)
    assert run.output_error < 1e-4 and run.gradient_error < 1e-4
    assert len(run.step_seconds) == 2 and "match the single process" in str(run)
    # every send the stages made, microbatch by microbatch, as the split graph predicts: activations forward
    # (the attention mask included), gradients of the floating-point ones back, between any two stages
    predicted = predicted_sends(part.pipe(), part.microbatches)
    assert comparable(run.sends) == comparable(predicted) and len(run.sends) == len(predicted) > 0
    assert {c.where for c in run.sends} == {c.where for c in predicted}


def test_llama_through_gloo_with_the_users_loss_and_optimizer_equals_one_process(tmp_path):
    """LLaMA, whose rotary embedding runs under no_grad in transformers <= 5.23, split as GradFree
    (fxforge/parallel/restructure.py); the user's loss runs on the last stage and in the reference alike; each
    stage steps the user's optimizer on its own parameters after every step."""
    model = models.llama().eval()
    part = fxforge.partition(model, {"input_ids": models.ids(batch=8)}, 2, microbatches=4, schedule="1F1B")
    if no_grad_forward(model.model.rotary_emb) is not None:
        assert isinstance(part.pipeline_model.model.rotary_emb, GradFree)
    assert type(model.model.rotary_emb).__name__ == "LlamaRotaryEmbedding"   # the model is left as it was
    record = tmp_path / "steps"
    run = run_pipeline(part, {"input_ids": models.ids(seed=4, batch=8)}, steps=2, loss_fn=cube_loss,
                       optimizer=functools.partial(RecordingSGD, record=str(record)))
    assert run.backend == "gloo" and run.stages == 2 and run.schedule == "1F1B"
    assert run.outputs_match and run.gradients_match, str(run)     # checked on the first step, before its update
    assert run.output_error < 1e-4 and run.gradient_error < 1e-4
    assert len(run.step_seconds) == 2
    stepped = [int(line) for line in record.read_text().split()]
    assert len(stepped) == 6                # two stages, two timed steps each and one measuring their memory
    assert sorted(set(stepped)) != [sum(p.numel() for p in model.parameters())]   # each its own stage's share


def test_resnet_through_gloo_equals_one_process():
    model = models.resnet().train()              # batch-norm statistics per microbatch, as eager's
    # A fixed machine: the roofline costs, and so the split, do not move with the load.
    part = fxforge.partition(model, (models.images(batch=16, size=64),), 2, microbatches=2,
                             machine=Machine("cpu", 150.0, 25.0, "fixed"))
    assert ".layers.0.layer." in part.split_points[0]               # inside a residual block: the skip is sent
    run = run_pipeline(part, (models.images(seed=3, batch=16, size=64),))
    assert run.ok, str(run)


def test_the_check_fails_when_gradients_or_outputs_differ(small_gpt2):
    from fxforge.parallel import launch

    model, batch, part = small_gpt2
    out, grads, _ = reference_step(model, (), batch, 2, square_mean_loss)

    def compare(output, gradients):
        worker = {"grads": gradients, "output": output, "seconds": [0.1], "sends": [], "memory": 0}
        aliases = [("transformer.wte.weight", ["transformer.wte.weight", "lm_head.weight"])]
        aliases += [(n, [n]) for n, _ in model.named_parameters() if n != "transformer.wte.weight"]
        return launch._compare(part, model, aliases, (), batch, square_mean_loss, [worker], "1F1B", "gloo", 1)

    # Each stage reports the copies it holds: the tied embedding's gradient comes in two parts that add up.
    one_copy = {n: g for n, g in grads.items() if n != "lm_head.weight"}
    assert compare(out, one_copy).ok
    assert not compare(out, grads).gradients_match                   # counted twice
    assert not compare(out, dict(one_copy, **{"transformer.wte.weight": None})).gradients_match  # lost
    assert not compare([o + 1e-2 for o in out], one_copy).outputs_match


def test_a_custom_loss_that_cannot_be_sent_or_fails_on_a_worker_is_reported(small_gpt2):
    _, batch, part = small_gpt2                                     # a custom loss that runs: GPT-2 [2-1F1B]
    with pytest.raises(ValueError, match="loss_fn cannot be sent to the workers"):
        run_pipeline(part, batch, loss_fn=lambda out, target: out.sum())
    with pytest.raises(RuntimeError, match=r"pipeline stage 1 failed: ValueError: no loss here"):
        run_pipeline(part, batch, loss_fn=failing_loss)


def cube_loss(output, target=None):
    return output.float().pow(3).mean()


def failing_loss(output, target=None):
    raise ValueError("no loss here")


def test_microbatches_are_sliced_like_the_schedules():
    pieces = microbatches_of((torch.arange(8).view(8, 1), 3), {"mask": torch.ones(8, 2)}, 4)
    assert [p[0][0].flatten().tolist() for p in pieces] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert pieces[0][0][1] == 3 and pieces[3][1]["mask"].shape == (2, 2)
