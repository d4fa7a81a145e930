"""A model output computed before the last stage is returned by the pipeline (fxforge/parallel/stage_outputs.py):
T5's encoder states when the split falls in the decoder, and a user model returning the features of two earlier
blocks over three stages (handed on through a stage that returned one value). On gloo, as one process gives them,
gradients included: the handed-on outputs are part of the loss."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch.distributed.pipelining import SplitPoint, pipeline

import fxforge
from fxforge.parallel.engine import first_failing_stage
from fxforge.parallel.launch import run_pipeline
from fxforge.parallel.stage_outputs import outputs_from_last_stage
from tests.parallel.mesh_models import Features


def test_values_from_earlier_stages_are_handed_on_in_the_output_order():
    model, x = Features(), torch.randn(4, 8)
    pipe = pipeline(model, (x,), split_spec={"block2": SplitPoint.BEGINNING, "block3": SplitPoint.BEGINNING})
    assert outputs_from_last_stage(pipe) == 2
    last = [n for n in pipe.split_gm.graph.nodes if n.op == "call_module"][-1]
    returned = pipe.split_gm.graph.output_node().all_input_nodes
    assert all(n.args[0] is last for n in returned)
    got = pipe(x)
    want = model(x)
    for got_value, key in zip(torch.utils._pytree.tree_leaves(got), ("logits", "f1", "f2")):
        torch.testing.assert_close(got_value, want[key])
    assert first_failing_stage(pipe, ((x,), {})) is None
    assert outputs_from_last_stage(pipe) == 0                     # nothing left to hand on


def test_a_model_returning_its_own_input_is_refused_with_the_reason():
    class Echo(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(x)), x

    pipe = pipeline(Echo(), (torch.randn(2, 4),), split_spec={"b": SplitPoint.BEGINNING})
    with pytest.raises(ValueError, match="which no pipeline stage computes"):
        outputs_from_last_stage(pipe)


def test_a_user_model_returning_earlier_features_trains_through_three_stages_as_one_process():
    model = Features()
    part = fxforge.partition(model, (torch.randn(12, 8),), 3, microbatches=3)
    run = run_pipeline(part, (torch.randn(12, 8, generator=torch.Generator().manual_seed(3)),))
    assert run.ok, str(run)


def test_t5_split_in_its_decoder_returns_the_encoder_states_and_their_gradients():
    torch.manual_seed(0)
    config = transformers.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=64,
                                   dropout_rate=0.0, use_cache=False)
    model = transformers.T5ForConditionalGeneration(config).eval()
    ids = torch.randint(0, 64, (4, 8))
    part = fxforge.partition(model, {"input_ids": ids, "decoder_input_ids": ids}, 2)
    assert any(name.startswith("decoder.") for name in part.split_points)
    fresh = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(5))
    run = run_pipeline(part, {"input_ids": fresh, "decoder_input_ids": fresh})
    assert run.ok, str(run)
