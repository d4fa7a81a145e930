"""One rank of a data / fully-sharded / tensor-parallel training run (:func:`fxforge.parallel.run` starts one
per device).

::

    python -m fxforge.parallel.mesh_worker PAYLOAD RANK WORLD OUT_DIR [SETUP_MODULE:FUNCTION]

The rank builds the device mesh ``dp x fsdp x tp`` (tp innermost), parallelizes its copy of the model in
the order the ecosystem composes them (tensor parallel with ``parallelize_module`` first, then
``fully_shard`` over the fsdp axis — hybrid over ``dp x fsdp`` — or data parallel: DDP alone, FSDP2's
``replicate`` over DTensor parameters), takes its slice of the batch (the batch is split over
``dp x fsdp``; tensor-parallel ranks see the same rows), and runs steps of forward, backward and the
optimizer:

- step 1 starts from the model's weights: its outputs and every parameter's full gradient are kept;
- every step's wall time, between barriers, is kept;
- one more step after them (the optimizer's state exists, DDP has rebuilt its buckets) is the steady state:
  its collectives are counted (:class:`~fxforge.parallel.collectives.CollectiveCounter`) and its memory
  measured (the CPU allocator's records through the profiler, or CUDA's statistics). It is not timed: the
  profiler and the counter slow it (a small float64 ViT's tensor-parallel step: 102 ms timed so, 30-45 ms
  without).
"""

from __future__ import annotations

import sys
import time
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from fxforge.parallel.collectives import CollectiveCounter, apply_fully_shard, blocking_allreduce_hook
from fxforge.parallel.processes import worker_main
from fxforge.training.measure import PhaseMeter

MESH_AXES = ("dp", "fsdp", "tp")
"""The axes a mesh run builds, outermost first (pipelines run through :mod:`fxforge.parallel.launch`)."""


def data_slice(value: Any, index: int, parts: int) -> Any:
    """Rows ``index`` of ``parts`` equal slices of every batched tensor in ``value``.

    Example:
        >>> data_slice((torch.arange(6), 3), 1, 3)
        (tensor([2, 3]), 3)
    """
    def cut(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or parts == 1:
            return t
        if t.shape[0] % parts:
            raise ValueError(f"a batch of {t.shape[0]} rows does not split into {parts} equal parts")
        rows = t.shape[0] // parts
        return t[index * rows:(index + 1) * rows]

    return pytree.tree_map(cut, value)


def build_mesh(strategy: dict[str, int], device_type: str) -> Any:
    """The device mesh over the axes of ``strategy`` above 1 (None when there are none)."""
    from torch.distributed.device_mesh import init_device_mesh

    axes = [(a, strategy.get(a, 1)) for a in MESH_AXES if strategy.get(a, 1) > 1]
    if not axes:
        return None
    return init_device_mesh(device_type, tuple(s for _, s in axes), mesh_dim_names=tuple(a for a, _ in axes))


def parallelized(model: torch.nn.Module, strategy: dict[str, int], tp_plan: Any, mesh: Any, *,
                 blocking_ddp: bool = False) -> tuple[torch.nn.Module, str]:
    """``model`` parallelized in place over ``mesh``; returns the module to call and the data-parallel style
    (``"ddp"``, ``"replicate"``, ``"fsdp"`` or ``""``)."""
    dp, fsdp, tp = (strategy.get(a, 1) for a in MESH_AXES)
    if tp > 1:
        from fxforge.parallel.tp_build import apply_tp

        apply_tp(model, tp_plan, mesh["tp"])
    if fsdp > 1:
        apply_fully_shard(model, mesh["dp", "fsdp"] if dp > 1 else mesh["fsdp"])
        return model, "fsdp"
    if dp > 1 and tp > 1:
        from torch.distributed._composable.replicate_with_fsdp import replicate

        from fxforge.parallel.collectives import fsdp_blocks

        for name in fsdp_blocks(model):
            replicate(model.get_submodule(name), mesh=mesh["dp"])
        replicate(model, mesh=mesh["dp"])
        return model, "replicate"
    if dp > 1:
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=mesh["dp"].get_group())
        if blocking_ddp:
            ddp.register_comm_hook(None, blocking_allreduce_hook)
        return ddp, "ddp"
    return model, ""


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    if isinstance(t, torch.distributed.tensor.DTensor):
        t = t.full_tensor()
    return t.detach().cpu().clone()


def run_rank(payload: dict[str, Any], rank: int, world: int, device: torch.device) -> dict[str, Any]:
    """Parallelize, run the payload's steps and return this rank's figures (the group is initialised)."""
    torch.set_num_threads(payload["threads"])
    strategy = payload["strategy"]
    model = payload["model"].to(device)
    mesh = build_mesh(strategy, device.type)
    module, style = parallelized(model, strategy, payload["tp_plan"], mesh)
    replicas = strategy.get("dp", 1) * strategy.get("fsdp", 1)
    index = rank // strategy.get("tp", 1)
    args, kwargs = data_slice((payload["args"], payload["kwargs"]), index, replicas)
    args, kwargs = pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, (args, kwargs))
    loss_fn = payload["loss_fn"]
    optimizer = payload["optimizer"](list(model.parameters())) if payload["optimizer"] else None
    named = list(model.named_parameters(remove_duplicate=False))
    steps = payload["warmup"] + payload["steps"] + 1  # the last one measured, not timed
    seconds, output, grads, counted, memory = [], None, None, [], {}
    for step in range(steps):
        last = step == steps - 1
        counter = CollectiveCounter(groups=mesh) if last and mesh is not None else None
        meter = PhaseMeter(device) if last else None
        for p in model.parameters():
            p.grad = None
        dist.barrier()
        start = time.perf_counter()
        with counter if counter is not None else nullcontext(), meter if meter is not None else nullcontext():
            out = module(*args, **kwargs)
            loss = loss_fn(out, None)
            if meter is not None:
                meter.end("forward")
            loss.backward()
            if meter is not None:
                meter.end("backward")
            if step == 0:
                grads = {n: _full(p.grad) for n, p in named}
                output = pytree.tree_map(lambda t: _full(t) if isinstance(t, torch.Tensor) else t, out)
            if optimizer is not None:
                with counter.phase("optimizer") if counter is not None else nullcontext():
                    optimizer.step()
            if meter is not None:
                meter.end("optimizer")
        dist.barrier()
        if not last:
            seconds.append(time.perf_counter() - start)
        if counter is not None:
            counted = counter.collectives
        if meter is not None:
            memory = {phase: figures.peak_bytes for phase, figures in meter.phases().items()}
        del out, loss
    persistent = local_bytes(model, optimizer)
    return {"seconds": seconds, "output": output, "grads": grads, "collectives": counted, "style": style,
            "memory": memory, "persistent": persistent, "index": index}


def local_bytes(model: torch.nn.Module, optimizer: Any) -> dict[str, int]:
    """This rank's share of the weights, buffers and the optimizer's state, in bytes (a tensor shared by
    several names once; a DTensor by its local shard).

    Example:
        >>> local_bytes(torch.nn.Linear(2, 2), None)
        {'weights': 24, 'buffers': 0, 'optimizer_state': 0}
    """
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, torch.distributed.tensor.DTensor) else t

    from fxforge.training.measure import unique_bytes

    state = [local(t) for s in (optimizer.state.values() if optimizer is not None else ()) for t in s.values()
             if isinstance(t, torch.Tensor)]
    return {"weights": unique_bytes(local(p) for p in model.parameters()),
            "buffers": unique_bytes(model.buffers()), "optimizer_state": unique_bytes(state)}


def main(argv: list[str]) -> int:
    return worker_main(argv, run_rank)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
