"""DDP's bucket all-reduces behind the backward (fxforge.parallel.overlap): ready times, buckets, the price."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fxforge
from fxforge.core.links import Link
from fxforge.parallel.collectives import Collective, data_parallel_collectives
from fxforge.parallel.overlap import (
    bucket_ready_shares,
    ddp_communication,
    gradient_ready_order,
    gradient_ready_times,
)
from tests.parallel.mesh_models import residual_mlp

LINK = Link("test link", alpha_s=50e-6, bandwidth_gbs=1.0, source="a round figure for the tests")


def _wide(layers: int = 6) -> torch.nn.Module:
    return residual_mlp(width=512, hidden=1024, layers=layers)


def _hooked_order(model: torch.nn.Module, x: torch.Tensor) -> list[str]:
    """The order autograd's post-accumulate hooks fire in one backward: the reference, taken apart from the
    module's timing."""
    order: list[str] = []
    handles = [p.register_post_accumulate_grad_hook(lambda _, n=n: order.append(n))
               for n, p in model.named_parameters()]
    model(x).sum().backward()
    for handle in handles:
        handle.remove()
    model.zero_grad(set_to_none=True)
    return order


def test_ready_times_follow_the_backward_from_the_head_to_the_first_layer():
    model, x = _wide(), torch.randn(64, 512)
    ready, backward_share = gradient_ready_times(model, (x,))
    names = [name for name, _ in ready]
    assert names == _hooked_order(model, x) == gradient_ready_order(model, (x,))
    shares = [share for _, share in ready]
    assert shares == sorted(shares) and all(0.0 <= s <= 1.0 for s in shares)
    # the head's gradients come first, the first block's last, near the backward's end
    assert names[0].startswith("head.") and names[-1].startswith("layers.0.")
    by_name = dict(ready)
    assert by_name["head.weight"] < 0.2 and by_name["layers.0.up.weight"] > 0.7
    assert 0.3 < backward_share < 0.9  # a backward takes about twice its forward
    assert all(p.grad is None for p in model.parameters())  # the gradients are put back


def test_buckets_are_ddps_and_each_is_ready_with_its_last_gradient():
    model, x = _wide(), torch.randn(64, 512)
    ready, _ = gradient_ready_times(model, (x,))
    shares = bucket_ready_shares(model, ready)
    reduces = [c for c in data_parallel_collectives(model, 2, ready_order=[n for n, _ in ready])
               if c.kind == "all_reduce"]
    assert len(shares) == len(reduces) > 1
    assert shares == sorted(shares) and shares[-1] == max(s for _, s in ready)


def test_a_ddp_step_pays_its_buckets_behind_the_backward_and_the_broadcasts_whole():
    buffers = Collective("broadcast", 10**5, 2, "dp", "forward", "buffers")
    buckets = [Collective("all_reduce", 4 * 10**6, 2, "dp", "backward", str(i)) for i in range(3)]
    each = LINK.seconds("all_reduce", 4 * 10**6, 2)
    shares, backward = [0.1, 0.5, 1.0], 0.1
    blocking = LINK.seconds("broadcast", 10**5, 2) + 3 * each
    assert ddp_communication(LINK, [buffers, *buckets], shares, backward, 0.2) == pytest.approx(blocking)
    hiding = dataclasses.replace(LINK, overlap=1.0)
    # the first two end inside the backward (hidden), the last is ready at its end (whole)
    assert ddp_communication(hiding, [buffers, *buckets], shares, backward, 0.2) == pytest.approx(
        LINK.seconds("broadcast", 10**5, 2) + each)
    waiting = dataclasses.replace(hiding, sync_s=1e-3, sync_fraction=0.1)  # the broadcast and the final wait
    assert ddp_communication(waiting, [buffers, *buckets], shares, backward, 0.2) == pytest.approx(
        LINK.seconds("broadcast", 10**5, 2) + each + 2e-3 + 0.02)
    with pytest.raises(ValueError, match="3 bucket all-reduces but 2 ready shares"):
        ddp_communication(LINK, buckets, shares[:2], backward, 0.2)


def test_the_planner_prices_ddp_with_the_links_overlap(monkeypatch):
    # The same DDP plan on a link that hides all of an asynchronous collective: only the buckets that run past
    # the backward remain (here the last, the first block's gradients); on a blocking link, every bucket.
    monkeypatch.setattr("fxforge.parallel.twins.Twins.__enter__", lambda self: self)
    model, batch = residual_mlp(width=1024, hidden=2048, layers=8), (torch.randn(64, 1024),)  # 6 buckets
    fast = dataclasses.replace(LINK, bandwidth_gbs=5.0)
    plans = {overlap: fxforge.parallelize(model, batch, devices=2, pipeline=False, mesh={"dp": 2},
                                          link=dataclasses.replace(fast, overlap=overlap))
             for overlap in (0.0, 1.0)}
    blocking, hiding = plans[0.0].chosen, plans[1.0].chosen
    assert blocking.comm_s == pytest.approx(sum(fast.seconds(c.kind, c.nbytes, c.ranks)
                                                for c in blocking.collectives))
    buckets = [c for c in hiding.collectives if c.kind == "all_reduce"]
    assert len(buckets) > 3
    assert 0.5 * fast.seconds("all_reduce", buckets[-1].nbytes, 2) < hiding.comm_s < 0.5 * blocking.comm_s
