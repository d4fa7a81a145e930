"""What a pipeline's stages send each other in a step: predicted from the engine's own split
(:func:`predicted_sends`) and counted in a run (:func:`counted_sends`), as the same records, so that the two
compare exactly (:func:`fxforge.parallel.collectives.comparable`).

``torch.distributed.pipelining`` sends, for each microbatch, every input a stage takes from an earlier
stage's outputs (forward: masks and other tensors that need no gradient included), and back a gradient for
each of those inputs that is floating point (backward: a zero gradient where autograd gave none). The
model's own inputs are not sent: the first stage reads them. One record per microbatch, direction and pair
of stages, with the bytes of all the tensors in it; ``where`` names the pair as ``"stage i -> j"`` (i < j)
in both directions.

Example:
    >>> from fxforge.parallel.engine import build_pipe, _spec
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    >>> pipe = build_pipe(net, ((torch.randn(3, 4),), {}), _spec(["1"]), 2)
    >>> [(c.phase, c.nbytes, c.where) for c in predicted_sends(pipe, microbatches=1)]
    [('forward', 96, 'stage 0 -> 1'), ('backward', 96, 'stage 0 -> 1')]
"""

from __future__ import annotations

from typing import Any

import torch

from fxforge.parallel.collectives import Collective


def _source_stage(node: torch.fx.Node, stage_of: dict[str, int]) -> int | None:
    """The stage whose output ``node`` (an argument of a stage's call in the split graph) is; None for the
    model's own inputs."""
    if node.op == "call_function" and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]  # getitem of a stage's outputs
    return stage_of.get(node.target) if node.op == "call_module" else None


def stage_inputs(pipe: Any) -> list[list[tuple[int, torch.Tensor]]]:
    """Per stage, each input it receives from an earlier stage: (that stage, its value on the traced
    microbatch, a fake tensor)."""
    calls = [n for n in pipe.split_gm.graph.nodes if n.op == "call_module"]
    stage_of = {call.target: index for index, call in enumerate(calls)}
    received = []
    for index, call in enumerate(calls):
        holders = list(pipe.get_stage_module(index).graph.find_nodes(op="placeholder"))
        if len(holders) != len(call.args) or call.kwargs:
            raise RuntimeError(f"stage {index}'s inputs do not line up with its call in the split graph")
        received.append([(source, holder.meta["val"]) for arg, holder in zip(call.args, holders)
                         if (source := _source_stage(arg, stage_of)) is not None])
    return received


def _nbytes(value: torch.Tensor) -> int:
    return value.numel() * value.element_size()


def predicted_sends(pipe: Any, microbatches: int) -> list[Collective]:
    """Every send of one step of ``pipe``'s stages over ``microbatches`` microbatches (module docstring)."""
    sends = []
    for stage, inputs in enumerate(stage_inputs(pipe)):
        for source in sorted({s for s, _ in inputs}):
            values = [v for s, v in inputs if s == source]
            where = f"stage {source} -> {stage}"
            forward = sum(_nbytes(v) for v in values)
            backward = sum(_nbytes(v) for v in values if v.is_floating_point())
            for _ in range(microbatches):
                sends.append(Collective("send", forward, 2, "pp", "forward", where))
                if backward:
                    sends.append(Collective("send", backward, 2, "pp", "backward", where))
    return sends


def counted_sends(stage: Any, rank: int) -> list[Collective]:
    """From now on, the sends of ``stage`` (rank ``rank`` of the default group, one stage per rank, as the
    worker runs them) recorded in the returned list as :func:`predicted_sends` writes them. It wraps the
    stage's own builders of its send operations, so it counts what the schedule sends.

    Example (in a pipeline's worker, after the stage is built)::

        sends = counted_sends(stage, rank)
        schedule.step(...)
        total_bytes(sends)
    """
    sent: list[Collective] = []

    def counting(build: Any, phase: str) -> Any:
        def built(chunk: int) -> list[Any]:
            ops = build(chunk)
            by_peer: dict[int, int] = {}
            for op in ops:
                by_peer[op.peer] = by_peer.get(op.peer, 0) + _nbytes(op.tensor)
            for peer, nbytes in by_peer.items():
                low, high = sorted((rank, peer))
                sent.append(Collective("send", nbytes, 2, "pp", phase, f"stage {low} -> {high}"))
            return ops
        return built

    stage.get_fwd_send_ops = counting(stage.get_fwd_send_ops, "forward")
    stage.get_bwd_send_ops = counting(stage.get_bwd_send_ops, "backward")
    return sent
