"""``python -m benchmarks --suite dynamic``: a request trace of changing shapes (issue 19, part 6).

Per model (BERT, GPT-2 and LLaMA from transformers configs, random seeded weights, eager attention, no
KV cache), one process and one run:

1. the trace: ``--calls`` requests (200), seeded; each has a batch drawn from {1, 2, 4, 8} and a length S
   uniform in [16, 512]; the inputs are ``input_ids`` and a padded ``attention_mask``: one row (at random)
   is S tokens long, every other row has a random valid length in [1, S]; BERT and GPT-2 pad on the right,
   LLaMA on the left (as their tokenizers do);
2. set-up: every contender is set up on one example (batch 2, S 64, one row padded) on its own deep copy of
   the model (eager: the model itself): ``torch.compile`` / export + session / ``fxforge.optimize``, plus
   its first call at the example: that time is "set-up s";
3. the trace: call ``i`` runs every contender on the same inputs, one after the other (in an order rotated
   by one each call, so no contender always runs first), each call timed on its own with
   ``time.perf_counter`` under ``torch.no_grad()``, including whatever first-time work it does (recompiles,
   new plans, new exports); the cyclic garbage collector is paused during a timed call;
4. every contender's first output (the last hidden state) at every call is compared with eager's on the
   valid (non-padding) positions: ``allclose`` with rtol = atol = 1e-3; a call that differs counts as a
   mismatch (the run goes on);
5. figures: trace total s and ``eager total / contender total``; p50 and p99 of the per-call times; p99/p50
   after warm-up (the first ``--warmup-calls``, 20, are left out: a fixed count, so new work after them
   shows up); the median over calls of ``eager ms / contender ms`` at the same call (a speed figure
   that does not depend on the sizes drawn); the first-time work each contender did (torch.compile:
   graphs compiled, ``torch._dynamo``'s ``unique_graphs``; fxforge: plans built, ``plans_built``;
   fxforge -> ORT: exports, ``exports``; plain ORT: its one session) and the last call that did some.

Contenders (``--contenders``): ``eager``; ``compile``: ``torch.compile(model)``, default (Inductor,
automatic dynamic shapes); ``compile_freezing``: the same with Inductor's ``freezing`` (weights folded as
constants, the CPU-inference setting; not run by default: one more set of compiles, minutes on a small
machine); ``ort``: ``torch.onnx.export(dynamo=True)`` with batch and S dynamic, one onnxruntime session;
``fxforge``: ``fxforge.optimize(model, example)`` (native, ``dynamic=None``: sizes that change become
dynamic); ``fxforge_ort``: ``fxforge.optimize(model, example, target="onnxruntime", dynamic=True)``. Every
ONNX Runtime session: torch's thread count, one inter-op thread, no spinning
(:func:`benchmarks.contenders.ort_session_options`).

Writes ``benchmarks/out/results-dynamic.json`` and the block between ``<!-- harness:dynamic:begin -->`` and
``<!-- harness:dynamic:end -->`` of ``benchmarks/RESULTS.md`` (the rest of the file is kept byte for byte).

Example::

    python -m benchmarks --suite dynamic
    python -m benchmarks --suite dynamic --calls 20 --models bert --no-markdown
    python -m benchmarks --suite dynamic --calls 200 --models bert,gpt2,llama --contenders eager,compile,ort,fxforge,fxforge_ort
"""

from __future__ import annotations

import argparse
import copy
import gc
import io
import os
import random
import shutil
import statistics
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from benchmarks import report
from benchmarks.contenders import ort_providers, ort_session, ort_session_options
from benchmarks.log import error_text, log
from benchmarks.section import Section, UsageError, csv_list

NAME = "dynamic"

MODELS = ("bert", "gpt2", "llama")
DEFAULT_CONTENDERS = ("eager", "compile", "ort", "fxforge", "fxforge_ort")
CALLS = 200
BATCHES = (1, 2, 4, 8)
SEQ_RANGE = (16, 512)
EXAMPLE = (2, 64)  # batch, S of the set-up example
WARMUP_CALLS = 20
RTOL = ATOL = 1e-3
MAX_P99_OVER_P50 = 3.0  # the target for fxforge, after warm-up


# --------------------------------------------------------------------------------------------------
# models


@dataclass(frozen=True)
class ModelSize:
    """The size of the models built; :data:`FULL` is the issue's, tests pass a tiny one.

    ``intermediate`` None: the model's usual (4 x hidden for BERT and GPT-2, 8/3 x hidden rounded up to a
    multiple of 16 for LLaMA's SwiGLU); ``vocab`` None: the model's own vocabulary size.
    """

    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int | None = None
    vocab: int | None = None
    max_positions: int = 512


FULL = ModelSize()


@dataclass
class TraceModel:
    """A model of the trace: the module (eval mode), its vocabulary size and the side its rows are padded on."""

    name: str
    module: nn.Module
    vocab: int
    padding_side: str  # "right" | "left"


def build_model(name: str, size: ModelSize = FULL, seed: int = 0) -> TraceModel:
    """``name`` (one of :data:`MODELS`) from a transformers config, seeded random weights, eval mode.

    Example:
        >>> build_model("llama", ModelSize(hidden=32, layers=1, heads=2, kv_heads=1, vocab=100)).padding_side
        'left'
    """
    torch.manual_seed(seed)
    if name == "bert":
        from transformers import BertConfig, BertModel

        vocab = size.vocab or 30522
        config = BertConfig(vocab_size=vocab, hidden_size=size.hidden, num_hidden_layers=size.layers,
                            num_attention_heads=size.heads, intermediate_size=size.intermediate or 4 * size.hidden,
                            max_position_embeddings=size.max_positions, attn_implementation="eager",
                            return_dict=False)
        return TraceModel(name, BertModel(config, add_pooling_layer=False).eval(), vocab, "right")
    if name == "gpt2":
        from transformers import GPT2Config, GPT2Model

        vocab = size.vocab or 50257
        special = min(50256, vocab - 1)
        config = GPT2Config(vocab_size=vocab, n_embd=size.hidden, n_layer=size.layers, n_head=size.heads,
                            n_inner=size.intermediate, n_positions=size.max_positions, bos_token_id=special,
                            eos_token_id=special, attn_implementation="eager", use_cache=False, return_dict=False)
        return TraceModel(name, GPT2Model(config).eval(), vocab, "right")
    if name == "llama":
        from transformers import LlamaConfig, LlamaModel

        vocab = size.vocab or 32000
        config = LlamaConfig(vocab_size=vocab, hidden_size=size.hidden,
                             intermediate_size=size.intermediate or -(-8 * size.hidden // 3 // 16) * 16,
                             num_hidden_layers=size.layers, num_attention_heads=size.heads,
                             num_key_value_heads=size.kv_heads, max_position_embeddings=size.max_positions,
                             attn_implementation="eager", use_cache=False, return_dict=False)
        return TraceModel(name, LlamaModel(config).eval(), vocab, "left")
    raise KeyError(f"unknown model {name!r}; the models are {', '.join(MODELS)}")


# --------------------------------------------------------------------------------------------------
# the trace


@dataclass(frozen=True)
class Request:
    """One call of the trace: its batch, its padded length S and each row's valid length."""

    batch: int
    seq: int
    lengths: tuple[int, ...]


def make_trace(calls: int, *, seed: int = 0, batches: Sequence[int] = BATCHES,
               seq_range: tuple[int, int] = SEQ_RANGE) -> list[Request]:
    """``calls`` requests, seeded: batch uniform in ``batches``, S uniform in ``seq_range`` (both ends
    included); one row of each is S long, the others have a valid length uniform in [1, S].

    Example:
        >>> [(r.batch, r.seq) for r in make_trace(3, seed=1, batches=(1, 2), seq_range=(8, 9))]
        [(1, 8), (1, 9), (2, 9)]
    """
    rng = random.Random(seed)
    trace = []
    for _ in range(calls):
        batch, seq = rng.choice(list(batches)), rng.randint(*seq_range)
        trace.append(Request(batch, seq, _lengths(rng, batch, seq)))
    return trace


def _lengths(rng: random.Random, batch: int, seq: int) -> tuple[int, ...]:
    full = rng.randrange(batch)
    return tuple(seq if row == full else rng.randint(1, seq) for row in range(batch))


def request_inputs(request: Request, vocab: int, padding_side: str, seed: int) -> dict[str, torch.Tensor]:
    """``input_ids`` (padding positions hold token 0) and the ``attention_mask`` of ``request``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (request.batch, request.seq), generator=gen)
    mask = torch.zeros(request.batch, request.seq, dtype=torch.long)
    for row, length in enumerate(request.lengths):
        valid = slice(0, length) if padding_side == "right" else slice(request.seq - length, request.seq)
        mask[row, valid] = 1
    return {"input_ids": ids * mask, "attention_mask": mask}


def example_request() -> Request:
    """The set-up example: batch 2, S 64, the second row 40 tokens long."""
    batch, seq = EXAMPLE
    return Request(batch, seq, (seq, *([seq * 5 // 8] * (batch - 1))))


# --------------------------------------------------------------------------------------------------
# contenders


@dataclass
class Setup:
    """What setting a contender up returns.

    Attributes:
        fn: called as ``fn(**inputs)``; its first tensor output is compared with eager's.
        count: the first-time work done so far (graphs compiled, plans built, exports, sessions), or None
            where it cannot be read; the runner takes differences around each of this contender's calls.
        unit: what ``count`` counts (``"graphs"``, ``"plans"``, ...).
        baseline: ``count()`` before the set-up began (for counters shared by contenders).
        note: a short text for the table.
    """

    fn: Callable[..., Any]
    count: Callable[[], int | None] = lambda: None
    unit: str = ""
    baseline: int = 0
    note: str = ""


def _dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _setup_eager(model: nn.Module, example: dict[str, torch.Tensor]) -> Setup:
    return Setup(model)


def _setup_compile(model: nn.Module, example: dict[str, torch.Tensor]) -> Setup:
    baseline = _dynamo_graphs()
    return Setup(torch.compile(model), _dynamo_graphs, "graphs", baseline, "Inductor, automatic dynamic")


def _setup_compile_freezing(model: nn.Module, example: dict[str, torch.Tensor]) -> Setup:
    baseline = _dynamo_graphs()
    compiled = torch.compile(model, options={"freezing": True})
    return Setup(compiled, _dynamo_graphs, "graphs", baseline, "Inductor, freezing, automatic dynamic")


class OrtKwargsCallable:
    """An onnxruntime session called like the model with keyword tensors: ``fn(input_ids=..., ...)``."""

    def __init__(self, session: Any):
        self.session = session
        self.input_names = [i.name for i in session.get_inputs()]

    def __call__(self, **inputs: torch.Tensor) -> list[torch.Tensor]:
        missing = [n for n in self.input_names if n not in inputs]
        if missing:
            raise ValueError(f"the ONNX model takes {self.input_names}; missing {missing}")
        feeds = {n: inputs[n].detach().cpu().numpy() for n in self.input_names}
        return [torch.from_numpy(o) for o in self.session.run(None, feeds)]


def dynamic_onnx_export(model: nn.Module, example: dict[str, torch.Tensor], path: str,
                        max_batch: int = 64, max_seq: int | None = None) -> None:
    """``torch.onnx.export(model, (), kwargs=example, dynamo=True)`` with dim 0 (batch) and dim 1 (S) of every
    input dynamic; the exporter's progress lines are kept off the console (kept in the error on failure)."""
    from torch.export import Dim

    from fxforge.exporters.program import quiet

    batch, seq = Dim("batch", max=max_batch), Dim("seq", max=max_seq) if max_seq else Dim("seq")
    dynamic_shapes = {name: {0: batch, 1: seq} for name in example}
    log = io.StringIO()
    try:
        with quiet(log):
            torch.onnx.export(model, (), path, kwargs=example, dynamo=True, dynamic_shapes=dynamic_shapes,
                              verbose=False)
    except Exception as exc:
        tail = "\n".join(log.getvalue().strip().splitlines()[-5:])
        raise RuntimeError(f"torch.onnx.export failed: {type(exc).__name__}: {exc}\n{tail}") from exc


def _setup_ort(model: nn.Module, example: dict[str, torch.Tensor]) -> Setup:
    tmp = tempfile.mkdtemp(prefix="fxforge-bench-dynamic-")
    try:
        path = os.path.join(tmp, "model.onnx")
        max_seq = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        dynamic_onnx_export(model, example, path, max_seq=max_seq)
        session = ort_session(path, torch.device("cpu"))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fn = OrtKwargsCallable(session)
    weakref.finalize(fn, shutil.rmtree, tmp, True)
    return Setup(fn, lambda: 1, "session", 0, "torch.onnx.export(dynamo=True), batch and S dynamic")


def _setup_fxforge(model: nn.Module, example: dict[str, torch.Tensor]) -> Setup:
    import fxforge

    opt = fxforge.optimize(model, example)

    def plans() -> int | None:
        built = getattr(opt, "plans_built", None)
        return int(built) if isinstance(built, int) else None

    if plans() is not None:
        return Setup(opt, plans, "plans", 0, "native, dynamic=None")
    # Before OptimizedModule counts its builds: the plans its cache holds (a plan dropped from the cache
    # and built again is not seen).
    cache = getattr(opt, "cache", None)
    if cache is not None and isinstance(getattr(cache, "plans", None), dict):
        return Setup(opt, lambda: len(cache.plans), "plans held", 0, "native, dynamic=None")
    return Setup(opt, lambda: None, "plans", 0, "native, dynamic=None")


def _setup_fxforge_ort(model: nn.Module, example: dict[str, torch.Tensor]) -> Setup:
    import fxforge

    module = fxforge.optimize(model, example, target="onnxruntime", dynamic=True,
                              session_options=ort_session_options(), providers=ort_providers(torch.device("cpu")))

    def exports() -> int | None:
        count = getattr(module, "exports", None)
        return int(count) if isinstance(count, int) else None

    return Setup(module, exports, "exports", 0, "target='onnxruntime', dynamic=True")


SETUPS: dict[str, Callable[[nn.Module, dict[str, torch.Tensor]], Setup]] = {
    "eager": _setup_eager,
    "compile": _setup_compile,
    "compile_freezing": _setup_compile_freezing,
    "ort": _setup_ort,
    "fxforge": _setup_fxforge,
    "fxforge_ort": _setup_fxforge_ort,
}
DESCRIPTIONS = {
    "eager": "the model as is",
    "compile": "torch.compile(model): Inductor, automatic dynamic shapes",
    "compile_freezing": "torch.compile(model, options={'freezing': True})",
    "ort": "torch.onnx.export(dynamo=True, dynamic_shapes: batch and S), one onnxruntime session",
    "fxforge": "fxforge.optimize(model, example) (native, dynamic=None)",
    "fxforge_ort": "fxforge.optimize(model, example, target='onnxruntime', dynamic=True)",
}


# --------------------------------------------------------------------------------------------------
# comparing


def first_tensor(output: Any) -> torch.Tensor:
    for leaf in tree_leaves(output):
        if isinstance(leaf, torch.Tensor):
            return leaf
    raise ValueError(f"the output ({type(output).__name__}) holds no tensor")


def compare(reference: torch.Tensor, output: torch.Tensor, mask: torch.Tensor, *, rtol: float = RTOL,
            atol: float = ATOL) -> tuple[bool, float]:
    """``(close, max abs error)`` of ``output`` against ``reference`` on the valid positions of ``mask``.

    Outputs shaped ``[batch, S, ...]`` like the mask are compared at its non-zero positions; other outputs
    as a whole. NaN where the reference has NaN counts as equal. A shape difference is not close (error inf).

    Example:
        >>> ref = torch.zeros(1, 3, 2)
        >>> out = torch.tensor([[[0.0, 0.0], [0.0, 0.0], [9.0, 9.0]]])
        >>> compare(ref, out, torch.tensor([[1, 1, 0]]))
        (True, 0.0)
    """
    if tuple(reference.shape) != tuple(output.shape):
        return False, float("inf")
    if reference.dim() >= 2 and tuple(reference.shape[:2]) == tuple(mask.shape):
        valid = mask.to(torch.bool)
        reference, output = reference[valid], output[valid]
    reference = reference.detach().to(torch.float64)
    output = output.detach().to(torch.float64)
    if reference.numel() == 0:
        return True, 0.0
    close = bool(torch.allclose(output, reference, rtol=rtol, atol=atol, equal_nan=True))
    diff = (reference - output).abs()
    diff = torch.where(torch.isnan(reference) & torch.isnan(output), torch.zeros_like(diff), diff)
    worst = float("inf") if torch.isnan(diff).any() else float(diff.max())
    return close, worst


# --------------------------------------------------------------------------------------------------
# statistics


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation between order statistics (numpy's default).

    Example:
        >>> percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50), percentile([1.0, 2.0, 3.0, 4.0, 5.0], 99)
        (3.0, 4.96)
    """
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def trace_stats(times_s: Sequence[float], eager_s: Sequence[float] | None, warmup_calls: int) -> dict[str, Any]:
    """The figures of one contender's per-call times (seconds); ``eager_s`` eager's at the same calls."""
    ms = [t * 1e3 for t in times_s]
    warm = ms[warmup_calls:] if len(ms) > warmup_calls else []
    out: dict[str, Any] = {
        "trace_s": sum(times_s),
        "p50_ms": percentile(ms, 50),
        "p99_ms": percentile(ms, 99),
        "max_ms": max(ms) if ms else None,
        "warm_calls": len(warm),
        "warm_p50_ms": percentile(warm, 50),
        "warm_p99_ms": percentile(warm, 99),
    }
    out["warm_p99_over_p50"] = (out["warm_p99_ms"] / out["warm_p50_ms"]) if warm and out["warm_p50_ms"] else None
    if eager_s is not None and len(eager_s) == len(times_s) and times_s:
        speed = [e / t for e, t in zip(eager_s, times_s) if t > 0]
        out["per_call_vs_eager"] = statistics.median(speed) if speed else None
        # How much slower than eager the slow calls are, after warm-up: size-free jitter (eager's own is 1).
        rel = [t / e for e, t in zip(eager_s[warmup_calls:], times_s[warmup_calls:]) if e > 0]
        p50 = percentile(rel, 50)
        out["warm_rel_p99_over_p50"] = (percentile(rel, 99) / p50) if rel and p50 else None
    return out


# --------------------------------------------------------------------------------------------------
# one model


def _work(setup: Setup) -> int | None:
    try:
        return setup.count()
    except Exception:  # noqa: BLE001 - a counter that cannot be read is unknown, not a failure
        return None


def _input_seed(seed: int, call: int) -> int:
    """The generator seed of the inputs of call ``call`` (-1: the set-up example) of the trace seeded ``seed``."""
    return seed * 1_000_003 + call + 1


def new_row(model: str, contender: str) -> dict[str, Any]:
    return {"model": model, "contender": contender, "status": "ok", "setup_s": None, "calls": 0,
            "trace_s": None, "mismatches": 0, "max_abs_err": None, "first_mismatch": None, "work_unit": "",
            "setup_work": None, "trace_work": None, "work_calls": [], "note": "", "error": None, "stage": None}


def run_model(model: TraceModel, trace: Sequence[Request], contenders: Sequence[str], *, seed: int = 0,
              warmup_calls: int = WARMUP_CALLS, rtol: float = RTOL, atol: float = ATOL,
              log: Callable[[str], None] = log) -> list[dict[str, Any]]:
    """Set every contender up on :func:`example_request`, then run ``trace`` through all of them, interleaved.

    ``eager`` is always run (first in the list if missing): the reference for outputs and ratios. A contender
    that raises (setting up, or at a call) gets a failed row with the error and the stage, and is left out of
    the rest of the trace. Returns one row per contender, in ``contenders`` order.
    """
    names = list(dict.fromkeys(["eager", *contenders]))
    unknown = [n for n in names if n not in SETUPS]
    if unknown:
        raise KeyError(f"unknown contender(s) {', '.join(unknown)}; known: {', '.join(SETUPS)}")
    rows = {n: new_row(model.name, n) for n in names}
    if any(n.startswith("compile") for n in names):
        torch._dynamo.reset()  # a fresh compile cache per model, and its counters from zero

    example = request_inputs(example_request(), model.vocab, model.padding_side, seed=_input_seed(seed, -1))
    setups: dict[str, Setup] = {}
    for name in names:
        row = rows[name]
        try:
            target = model.module if name == "eager" else copy.deepcopy(model.module)
            t0 = time.perf_counter()
            with torch.no_grad():
                setup = SETUPS[name](target, example)
                setup.fn(**example)
        except Exception as exc:  # noqa: BLE001 - one failed contender, not a failed run
            row.update(status="failed", stage="set-up", error=error_text(exc, 600))
            log(f"[{model.name}] {name}: set-up failed: {error_text(exc, 300)}")
            continue
        row["setup_s"] = time.perf_counter() - t0
        count = _work(setup)
        row.update(note=setup.note, work_unit=setup.unit,
                   setup_work=None if count is None else count - setup.baseline)
        setups[name] = setup
        log(f"[{model.name}] {name}: set up in {row['setup_s']:.2f} s"
            + (f", {row['setup_work']} {setup.unit}" if row["setup_work"] is not None else ""))
    if "eager" not in setups:
        return list(rows.values())

    times: dict[str, list[float]] = {n: [] for n in setups}
    work_known = {n: rows[n]["setup_work"] is not None for n in setups}
    trace_work = dict.fromkeys(setups, 0)
    alive = list(setups)
    gc.collect()
    started = time.perf_counter()
    with torch.no_grad():
        for i, request in enumerate(trace):
            inputs = request_inputs(request, model.vocab, model.padding_side, seed=_input_seed(seed, i))
            outputs: dict[str, torch.Tensor] = {}
            k = i % len(alive)
            for name in alive[k:] + alive[:k]:
                setup = setups[name]
                before = _work(setup) if work_known[name] else None
                gc.disable()
                try:
                    t0 = time.perf_counter()
                    out = setup.fn(**inputs)
                    elapsed = time.perf_counter() - t0
                except Exception as exc:  # noqa: BLE001 - this contender stops, the trace goes on
                    rows[name].update(status="failed", stage=f"call {i} (batch {request.batch}, S {request.seq})",
                                      error=error_text(exc, 600))
                    log(f"[{model.name}] {name}: failed at call {i}: {error_text(exc, 300)}")
                    continue
                finally:
                    gc.enable()
                times[name].append(elapsed)
                try:
                    outputs[name] = first_tensor(out)
                except ValueError as exc:
                    rows[name].update(status="failed", stage=f"call {i}: output", error=error_text(exc, 600))
                    continue
                finally:
                    del out
                if work_known[name]:
                    after = _work(setup)
                    if before is None or after is None:
                        work_known[name] = False
                    elif after > before:
                        trace_work[name] += after - before
                        rows[name]["work_calls"].append(i)
            alive = [n for n in alive if rows[n]["status"] != "failed"]
            if "eager" not in alive:
                log(f"[{model.name}] eager failed: the trace stops")
                break
            reference = outputs["eager"]
            for name, output in outputs.items():
                if name == "eager":
                    continue
                close, err = compare(reference, output, inputs["attention_mask"], rtol=rtol, atol=atol)
                row = rows[name]
                row["max_abs_err"] = err if row["max_abs_err"] is None else max(row["max_abs_err"], err)
                if not close:
                    row["mismatches"] += 1
                    row["first_mismatch"] = i if row["first_mismatch"] is None else row["first_mismatch"]
            del outputs, reference
            gc.collect(1)  # outside the timed calls: young garbage of this call, not carried into the next
            if (i + 1) % 20 == 0 or i + 1 == len(trace):
                totals = ", ".join(f"{n} {sum(times[n]):.1f} s" for n in alive)
                log(f"[{model.name}] {i + 1}/{len(trace)} calls ({time.perf_counter() - started:.0f} s): {totals}")
                gc.collect()

    eager_times = times["eager"] if rows["eager"]["status"] == "ok" else None
    for name in setups:
        row = rows[name]
        row["calls"] = len(times[name])
        row["times_ms"] = [round(t * 1e3, 4) for t in times[name]]
        if row["status"] != "ok":
            continue
        row.update(trace_stats(times[name], eager_times, warmup_calls))
        if work_known[name]:
            row["trace_work"] = trace_work[name]
        else:
            row["work_calls"] = []
        row["last_work_call"] = row["work_calls"][-1] if row["work_calls"] else None
    eager_total = rows["eager"].get("trace_s")
    for row in rows.values():
        if eager_total and row.get("trace_s"):
            row["trace_vs_eager"] = eager_total / row["trace_s"]
    return [rows[n] for n in names]


# --------------------------------------------------------------------------------------------------
# markdown


def _work_text(row: dict[str, Any]) -> str:
    if row.get("setup_work") is None:
        return "—"
    if row.get("trace_work") is None:
        return f"{row['setup_work']} + ? {row['work_unit']}"
    return f"{row['setup_work']} + {row['trace_work']} {row['work_unit']}"


def _call_text(index: int | None) -> str:
    return "—" if index is None else f"#{index + 1}"


def _note(row: dict[str, Any]) -> str:
    if row.get("error"):
        return f"**failed** ({row.get('stage') or '?'}): {str(row['error']).splitlines()[0]}"
    return row.get("note") or ""


COLUMNS: list[report.Column] = [
    report.Column("model", lambda r: r["model"]),
    report.Column("contender", lambda r: r["contender"]),
    report.Column("set-up s", lambda r: report.fmt_float(r.get("setup_s"), 2), "right"),
    report.Column("trace s", lambda r: report.fmt_float(r.get("trace_s"), 2), "right"),
    report.Column("trace × vs eager", lambda r: report.fmt_ratio(r.get("trace_vs_eager")), "right"),
    report.Column("p50 ms", lambda r: report.fmt_float(r.get("p50_ms"), 1), "right"),
    report.Column("p99 ms", lambda r: report.fmt_float(r.get("p99_ms"), 1), "right"),
    report.Column("p99/p50 after warm-up", lambda r: report.fmt_float(r.get("warm_p99_over_p50"), 2), "right"),
    report.Column("per-call × vs eager (median)", lambda r: report.fmt_ratio(r.get("per_call_vs_eager")), "right"),
    report.Column("first-time work (set-up + trace)", _work_text, "right"),
    report.Column("last call with new work", lambda r: _call_text(r.get("last_work_call")), "right"),
    report.Column("mismatches", lambda r: "—" if r["contender"] == "eager" or not r.get("calls") else
                  f"{r.get('mismatches', 0)} / {r.get('calls', 0)}", "right"),
    report.Column("max abs err", lambda r: "—" if r["contender"] == "eager" else report.fmt_err(r.get("max_abs_err")),
                  "right"),
    report.Column("note", _note),
]


def _row_of(rows: list[dict[str, Any]], model: str, contender: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["model"] == model and r["contender"] == contender), None)


def _finished(row: dict[str, Any] | None) -> bool:
    return row is not None and row.get("status") == "ok" and row.get("trace_s") is not None


def summary(rows: list[dict[str, Any]], *, contender: str = "fxforge", onnx: str = "fxforge_ort",
            peers: Sequence[str] = ("eager", "compile"), max_spread: float = MAX_P99_OVER_P50) -> list[str]:
    """The issue's targets, one markdown bullet per line.

    Per model: ``contender``'s trace total below each of ``peers``'; its p99/p50 after warm-up within
    ``max_spread`` (eager's own beside it: the sizes alone spread the latencies); ``onnx`` serves the trace
    with one export (one session); the contenders whose outputs differed from eager's at some call.
    """
    lines = []
    for model in report.row_models(rows):
        ours = _row_of(rows, model, contender)
        if not _finished(ours):
            why = "not in this run" if ours is None else f"{ours.get('status')} ({ours.get('stage') or '?'})"
            lines.append(f"- {model}: {contender} {why} (targets: {report.verdict(False)})")
            continue
        parts, met = [], True
        for peer in peers:
            theirs = _row_of(rows, model, peer)
            if not _finished(theirs):
                met = False
                parts.append(f"{peer} {'not in this run' if theirs is None else 'did not finish the trace'}")
                continue
            faster = ours["trace_s"] < theirs["trace_s"]
            met &= faster
            parts.append(f"{peer} {theirs['trace_s']:.2f} s ({theirs['trace_s'] / ours['trace_s']:.2f}×)")
        lines.append(f"- {model}: {contender} trace total {ours['trace_s']:.2f} s; " + ", ".join(parts)
                     + f" (target: below {' and '.join(peers)}: {report.verdict(met)})")
        # set-up moves work out of the trace (fxforge prepares its shape-generic plan there): both sums shown
        whole = [(name, row["setup_s"] + row["trace_s"]) for name, row in
                 ((name, _row_of(rows, model, name)) for name in (contender, *peers))
                 if _finished(row) and row.get("setup_s") is not None]
        if len(whole) > 1 and whole[0][0] == contender:
            lines.append(f"- {model}: set-up + trace: {contender} {whole[0][1]:.2f} s; "
                         + ", ".join(f"{name} {total:.2f} s ({total / whole[0][1]:.2f}×)" for name, total in whole[1:])
                         + " (for reading, not a target)")
        spread = ours.get("warm_p99_over_p50")
        eager = _row_of(rows, model, "eager") or {}
        line = (f"- {model}: {contender} p99/p50 after the first {ours.get('calls', 0) - ours.get('warm_calls', 0)} "
                f"calls {report.fmt_float(spread, 2)} (eager's {report.fmt_float(eager.get('warm_p99_over_p50'), 2)}; "
                f"{contender} ms / eager ms at the same call: p99/p50 "
                f"{report.fmt_float(ours.get('warm_rel_p99_over_p50'), 2)}) "
                f"(target ≤ {max_spread:g}: {report.verdict(spread is not None and spread <= max_spread)})")
        lines.append(line)
    for model in report.row_models(rows):
        row = _row_of(rows, model, onnx)
        if row is None:
            continue
        if not _finished(row):
            lines.append(f"- {model}: {onnx} did not serve the trace ({row.get('stage') or '?'}: "
                         f"{report.md_cell(str(row.get('error') or ''), 160)}) (target: one session: "
                         f"{report.verdict(False)})")
            continue
        total = None if row.get("setup_work") is None or row.get("trace_work") is None else (
            row["setup_work"] + row["trace_work"])
        unit = row["work_unit"].removesuffix("s") if total == 1 else row["work_unit"]
        what = "exports unknown (no `exports` count)" if total is None else f"{total} {unit}"
        lines.append(f"- {model}: {onnx} served {row['calls']} calls with {what} "
                     f"(target: one session: {report.verdict(total == 1)})")
    bad = [f"{r['model']} {r['contender']} {r['mismatches']}/{r['calls']}" for r in rows
           if r["contender"] != "eager" and r.get("mismatches")]
    lines.append(f"- calls whose output differs from eager's (valid positions, rtol = atol = {RTOL:g}): "
                 f"{', '.join(bad) or 'none'} (target: none: {report.verdict(not bad)})")
    return lines


def markdown_block(result: dict[str, Any]) -> str:
    meta, m = result["meta"], result["meta"]["machine"]
    t = meta["trace"]
    lines = [
        f"## {meta['title']}",
        "",
        *report.machine_lines(m, with_gpu=False),
        f"- Threads: torch.set_num_threads({m['threads']})" + (
            "; ONNX Runtime intra-op threads = the same, one inter-op thread, no spinning"
            if any(c in meta["contenders"] for c in ("ort", "fxforge_ort")) else ""),
        report.load_line(m, meta),
        f"- Date: {meta['date']}" + (f", commit {meta['commit']}" if meta.get("commit") else ""),
        f"- Command: `{meta['command']}`",
        (f"- Trace: {t['calls']} calls (seed {t['seed']}), batch uniform in {{{', '.join(map(str, t['batches']))}}}, "
         f"S uniform in [{t['seq_range'][0]}, {t['seq_range'][1]}]; inputs `input_ids` and a padded `attention_mask` "
         "(one row S long, the others 1..S; BERT and GPT-2 padded on the right, LLaMA on the left). Models: "
         "hidden 256, 4 layers, 4 heads (LLaMA: 2 key/value heads, MLP 688), random weights, eager attention, "
         "no KV cache."),
        (f"- Method: each contender set up on one example (batch {EXAMPLE[0]}, S {EXAMPLE[1]}); set-up s = set-up + "
         "its first call there. Then every call of the trace runs every contender on the same inputs (order "
         "rotated by one each call), each call timed on its own (`time.perf_counter`, `torch.no_grad()`), "
         "recompiles / new plans / new exports included. trace × vs eager = eager trace s / contender trace s; "
         "per-call × vs eager = median over calls of eager ms / contender ms at the same call (> 1 is faster). "
         f"p50 / p99 over all calls; p99/p50 after warm-up over calls {t['warmup_calls'] + 1}..{t['calls']} "
         f"(the first {t['warmup_calls']} calls left out, a fixed count). First-time work: graphs compiled "
         "(torch.compile, dynamo's unique graphs), plans built (fxforge), exports (fxforge -> ORT), sessions "
         "(plain ORT). Outputs (last hidden state) compared with eager's at every call on the valid positions, "
         f"rtol = atol = {RTOL:g}."),
        "",
        report.markdown_table(result["rows"], COLUMNS),
        "",
    ]
    if result.get("summary"):
        lines += [*result["summary"], ""]
    return "\n".join(lines)


def write_markdown(path: str, result: dict[str, Any]) -> None:
    """Replace this section's block of ``path`` (appended if missing); the rest is kept byte for byte."""
    report.write_block(path, markdown_block(result), NAME)


# --------------------------------------------------------------------------------------------------
# CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``--suite dynamic``."""
    p.add_argument("--calls", type=int, default=CALLS, help=f"calls in the trace (default {CALLS})")
    p.add_argument("--models", type=csv_list, default=list(MODELS), help=f"comma-separated, of {','.join(MODELS)}")
    p.add_argument("--contenders", type=csv_list, default=list(DEFAULT_CONTENDERS),
                   help=f"comma-separated, of {','.join(SETUPS)} (default {','.join(DEFAULT_CONTENDERS)}); "
                   "eager is always run")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of the trace (default 0)")
    p.add_argument("--warmup-calls", type=int, default=WARMUP_CALLS,
                   help=f"calls left out of p99/p50 after warm-up (default {WARMUP_CALLS})")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads and ORT intra-op threads "
                   "(default 2, as the harness)")
    report.add_output_options(p, NAME)


def run(opts: argparse.Namespace) -> int:
    """Run the trace on every model; returns the exit status."""
    unknown = [n for n in opts.models if n not in MODELS] + [n for n in opts.contenders if n not in SETUPS]
    if unknown:
        raise UsageError(f"unknown model(s) or contender(s): {', '.join(unknown)}")
    if opts.calls < 1 or opts.threads < 1 or opts.warmup_calls < 0:
        raise UsageError("--calls and --threads must be >= 1, --warmup-calls >= 0")
    threads_before = torch.get_num_threads()
    cache_before = os.environ.get("FXFORGE_CACHE_DIR")
    # fxforge's set-up is a first use: autotune measures afresh (its on-disk cache would replay another run's).
    os.environ["FXFORGE_CACHE_DIR"] = cache_dir = tempfile.mkdtemp(prefix="fxforge-bench-autotune-")
    torch.set_num_threads(opts.threads)
    try:
        return _run(opts, opts.command)
    finally:
        torch.set_num_threads(threads_before)
        if cache_before is None:
            os.environ.pop("FXFORGE_CACHE_DIR", None)
        else:
            os.environ["FXFORGE_CACHE_DIR"] = cache_before
        shutil.rmtree(cache_dir, ignore_errors=True)


def _run(opts: argparse.Namespace, command: str) -> int:
    contenders = list(dict.fromkeys(["eager", *opts.contenders]))
    trace = make_trace(opts.calls, seed=opts.seed)
    result: dict[str, Any] = {
        "meta": {
            "suite": NAME,
            "title": (f"Dynamic shapes: a trace of {opts.calls} requests, batch in {{1, 2, 4, 8}}, S in [16, 512] "
                      "(issue 19)"),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": command,
            "commit": report.git_commit(),
            "machine": report.machine_info(torch.get_num_threads()),
            "contenders": {c: DESCRIPTIONS[c] for c in contenders},
            "models": opts.models,
            "trace": {"calls": opts.calls, "seed": opts.seed, "batches": list(BATCHES), "seq_range": list(SEQ_RANGE),
                      "warmup_calls": opts.warmup_calls, "example": list(EXAMPLE),
                      "requests": [[r.batch, r.seq, list(r.lengths)] for r in trace]},
            "complete": False,
        },
        "rows": [],
    }
    json_path = os.path.join(opts.out, f"results-{NAME}.json")
    log(f"dynamic: {len(opts.models)} model(s) × {len(contenders)} contender(s), {opts.calls} calls, "
         f"{torch.get_num_threads()} thread(s)")
    for name in opts.models:
        model = build_model(name, seed=opts.seed)
        result["rows"].extend(run_model(model, trace, contenders, seed=opts.seed, warmup_calls=opts.warmup_calls))
        report.write_json(json_path, result)  # partial results survive a crash or ^C
        del model
        gc.collect()
    result["meta"]["complete"] = True
    result["meta"]["loadavg_end"] = report.load_average()
    result["summary"] = summary(result["rows"])
    report.write_json(json_path, result)
    log(f"wrote {json_path}")
    if not opts.no_markdown:
        write_markdown(opts.markdown, result)
        log(f"wrote {opts.markdown}")
    print(report.markdown_table(result["rows"], COLUMNS))
    for line in result["summary"]:
        print(line)
    return 0


SECTION = Section(NAME, "a 200-request trace of changing batch and sequence length on BERT, GPT-2 and LLaMA, "
                  "every call timed, first-time work included (issue 19)", add_arguments, run)
