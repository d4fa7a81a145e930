"""Autotune: keep a fusion only where it measured faster, on the real shapes, on this machine.

After ``conv_activation`` has fused, :func:`autotune`

1. picks each fused op's kernel by timing every kernel that can run it (oneDNN with prepacked weights,
   cuDNN, the composite of plain ops) on random tensors of the op's real input shapes and strides
   (interleaved calls, medians);
2. times that layout's whole lowered graph against the graph before fusing (interleaved runs, medians)
   and keeps it if it is faster;
3. tries the memory layouts in turn, channels-last first (inputs converted once at the graph's entry,
   outputs back once at its exit, so convolutions never reorder in between), then as captured only if
   channels-last cannot run the graph or is not faster; if no layout's graph is faster, the graph goes
   back to what it was. It returns what it chose: whether the fusion stays, and the kept graph lowered
   with its outputs on the verification inputs (a :class:`~fxforge.core.captured.LoweredRun`), which
   verification and lowering use instead of running and lowering the same graph again.

Every choice, with the timings behind it, lands in the report (``report.tuning``). A
:class:`TuningPolicy` can take choices out of its hands (the report then says so); it travels as a value
(``fxforge.rewrite(..., tuning=TuningPolicy(...))``), so concurrent optimizations never see each other's.
Measurements are remembered on disk per machine (:func:`autotune_cache`): a result read back is reported
as "measured earlier on this machine"; a whole-graph timing is only stored when one graph was clearly
faster (by more than :data:`DECISIVE`), so a close call is measured again next time. A busy moment must
not be trusted from then on: every timing is stored with the machine's load
(:func:`~fxforge.core.disk_cache.machine_load`) and not stored at all when other work ran; a whole-graph
timing that its fused ops' own times cannot explain (:func:`inconsistent_with_parts`) is measured once
more and, still inconsistent, used but not stored. ``FXFORGE_AUTOTUNE_CACHE=0`` turns the cache off.

Example:
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU()).eval()
    >>> new = fxforge.rewrite(fxforge.capture(model, (torch.randn(1, 3, 32, 32),)), ["conv_activation"])
    >>> [t.subject for t in new.report.tuning][-2:]
    ['layout', 'graph']
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from typing import Any

import torch
from torch.fx import Node
from torch.utils import _pytree as pytree

from fxforge.core.captured import LoweredRun
from fxforge.core.disk_cache import BUSY_LOAD, machine_key, machine_load
from fxforge.core.nodes import constant_tensor, copy_graph_module
from fxforge.core.shapes import annotate
from fxforge.core.symbolic import hint
from fxforge.core.verify import isolated
from fxforge.lowering.kernels import KERNELS_BY_OP, kernels_for
from fxforge.lowering.layout import to_channels_last
from fxforge.lowering.lower import KERNEL_SET, fused_calls, lower
from fxforge.lowering.timing import (  # noqa: F401 - tests read MIN_REPS here
    DECISIVE,
    DECISIVE_FIRST,
    MIN_REPS,
    NODE_BUDGET_S,
    NOTE,
    autotune_cache,
    time_interleaved,
)
from fxforge.rewrites.passes import PassContext, Tuned

aten = torch.ops.aten
GRAPH_BUDGET_S = 0.25
# The fused graph must beat the graph before it by this fraction to be kept (timing noise).
MARGIN = 0.02
# How far a whole-graph timing may stray from its fused ops' own times before it is measured again and not
# remembered (:func:`inconsistent_with_parts`): their summed times this many times over, plus a share of the
# plain graph's time (layout conversions, Python overhead), plus a floor for tiny graphs.
PARTS_SLACK, PARTS_SHARE, PARTS_FLOOR_MS = 2.0, 0.1, 0.2
# Layouts in the order they are tried. Channels-last first: its convolutions take the activations as they
# come (inputs converted once at the entry, outputs back once at the exit), where oneDNN's kernels reorder
# NCHW activations around every fused op; as captured only when channels-last cannot run the graph or its
# graph is not faster than the graph before.
LAYOUTS = ("channels-last", "as captured")


@dataclasses.dataclass(frozen=True)
class TuningPolicy:
    """Choices taken out of autotune's hands (all None: everything is measured).

    Attributes:
        kernel: use this kernel wherever it can run (else the composite).
        layout: ``"as captured"`` or ``"channels-last"``.
        keep: ``"fused"`` or ``"before"``, instead of timing the whole graph.

    Example:
        >>> TuningPolicy(keep="fused").settled("keep"), TuningPolicy().settled("keep")
        ('; set by the tuning policy (keep=fused)', '')
    """

    kernel: str | None = None
    layout: str | None = None
    keep: str | None = None

    def settled(self, what: str) -> str:
        """A note for the report when the policy settled ``what`` (else "")."""
        value = getattr(self, what)
        return f"; set by the tuning policy ({what}={value})" if value is not None else ""


MEASURE_ALL = TuningPolicy()  # the default: every choice measured


def _random_like_meta(value: Any, pool: dict, position: int) -> Any:
    """A real tensor like the fake ``value`` (same shape, strides, dtype, device), drawn once per pool and
    argument position (two arguments of one call never share memory: a kernel may write into one)."""
    if not isinstance(value, torch.Tensor):
        return value
    key = (position, tuple(value.shape), value.stride(), value.dtype, value.device)
    if key not in pool:
        out = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
        if out.is_floating_point():  # copied from one random draw per device: copying is faster than drawing
            source = pool.get(("source", value.device))
            if source is None or source.numel() < out.numel():
                source = pool[("source", value.device)] = torch.empty(out.numel(), device=value.device).uniform_(-1, 1)
            out.copy_(source[:out.numel()].view(out.shape))
        else:
            out.zero_()
        pool[key] = out
    return pool[key]


def _concrete(value: Any) -> Any:
    """A fake value with symbolic sizes as an (uninitialised) tensor of the example's sizes, which kernels
    are timed on; anything else as it is."""
    if isinstance(value, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in (*value.shape, *value.stride())):
        return torch.empty_strided([hint(s) for s in value.shape], [hint(s) for s in value.stride()],
                                   dtype=value.dtype, device=value.device)
    return value


def tune_kernels(gm: torch.fx.GraphModule, pool: dict | None = None, *, memo: dict | None = None,
                 policy: TuningPolicy = MEASURE_ALL) -> tuple[float, list[tuple]]:
    """Time each fused op's kernels on its real shapes; set the fastest. Returns (total ms, choices).

    Identical calls (same op, shapes, strides and settings) are timed once; random inputs of the same
    shape and strides are drawn once (``pool``, shared between calls when given).

    Args:
        gm: the graph whose fused ops get their kernel (``node.args[-1]``) set.
        pool: random inputs by shape and strides, shared between calls.
        memo: measurements by call, shared between calls (an op timed once is not timed again).
        policy: a kernel it sets is used wherever it can run.
    """
    pool = {} if pool is None else pool
    cache = autotune_cache()
    total, choices, seen = 0.0, [], {} if memo is None else memo
    for node, op, weight in fused_calls(gm):
        *op_args, _ = node.args
        values = [_concrete(a.meta.get("val")) if isinstance(a, Node) else a for a in op_args]
        key = repr((str(node.target), *((tuple(v.shape), v.stride(), str(v.dtype)) if isinstance(v, torch.Tensor)
                                        else str(v) for v in values)))
        if key not in seen:
            device = values[0].device
            cache_key = f"{machine_key(device)} | {key}"
            stored = cache.get(cache_key) if cache is not None else None
            if stored is not None:
                timings, note = stored["timings"], "; ".join(filter(None, [stored["note"], NOTE]))
            else:
                timings, note = _time_kernels(gm, op_args, values, op, weight, pool)
                if cache is not None and (load := machine_load()) <= BUSY_LOAD:  # a busy moment: not remembered
                    cache.put(cache_key, {"timings": timings, "note": note, "load": round(load, 2)})
            best = min(timings, key=timings.__getitem__)
            if policy.kernel is not None:
                best = policy.kernel if policy.kernel in timings else "composite"
            seen[key] = (best, timings, note)
        best, timings, note = seen[key]
        node.args = (*op_args, best)
        if policy.kernel is not None:
            node.meta[KERNEL_SET] = True  # (lowering then keeps it at every size: no choice per shape bucket)
        total += timings[best]
        choices.append((node.name, best, timings, note))
    return total, choices


def _time_kernels(gm: torch.fx.GraphModule, op_args: list, values: list, op: str, weight: Any,
                  pool: dict) -> tuple[dict[str, float], str]:
    """Milliseconds of each kernel that can run this call, and why the others cannot."""
    bias = constant_tensor(gm, op_args[2])
    given = {1: weight} if bias is None else {1: weight, 2: bias}  # the op's own weight (prepacked) and bias
    real = [given[i] if i in given else _random_like_meta(v, pool, i) for i, v in enumerate(values)]
    calls, reasons = {}, {}
    for kernel in kernels_for(real[0].device):
        call = KERNELS_BY_OP[op](kernel, *real)
        if isinstance(call, str):
            reasons[kernel] = call
        else:
            fn, args = call
            calls[kernel] = (lambda fn=fn, args=args: fn(*args))
    with torch.no_grad():
        timings = time_interleaved(calls, NODE_BUDGET_S, decisive=DECISIVE, decisive_first=DECISIVE_FIRST)
    return timings, "; ".join(f"{k}: {v}" for k, v in reasons.items())


_NOT_RUN = object()


@dataclasses.dataclass
class _Candidate:
    """One layout's graph: its fused ops' kernels, their summed times, and its lowered graph's first run.

    ``lowered``/``output`` are set once the lowered graph ran on the example inputs (seed 0, buffers
    restored: the same run :func:`fxforge.core.verify.check_same` makes of it on the example inputs);
    ``outputs`` holds its runs on the random verification inputs its timing ran it on, by seed:
    ``(args, kwargs, output)``.
    """

    graph: torch.fx.GraphModule
    total: float
    choices: list
    lowered: torch.fx.GraphModule | None = None
    output: Any = _NOT_RUN
    outputs: dict[int, tuple] = dataclasses.field(default_factory=dict)

    def first_run(self, args: tuple, kwargs: dict) -> None:
        """Lower the graph and run it once on the example inputs (its warm-up, and its check output)."""
        if self.lowered is None:
            self.lowered = lower(self.graph)
        if self.output is _NOT_RUN:
            with isolated(self.graph, seed=0, inputs=(args, kwargs)), torch.no_grad():
                self.output = self.lowered(*args, **kwargs)


def autotune(gm: torch.fx.GraphModule, before: torch.fx.GraphModule, ctx: PassContext,
             policy: TuningPolicy = MEASURE_ALL) -> Tuned:
    """Choose kernels and layout for ``gm``'s fused ops, or put back ``before`` if fusing is not faster.

    ``gm`` is modified in place (its graph replaced); each choice is recorded with ``ctx.tuned``.
    Without example inputs (a pass run outside the pipeline) the kernels stay the composite.

    Layouts are tried in the order of :data:`LAYOUTS`: each gets its kernels chosen op by op, then its
    whole lowered graph is timed against the graph before; the first that is faster is kept, and the
    layouts after it are not timed at all.

    Returns:
        A :class:`~fxforge.rewrites.passes.Tuned`: whether the fusion stays and, when it does, the kept
        graph's lowered form with its outputs on the verification inputs it ran on (lowering runs that
        lowered graph, and verification compares those outputs, instead of doing the same work again).
    """
    if ctx.example_args is None:
        ctx.tuned("graph", "composite", {}, "no example inputs to time on; kernels left as the composite")
        return Tuned(fused=True)
    args, kwargs = ctx.example_args, ctx.example_kwargs or {}
    pool: dict = {}
    memo: dict = {}
    forced_layout = policy.layout in LAYOUTS
    order = [policy.layout, *(n for n in LAYOUTS if n != policy.layout)] if forced_layout else list(LAYOUTS)
    sums: dict[str, float] = {}
    events: list[str] = []
    tried: tuple | None = None
    for name in order:
        candidate = _build(name, gm, args, kwargs, pool, memo, ctx, policy)
        if candidate is None:
            continue
        sums[name] = round(candidate.total, 3)
        if policy.keep is not None:
            verdict = (policy.keep, {}, policy.settled("keep").lstrip("; "))
        elif _plain(name, candidate):
            verdict = ("before", {}, "no fused kernel beat the plain ops")
        else:
            verdict = _keep_or_undo(candidate, before, args, kwargs, ctx.check_inputs)
        if tried is not None and verdict[0] == "fused":
            events.append(f"the {tried[0]} graph was not faster than the graph before, the {name} graph was")
        tried = (name, candidate, *verdict)
        if verdict[0] == "fused" or forced_layout or policy.keep is not None:
            break
    layout, chosen, keep, timings, note = tried
    skipped = [name for name in order if name not in sums and name != layout]
    if skipped and keep == "fused":
        events.append(f"{', '.join(skipped)}: not timed, the {layout} graph was already faster than the graph before")
    if keep == "before" and timings:
        note += "; not faster, undone"
    layout_note = (f"sum of the fused ops' best kernel times per layout timed; layouts tried in the order "
                   f"{', '.join(LAYOUTS)}, the first whose graph beats the graph before kept{policy.settled('layout')}")
    for name, best, op_timings, op_note in chosen.choices:
        ctx.tuned(name, best, op_timings, op_note)
    ctx.tuned("layout", layout, sums, "; ".join([layout_note, *events]))
    ctx.tuned("graph", keep, timings, note)
    cache = autotune_cache()
    if cache is not None:
        cache.save()
    if keep != "fused":
        gm.graph = before.graph
        return Tuned(fused=False)
    gm.graph = chosen.graph.graph
    if chosen.lowered is None:
        return Tuned(fused=True)
    runs = dict(chosen.outputs)
    if chosen.output is not _NOT_RUN:
        runs[0] = (args, kwargs, chosen.output)
    return Tuned(fused=True, lowered_run=LoweredRun.record(gm, chosen.lowered, runs))


def _build(layout: str, gm: torch.fx.GraphModule, args: tuple, kwargs: dict, pool: dict, memo: dict,
           ctx: PassContext, policy: TuningPolicy) -> _Candidate | None:
    """``layout``'s graph with its kernels chosen, or None where the layout does not apply (no 4-d or 5-d
    floating input to convert) or cannot run the graph (the reason goes to the report)."""
    if layout == "as captured":  # gm itself: its kernels set in place (the other layouts' graphs are copies)
        total, choices = tune_kernels(gm, pool, memo=memo, policy=policy)
        return _Candidate(gm, total, choices)
    graph = copy_graph_module(gm)
    if not to_channels_last(graph):
        return None
    try:
        with isolated(graph):  # strides changed: propagate them (the rules already gave new nodes shapes)
            annotate(graph, args, kwargs, force=True)
            total, choices = tune_kernels(graph, pool, memo=memo, policy=policy)
        candidate = _Candidate(graph, total, choices)
        candidate.first_run(args, kwargs)  # fake tensors can miss a .view() that real strides refuse
    except Exception as error:  # noqa: BLE001 - e.g. a .view() that needs contiguous memory
        ctx.tuned("layout", "as captured", {}, f"channels-last cannot run this graph: {error}"[:300])
        return None
    return candidate


def _plain(layout: str, candidate: _Candidate) -> bool:
    """An as-captured candidate whose every op chose the composite: the graph before, in effect."""
    return layout == "as captured" and all(best == "composite" for _, best, _, _ in candidate.choices)


def _keep_or_undo(candidate: _Candidate, before: torch.fx.GraphModule, args: tuple, kwargs: dict,
                  check_inputs: list | None = None) -> tuple[str, dict[str, float], str]:
    """Time a candidate's whole lowered graph against the graph before fusing (or read the cache):
    ``("fused" | "before", timings, note)``.

    Both graphs run on the same inputs each round: the random verification inputs in turn where there are
    any (``check_inputs[1:]``, each under its seed, as verification runs them), so the candidate's first
    output on each is recorded in ``candidate.outputs`` and verification need not run it again.
    """
    chosen = candidate.graph
    chosen.recompile()  # its code, in the cache key, must name the kernels just chosen
    cache = autotune_cache()
    cache_key = _graph_key(chosen, before, args, kwargs)
    timings = cache.get(cache_key) if cache is not None else None
    from_cache = timings is not None
    if not from_cache:
        candidate.first_run(args, kwargs)  # its warm-up (a channels-last candidate's check run already was)
        inputs = [(i, *pair) for i, pair in enumerate(check_inputs or []) if i > 0] or [(0, args, kwargs)]
        fused = _InputCycle(candidate.lowered, chosen, inputs, candidate.outputs)
        plain = _InputCycle(lower(before), before, inputs, None)
        # The graph before has the captured graph's kernels on the captured shapes, which capture's check and
        # verification's reference runs warmed up; a cold first sample of it cannot decide (medians, and
        # ``decisive`` compares the fastest samples), so it gets no warm-up run of its own.
        calls = {"fused": fused, "before": plain}
        timings = time_interleaved(calls, GRAPH_BUDGET_S, warmed=("fused", "before"), decisive=DECISIVE)
        doubt = inconsistent_with_parts(timings, candidate.choices)
        if doubt:  # measured while something else ran, most likely: measured once more
            timings = time_interleaved(calls, GRAPH_BUDGET_S, warmed=("fused", "before"), decisive=DECISIVE)
            doubt = inconsistent_with_parts(timings, candidate.choices)
        clear = abs(timings["before"] / timings["fused"] - 1) > DECISIVE
        load = machine_load()
        remembered = ""
        if doubt or load > BUSY_LOAD:
            remembered = "; not remembered: " + (doubt or f"the machine was busy (load {load:.2f} per core)")
        elif clear and cache is not None:  # a close call is measured again next time, not replayed
            cache.put(cache_key, {**timings, "load": round(load, 2)})
    timings = {k: v for k, v in timings.items() if k in ("fused", "before")}
    keep = "fused" if timings["fused"] < timings["before"] * (1 - MARGIN) else "before"
    note = f"{timings['before'] / timings['fused']:.2f}x the speed of the graph before"
    return keep, timings, note + (f"; {NOTE}" if from_cache else remembered)


def inconsistent_with_parts(timings: dict[str, float], choices: list) -> str:
    """Why a whole-graph timing cannot be right, or "": the fused and the plain graph differ only in their
    fused ops, so their times cannot differ by much more than those ops' own kernel times (each op's
    chosen kernel and its composite, timed one by one). A graph whose ops sum to 0.2 ms timed at 32 ms
    against the plain graph's 1 ms was measured while something else ran.

    Example:
        >>> choices = [("conv_1", "mkldnn", {"mkldnn": 0.1, "composite": 0.12}, "")]
        >>> inconsistent_with_parts({"fused": 0.9, "before": 1.0}, choices)
        ''
        >>> inconsistent_with_parts({"fused": 32.0, "before": 1.0}, choices)[:44]
        'the graphs differ by 31 ms, their fused ops '
    """
    fused = sum(op_timings[best] for _, best, op_timings, _ in choices)
    plain = sum(op_timings.get("composite", op_timings[best]) for _, best, op_timings, _ in choices)
    allowed = PARTS_SLACK * (fused + plain) + PARTS_SHARE * timings["before"] + PARTS_FLOOR_MS
    difference = abs(timings["fused"] - timings["before"])
    if difference <= allowed:
        return ""
    return (f"the graphs differ by {difference:.2g} ms, their fused ops by {abs(plain - fused):.2g} ms "
            f"({fused:.2g} ms fused, {plain:.2g} ms plain)")


class _InputCycle:
    """A graph run on a list of ``(seed, args, kwargs)`` in turn, one per call, each under ``isolated(graph,
    seed=seed)`` with gradients off (as verification runs it); the first run on each seed goes to ``record``
    (``{seed: (args, kwargs, output)}``) when one is given."""

    def __init__(self, run: Callable[..., Any], graph: torch.nn.Module, inputs: list[tuple[int, tuple, dict]],
                 record: dict[int, Any] | None):
        self.run, self.graph, self.inputs, self.record, self.calls = run, graph, inputs, record, 0

    def __call__(self) -> None:
        seed, args, kwargs = self.inputs[self.calls % len(self.inputs)]
        self.calls += 1
        with isolated(self.graph, seed=seed, inputs=(args, kwargs)), torch.no_grad():
            output = self.run(*args, **kwargs)
        if self.record is not None and seed not in self.record:
            self.record[seed] = (args, kwargs, output)


def _graph_key(chosen: torch.fx.GraphModule, before: torch.fx.GraphModule, args: tuple, kwargs: dict) -> str:
    """The cache key of a whole-graph timing: both graphs' code and the inputs' shapes, on this machine."""
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    inputs = [(tuple(t.shape), t.stride(), str(t.dtype)) for t in tensors]
    device = tensors[0].device if tensors else torch.device("cpu")
    digest = hashlib.sha256(f"{chosen.code}\n{before.code}\n{inputs}".encode()).hexdigest()
    return f"{machine_key(device)} | graph {digest}"
