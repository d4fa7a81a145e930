"""``python -m benchmarks --suite training``: a training step's memory, predicted and under budgets (issue 22).

Models (:mod:`benchmarks.training_models`): transformers GPT-2, BERT and LLaMA with LM heads (4 layers,
hidden 256, 4 heads, vocab 8000, S 512, token ids in), torchvision ResNet-50 and timm ViT-S/16 at 224 x 224;
batch 8, seeded random weights, train mode, dropout 0. ResNet-50 and ViT-S need torchvision and timm, which
only the zoo environment has (``.venv-zoo``, :mod:`benchmarks.zoo`): run from the main environment, their
rows run in a subprocess of ``.venv-zoo/bin/python`` (the same runner), and every row says which
environment ran it.

The step is ``loss(fn(*inputs)).backward(); AdamW.step(); zero_grad(set_to_none=True)``, the loss the sum
of the floating-point outputs (fxforge's default). Per model, in one process:

1. **prediction**: ``fxforge.training_memory(model, inputs, optimizer=torch.optim.AdamW)`` (timed), then
   ``.measure()`` (fxforge's own measured step, the CPU allocator's records): predicted and measured peak, activations,
   error %;
2. **contenders**: ``eager``; ``per-block checkpoint`` (:func:`benchmarks.training_models.checkpoint_blocks`
   on a copy of the model); ``inductor f``: ``torch.compile`` with Inductor under
   ``torch._functorch.config.activation_memory_budget = f`` (set while compiling and around every call);
   ``fxforge f``: ``fxforge.optimize(model, inputs, memory_budget="<f*100>%", loss=loss)``; ``fxforge-inductor f``:
   the same with ``target="inductor"`` (the same plan, its graphs compiled by Inductor); then ``fxforge <= peer``
   and ``fxforge-inductor <= peer``: ``memory_budget=<bytes>`` equal to each peer's measured whole-step peak;
3. **gradients**: at the initial weights, each contender's gradients (one forward and backward, no
   optimizer step) against eager's: max abs difference over all parameters (and that over the largest
   eager gradient); the first such call is part of "prepare s" (the compile happens there);
4. **memory**: in the steady state (the gradient check ran the code once, compiling it; a warm-up step first
   where the optimizer has no state yet), one step measured with the profiler's allocator records
   (:mod:`benchmarks.step_memory`), the same way for every contender; the whole-step peak = weights +
   buffers + optimizer state + inputs + the most held above them during the step; the activation peak = the
   most held during forward and backward beyond those and the parameter gradients allocated by then; on
   eager the figure is checked against fxforge's dispatch tracker;
5. **time**: one untimed step per contender, then ``--rounds`` rounds; in round r the contenders run in an
   order rotated by r, ``--reps`` steps each, each step timed on its own; median per contender, quoted as a
   ratio to eager's median (and the fastest step's, as a check on other work loading the machine).

The tables, the summary lines and the block of ``RESULTS.md`` are :mod:`benchmarks.training_report`'s.

"fits" for a fraction f: the measured activation peak <= f x the unconstrained activation peak of
fxforge's plan (``plan.unconstrained_activation_bytes``; eager's measured one if no plan exists); for a
byte budget: the measured whole-step peak <= the budget.

Example::

    python -m benchmarks --suite training
    python -m benchmarks --suite training --quick --models gpt2 --no-markdown
    python -m benchmarks --suite training --models gpt2,resnet50 --fractions 0.6 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from benchmarks import report
from benchmarks import training_models as models_mod
from benchmarks.log import error_text, log
from benchmarks.section import Section, UsageError, csv_list
from benchmarks.step_memory import mark, step_peak, tracker_peak
from benchmarks.training_report import COLUMNS, PREDICTION_COLUMNS, summary, write_markdown
from benchmarks.zoo_env import ZOO_PYTHON, run_in_zoo

NAME = "training"

FRACTIONS = (0.8, 0.6, 0.4)
KINDS = ("eager", "checkpoint", "inductor", "fxforge", "fxforge-peer", "fxforge-inductor", "fxforge-inductor-peer")
OURS = {"fxforge": "native", "fxforge-peer": "native", "fxforge-inductor": "inductor",
        "fxforge-inductor-peer": "inductor"}
"""fxforge's kinds and the ``target`` each runs its plan on."""
PEER_KINDS = {"fxforge-peer": "fxforge", "fxforge-inductor-peer": "fxforge-inductor"}
"""The kinds budgeted at each peer's measured peak, and their rows' name (``fxforge-inductor ≤ inductor 0.6``)."""
TIMING = {"rounds": 5, "reps": 1}
QUICK_TIMING = {"rounds": 1, "reps": 1}
LR = 1e-5  # small steps: the timed steps keep training the same weights without drifting far


def env_name() -> str:
    """The environment running this process: the name of ``sys.prefix`` (``.venv``, ``.venv-zoo``)."""
    return os.path.basename(os.path.normpath(sys.prefix))


def default_loss(outputs: Any) -> torch.Tensor:
    """The sum of every floating-point tensor of the outputs (fxforge's default loss).

    Example:
        >>> default_loss({"logits": torch.ones(2, 3), "ids": torch.arange(2)})
        tensor(6.)
    """
    leaves = [t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    total = leaves[0].sum()
    for leaf in leaves[1:]:
        total = total + leaf.sum()
    return total


def unique_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors``.

    Example:
        >>> w = torch.ones(4)
        >>> unique_bytes([w, w[:2], torch.ones(2)])
        24
    """
    seen, total = set(), 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += int(storage.nbytes())
    return total


# --------------------------------------------------------------------------------------------------
# contenders


@dataclasses.dataclass
class Contender:
    """One way to run the model's step.

    Attributes:
        name: the row's name (``"inductor 0.6"``).
        kind: one of :data:`KINDS`.
        fn: called as ``fn(*inputs)``, returns the model's outputs.
        model: the module whose parameters the step trains (the model, or the per-block copy).
        optimizer: AdamW over ``model``'s parameters (shared by the contenders that share the model).
        fraction: the fraction of the unconstrained activation peak it was given (None: none).
        budget_bytes: the whole-step cap it was given (fxforge at a peer's peak), None otherwise.
        context: entered around every call (Inductor's budget).
        row: its row of the results.
    """

    name: str
    kind: str
    fn: Callable[..., Any]
    model: nn.Module
    optimizer: torch.optim.Optimizer
    fraction: float | None = None
    budget_bytes: int | None = None
    context: Callable[[], Any] = contextlib.nullcontext
    row: dict[str, Any] = dataclasses.field(default_factory=dict)


def inductor_backend(fraction: float) -> Callable[..., Any]:
    """Inductor's ``compile_fx`` (what ``torch.compile``'s default backend calls) with
    ``activation_memory_budget = fraction`` while it compiles.

    One backend object per budget: dynamo keeps a compiled graph per code object and hands it to every
    ``torch.compile(model)`` with an equal backend, so a second ``torch.compile(model)`` under another budget
    would reuse the first one's graph (measured: same graph count, same peak); a backend of its own keeps
    each budget's graph apart without resetting dynamo, so the budgets can be timed side by side.
    """

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        from torch._inductor.compile_fx import compile_fx

        with torch._functorch.config.patch(activation_memory_budget=fraction):
            return compile_fx(gm, example_inputs)

    backend.__name__ = f"inductor_budget_{fraction:g}"
    return backend


def new_row(model: str, name: str, kind: str) -> dict[str, Any]:
    return {"model": model, "contender": name, "kind": kind, "env": env_name(), "status": "ok", "stage": None,
            "error": None, "fraction": None, "budget_bytes": None, "prepare_s": None, "peak_bytes": None,
            "activation_peak_bytes": None, "median_ms": None, "step_vs_eager": None, "min_vs_eager": None,
            "fits": None, "max_grad_err": None, "rel_grad_err": None, "note": "", "info": {}}


def fail(row: dict[str, Any], stage: str, exc: BaseException) -> None:
    """Mark ``row`` failed at ``stage``; "refused" when fxforge said the budget cannot be met (its
    ``BudgetError``: an answer, not a crash)."""
    refused = any(cls.__name__ == "BudgetError" for cls in type(exc).__mro__)
    row.update(status="refused" if refused else "failed", stage=stage, error=error_text(exc, 600, one_line=True))


# --------------------------------------------------------------------------------------------------
# one step, its gradients, its memory


def train_step(c: Contender, inputs: tuple[Any, ...], loss: Callable[[Any], torch.Tensor]) -> None:
    """One training step of ``c``: forward, loss, backward (then the ``"backward"`` mark), AdamW step,
    gradients dropped."""
    with c.context():
        value = loss(c.fn(*inputs))
        value.backward()
    del value
    mark("backward")
    c.optimizer.step()
    c.optimizer.zero_grad(set_to_none=True)


def gradients(c: Contender, inputs: tuple[Any, ...], loss: Callable[[Any], torch.Tensor]) -> list[torch.Tensor | None]:
    """``c``'s parameter gradients of one forward and backward (no optimizer step), in parameter order."""
    c.optimizer.zero_grad(set_to_none=True)
    with c.context():
        loss(c.fn(*inputs)).backward()
    grads = [None if p.grad is None else p.grad.detach().clone() for p in c.model.parameters()]
    c.optimizer.zero_grad(set_to_none=True)
    return grads


def gradient_error(reference: list[torch.Tensor | None], grads: list[torch.Tensor | None]) -> tuple[float, float]:
    """``(max abs difference, that / the largest reference gradient)``; a gradient missing on one side only
    is an infinite error.

    Example:
        >>> gradient_error([torch.tensor([2.0, -4.0])], [torch.tensor([2.0, -3.0])])
        (1.0, 0.25)
    """
    worst, scale = 0.0, 0.0
    if len(reference) != len(grads):
        return float("inf"), float("inf")
    for a, b in zip(reference, grads):
        if a is None or b is None:
            if a is not b:
                return float("inf"), float("inf")
            continue
        worst = max(worst, float((a.double() - b.double()).abs().max()))
        scale = max(scale, float(a.double().abs().max()))
    return worst, (worst / scale if scale else worst)


def persistent_bytes(c: Contender, inputs: tuple[Any, ...]) -> int:
    """What exists when a step begins: weights, buffers, optimizer state, inputs."""
    state = [t for s in c.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return (unique_bytes(c.model.parameters()) + unique_bytes(c.model.buffers()) + unique_bytes(state)
            + unique_bytes(t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)))


def measure_memory(c: Contender, inputs: tuple[Any, ...], loss: Callable[[Any], torch.Tensor]) -> None:
    """One measured step in the steady state: ``peak_bytes`` and ``activation_peak_bytes`` of ``c.row``.

    The steady state: ``c`` has run a forward and backward (its gradient check: code compiled, plans made)
    and its optimizer has state; a warm-up step first where the optimizer has none yet."""
    if not c.optimizer.state:
        train_step(c, inputs, loss)
    base = persistent_bytes(c, inputs)
    measured = step_peak(lambda: train_step(c, inputs, loss), c.model.parameters())
    c.row.update(peak_bytes=base + measured.peak_bytes, activation_peak_bytes=measured.activation_peak_bytes,
                 persistent_bytes=base, gradient_bytes=measured.gradient_bytes, end_bytes=measured.end_bytes)


def restore(model: nn.Module, snapshot: list[torch.Tensor]) -> None:
    """Copy ``snapshot`` (parameters then buffers, in order) into ``model``, in place."""
    with torch.no_grad():
        for t, value in zip([*model.parameters(), *model.buffers()], snapshot):
            t.copy_(value)


def snapshot_of(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]


# --------------------------------------------------------------------------------------------------
# one model


@dataclasses.dataclass
class RunOptions:
    """What :func:`run_model` does: the fractions, the contender kinds, the timing."""

    fractions: tuple[float, ...] = FRACTIONS
    kinds: tuple[str, ...] = KINDS
    rounds: int = TIMING["rounds"]
    reps: int = TIMING["reps"]
    cross_check: bool = True  # eager's profiler peak against the dispatch tracker
    float64: bool = True  # eager's own gradient error against a float64 copy: the scale the others are read at


def _finite(value: Any) -> Any:
    """None for NaN (the table's empty cells), the value otherwise."""
    return None if isinstance(value, float) and math.isnan(value) else value


def predict(name: str, model: nn.Module, inputs: tuple[Any, ...]) -> dict[str, Any]:
    """fxforge's prediction of the step's memory, its measurement (the allocator's records) and the time it took."""
    import fxforge

    row: dict[str, Any] = {"model": name, "env": env_name(), "status": "ok", "error": None}
    try:
        start = time.perf_counter()
        tm = fxforge.training_memory(model, inputs, optimizer=torch.optim.AdamW)
        row["predict_s"] = time.perf_counter() - start
        start = time.perf_counter()
        tm.measure()
        row["measure_s"] = time.perf_counter() - start
    except Exception as exc:  # noqa: BLE001 - the prediction failing loses its row, not the model's
        row.update(status="failed", error=error_text(exc, 600, one_line=True))
        return row
    table = tm.table
    row.update(predicted_peak_bytes=tm.peak_bytes, measured_peak_bytes=tm.measured.peak_bytes,
               peak_phase=tm.peak_phase, table={k: {c: _finite(v) for c, v in cols.items()}
                                                 for k, cols in table.to_dict(orient="index").items()})
    for figure in ("peak", "activations"):
        row[f"{figure}_error_pct"] = table.loc[figure, "error_%"]
    return row


def run_model(name: str, spec: models_mod.Spec, opts: RunOptions, *, seed: int = 0,
              log: Callable[[str], None] = log) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The prediction row and the contender rows of one model (see the module docstring)."""
    model, inputs = models_mod.build(name, spec, seed=seed)
    loss = default_loss
    torch._dynamo.reset()  # a fresh compile cache per model
    log(f"[{name}] {spec.describe(name)}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters")

    prediction = predict(name, model, inputs) if "fxforge" in opts.kinds else None
    if prediction is not None:
        log(f"[{name}] prediction: " + (f"peak {prediction['predicted_peak_bytes'] / 2**20:.1f} MiB predicted in "
            f"{prediction['predict_s']:.1f} s, {prediction['measured_peak_bytes'] / 2**20:.1f} MiB measured "
            f"({prediction['peak_error_pct']:+.2f} %)" if prediction["status"] == "ok" else prediction["error"]))

    initial = snapshot_of(model)
    shared_opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def contender(label: str, kind: str, fn: Any = None, on: nn.Module = model, opt: Any = shared_opt,
                  **extra: Any) -> Contender:
        c = Contender(label, kind, fn, on, opt, **extra)
        c.row = new_row(name, label, kind)
        c.row["fraction"] = c.fraction
        return c

    contenders = [contender("eager", "eager", model)]
    if "checkpoint" in opts.kinds:
        blocked = copy.deepcopy(model)
        c = contender("per-block checkpoint", "checkpoint", blocked, blocked,
                      torch.optim.AdamW(blocked.parameters(), lr=LR))
        c.row["info"]["blocks"] = models_mod.checkpoint_blocks(blocked)
        contenders.append(c)
    for f in opts.fractions if "inductor" in opts.kinds else ():
        contenders.append(contender(f"inductor {f:g}", "inductor", fraction=f, context=_budget_context(f)))
    for f in opts.fractions if "fxforge" in opts.kinds else ():
        contenders.append(contender(f"fxforge {f:g}", "fxforge", fraction=f))
    for f in opts.fractions if "fxforge-inductor" in opts.kinds else ():
        contenders.append(contender(f"fxforge-inductor {f:g}", "fxforge-inductor", fraction=f))

    reference = gradients(contenders[0], inputs, loss)
    if opts.float64:
        _float64_check(contenders[0], inputs, loss, reference, log)
    alive = [contenders[0]]
    for c in contenders[1:]:
        if _prepare(c, model, inputs, loss, initial, reference, log):
            alive.append(c)
    for c in alive:
        _measure(c, inputs, loss, log)
    unconstrained, source = _unconstrained(contenders, prediction)
    for kind in PEER_KINDS:
        if kind not in opts.kinds:
            continue
        peers = _peer_contenders(name, contenders, model, shared_opt, kind)
        contenders += peers
        for c in peers:
            if _prepare(c, model, inputs, loss, initial, reference, log):
                _measure(c, inputs, loss, log)
                alive.append(c)
    if opts.cross_check:
        _cross_check(contenders[0], inputs, loss, log)

    alive = [c for c in alive if c.row["status"] == "ok"]
    _time(alive, inputs, loss, opts.rounds, opts.reps, log)
    eager_ms, eager_min = contenders[0].row["median_ms"], contenders[0].row.get("min_ms")
    for c in contenders:
        row = c.row
        if eager_ms and row["median_ms"]:
            row["step_vs_eager"] = row["median_ms"] / eager_ms
            row["min_vs_eager"] = row["min_ms"] / eager_min
        row["fits"] = _fits(c, unconstrained, opts.fractions)
        row["unconstrained_activation_bytes"], row["unconstrained_source"] = unconstrained, source
    rows = [c.row for c in contenders]
    if prediction is not None:
        prediction.update(unconstrained_activation_bytes=unconstrained, unconstrained_source=source,
                          spec=spec.describe(name),
                          eager_activation_peak_bytes=contenders[0].row.get("activation_peak_bytes"),
                          eager_peak_bytes=contenders[0].row.get("peak_bytes"))
    else:
        prediction = {"model": name, "env": env_name(), "status": "skipped", "spec": spec.describe(name)}
    del contenders, alive, model, inputs, initial, reference
    torch._dynamo.reset()
    gc.collect()
    return prediction, rows


def _budget_context(fraction: float) -> Callable[[], Any]:
    return lambda: torch._functorch.config.patch(activation_memory_budget=fraction)


def _prepare(c: Contender, model: nn.Module, inputs: tuple[Any, ...], loss: Callable[[Any], torch.Tensor],
             initial: list[torch.Tensor], reference: list[torch.Tensor | None], log: Callable[[str], None]) -> bool:
    """Make ``c``'s callable, run its first forward and backward at the initial weights (compiles happen
    there: both are "prepare s") and compare its gradients with eager's. False when it failed."""
    import fxforge

    start = time.perf_counter()
    try:
        if c.kind == "inductor":
            c.fn = torch.compile(model, backend=inductor_backend(c.fraction))
        elif c.kind in OURS:
            budget = c.budget_bytes if c.kind in PEER_KINDS else f"{round(c.fraction * 100)}%"
            # The step's own loss, so the plan counts what it holds between forward and backward.
            c.fn = fxforge.optimize(model, inputs, memory_budget=budget, loss=loss, target=OURS[c.kind])
            c.row["info"].update(_plan_info(getattr(c.fn, "plan", None)))
        restore(c.model, initial)
        grads = gradients(c, inputs, loss)
    except Exception as exc:  # noqa: BLE001 - any error fails this contender, not the run
        fail(c.row, "prepare", exc)
        log(f"[{c.row['model']}] {c.name}: {c.row['status']} while preparing: {error_text(exc, 300, one_line=True)}")
        return False
    c.row["prepare_s"] = time.perf_counter() - start
    c.row["max_grad_err"], c.row["rel_grad_err"] = gradient_error(reference, grads)
    log(f"[{c.row['model']}] {c.name}: prepared in {c.row['prepare_s']:.1f} s, max abs gradient error "
        f"{c.row['max_grad_err']:.1e} (rel {c.row['rel_grad_err']:.1e})")
    return True


def _float64_check(eager: Contender, inputs: tuple[Any, ...], loss: Callable[[Any], torch.Tensor],
                   reference: list[torch.Tensor | None], log: Callable[[str], None]) -> None:
    """Eager's float32 gradients against a float64 copy's (at the same weights): in eager's row, the error that
    float32 itself makes, beside which the contenders' differences from eager are read."""
    try:
        model64 = copy.deepcopy(eager.model).double()
        inputs64 = tree_map(lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                            inputs)
        loss(model64(*inputs64)).backward()
        grads64 = [None if p.grad is None else p.grad.detach() for p in model64.parameters()]
    except Exception as exc:  # noqa: BLE001 - the scale is extra
        eager.row["info"]["float64_error"] = error_text(exc, 600, one_line=True)
        return
    eager.row["max_grad_err"], eager.row["rel_grad_err"] = gradient_error(grads64, reference)
    log(f"[{eager.row['model']}] eager float32 against float64: max abs gradient error "
        f"{eager.row['max_grad_err']:.1e} (rel {eager.row['rel_grad_err']:.1e})")


def _plan_info(plan: Any) -> dict[str, Any]:
    """The figures of fxforge's ``CheckpointPlan`` the table and the JSON show (those that exist)."""
    if plan is None:
        return {}
    info: dict[str, Any] = {}
    for key in ("budget_bytes", "unconstrained_activation_bytes", "predicted_activation_peak_bytes",
                "predicted_peak_bytes", "overhead", "solver", "measured_bytes", "margin_bytes"):
        value = getattr(plan, key, None)
        if value is not None:
            info[key] = value
    for key in ("saved", "recomputed"):
        value = getattr(plan, key, None)
        if value is not None:
            info[f"{key}_nodes"] = len(value)
    info["summary"] = str(plan)
    return info


def _measure(c: Contender, inputs: tuple[Any, ...], loss: Callable[[Any], torch.Tensor],
             log: Callable[[str], None]) -> None:
    try:
        measure_memory(c, inputs, loss)
    except Exception as exc:  # noqa: BLE001 - any error fails this contender, not the run
        fail(c.row, "memory", exc)
        log(f"[{c.row['model']}] {c.name}: failed while measured: {error_text(exc, 300, one_line=True)}")
        return
    log(f"[{c.row['model']}] {c.name}: whole-step peak {c.row['peak_bytes'] / 2**20:.1f} MiB, activations "
        f"{c.row['activation_peak_bytes'] / 2**20:.1f} MiB")


def _cross_check(eager: Contender, inputs: tuple[Any, ...], loss: Callable[[Any], torch.Tensor],
                 log: Callable[[str], None]) -> None:
    """Eager's step measured by the dispatch tracker beside the profiler's figure (above the start)."""
    row = eager.row
    if row["status"] != "ok" or row["peak_bytes"] is None:
        return
    try:
        tracked = tracker_peak(lambda: train_step(eager, inputs, loss))
    except Exception as exc:  # noqa: BLE001 - the cross-check is extra
        row["info"]["tracker_error"] = error_text(exc, 600, one_line=True)
        return
    profiled = row["peak_bytes"] - row["persistent_bytes"]
    row["info"].update(tracker_peak_bytes=tracked, profiler_peak_bytes=profiled,
                       profiler_vs_tracker_pct=100.0 * (profiled - tracked) / tracked if tracked else None)
    log(f"[{row['model']}] eager step above its start: profiler {profiled / 2**20:.1f} MiB, dispatch tracker "
        f"{tracked / 2**20:.1f} MiB")


def _unconstrained(contenders: list[Contender], prediction: dict[str, Any] | None) -> tuple[int | None, str]:
    """The unconstrained activation peak: fxforge's plan's, else eager's measured one; and where it is from."""
    for c in contenders:
        value = c.row["info"].get("unconstrained_activation_bytes")
        if c.kind in ("fxforge", "fxforge-inductor") and c.row["status"] == "ok" and value:
            return int(value), "fxforge plan"
    eager = contenders[0].row.get("activation_peak_bytes")
    return (eager, "eager measured") if eager else (None, "none")


PEER_MERGE = 0.03  # peers whose peaks are within 3 % of a lower one share that one's fxforge row


def _peer_contenders(name: str, contenders: list[Contender], model: nn.Module,
                     optimizer: torch.optim.Optimizer, kind: str = "fxforge-peer") -> list[Contender]:
    """``fxforge ≤ peer`` (``kind``: ``"fxforge-peer"``; ``"fxforge-inductor-peer"``: ``fxforge-inductor ≤ peer``):
    fxforge with ``memory_budget`` = a peer's (per-block checkpointing's, an Inductor budget's) measured
    whole-step peak. Peers whose peaks lie within :data:`PEER_MERGE` above a lower peer's share that lower budget
    (one plan, one row: fewer minutes, and a budget no looser for fxforge)."""
    measured = sorted((c.row["peak_bytes"], c.name) for c in contenders
                      if c.kind in ("checkpoint", "inductor") and c.row["status"] == "ok" and c.row["peak_bytes"])
    groups: list[tuple[int, list[str]]] = []
    for nbytes, peer in measured:
        if groups and nbytes <= groups[-1][0] * (1 + PEER_MERGE):
            groups[-1][1].append(peer)
        else:
            groups.append((nbytes, [peer]))
    peers = []
    for nbytes, names in groups:
        c = Contender(f"{PEER_KINDS[kind]} ≤ {', '.join(names)}", kind, None, model, optimizer, budget_bytes=nbytes)
        c.row = new_row(name, c.name, c.kind)
        c.row.update(budget_bytes=nbytes, info={"peers": names})
        peers.append(c)
    return peers


def _fits(c: Contender, unconstrained: int | None, fractions: Sequence[float]) -> Any:
    """True/False against the contender's budget; per fraction for per-block checkpointing; None for eager."""
    row = c.row
    if row["status"] != "ok" or row.get("peak_bytes") is None:
        return None
    if c.kind in PEER_KINDS:
        return row["peak_bytes"] <= c.budget_bytes
    if unconstrained is None:
        return None
    if c.kind == "checkpoint":
        return {f"{f:g}": row["activation_peak_bytes"] <= f * unconstrained for f in fractions}
    if c.fraction is not None:
        return row["activation_peak_bytes"] <= c.fraction * unconstrained
    return None


def _time(contenders: list[Contender], inputs: tuple[Any, ...], loss: Callable[[Any], torch.Tensor],
          rounds: int, reps: int, log: Callable[[str], None]) -> None:
    """``rounds`` rounds, the order rotated by one each round, ``reps`` steps per contender, each timed."""
    times: dict[str, list[float]] = {c.name: [] for c in contenders}
    for c in contenders:  # one untimed step each: after the measurements' profiler and tracker
        try:
            train_step(c, inputs, loss)
        except Exception as exc:  # noqa: BLE001 - any error fails this contender
            fail(c.row, "time", exc)
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds):
            k = r % len(contenders) if contenders else 0
            for c in contenders[k:] + contenders[:k]:
                if c.row["status"] != "ok":
                    continue
                try:
                    for _ in range(reps):
                        start = time.perf_counter_ns()
                        train_step(c, inputs, loss)
                        times[c.name].append((time.perf_counter_ns() - start) / 1e6)
                except Exception as exc:  # noqa: BLE001 - any error fails this contender
                    fail(c.row, "time", exc)
                    log(f"[{c.row['model']}] {c.name}: failed while timed: {error_text(exc, 300, one_line=True)}")
            gc.enable()
            gc.collect()  # between rounds, not inside a timed step
            gc.disable()
    finally:
        if enabled:
            gc.enable()
    for c in contenders:
        flat = times[c.name]
        if c.row["status"] == "ok" and flat:
            q = statistics.quantiles(flat, n=4) if len(flat) >= 2 else [flat[0]] * 3
            c.row.update(median_ms=statistics.median(flat), min_ms=min(flat), iqr_ms=q[2] - q[0],
                         times_ms=[round(t, 2) for t in flat])
    log(f"[{contenders[0].row['model']}] step ms: " + ", ".join(
        f"{c.name} {c.row['median_ms']:.0f}" for c in contenders if c.row["median_ms"]))


# --------------------------------------------------------------------------------------------------
# the zoo models in the zoo environment


def run_in_zoo_env(models: list[str], argv: list[str], python: str = ZOO_PYTHON) -> dict[str, Any]:
    """This section for ``models`` in the zoo environment's ``python`` (a subprocess, its log on our stderr),
    given our arguments ``argv``; a result with failed rows when it cannot run."""
    result, why = run_in_zoo(NAME, models, argv, python)
    return result if result is not None else _failed_result(models, why)


def _failed_result(models: list[str], why: str) -> dict[str, Any]:
    return {"meta": {}, "predictions": [{"model": m, "env": ".venv-zoo", "status": "failed", "error": why}
                                        for m in models],
            "rows": [{**new_row(m, "eager", "eager"), "env": ".venv-zoo", "status": "failed", "stage": "environment",
                      "error": why} for m in models]}


# --------------------------------------------------------------------------------------------------
# CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``--suite training``."""
    p.add_argument("--models", type=csv_list, default=list(models_mod.MODELS),
                   help=f"comma-separated, of {','.join(models_mod.MODELS)} (default all; "
                   f"{','.join(models_mod.ZOO_MODELS)} run in the zoo environment)")
    p.add_argument("--contenders", type=csv_list, default=list(KINDS),
                   help=f"comma-separated kinds, of {','.join(KINDS)} (default all; eager always runs)")
    p.add_argument("--fractions", type=lambda s: [float(x) for x in csv_list(s)], default=list(FRACTIONS),
                   help="fractions of the unconstrained activation peak (default 0.8,0.6,0.4)")
    p.add_argument("--quick", action="store_true", help="tiny models (batch 2, S 32, hidden 32, 64x64 images), "
                   "one round: a smoke run")
    p.add_argument("--rounds", type=int, default=None, help=f"timed rounds (default {TIMING['rounds']})")
    p.add_argument("--reps", type=int, default=None, help=f"steps per contender per round (default {TIMING['reps']})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--zoo-python", default=ZOO_PYTHON, help="the zoo environment's python (default .venv-zoo)")
    report.add_output_options(p, NAME)


def run(opts: argparse.Namespace) -> int:
    """Run the benchmark; returns the exit status."""
    unknown = [m for m in opts.models if m not in models_mod.MODELS] + [k for k in opts.contenders if k not in KINDS]
    if unknown:
        raise UsageError(f"unknown model(s) or contender(s): {', '.join(unknown)}")
    timing = dict(QUICK_TIMING if opts.quick else TIMING)
    for key in timing:
        if getattr(opts, key) is not None:
            timing[key] = getattr(opts, key)
    if timing["rounds"] < 1 or timing["reps"] < 1 or opts.threads < 1 or not all(0 < f <= 1 for f in opts.fractions):
        raise UsageError("--rounds, --reps and --threads must be >= 1, fractions in (0, 1]")
    threads_before = torch.get_num_threads()
    torch.set_num_threads(opts.threads)
    cache_before = os.environ.get("FXFORGE_CACHE_DIR")
    os.environ["FXFORGE_CACHE_DIR"] = cache_dir = tempfile.mkdtemp(prefix="fxforge-bench-autotune-")
    try:
        return _run(opts, getattr(opts, "argv", []), timing, opts.command)
    finally:
        torch.set_num_threads(threads_before)
        if cache_before is None:
            os.environ.pop("FXFORGE_CACHE_DIR", None)
        else:
            os.environ["FXFORGE_CACHE_DIR"] = cache_before
        shutil.rmtree(cache_dir, ignore_errors=True)


def _run(opts: argparse.Namespace, argv: list[str], timing: dict[str, int], command: str) -> int:
    sizes = models_mod.SIZES["quick" if opts.quick else "full"]
    here = [m for m in opts.models if m in models_mod.HF_MODELS or models_mod.zoo_available()]
    elsewhere = [m for m in opts.models if m not in here]
    if models_mod.zoo_available():
        from benchmarks.zoo import define_torchvision_op_schemas

        define_torchvision_op_schemas()  # before transformers imports torchvision
    run_opts = RunOptions(tuple(opts.fractions), tuple(dict.fromkeys(["eager", *opts.contenders])), **timing)
    result: dict[str, Any] = {
        "meta": {
            "suite": NAME,
            "title": "Training memory: fxforge's prediction, and checkpointing under a budget against per-block "
                     "checkpointing and Inductor's activation memory budget (issue 22)",
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": command,
            "commit": report.git_commit(),
            "machine": report.machine_info(torch.get_num_threads()),
            "env": env_name(),
            "env_models": here,
            "versions": _versions(),
            "models": {m: sizes[m].describe(m) for m in opts.models},
            "fractions": list(opts.fractions),
            "timing": timing,
            "complete": False,
        },
        "predictions": [],
        "rows": [],
    }
    json_path = os.path.join(opts.out, f"results-{NAME}.json")
    log(f"training: {', '.join(here)} here ({env_name()})" + (f", {', '.join(elsewhere)} in the zoo environment"
                                                                if elsewhere else ""))
    for name in here:
        try:
            prediction, rows = run_model(name, sizes[name], run_opts, seed=opts.seed)
        except Exception as exc:  # noqa: BLE001 - a model that fails to build fails its row, not the run
            log(f"[{name}] failed: {error_text(exc, 300, one_line=True)}")
            prediction, rows = {"model": name, "env": env_name(), "status": "failed", "error": error_text(exc, 600, one_line=True)}, [
                {**new_row(name, "eager", "eager"), "status": "failed", "stage": "build", "error": error_text(exc, 600, one_line=True)}]
        result["predictions"].append(prediction)
        result["rows"].extend(rows)
        report.write_json(json_path, result)  # partial results survive a crash or ^C
    if elsewhere:
        zoo = run_in_zoo_env(elsewhere, argv, python=opts.zoo_python)
        result["predictions"] += zoo["predictions"]
        result["rows"] += zoo["rows"]
        zoo_meta = zoo.get("meta") or {}
        result["meta"]["zoo_env"] = {"env": zoo_meta.get("env", ".venv-zoo"), "models": elsewhere,
                                     **zoo_meta.get("versions", {})}
    result["meta"]["complete"] = True
    result["meta"]["loadavg_end"] = report.load_average()
    result["summary"] = summary(result["rows"])
    report.write_json(json_path, result)
    log(f"wrote {json_path}")
    if not opts.no_markdown:
        write_markdown(opts.markdown, result)
        log(f"wrote {opts.markdown}")
    print(report.markdown_table(result["predictions"], PREDICTION_COLUMNS))
    print()
    print(report.markdown_table(result["rows"], COLUMNS))
    for line in result["summary"]:
        print(line)
    return 0


def _versions() -> dict[str, str | None]:
    import importlib.metadata

    out = {}
    for dist in ("torch", "transformers", "torchvision", "timm"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


SECTION = Section(NAME, "a training step's memory: fxforge's prediction against a measured step, then fxforge's "
                  "checkpointing under budgets against per-block checkpointing and Inductor's activation memory "
                  "budget, on GPT-2, BERT, LLaMA, ResNet-50 and ViT-S (issue 22)", add_arguments, run)
