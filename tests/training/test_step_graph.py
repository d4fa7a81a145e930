"""The step's partitions: made with lazily generated code, the same graphs as torch's partitioner makes."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from fxforge.training.step_graph import is_random, lazy_code, partition, trace_step

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "user_models"))
from hand_written import GPT


def _shape(gm: torch.fx.GraphModule) -> list[tuple]:
    return [(n.op, n.name, str(n.target), tuple(str(a) for a in n.args)) for n in gm.graph.nodes]


def test_lazy_code_makes_the_same_partition_and_it_runs():
    torch.manual_seed(0)
    model, x = GPT().train(), torch.randint(0, 64, (2, 16))
    step = trace_step(model, (x,), {}, loss=None)
    names = [n.name for n in step.forward_nodes() if not is_random(n) and "getitem" not in n.name]
    recompute = set(names[5:40:2])
    plain = partition(step.joint, step.joint_inputs, recompute, **step.partition_kwargs)
    with lazy_code():
        lazy = partition(step.joint, step.joint_inputs, recompute, **step.partition_kwargs)
    assert [_shape(g) for g in plain] == [_shape(g) for g in lazy]
    from torch.fx._lazy_graph_module import _LazyGraphModule

    assert all(isinstance(g, _LazyGraphModule) for g in lazy)  # the backward reordering's module too
    assert not any(isinstance(g, _LazyGraphModule) for g in plain)
    assert torch.fx.GraphModule.__name__ == "GraphModule"  # put back after the call
    # The lazy backward generates its code on its first call and computes what the plain one does.
    fake = step.repartition(recompute)
    assert [_shape(g) for g in (fake.forward, fake.backward)] == [_shape(g) for g in plain]
    assert "def forward" in lazy[1].code
