"""``fxforge.parallelize``: every way to spread a training step over the devices, priced, and the fastest
that fits chosen.

For each mesh ``pp x dp x fsdp x tp`` over the devices (:mod:`fxforge.parallel.strategy`):

- **compute**: rank 0's step as the run builds it (DDP, FSDP2, tensor parallel), on its slice of the batch,
  under a fake process group (:mod:`fxforge.parallel.rank_steps`), timed beside the other ranks' twins
  (:mod:`fxforge.parallel.twins`): DDP's bucket copies, DTensor's dispatch, FSDP2's buffer copies and the
  sharded optimizer step are in it; on meta tensors, the roofline's share of the one-process step;
- **collectives**: every collective of a step, predicted exactly from the graph and the parameters
  (tensor parallel: :func:`~fxforge.parallel.tp_build.predicted_tp_collectives`; fully sharded and data
  parallel: :mod:`fxforge.parallel.collectives`), each priced on the link (alpha-beta,
  :mod:`fxforge.core.links`: measured here for gloo, or a published figure) and added to the compute as
  blocking, but DDP's bucket all-reduces, which run behind the rest of the backward as far as the link's measured
  overlap lets them (:mod:`fxforge.parallel.overlap`), with the waits a blocking collective meets inside a step, measured on the
  link too (:meth:`~fxforge.core.links.Link.synced`: the ranks reach each collective apart; a pipeline's
  sends are such meetings too);
- **memory**: one device's peak (:mod:`fxforge.parallel.device_memory`);
- **pipelines**: :func:`fxforge.partition`'s split, its simulated schedule with each stage's work scaled to
  its step as built and timed under a fake process group (:func:`fxforge.parallel.rank_steps.stage_steps`),
  then the slowest stage's optimizer step; each stage's peak measured on one more step as built (the
  partition's own per-stage model where the stages cannot be built here).

The fastest candidate within ``memory_per_device`` is chosen; the others stay in the table with their
figures, and those that do not fit say by how much.

Example (starts a link measurement the first time, cached after)::

    plan = fxforge.parallelize(model, (ids,), devices=2)
    print(plan)                       # the candidates, the chosen mesh and why
    plan.strategy, plan.tp_plan
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from typing import Any

import torch

from fxforge.capture.model import normalize_inputs
from fxforge.core.memory import tensor_leaves
from fxforge.core.units import format_bytes, parse_bytes
from fxforge.parallel.collectives import (
    Collective,
    data_parallel_collectives,
    fsdp_blocks,
    fsdp_collectives,
    total_bytes,
)
from fxforge.parallel.device_memory import device_memory, local_model, shard_dims
from fxforge.parallel.overlap import bucket_ready_shares, ddp_communication, gradient_ready_times
from fxforge.parallel.plan import Candidate, ParallelPlan
from fxforge.parallel.stage_sends import predicted_sends
from fxforge.parallel.step_costs import StepCosts, graph_shares, is_meta, time_step
from fxforge.parallel.strategy import devices_of, full, meshes
from fxforge.parallel.strategy import name as mesh_name


def _rows(args: tuple, kwargs: dict) -> int:
    leaves = [t for t in tensor_leaves((args, kwargs)) if t.dim()]
    return int(leaves[0].shape[0]) if leaves else 1


def as_inputs(args: tuple, kwargs: dict) -> Any:
    """What ``normalize_inputs`` turns back into ``(args, kwargs)``: the positional tuple, or the keyword dict.

    Example:
        >>> as_inputs((), {"input_ids": 1}), as_inputs((1,), {})
        ({'input_ids': 1}, (1,))
    """
    if args and kwargs:
        raise ValueError("give the example inputs positionally or by keyword, not both: parallel plans take one form")
    return kwargs if kwargs else args


def _slice(value: Any, parts: int) -> Any:
    from fxforge.parallel.mesh_worker import data_slice

    return data_slice(value, 0, parts)


class _Planner:
    """The figures shared by every candidate, computed once."""

    def __init__(self, model, args, kwargs, devices, cap, loss_fn, optimizer, link, threads, tp_plans=None,
                 options=None):
        from fxforge.training.optimizer_memory import resolve_optimizer

        self.model, self.args, self.kwargs, self.devices, self.cap = model, args, kwargs, devices, cap
        self.loss_fn, self.optimizer = loss_fn, optimizer
        self.optimizer_factory = resolve_optimizer(optimizer)
        self.link, self.threads = link, threads
        self.rows = _rows(args, kwargs)
        self.blocks = fsdp_blocks(model)
        self.weights = sum(p.numel() * p.element_size() for p in dict.fromkeys(model.parameters()))
        self._training: dict[int, Any] = {}
        self._ready: tuple[list[tuple[str, float]], float] | None = None
        self._replica_steps: dict[int, tuple[float, float]] = {}
        self._built_steps: dict[str, tuple[float, float]] = {}
        self._built_peaks: dict[str, dict[str, int]] = {}
        self._pipelines: dict[int, tuple[Any, str]] = {}
        self._stage_steps: dict[int, list[Any]] = {}  # StageStep per stage
        self.tp_plans = dict(tp_plans or {})
        self.options = [full(m) for m in options or []]
        self.notes: list[str] = []
        self.costs = self._step_costs()

    def training(self, replicas: int) -> Any:
        """The training-memory model of one replica's slice of the batch."""
        if replicas not in self._training:
            from fxforge.training.breakdown import training_memory

            args, kwargs = _slice((self.args, self.kwargs), replicas)
            self._training[replicas] = training_memory(self.model, as_inputs(args, kwargs),
                                                       optimizer=self.optimizer,
                                                       loss=lambda out: self.loss_fn(out, None))
        return self._training[replicas]

    def _step_costs(self) -> StepCosts:
        from fxforge.runtime.roofline import measure_machine

        whole = self.training(1)
        seconds, stacks, owners = graph_shares(whole.step, measure_machine())
        forward = whole.step.forward.graph
        if is_meta(self.args, self.kwargs, self.model):
            return StepCosts(sum(seconds), 0.0, False, self.threads, seconds, stacks, owners, forward)
        self._replica_steps = self._time_replica_steps()
        fb, opt = self._replica_steps[1]
        return StepCosts(fb, opt, True, self.threads, seconds, stacks, owners, forward)

    def _time_replica_steps(self) -> dict[int, tuple[float, float]]:
        """Forward + backward and optimizer seconds of one replica's slice of the batch, for the whole batch and
        each replica count the devices allow whose meshes were not timed as built, each timed while the other
        ranks' twins run beside it on this machine's cores (or alone, with a note, where the model cannot run
        in another process); the built ranks and the pipeline stages are timed beside the twins too."""
        from fxforge.parallel.twins import Twins, TwinsUnavailable

        counts = self._replica_counts(self.devices)
        twin_args, twin_kwargs = _slice((self.args, self.kwargs), max(counts))
        twins = Twins(self.model, twin_args, twin_kwargs, threads=self.threads, count=self.devices - 1)
        with contextlib.ExitStack() as beside:
            try:
                beside.enter_context(twins)
            except TwinsUnavailable as why:
                self.notes.append(f"steps timed alone, not beside the other ranks' twins (they read low): {why}")
            self._time_built_steps()
            self._time_pipelines()
            # The model's own step on a replica's slice: on the whole batch for the pipelines and the roofline's
            # shares, and for each replica count whose meshes were not timed as built.
            needed = {1} | {m["dp"] * m["fsdp"] for m in self.options
                            if m["pp"] == 1 and mesh_name(m) not in self._built_steps}
            return {r: self._time_slice(r) for r in counts if r in needed}

    def _time_pipelines(self) -> None:
        """Each pipeline option's partition, and its stages' steps as the run builds them, timed under a fake
        process group (:func:`fxforge.parallel.rank_steps.stage_steps`): the engine's own work per microbatch
        and the stage's optimizer step, which the nodes' times leave out."""
        import torch.distributed as dist

        from fxforge.parallel.rank_steps import stage_steps

        for mesh in self.options:
            if mesh["pp"] == 1 or devices_of(mesh) != mesh["pp"]:
                continue
            part, _ = self._pipelines[mesh["pp"]] = self._pipeline_partition(mesh["pp"], measured=True)
            if dist.is_initialized():
                self.notes.append(f"{mesh_name(mesh)}: stages priced from their nodes' times (a process group is "
                                  "already initialised here, so none was built to time them)")
                continue
            times = stage_steps(part, self.args, self.kwargs, self.loss_fn, self.optimizer_factory,
                                threads=self.threads)
            if isinstance(times, str):
                self.notes.append(f"{mesh_name(mesh)}: stages priced from their nodes' times: {times}")
            else:
                self._stage_steps[mesh["pp"]] = times

    def _replica_counts(self, devices: int) -> list[int]:
        """The replica counts ``devices`` can hold that split the batch's rows evenly."""
        return [r for r in range(1, devices + 1) if devices % r == 0 and self.rows % r == 0]

    def _time_built_steps(self) -> None:
        """Rank 0's step of every mesh but pipelines as built, timed in this process under a fake process group
        (:mod:`fxforge.parallel.rank_steps`): DDP's bucket copies, DTensor's dispatch, FSDP2's buffer copies and
        hooks and the sharded optimizer step, which the one-process step leaves out."""
        import torch.distributed as dist

        from fxforge.parallel.rank_steps import built, built_peaks, built_steps

        meshes = [m for m in self.options if built(m) and (m["tp"] == 1 or m["tp"] in self.tp_plans)
                  and self.rows % (m["dp"] * m["fsdp"]) == 0]
        if not meshes:
            return
        if dist.is_initialized():
            self.notes.append("ranks' steps estimated from the one-process step (a process group is already "
                              "initialised here, so none was built to time them)")
            return
        self._built_steps = built_steps(self.model, meshes, self.tp_plans, self.args, self.kwargs, self.loss_fn,
                                        self.optimizer_factory, threads=self.threads, timer=time_step)
        for mesh in meshes:
            # What a tensor-parallel rank saves is DTensor's, what FSDP2 holds gathered its own: both measured as
            # built. Not DDP's: the blocking all-reduce hook the fake backend needs holds buckets the run does
            # not (a user's MLP tower: 250.9 MiB measured so, 202.4 in the run and in the model).
            if mesh["tp"] > 1 or mesh["fsdp"] > 1:
                self._built_peaks[mesh_name(mesh)] = built_peaks(self.model, mesh, self.tp_plans.get(mesh["tp"]),
                                                                 self.args, self.kwargs, self.loss_fn,
                                                                 self.optimizer_factory)

    def _time_slice(self, replicas: int) -> tuple[float, float]:
        args, kwargs = _slice((self.args, self.kwargs), replicas)
        return time_step(self.model, args, kwargs, self.loss_fn, self.optimizer_factory, threads=self.threads)

    def replica_step(self, replicas: int) -> tuple[float, float]:
        """Forward + backward and optimizer seconds of one of ``replicas`` replicas (the roofline's share of
        the whole step on meta tensors)."""
        if not self.costs.measured:
            return self.costs.forward_backward_s / replicas, self.costs.optimizer_s
        return self._replica_steps[replicas]

    def ready_times(self) -> tuple[list[tuple[str, float]], float]:
        """Each trainable parameter's gradient's ready time in a backward (a share of it) in ready order, and
        the backward's share of forward + backward (:func:`~fxforge.parallel.overlap.gradient_ready_times`)."""
        if self._ready is None:
            self._ready = gradient_ready_times(self.model, as_inputs(self.args, self.kwargs),
                                               loss=lambda out: self.loss_fn(out, None),
                                               steps=1 if is_meta(self.args, self.kwargs, self.model) else 2)
        return self._ready

    def ready_order(self) -> list[str]:
        return [name for name, _ in self.ready_times()[0]]

    def collectives(self, mesh: dict[str, int], tp_plan: Any) -> list[Collective]:
        dp, fsdp, tp = mesh["dp"], mesh["fsdp"], mesh["tp"]
        replicas = dp * fsdp
        out: list[Collective] = []
        styles = tp_plan.styles if tp > 1 else {}
        local = local_model(self.model, shard_dims(self.model, styles), tp) if tp > 1 else self.model
        if tp > 1:
            from fxforge.parallel.tp_build import predicted_tp_collectives

            args, kwargs = _slice((self.args, self.kwargs), replicas)
            out += predicted_tp_collectives(self.model, as_inputs(args, kwargs), tp_plan)
        if fsdp > 1:
            shard = fsdp_collectives(local, fsdp, blocks=self.blocks)
            out += shard
            if dp > 1:  # hybrid: the reduce-scattered shards are then all-reduced across the replicas
                out += [Collective("all_reduce", c.nbytes // fsdp, dp, "dp", "backward", c.where)
                        for c in shard if c.kind == "reduce_scatter"]
        elif dp > 1 and tp > 1:
            out += data_parallel_collectives(local, dp, style="replicate", blocks=self.blocks)
        elif dp > 1:
            out += data_parallel_collectives(self.model, dp, step=3, ready_order=self.ready_order())
        return out

    def candidate(self, mesh: dict[str, int], tp_plan: Any) -> Candidate:
        dp, fsdp, tp = mesh["dp"], mesh["fsdp"], mesh["tp"]
        replicas = dp * fsdp
        styles = tp_plan.styles if tp > 1 else {}
        dims = shard_dims(self.model, styles)
        memory = device_memory(self.training(replicas), self.model, mesh, styles, dims, self.optimizer,
                               self.blocks, self._built_peaks.get(mesh_name(mesh)))
        if mesh_name(mesh) in self._built_steps:  # rank 0's step as built, timed
            compute = sum(self._built_steps[mesh_name(mesh)])
        else:
            share = self.costs.sharded_share(styles) if tp > 1 else 0.0
            forward_backward, optimizer = self.replica_step(replicas)
            compute = (forward_backward * ((1 - share) + share / tp)
                       + optimizer * memory.weights / max(self.weights, 1))
        collectives = self.collectives(mesh, tp_plan)
        if dp > 1 and fsdp == 1 and tp == 1:  # DDP: each bucket's all-reduce behind the rest of the backward
            ready, backward_share = self.ready_times()
            if mesh_name(mesh) in self._built_steps:
                forward_backward = self._built_steps[mesh_name(mesh)][0]
            else:
                forward_backward = self.replica_step(replicas)[0]
            comm = ddp_communication(self.link, collectives, bucket_ready_shares(self.model, ready),
                                     forward_backward * backward_share, compute)
        else:  # each collective blocking the step, and waiting for the rank that arrives last
            comm = (sum(self.link.seconds(c.kind, c.nbytes, c.ranks) for c in collectives)
                    + self.link.synced(len(collectives), compute))
        fits = self.cap is None or memory.peak <= self.cap
        reason = "" if fits else (f"needs {format_bytes(memory.peak)} per device, over the "
                                  f"{format_bytes(self.cap)} given")
        return Candidate(mesh, compute + comm, compute, comm, memory.peak, total_bytes(collectives), fits,
                         reason, collectives, memory.parts())

    def _partition(self, stages: int, cap: int | None, measured: bool) -> Any:
        from fxforge.parallel.partition import partition

        inputs = as_inputs(self.args, self.kwargs)
        if not measured:
            return partition(self.model, inputs, stages, memory_per_stage=cap)
        previous = torch.get_num_threads()  # each node timed on one microbatch, on a stage's threads
        torch.set_num_threads(self.threads)
        try:
            return partition(self.model, inputs, stages, memory_per_stage=cap, costs="measured")
        finally:
            torch.set_num_threads(previous)

    def _pipeline_partition(self, stages: int, measured: bool) -> tuple[Any, str]:
        """The partition into ``stages`` within the cap, or, where none fits, the one without it and why;
        nodes timed (``measured``) or priced by the roofline."""
        try:
            return self._partition(stages, self.cap, measured), ""
        except ValueError as error:  # no split fits the cap: priced without it, and refused with its reason
            return self._partition(stages, None, measured), " ".join(str(error).split())

    def _stage_peak(self, part: Any, stage: int) -> int:
        """A stage's peak: the partition's (weights, gradients, the activations of the microbatches it holds),
        or its optimizer step's (weights, gradients and the step's temporaries), over its optimizer state."""
        from fxforge.training.optimizer_memory import optimizer_memory

        params = list(dict.fromkeys(part.pipe().get_stage_module(stage).parameters()))
        if self.optimizer is None or not params:
            return part.stage_memory[stage]
        metas = [torch.empty(p.shape, dtype=p.dtype, device="meta", requires_grad=p.requires_grad) for p in params]
        memory = optimizer_memory(self.optimizer, metas)
        weights = sum(p.numel() * p.element_size() for p in params)
        return memory.state_bytes + max(part.stage_memory[stage], 2 * weights + memory.step_peak_bytes)

    def pipeline_candidate(self, mesh: dict[str, int]) -> Candidate:
        pp = mesh["pp"]
        part, refusal = self._pipelines.get(pp) or self._pipeline_partition(pp, self.costs.measured)
        if pp in self._stage_steps:
            # Each stage's simulated work scaled to its step as built and timed; the schedule's waits are the
            # simulation's; the stages then step their optimizers side by side.
            steps = self._stage_steps[pp]
            factors = [s.forward_backward / busy if busy > 0 else 1.0
                       for s, busy in zip(steps, part.simulate().busy)]
            scaled = dataclasses.replace(
                part, stage_forward_seconds=[f * k for f, k in zip(part.stage_forward_seconds, factors)],
                stage_backward_seconds=[b * k for b, k in zip(part.stage_backward_seconds, factors)])
            compute = scaled.simulate().makespan + max(s.optimizer for s in steps)
            busiest = max(s.forward_backward for s in steps)
        else:
            # The nodes' own times, one by one on a microbatch (or the roofline's); the real step also pays
            # autograd's engine and its accumulation between them: the whole step measured in this process
            # over the same nodes' sum on the whole batch gives that factor.
            node_sum = float(part.units.seconds.sum()) * part.microbatches
            engine = self.costs.forward_backward_s / node_sum if self.costs.measured and node_sum > 0 else 1.0
            simulated = part.simulate()
            compute = simulated.makespan * max(engine, 1.0) + self.costs.optimizer_s / pp
            busiest = max(simulated.busy) * max(engine, 1.0)
        sends = predicted_sends(part.pipe(), part.microbatches)
        # A send and its receive hold both stages: each one a blocking meeting of two ranks, which pays the
        # link's in-step waits as a collective does (a stage meets 2/pp of the sends, on average), over the
        # busiest stage's compute; the schedule's own waits for the work upstream are the simulation's.
        meetings = math.ceil(2 * len(sends) / pp)
        comm = (sum(self.link.seconds("send", c.nbytes, 2) for c in sends)
                + self.link.synced(meetings, busiest))
        if pp in self._stage_steps:  # each stage's peak as built, measured as the run's worker measures it
            peak = max(s.peak_bytes for s in self._stage_steps[pp])
        else:
            peak = max(self._stage_peak(part, s) for s in range(part.stages))
        fits = not refusal and (self.cap is None or peak <= self.cap)
        reason = refusal or ("" if fits else f"a stage needs {format_bytes(peak)}, over the {format_bytes(self.cap)} given")
        return Candidate(mesh, compute + comm, compute, comm, peak, total_bytes(sends), fits, reason, sends,
                         {"peak": peak}, partition=part)


def tp_degrees(model: torch.nn.Module, example_inputs: Any, devices: int) -> dict[int, Any]:
    """The tensor-parallel plan derived at each degree dividing ``devices`` that splits at least one layer."""
    from fxforge.parallel.tp_derive import derive_tp_plan

    plans = {}
    for degree in range(2, devices + 1):
        if devices % degree:
            continue
        plan = derive_tp_plan(model, example_inputs, degree)
        if any(style in ("colwise", "rowwise", "vocab") for style in plan.styles.values()):
            plans[degree] = plan
    return plans


def parallelize(model: torch.nn.Module, example_inputs: Any, devices: int = 4, memory_per_device: Any = None,
                loss: Any = None, optimizer: Any = torch.optim.AdamW, mesh: dict[str, int] | None = None, *,
                link: Any = None, threads: int | None = None, pipeline: bool = True, cluster: Any = None,
                precision: str | None = None, activation_checkpointing: str | None = None) -> ParallelPlan:
    """Plan data, fully sharded, tensor and pipeline parallelism for training ``model`` on ``devices``.

    Args:
        model: the model (train or eval mode, as it will train; keep dropout off for an exact run check).
        example_inputs: one whole batch (tuple, tensor or dict); data parallelism splits its rows.
        devices: how many devices (processes) the step spreads over.
        memory_per_device: bytes or ``"16GiB"`` a device may hold at its peak; None: no cap.
        loss: ``(output, target) -> scalar``, a mean over the batch's rows (default: the mean square of the
            outputs, :func:`~fxforge.parallel.launch.square_mean_loss`); module-level, to reach the workers.
        optimizer: an optimizer class, factory or name, as for :func:`fxforge.training.training_memory`.
        mesh: force a mesh (``{"tp": 2}``, ``{"dp": 2, "tp": 2}``) instead of choosing; its product is the
            device count.
        link: a :class:`~fxforge.core.links.Link` to cost collectives on (default: gloo measured here between
            ``devices`` processes, as the run will start them; cached per count).
        threads: torch threads per device for the compute (default: this machine's cores shared).
        pipeline: offer pipeline stages.
        cluster: a :class:`~fxforge.parallel.cluster.Cluster` to plan for on paper (usually with the model and
            inputs on the meta device): compute from the step's FLOPs at the cluster's peak and assumed
            efficiency, collectives on the links their groups span, ``memory_per_device`` defaulting to its
            GPUs' memory; the candidates add ``mfu`` and ``tokens_per_s_per_device``
            (:mod:`fxforge.parallel.paper` says what is modelled).
        precision: with ``cluster``: ``"bf16"`` for FSDP2's bf16 mixed precision (float32 master weights,
            gradients and optimizer state; bf16 compute), None for the model's own dtypes.
        activation_checkpointing: with ``cluster``: ``"full"`` keeps only each block's input for backward
            (recomputing the block), None keeps what the step saves.

    Example (slow: measures the link once)::

        plan = fxforge.parallelize(model, (ids,), devices=2, memory_per_device="4GiB")
        print(plan.candidates[["strategy", "step_s", "memory_per_device", "fits"]])
    """
    from fxforge.parallel.launch import square_mean_loss

    args, kwargs = normalize_inputs(example_inputs)
    if mesh is not None:
        forced = full(mesh)
        devices = devices_of(forced)
    if devices < 1:
        raise ValueError(f"devices must be at least 1, not {devices}")
    cap = parse_bytes(memory_per_device) if memory_per_device is not None else None
    loss_fn = loss or square_mean_loss
    if cluster is not None:
        from fxforge.parallel.paper import plan_on_paper

        cap = cap if memory_per_device is not None else cluster.memory_bytes
        return plan_on_paper(model, args, kwargs, devices, cluster, cap, loss_fn, optimizer,
                             forced if mesh is not None else None, loss=loss, precision=precision,
                             activation_checkpointing=activation_checkpointing)
    if precision is not None or activation_checkpointing is not None:
        raise ValueError("precision= and activation_checkpointing= are planned on paper only: give cluster= too")
    threads = threads or max(1, (os.cpu_count() or 1) // devices)
    if link is None:  # the link the run will use: gloo between as many local processes as devices
        from fxforge.runtime.link_measure import measured_link

        link = measured_link("gloo", max(2, devices))
    inputs = as_inputs(args, kwargs)
    tp_plans = tp_degrees(model, inputs, devices)
    units_max = len(fsdp_blocks(model)) + 1
    options = [forced] if mesh is not None else meshes(devices, tp_degrees=tp_plans, pipeline=pipeline,
                                                       max_stages=units_max)
    planner = _Planner(model, args, kwargs, devices, cap, loss_fn, optimizer, link, threads, tp_plans, options)
    candidates, notes = [], planner.notes
    for option in options:
        replicas = option["dp"] * option["fsdp"]
        if planner.rows % replicas:
            notes.append(f"{mesh_name(option)}: a batch of {planner.rows} rows does not split over {replicas} replicas")
            continue
        if option["tp"] > 1 and option["tp"] not in tp_plans:
            notes.append(f"{mesh_name(option)}: no layer splits at tensor-parallel degree {option['tp']}")
            continue
        if option["pp"] > 1:
            if devices_of(option) != option["pp"]:
                notes.append(f"{mesh_name(option)}: pipelines combined with other axes are not planned yet")
                continue
            candidates.append(planner.pipeline_candidate(option))
            continue
        candidates.append(planner.candidate(option, tp_plans.get(option["tp"])))
    if not candidates:
        raise ValueError(f"no way to spread this model over {devices} devices: " + "; ".join(notes))
    return _choose(candidates, planner, tp_plans, notes, model, loss, devices, cap)


def _choose(candidates: list[Candidate], planner: _Planner, tp_plans: dict[int, Any], notes: list[str],
            model: torch.nn.Module, loss: Any, devices: int, cap: int | None) -> ParallelPlan:
    import pandas as pd

    ranked = sorted(candidates, key=lambda c: (not c.fits, c.step_s))
    chosen = ranked[0]
    fitting = [c for c in ranked if c.fits]
    if not fitting:
        least = min(candidates, key=lambda c: c.memory_per_device)
        why = (f"nothing fits in {format_bytes(cap)} per device; the smallest need is "
               f"{format_bytes(least.memory_per_device)} ({least.name})")
        raise ValueError(why)
    runner_up = fitting[1] if len(fitting) > 1 else None
    why = f"{chosen.name} is the fastest predicted step that fits ({chosen.step_s * 1e3:.2f} ms"
    why += f", {runner_up.step_s / chosen.step_s:.2f}x faster than {runner_up.name})" if runner_up else ")"
    why += (f"; compute {chosen.compute_s * 1e3:.2f} ms, collectives {chosen.comm_s * 1e3:.2f} ms on "
            f"{chosen.comm_bytes / 2**20:.2f} MiB; peak {chosen.memory_per_device / 2**20:.1f} MiB per device")
    table = pd.DataFrame([c.row() for c in ranked])
    tp = tp_plans.get(chosen.strategy["tp"]) or (tp_plans[max(tp_plans)] if tp_plans else None)
    styles = dict(tp.styles) if chosen.strategy["tp"] > 1 and tp is not None else {}
    if not planner.costs.measured:
        notes.append("compute estimated by the roofline model (meta tensors): not measured")
    return ParallelPlan(chosen.strategy, styles, table, chosen, why, chosen.collectives, tp, planner.link, model,
                        loss, planner.optimizer_factory, devices, cap, notes, ranked, dict(tp_plans))


def mfu(step_s: float, flops: float, devices: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: the step's FLOPs over what the devices could do in ``step_s``.

    Example:
        >>> mfu(1.0, 4e12, 8, 1e12)
        0.5
    """
    return flops / (step_s * devices * peak_flops) if step_s > 0 and devices and peak_flops else math.nan
