"""The differential fuzz suite (issue 18): random programs optimized by fxforge answer as eager does on fresh
inputs, after random state changes, under random call conditions.

Property, for every drawn program: outputs (NaN where eager has NaN), input gradients and parameter
gradients, buffers (BatchNorm statistics in train mode), what hooks saw, and the caller's inputs after the
call (a model that changes its input in place) equal eager's. The model runs optimized and its deep copy
runs eagerly; each state change is made to both.

``make test`` runs the ``short`` profile; ``make fuzz`` runs ``long`` (``FXFORGE_FUZZ=long``).
"""

from __future__ import annotations

import contextlib
import copy
import threading
import warnings

import pytest
import torch
from hypothesis import assume, given, note, settings
from hypothesis import strategies as st
from torch import nn

import fxforge
from fxforge.lowering.autotune import TuningPolicy
from tests.fuzz.programs import (
    CONDITIONS,
    LAYOUTS,
    STATE_CHANGES,
    attention_inputs,
    attentions,
    branchy_nets,
    breaking_nets,
    conv_nets,
    laid_out,
    token_readers,
    twins,
)

# ---------------------------------------------------------------------------------------------- one call


def _condition(name: str):
    if name == "no_grad":
        return torch.no_grad()
    if name == "inference_mode":
        return torch.inference_mode()
    if name == "autocast":
        return torch.autocast("cpu", torch.bfloat16)
    return contextlib.nullcontext()  # "grad", "threads", "hooks", "train"


def _call(module: nn.Module, inputs: tuple, condition: str, seed: int) -> dict:
    """One call of ``module`` as a user makes it: what comes out, and what the call left behind."""
    inputs = tuple(t.clone() for t in inputs)
    leaves = []
    if condition in ("grad", "train"):  # gradients reach the caller's leaves through a non-leaf input
        leaves = [t.requires_grad_() if t.is_floating_point() else None for t in inputs]
        inputs = tuple(t * 1.0 if t.is_floating_point() else t for t in inputs)
    module.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # dropout in train mode draws the same masks in both
    with _condition(condition):
        out = module(*inputs)
    result = {"out": out.detach().clone(), "inputs": [t.detach().clone() for t in inputs]}
    if leaves and out.requires_grad:
        weights = torch.linspace(-1.0, 1.0, out.numel()).view(out.shape)
        (torch.nan_to_num(out) * weights).sum().backward()
        result["input grads"] = [None if t is None else t.grad for t in leaves]
        result["grads"] = {name: p.grad for name, p in module.named_parameters()}
    result["buffers"] = {name: b.detach().clone() for name, b in module.named_buffers()}
    return result


def _threaded(module: nn.Module, calls: list[tuple]) -> list[torch.Tensor]:
    """Every call at once from its own thread (first calls included), under no_grad."""
    results: list = [None] * len(calls)
    start = threading.Barrier(len(calls))

    def run(i: int) -> None:
        start.wait()
        with torch.no_grad():
            results[i] = module(*(t.clone() for t in calls[i]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


# ---------------------------------------------------------------------------------------------- comparing


def _close(actual, expected, what: str, low_precision: bool = False) -> None:
    if expected is None or actual is None:
        assert actual is None and expected is None, f"{what}: {actual} against eager's {expected}"
        return
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    scale = float(torch.nan_to_num(expected.double(), 0, 0, 0).abs().max()) if expected.numel() else 0.0
    tolerance = (5e-2 if low_precision else 1e-4) * max(scale, 1.0)  # folds round differently than eager
    torch.testing.assert_close(actual.double(), expected.double(), rtol=5e-2 if low_precision else 1e-4,
                               atol=tolerance, equal_nan=True, msg=lambda m: f"{what}: {m}")


def _same_call(actual: dict, expected: dict, low_precision: bool, exact_gradients: bool = True) -> None:
    _close(actual["out"], expected["out"], "output", low_precision)
    for i, (a, e) in enumerate(zip(actual["inputs"], expected["inputs"])):
        _close(a, e, f"input {i} after the call")
    assert actual["buffers"].keys() == expected["buffers"].keys()
    for name, buffer in expected["buffers"].items():
        _close(actual["buffers"][name], buffer, f"buffer {name}")
    assert ("grads" in actual) == ("grads" in expected)
    if not bool(expected["out"].isfinite().all()):
        return  # documented (README): NaN outputs' gradients are NaN in eager, 0 in a replaced attention's rows
    if not exact_gradients:
        return  # documented (README): a row an additive finite mask hides entirely (see _hidden_by_addition)
    for name, grad in expected.get("grads", {}).items():
        _close(actual["grads"][name], grad, f"gradient of {name}")
    for i, (a, e) in enumerate(zip(actual.get("input grads", []), expected.get("input grads", []))):
        _close(a, e, f"gradient of input {i}")


def _same_outcome(opt: nn.Module, eager: nn.Module, inputs: tuple, condition: str, seed: int,
                  exact_gradients: bool = True) -> None:
    """The optimized call answers as the eager one, or raises as it does (a fill of finfo(float32).min
    into bfloat16 scores under autocast overflows in eager too)."""
    try:
        expected = _call(eager, inputs, condition, seed)
    except Exception as error:  # noqa: BLE001 - whatever eager raises, the optimized module must raise
        with pytest.raises(type(error)):
            _call(opt, inputs, condition, seed)
        return
    _same_call(_call(opt, inputs, condition, seed), expected, condition == "autocast", exact_gradients)


def _called_in_training_mode(model: nn.Module, inputs: tuple, seed: int) -> None:
    """One call of the model itself (not the optimized module) in training mode, its modes then put back."""
    modes = [(m, m.training) for m in model.modules()]
    model.train()
    torch.manual_seed(seed)
    try:
        with torch.no_grad():
            model(*(torch.nan_to_num(t) * 2.0 + 0.5 if t.is_floating_point() else t for t in inputs))
    finally:
        for module, training in modes:
            module.training = training


def _hook_all(model: nn.Module, log: list) -> list:
    """A forward hook on every submodule that records what it saw (Grad-CAM and feature extraction do this)."""
    return [m.register_forward_hook(lambda mod, args, out, name=name: log.append((name, out.detach().clone())))
            for name, m in model.named_modules() if name]


# ---------------------------------------------------------------------------------------------- the property


def _check(data, model: nn.Module, make_inputs, fresh_inputs, exact_gradients: bool = True, **options) -> None:
    """Optimize ``model``, then: a first call, a state change, a call under a condition, one more call.
    ``exact_gradients`` is False where the README says the gradients of the fresh inputs differ from eager's."""
    model, eager = twins(model)
    example = make_inputs(0)
    before = [t.clone() for t in example]
    tuning = TuningPolicy(kernel=data.draw(st.sampled_from(["composite", "mkldnn"]), label="kernel"),
                          layout=data.draw(st.sampled_from(["as captured", "channels-last"]), label="layout"),
                          keep="fused")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a gradients plan or an eager fallback warns; results are what count
        opt = fxforge.optimize(model, example, tuning=tuning, **options)
        for a, b in zip(example, before):  # optimizing does not run the caller's inputs through the model
            torch.testing.assert_close(a, b, equal_nan=True, rtol=0, atol=0)

        _same_outcome(opt, eager, fresh_inputs(1), "no_grad", 1)

        change = data.draw(st.sampled_from(sorted(STATE_CHANGES)), label="state change")
        rng = data.draw(st.integers(0, 1000), label="rng")
        STATE_CHANGES[change](model, rng)
        STATE_CHANGES[change](eager, rng)
        if data.draw(st.booleans(), label="a training-mode call on the model itself"):
            for twin in (model, eager):  # BatchNorm moves its statistics behind their version counters
                with contextlib.suppress(ValueError):  # (one value per channel: eager refuses to train; both alike)
                    _called_in_training_mode(twin, fresh_inputs(4), rng)
        assert opt.training == model.training, "the optimized module's mode does not follow the model's"

        condition = data.draw(st.sampled_from([*CONDITIONS, "hooks", "train"]), label="condition")
        note(f"optimized: {opt.report.counts}")
        if condition == "threads":
            # Active dropout in threads draws from one generator in an order nobody fixes: no eager answer.
            assume(not any(isinstance(m, nn.Dropout) and m.training and m.p > 0 for m in model.modules()))
            calls = [fresh_inputs(10 + i) for i in range(3)]
            for got, inputs in zip(_threaded(opt, calls), calls):
                with torch.no_grad():
                    _close(got, eager(*(t.clone() for t in inputs)), "output of a threaded call")
            return
        if condition == "train":
            model.train()
            eager.train()
        logs: tuple[list, list] = ([], [])
        handles = _hook_all(model, logs[0]) + _hook_all(eager, logs[1]) if condition == "hooks" else []
        _same_outcome(opt, eager, fresh_inputs(2), condition, 2, exact_gradients)
        assert [name for name, _ in logs[0]] == [name for name, _ in logs[1]], "hooks fired differently"
        for (name, a), (_, e) in zip(*logs):
            _close(a, e, f"what the hook on {name} saw", condition == "autocast")
        for handle in handles:
            handle.remove()
        # nothing stale after the condition is gone
        _same_outcome(opt, eager, fresh_inputs(3), "no_grad", 3)


@given(st.data())
def test_random_conv_nets_answer_as_eager(data):
    model, shape = data.draw(conv_nets(), label="conv net")
    nan = data.draw(st.booleans(), label="NaN in the fresh inputs")
    layouts = [data.draw(st.sampled_from(LAYOUTS), label=f"{which} input layout") for which in ("example", "fresh")]
    assume(not (model.mutate_input and "expanded" in layouts))  # (eager refuses to write into a broadcast input)

    def make(seed: int, layout: str = layouts[0]) -> tuple:
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
        if nan and seed > 0:
            x[0, 0, 0, 0] = float("nan")
        return (laid_out(x, layout),)

    def fresh(seed: int) -> tuple:
        return make(seed, layouts[1])

    note(repr(model))
    _check(data, model, make, fresh)


@settings(max_examples=max(3, settings().max_examples // 4))  # (an ONNX export and a search per program)
@given(st.data())
def test_random_conv_nets_served_for_throughput_by_onnxruntime_answer_as_eager(data):
    """Issue 53: ``objective="throughput"`` with ``target="onnxruntime"``: fresh requests through ``opt.map`` (in
    batches where proven) and calls from several threads at once, each stream on a session of its thread count."""
    pytest.importorskip("onnxruntime")
    model, shape = data.draw(conv_nets(), label="conv net")
    assume(not model.mutate_input)  # (the ONNX file does not write into the caller's tensors: documented)
    note(repr(model))
    requests = [torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) for seed in range(6)]
    opt = fxforge.optimize(model, (requests[0],), target="onnxruntime", objective="throughput",
                           throughput_budget_s=0.05)
    try:
        with torch.no_grad():
            expected = [model(r) for r in requests[1:]]
            for i, (out, want) in enumerate(zip(opt.map(requests[1:]), expected, strict=True)):
                _close(out, want, f"request {i}")
        for i, (out, want) in enumerate(zip(_threaded(opt, [(r,) for r in requests[1:4]]), expected, strict=False)):
            _close(out, want, f"threaded call {i}")
    finally:
        opt.close()


@settings(max_examples=max(6, settings().max_examples // 2))  # (each optimize times its kernels: half the budget)
@given(st.data())
def test_random_branchy_nets_with_every_branch_concurrent_answer_as_eager(data):
    """Issue 53: every region of independent branches run on threads of its own (inter_op="always")."""
    model, shape = data.draw(branchy_nets(), label="branchy net")

    def make(seed: int) -> tuple:
        return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)),)

    note(repr(model.nodes) + f" mutate={model.mutate}")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # (the suite's workers run on one thread: branches would run in turn)
    try:
        _check(data, model, make, make, inter_op="always")
    finally:
        torch.set_num_threads(threads)


@given(st.data())
def test_random_nets_with_graph_breaks_answer_as_eager(data):
    """Issue 49: TorchDynamo cuts the model at its break and fxforge optimizes each graph; same property."""
    model, shape = data.draw(breaking_nets(), label="net with a break")

    def make(seed: int) -> tuple:
        return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)),)

    note(repr(model))
    _check(data, model, make, make)


@given(st.data())
def test_random_attentions_answer_as_eager(data):
    model, shape = data.draw(attentions(), label="attention")
    lengths = st.lists(st.integers(0, shape["length"]), min_size=shape["batch"], max_size=shape["batch"])
    example_lengths = data.draw(lengths, label="example lengths")
    call_lengths = data.draw(lengths, label="call lengths")  # 0: every key of that sequence hidden
    nan = data.draw(st.booleans(), label="NaN in the fresh inputs")
    note(f"{model.scale_form=} {model.mask_form=} {model.softmax_form=} {model.fill=} {model.causal=} {shape=}")
    _check(data, model, lambda seed: attention_inputs(shape, example_lengths, seed),
           lambda seed: attention_inputs(shape, call_lengths, seed, nan=nan),
           not _hidden_by_addition(shape, call_lengths))


@given(st.data())
def test_random_token_readers_answer_as_eager(data):
    """A model that reads one token of its last hidden states (cleanup leaves the other rows out) answers as
    eager, its gradients included: the rows nobody reads get eager's zero gradients."""
    model, shape = data.draw(token_readers(), label="token reader")
    lengths = st.lists(st.integers(1, shape["length"]), min_size=shape["batch"], max_size=shape["batch"])
    example_lengths, call_lengths = data.draw(lengths, label="example lengths"), data.draw(lengths, label="lengths")
    nan = data.draw(st.booleans(), label="NaN in the fresh inputs")
    note(repr(model))
    _check(data, model, lambda seed: attention_inputs(shape, example_lengths, seed),
           lambda seed: attention_inputs(shape, call_lengths, seed, nan=nan))


def _hidden_by_addition(shape: dict, lengths: list[int]) -> bool:
    """Whether an additive mask with a finite fill hides every key of a row: the one case (README) where a
    replaced attention's gradients are not eager's. Eager's scores are all absorbed into the fill, a uniform
    softmax; torch's fused CPU kernel gets that output right, but its backward recomputes the probabilities
    from a log-sum-exp the fill absorbed too, so it returns the row's gradients times the number of keys."""
    additive = shape["mask_form"] in ("additive", "additive_from_keep")
    return additive and shape["fill"] != float("-inf") and 0 in lengths


@given(st.data())
def test_random_attentions_at_new_sizes_answer_as_eager(data):
    """Issue 19: optimized on one (batch, length), called at others, the sizes that change become dynamic
    and a shape-generic plan (with its rewrites) serves them: every output is eager's."""
    model, shape = data.draw(attentions(), label="attention")
    shapes = [shape] + [dict(shape, batch=data.draw(st.integers(1, 4), label="batch"),
                             length=data.draw(st.integers(1, 9), label="length")) for _ in range(3)]
    note(f"{model.scale_form=} {model.mask_form=} {model.softmax_form=} {model.fill=} {model.causal=} {shapes=}")

    def inputs(at: dict, seed: int) -> tuple:
        lengths = data.draw(st.lists(st.integers(0, at["length"]), min_size=at["batch"], max_size=at["batch"]),
                            label="lengths")
        return attention_inputs(at, lengths, seed)

    opt = fxforge.optimize(model, inputs(shapes[0], 0))
    for seed, at in enumerate(shapes, 1):
        x = inputs(at, seed)
        with torch.no_grad():
            _close(opt(*x), model(*x), f"the output at {at['batch']}x{at['length']}", False)


def test_the_fuzz_suite_would_see_a_wrong_answer(monkeypatch):
    """The property itself fails when the optimized module answers differently (here: a plan that doubles
    its output), so a green fuzz run means something."""
    from fxforge.runtime import native

    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU()).eval()
    x = (torch.randn(1, 2, 6, 6),)
    real = native.OptimizedModule.forward

    def wrong(self, *args, **kwargs):
        return real(self, *args, **kwargs) * 2

    monkeypatch.setattr(native.OptimizedModule, "forward", wrong)
    opt, eager = fxforge.optimize(model, x), copy.deepcopy(model)
    try:
        _same_call(_call(opt, x, "no_grad", 0), _call(eager, x, "no_grad", 0), False)
    except AssertionError:
        return
    raise AssertionError("the comparison did not see a doubled output")
