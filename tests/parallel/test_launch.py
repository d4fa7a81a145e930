"""Partitioned models run on torch.distributed.pipelining with gloo, one local process per stage, and
give the single process's outputs and gradients (fxforge/parallel/launch.py, worker.py).

Each run starts k Python processes (about 10-25 s on two cores), so each case runs distinct code: GPT-2 over 2
stages with 1F1B and a loss of the user's, over 4 with GPipe and the default loss; ResNet in train mode (batch-norm
statistics per microbatch, a residual's skip sent between stages); a loss failing on the last stage."""

from __future__ import annotations

import pytest
import torch

import fxforge
from fxforge.parallel.launch import microbatches_of, reference_step, run_pipeline, square_mean_loss
from tests.training import models


@pytest.mark.parametrize("stages,schedule,loss_fn", [(2, "1F1B", "cube_loss"), (4, "GPipe", None)])
def test_gpt2_through_gloo_equals_one_process(stages, schedule, loss_fn):
    model = models.gpt2(dropout=0.0, layers=4).eval()
    batch = {"input_ids": models.ids(seed=7, batch=8)}              # fresh inputs, not the planning ones
    part = fxforge.partition(model, {"input_ids": models.ids(batch=8)}, stages, microbatches=4,
                             schedule=schedule)
    # a custom loss runs on the workers and the reference alike (the default is square_mean_loss)
    run = run_pipeline(part, batch, steps=2, loss_fn=globals()[loss_fn] if loss_fn else None)
    assert run.backend == "gloo" and run.stages == stages and run.schedule == schedule
    assert run.outputs_match and run.gradients_match, str(run)
    assert run.output_error < 1e-4 and run.gradient_error < 1e-4
    assert len(run.step_seconds) == 2 and "match the single process" in str(run)


def test_resnet_through_gloo_equals_one_process():
    model = models.resnet().train()              # batch-norm statistics per microbatch, as eager's
    part = fxforge.partition(model, (models.images(batch=16, size=64),), 2, microbatches=2)
    assert ".layers.0.layer." in part.split_points[0]               # inside a residual block: the skip is sent
    run = run_pipeline(part, (models.images(seed=3, batch=16, size=64),))
    assert run.ok, str(run)


def test_the_check_fails_when_gradients_or_outputs_differ():
    from fxforge.parallel import launch

    model = models.gpt2(dropout=0.0, layers=2).eval()
    batch = {"input_ids": models.ids(batch=4)}
    part = fxforge.partition(model, batch, 2, microbatches=2)
    out, grads, _ = reference_step(model, (), batch, 2, square_mean_loss)

    def compare(output, gradients):
        worker = {"grads": gradients, "output": output, "seconds": [0.1]}
        aliases = [("transformer.wte.weight", ["transformer.wte.weight", "lm_head.weight"])]
        aliases += [(n, [n]) for n, _ in model.named_parameters() if n != "transformer.wte.weight"]
        return launch._compare(part, model, aliases, (), batch, square_mean_loss, [worker], "1F1B", "gloo", 1)

    # Each stage reports the copies it holds: the tied embedding's gradient comes in two parts that add up.
    one_copy = {n: g for n, g in grads.items() if n != "lm_head.weight"}
    assert compare(out, one_copy).ok
    assert not compare(out, grads).gradients_match                   # counted twice
    assert not compare(out, dict(one_copy, **{"transformer.wte.weight": None})).gradients_match  # lost
    assert not compare([o + 1e-2 for o in out], one_copy).outputs_match


def test_a_custom_loss_that_cannot_be_sent_or_fails_on_a_worker_is_reported():
    model = models.gpt2(dropout=0.0, layers=2).eval()
    batch = {"input_ids": models.ids(batch=4)}
    part = fxforge.partition(model, batch, 2, microbatches=2)       # a custom loss that runs: GPT-2 [2-1F1B]
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
