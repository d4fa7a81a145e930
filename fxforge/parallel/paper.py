"""Planning a cluster on paper: :func:`fxforge.parallelize` with ``cluster=``, for a model (usually on the meta
device) at real sizes on GPUs that are not here.

What is modelled, per mesh ``dp x fsdp x tp`` (tensor parallelism innermost, inside a node; pipelines are
not planned on paper):

- **the step, traced once**: one training step at one row of the batch, with the model in the compute dtype,
  read for its FLOPs (:func:`fxforge.core.costs.node_flops`), the tensors it saves for backward and its
  largest working tensor; every figure is linear in the rows (a transformer's are). A model whose blocks
  repeat (an ``nn.ModuleList`` of three or more blocks of one type and shape) is traced with two of them
  and the second counted for all the others (:class:`BlockFold`): the same figures, in seconds;
- **compute**: the step's FLOPs on one device (its rows, the share tensor parallelism splits divided by
  its degree; full activation checkpointing adds each block's forward again) at ``cluster.efficiency`` of
  the bf16 peak (an assumption, whose source the cluster states), plus the optimizer's step at the
  memory's bandwidth;
- **collectives**: tensor parallel (:func:`~fxforge.parallel.tp_build.predicted_tp_collectives`, their
  forward repeated under full checkpointing), FSDP2 and data parallel (:mod:`fxforge.parallel.collectives`),
  each on the link its group spans (:meth:`~fxforge.parallel.cluster.Cluster.group_link`: tp on adjacent
  GPUs, then fsdp, then dp). FSDP's and DDP's run on their own stream and hide behind the compute (only
  what exceeds it shows); tensor parallel ones are on the critical path (no async TP);
- **memory**, with ``precision="bf16"`` as torchtitan trains (FSDP2 ``MixedPrecisionPolicy(param_dtype=
  bfloat16, reduce_dtype=float32)``): float32 master weights, float32 gradients and the optimizer's state
  (AdamW: two float32 moments), sharded; bfloat16 parameters all-gathered for
  :data:`~fxforge.parallel.device_memory.FSDP_BLOCKS_HELD` blocks at a time plus the root's, and one
  block's float32 gradients before their reduce-scatter; without FSDP a whole bfloat16 working copy.
  Activations: the saved tensors of the step, those tensor parallelism splits divided by its degree,
  attention's ``s x s`` matrices replaced by the log-sum-exp a fused (flash) kernel keeps; under
  ``activation_checkpointing="full"`` only each block's input is kept, plus one block's saved tensors
  while it is recomputed; and twice the largest working tensor (a language model's float32 logits), the
  loss on vocabulary-split logits under TP (torchtitan's ``loss_parallel``; fxforge's run gathers them).
  Not modelled: allocator fragmentation, NCCL's buffers. MFU: forward + backward FLOPs / (step x GPUs x peak).

Example:
    >>> fold = BlockFold("layers", total=32)
    >>> fold.weight(["layers.1", "layers.1.mlp"]), fold.weight(["layers.0"]), fold.full_name("layers.7.mlp")
    (31, 1, 'layers.1.mlp')
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import torch

from fxforge.core.costs import node_flops
from fxforge.core.memory import tensor_leaves
from fxforge.core.units import format_bytes
from fxforge.parallel.collectives import Collective, data_parallel_collectives, fsdp_blocks, fsdp_collectives
from fxforge.parallel.device_memory import FSDP_BLOCKS_HELD, local_model, local_parameters, shard_dims
from fxforge.parallel.plan import Candidate, ParallelPlan
from fxforge.parallel.step_costs import StepCosts, saved_is_sharded, sharded_regions
from fxforge.parallel.strategy import name as mesh_name
from fxforge.parallel.units import module_stack


@dataclasses.dataclass(frozen=True)
class BlockFold:
    """A model's repeated blocks (``total`` in the ``nn.ModuleList`` named ``container``) traced as two:
    ``container.0`` counts once, ``container.1`` for all the others."""

    container: str
    total: int

    def weight(self, stack: list[str]) -> int:
        """How many blocks of the whole model a node run in the modules ``stack`` stands for."""
        return self.total - 1 if _in_block(stack, f"{self.container}.1") else 1

    def full_name(self, name: str) -> str:
        """The traced (two-block) model's name for a module of the whole model."""
        prefix = self.container + "."
        if not name.startswith(prefix):
            return name
        index, dot, rest = name[len(prefix):].partition(".")
        return f"{prefix}{0 if index == '0' else 1}{dot}{rest}"


def fold_blocks(model: torch.nn.Module) -> tuple[torch.nn.Module, BlockFold | None]:
    """A copy of ``model`` with only the first two of its repeated blocks, and how to count them back.

    Blocks repeat when an ``nn.ModuleList`` (:func:`~fxforge.parallel.collectives.fsdp_blocks`) holds three
    or more of one type with the same parameter shapes; otherwise ``(model, None)``. The copy shares nothing
    it could change (on the meta device it costs nothing).

    Example:
        >>> net = torch.nn.Module(); net.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(5)])
        >>> short, fold = fold_blocks(net)
        >>> len(short.layers), fold
        (2, BlockFold(container='layers', total=5))
    """
    containers: dict[str, list[str]] = {}
    for block in fsdp_blocks(model):
        containers.setdefault(block.rpartition(".")[0], []).append(block)
    for container, names in containers.items():
        holder, modules = model.get_submodule(container), [model.get_submodule(n) for n in names]
        kinds = {(type(m), tuple((n, tuple(p.shape), p.dtype) for n, p in m.named_parameters())) for m in modules}
        if len(names) < 3 or len(holder) != len(names) or not isinstance(holder, torch.nn.ModuleList) or len(kinds) > 1:
            continue
        memo = {id(holder): torch.nn.ModuleList(copy.deepcopy(list(holder)[:2]))}
        return copy.deepcopy(model, memo), BlockFold(container, len(names))
    return model, None


@dataclasses.dataclass
class StepFigures:
    """One row of the batch through one training step, counted for the whole model: ``flops`` (forward +
    backward), ``block_forward_flops`` (what full checkpointing recomputes), per node ``node_flops`` and
    ``stacks``; ``saved`` bytes by module (attention matrices replaced by a fused kernel's), one block's
    ``block_saved`` and ``block_input``; the largest tensor made (``working`` bytes, last dim ``working_dim``);
    ``tokens`` in the row (the first input's second dimension, else 1)."""

    flops: float
    block_forward_flops: float
    node_flops: list[float]
    stacks: list[list[str]]
    saved: dict[tuple[str, int], int]
    block_saved: dict[tuple[str, int], int]
    block_input: int
    working: int
    working_dim: int
    tokens: int


def _bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensor_leaves(value))


def _is_square(value: Any, seq: int) -> bool:  # an attention matrix: s x s
    return isinstance(value, torch.Tensor) and value.dim() >= 3 and seq > 1 and value.shape[-1] == value.shape[-2] == seq


def _in_block(stack: list[str], block: str | None) -> bool:
    return block is not None and any(m == block or m.startswith(block + ".") for m in stack)


def step_figures(step: Any, fold: BlockFold | None, tokens: int, blocks: list[str]) -> StepFigures:
    """:class:`StepFigures` of a traced step (:func:`fxforge.training.training_memory`'s ``step``)."""
    weight = fold.weight if fold else (lambda stack: 1)
    flops, fwd_block, per_node, stacks, by_seq = 0.0, 0.0, [], [], {}
    working, working_dim = 0, 1
    for graph, phase in ((step.forward.graph, "forward"), (step.backward.graph, "backward")):
        for node in graph.nodes:
            if node.op != "call_function":
                continue
            stack = module_stack(node)
            if phase == "forward" and (seq := node.meta.get("seq_nr")) is not None:
                by_seq.setdefault(seq, stack)
            if phase == "backward":
                stack = by_seq.get(node.meta.get("seq_nr"), stack)
            f = float(node_flops(node)) * weight(stack)
            flops += f
            per_node.append(f)
            stacks.append(stack)
            if phase == "forward" and any(m in blocks for m in stack):
                fwd_block += f
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and not _is_square(val, tokens) and _bytes(val) > working:
                working, working_dim = _bytes(val), int(val.shape[-1]) if val.dim() else 1
    saved: dict[tuple[str, int], int] = {}
    block_saved: dict[tuple[str, int], int] = {}
    square: dict[str, torch.Tensor] = {}
    seen = set()
    second = f"{fold.container}.1" if fold else (blocks[0] if blocks else None)
    for node in step.saved_nodes():
        val = node.meta["val"]
        try:
            key = val.untyped_storage()._cdata
        except Exception:  # noqa: BLE001 - no storage: count it alone
            key = id(node)
        if key in seen:
            continue
        seen.add(key)
        stack = module_stack(node)
        module = stack[-1] if stack else ""
        if _is_square(val, tokens):  # a fused attention kernel keeps the log-sum-exp, not the s x s matrix
            if module not in square or val.numel() > square[module].numel():
                square[module] = val
            continue
        nbytes = _bytes(val)
        key = (module, int(val.shape[-1]) if val.dim() else 1)
        saved[key] = saved.get(key, 0) + nbytes * weight(stack)
        if _in_block(stack, second):
            block_saved[key] = block_saved.get(key, 0) + nbytes
    for module, val in square.items():
        stack = [module]
        lse = val.numel() // val.shape[-1] * 4
        saved[(module, 0)] = saved.get((module, 0), 0) + lse * weight(stack)
        if _in_block(stack, second):
            block_saved[(module, 0)] = block_saved.get((module, 0), 0) + lse
    return StepFigures(flops, fwd_block, per_node, stacks, saved, block_saved, _block_input(step, second),
                       working, working_dim, tokens)


def _block_input(step: Any, block: str | None) -> int:
    """The largest activation a block reads from outside it (the residual stream coming in), bytes."""
    if block is None:
        return 0
    inside = {n for n in step.forward.graph.nodes if n.op == "call_function" and block in module_stack(n)}
    return max((_bytes(arg.meta.get("val")) for node in inside for arg in node.all_input_nodes
                if arg not in inside and arg.op == "call_function"), default=0)


@dataclasses.dataclass
class PaperCandidate(Candidate):
    """A :class:`~fxforge.parallel.plan.Candidate` planned on paper, with its ``mfu`` (the forward and
    backward's counted FLOPs over ``step x devices x peak``) and ``tokens_per_s`` per device."""

    mfu: float = math.nan
    tokens_per_s: float = math.nan

    def row(self) -> dict[str, Any]:
        return {**super().row(), "mfu": self.mfu, "tokens_per_s_per_device": self.tokens_per_s}


class PaperPlanner:
    """The figures every mesh shares, found once: the traced step, the tensor-parallel plans per degree and
    their collectives (all at one row of the batch, counted for the whole model)."""

    def __init__(self, model, args, kwargs, devices, cluster, cap, loss_fn, optimizer, precision,
                 activation_checkpointing):
        from fxforge.parallel.mesh_worker import data_slice
        from fxforge.training.breakdown import training_memory
        from fxforge.training.optimizer_memory import resolve_optimizer

        if precision not in (None, "bf16"):
            raise ValueError(f"precision must be None or 'bf16', not {precision!r}")
        if activation_checkpointing not in (None, "full"):
            raise ValueError(f"activation_checkpointing must be None or 'full', not {activation_checkpointing!r}")
        self.model, self.devices, self.cluster, self.cap = model, devices, cluster, cap
        self.optimizer, self.optimizer_factory = optimizer, resolve_optimizer(optimizer)
        self.precision, self.ac = precision, activation_checkpointing
        leaves = [t for t in tensor_leaves((args, kwargs)) if t.dim()]
        self.rows = int(leaves[0].shape[0]) if leaves else 1
        tokens = int(leaves[0].shape[1]) if leaves and leaves[0].dim() >= 2 else 1
        self.blocks = fsdp_blocks(model)
        short, self.fold = fold_blocks(model)
        self.compute_dtype = torch.bfloat16 if precision == "bf16" else None
        if self.compute_dtype is not None:
            short = short.to(self.compute_dtype) if short is not model else copy.deepcopy(model).to(self.compute_dtype)
        one_args, one_kwargs = data_slice((args, kwargs), 0, self.rows)
        self.one = one_kwargs or one_args
        tm = training_memory(short, self.one, optimizer=None, loss=lambda out: loss_fn(out, None))
        short_blocks = fsdp_blocks(short)
        self.step = step_figures(tm.step, self.fold, tokens, short_blocks)
        self.short = short
        self.tp_plans: dict[int, Any] = {}
        self.tp_collectives: dict[int, list[Collective]] = {}
        self._local: dict[int, torch.nn.Module] = {}
        self._state_fit: dict[torch.dtype, tuple[float, float]] = {}

    def derive_tp(self, only: int | None = None) -> dict[int, Any]:
        """The tensor-parallel plan at each power-of-two degree up to a node's GPUs (or degree ``only``) that
        splits a layer, its styles named for the whole model."""
        from fxforge.parallel.tp_build import tp_collectives
        from fxforge.parallel.tp_derive import derive_tp_plan
        from fxforge.parallel.tp_trace import trace_forward

        names, traced = [n for n, _ in self.model.named_modules()], None
        for degree in (2**i for i in range(1, self.cluster.gpus_per_node.bit_length())):
            if self.devices % degree or only not in (None, degree):
                continue
            plan = derive_tp_plan(self.short, self.one, degree)
            if not any(s in ("colwise", "rowwise", "vocab") for s in plan.styles.values()):
                continue
            traced = traced or trace_forward(self.short, self.one)  # one trace serves every degree
            predicted = tp_collectives(traced, plan)
            if self.fold is not None:
                plan = dataclasses.replace(plan, styles={n: plan.styles[self.fold.full_name(n)] for n in names
                                                         if self.fold.full_name(n) in plan.styles})
            self.tp_plans[degree] = plan
            self.tp_collectives[degree] = self._unfold(predicted)
        return self.tp_plans

    def _unfold(self, collectives: list[Collective]) -> list[Collective]:
        if self.fold is None:
            return collectives
        out, second = [], f"{self.fold.container}.1"
        for c in collectives:
            if _in_block([c.where], second):
                rest = c.where[len(second):]
                out += [dataclasses.replace(c, where=f"{self.fold.container}.{i}{rest}")
                        for i in range(1, self.fold.total)]
            else:
                out.append(c)
        return out

    def local(self, tp: int) -> torch.nn.Module:
        """The whole model with one tensor-parallel rank's parameter shapes (on meta)."""
        if tp not in self._local:
            styles = self.tp_plans[tp].styles if tp > 1 else {}
            self._local[tp] = local_model(self.model, shard_dims(self.model, styles), tp) if tp > 1 else self.model
        return self._local[tp]

    def _itemsize(self, role: str, native: torch.dtype) -> int:
        """Bytes per element of the master weights, gradients and reduce-scatters ("master") or of the
        computed-on parameters and their all-gathers ("compute")."""
        if self.precision == "bf16":
            return 4 if role == "master" else 2
        return native.itemsize

    def collectives(self, mesh: dict[str, int], rows: int) -> list[Collective]:
        dp, fsdp, tp = mesh["dp"], mesh["fsdp"], mesh["tp"]
        out = []
        if tp > 1:
            for c in self.tp_collectives[tp]:
                scaled = dataclasses.replace(c, nbytes=c.nbytes * rows)
                out.append(scaled)
                if self.ac == "full" and c.phase == "forward" and any(_in_block([c.where], b) for b in self.blocks):
                    out.append(dataclasses.replace(scaled, phase="backward", where=c.where + " (recomputed)"))
        local = self.local(tp)
        native = next(local.parameters()).dtype

        def cast(c: Collective, role: str) -> Collective:
            return dataclasses.replace(c, nbytes=c.nbytes * self._itemsize(role, native) // native.itemsize)

        if fsdp > 1:
            shard = [cast(c, "compute" if c.kind == "all_gather" else "master")
                     for c in fsdp_collectives(local, fsdp, blocks=self.blocks)]
            out += shard
            if dp > 1:
                out += [Collective("all_reduce", c.nbytes // fsdp, dp, "dp", "backward", c.where)
                        for c in shard if c.kind == "reduce_scatter"]
        elif dp > 1:
            out += [cast(c, "master") for c in data_parallel_collectives(local, dp, style="replicate",
                                                                          blocks=self.blocks)]
        return out

    def link_seconds(self, c: Collective, mesh: dict[str, int]) -> float:
        stride = {"tp": 1, "fsdp": mesh["tp"], "dp": mesh["tp"] * mesh["fsdp"]}.get(c.group, 1)
        return self.cluster.group_link(c.ranks, stride).seconds(c.kind, c.nbytes, c.ranks)

    def _state_bytes(self, numel: int, dtype: torch.dtype) -> int:
        """The optimizer's state for one tensor of ``numel`` elements: linear in them (``a * numel + b``,
        fitted on two meta tensors once per dtype: running it on every shard of every mesh takes minutes)."""
        from fxforge.training.optimizer_memory import optimizer_memory

        if self.optimizer is None:
            return 0
        if dtype not in self._state_fit:
            one, two = (optimizer_memory(self.optimizer, [torch.empty(n, dtype=dtype, device="meta",
                                                                      requires_grad=True)]).state_bytes
                        for n in (1024, 2048))
            self._state_fit[dtype] = ((two - one) / 1024, 2 * one - two)
        a, b = self._state_fit[dtype]
        return int(a * numel + b)

    def memory(self, mesh: dict[str, int], rows: int, styles: dict[str, str]) -> dict[str, int]:
        """One device's memory, bytes by part (module docstring)."""

        tp, fsdp = mesh["tp"], mesh["fsdp"]
        dims = shard_dims(self.model, styles)
        local = local_parameters(self.model, dims, tp, fsdp)
        weights = sum(math.prod(s) * self._itemsize("master", d) for _, s, d, _ in local)
        gradients = sum(math.prod(s) * self._itemsize("master", d) for _, s, d, g in local if g)
        state = sum(self._state_bytes(math.prod(s), torch.float32 if self.precision == "bf16" else d)
                    for _, s, d, g in local if g)
        whole = local_parameters(self.model, dims, tp, 1)
        per_block = {b: 0 for b in self.blocks}
        root = 0
        for name, shape, dtype, _ in whole:
            owner = next((b for b in self.blocks if name.startswith(b + ".")), None)
            n = math.prod(shape)
            if owner is None:
                root += n * self._itemsize("compute", dtype)
            else:
                per_block[owner] += n
        block = max(per_block.values(), default=0)
        compute_size = self._itemsize("compute", whole[0][2]) if whole else 2
        if fsdp > 1:
            gathered = FSDP_BLOCKS_HELD * block * compute_size + root
            reduce_buffer = block * self._itemsize("master", whole[0][2])
        else:
            gathered = (sum(math.prod(s) for _, s, _, _ in whole) * compute_size
                        if self.precision == "bf16" else 0)
            reduce_buffer = 0
        regions = sharded_regions(styles)

        vocab = {_out_features(self.model.get_submodule(m)) for m, s in styles.items() if s in ("colwise", "vocab")
                 and not any(_in_block([m], b) for b in self.blocks)} if tp > 1 else set()

        sp = tp if tp > 1 and getattr(self.tp_plans.get(tp), "sequence_parallel", False) else 1

        def divided(m: str, dim: int) -> bool:  # + a column-split layer's output; sequence-parallel norms
            return (saved_is_sharded(m, styles, regions) or dim in vocab or (sp > 1 and styles.get(m) == "sequence")
                    or (styles.get(m) == "colwise" and dim == _out_features(self.model.get_submodule(m))))

        def split(saved: dict[tuple[str, int], int]) -> float:
            return sum(b / tp if tp > 1 and divided(m, dim) else b for (m, dim), b in saved.items())

        if self.ac == "full":
            outside = {k: b for k, b in self.step.saved.items() if not any(_in_block([k[0]], b) for b in self.blocks)}
            saved = split(outside) + len(self.blocks) * self.step.block_input / sp + split(self.step.block_saved)
        else:
            saved = split(self.step.saved)
        working = 2 * self.step.working / (tp if self.step.working_dim in vocab else 1)
        activations = int(rows * (saved + working))
        peak = weights + gradients + state + gathered + reduce_buffer + activations
        return {"weights": weights, "gradients": gradients, "optimizer_state": state, "gathered": gathered,
                "reduce_buffer": reduce_buffer, "activations": activations, "peak": peak}

    def candidate(self, mesh: dict[str, int]) -> PaperCandidate:
        dp, fsdp, tp = mesh["dp"], mesh["fsdp"], mesh["tp"]
        rows = self.rows // (dp * fsdp)
        styles = self.tp_plans[tp].styles if tp > 1 else {}
        costs = StepCosts(0.0, 0.0, False, 1, self.step.node_flops, self.step.stacks)
        share = costs.sharded_share(styles) if tp > 1 else 0.0
        divided = (1 - share) + share / tp
        recompute = self.step.block_forward_flops if self.ac == "full" else 0.0
        flops = rows * (self.step.flops + recompute) * divided
        memory = self.memory(mesh, rows, styles)
        optimizer_s = 2 * (memory["weights"] + memory["optimizer_state"]) / (self.cluster.hbm_tbs * 1e12)
        compute = flops / (self.cluster.peak_flops * self.cluster.efficiency) + optimizer_s
        collectives = self.collectives(mesh, rows)
        critical = sum(self.link_seconds(c, mesh) for c in collectives if c.group == "tp")
        hidden = sum(self.link_seconds(c, mesh) for c in collectives if c.group != "tp")
        comm = critical + max(0.0, hidden - compute)
        step_s = compute + comm
        fits = self.cap is None or memory["peak"] <= self.cap
        reason = "" if fits else (f"needs {format_bytes(memory['peak'])} per GPU, over the "
                                  f"{format_bytes(self.cap)} given")
        mfu = self.rows * self.step.flops / (step_s * self.devices * self.cluster.peak_flops)
        tokens = self.rows * self.step.tokens / step_s / self.devices
        return PaperCandidate(mesh, step_s, compute, comm, memory["peak"], sum(c.nbytes for c in collectives),
                              fits, reason, collectives, memory, mfu=mfu, tokens_per_s=tokens)

    def meshes(self) -> list[dict[str, int]]:
        """``dp x fsdp x tp`` over the devices: tp a power of two up to a node with a derived plan, and the
        rest split every way between dp and fsdp (no pipelines)."""
        out = []
        for tp in [1, *self.tp_plans]:
            rest = self.devices // tp
            out += [{"pp": 1, "dp": dp, "fsdp": rest // dp, "tp": tp} for dp in range(1, rest + 1) if rest % dp == 0]
        return out


def _out_features(module: torch.nn.Module) -> int | None:
    weight = getattr(module, "weight", None)
    if isinstance(module, torch.nn.Embedding) or weight is None or weight.dim() != 2:
        return getattr(module, "num_embeddings", None)
    return int(weight.shape[1] if type(module).__name__ == "Conv1D" else weight.shape[0])


def plan_on_paper(model: torch.nn.Module, args: tuple, kwargs: dict, devices: int, cluster: Any, cap: int | None,
                  loss_fn: Any, optimizer: Any, mesh: dict[str, int] | None, *, loss: Any = None,
                  precision: str | None = None, activation_checkpointing: str | None = None) -> ParallelPlan:
    """:func:`fxforge.parallelize` with ``cluster=`` (the module docstring says what is modelled).

    Example (a LLaMA-style model of 8 layers on the meta device, 16 H100s; about a second)::

        plan = fxforge.parallelize(model, (ids,), devices=16, cluster=PUBLISHED_CLUSTERS["h100-sxm-8x"],
                                   precision="bf16", activation_checkpointing="full")
        plan.chosen.mfu, plan.chosen.tokens_per_s, plan.chosen.memory_per_device
    """
    import pandas as pd

    if cluster.gpus < devices:
        cluster = cluster.scaled(devices)
    planner = PaperPlanner(model, args, kwargs, devices, cluster, cap, loss_fn, optimizer, precision,
                           activation_checkpointing)
    tp_plans = planner.derive_tp(None if mesh is None else mesh["tp"])
    notes = [f"planned on paper for {cluster.describe()}", ("pipeline stages are not planned on paper; FSDP and "
             "DDP collectives overlap the compute, tensor parallel ones do not")]
    if mesh is not None and mesh.get("tp", 1) > 1 and mesh["tp"] not in tp_plans:
        raise ValueError(f"no tensor-parallel plan at degree {mesh['tp']} (degrees planned: "
                         f"{sorted(tp_plans) or 'none'})")
    options = [mesh] if mesh is not None else planner.meshes()
    candidates = []
    for option in options:
        if option["pp"] > 1:
            notes.append(f"{mesh_name(option)}: pipelines are not planned on paper")
            continue
        if planner.rows % (option["dp"] * option["fsdp"]):
            notes.append(f"{mesh_name(option)}: a batch of {planner.rows} rows does not split over "
                         f"{option['dp'] * option['fsdp']} replicas")
            continue
        candidates.append(planner.candidate(option))
    if not candidates:
        raise ValueError(f"no way to spread this model over {devices} GPUs: " + "; ".join(notes))
    ranked = sorted(candidates, key=lambda c: (not c.fits, c.step_s))
    fitting = [c for c in ranked if c.fits]
    if not fitting:
        least = min(candidates, key=lambda c: c.memory_per_device)
        raise ValueError(f"nothing fits in {format_bytes(cap)} per GPU on {devices} GPUs; the smallest need is "
                         f"{format_bytes(least.memory_per_device)} ({least.name})")
    chosen = fitting[0]
    why = (f"{chosen.name} is the fastest predicted step that fits ({chosen.step_s:.3f} s: compute "
           f"{chosen.compute_s:.3f} s, exposed collectives {chosen.comm_s:.3f} s; {chosen.tokens_per_s:,.0f} "
           f"tokens/s per GPU, MFU {chosen.mfu:.1%}; peak {chosen.memory_per_device / 2**30:.1f} GiB per GPU)")
    if len(fitting) > 1:
        why += f"; next {fitting[1].name} at {fitting[1].step_s:.3f} s"
    tp = tp_plans.get(chosen.strategy["tp"])
    styles = dict(tp.styles) if tp is not None and chosen.strategy["tp"] > 1 else {}
    table = pd.DataFrame([c.row() for c in ranked])
    return ParallelPlan(chosen.strategy, styles, table, chosen, why, chosen.collectives, tp, cluster, model, loss,
                        planner.optimizer_factory, devices, cap, notes, ranked, dict(tp_plans))
