"""The targets package: one protocol, one list, and contracts that say what each target really serves.

The contract tests are differential: each claim a target's contract makes (live weights, hooks, gradients,
the file it writes) is checked against eager on the module that target builds, and so is its absence."""

from __future__ import annotations

import argparse

import onnxruntime
import pytest
import torch
from torch import nn

import fxforge
from fxforge.cli import build_parser
from fxforge.cli.commands import artifact_suffixes, check_target
from fxforge.targets import TARGETS, Contract, Target, by_artifact, lookup


def small_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).eval()


def x_of(seed: int, batch: int = 4) -> torch.Tensor:
    return torch.randn(batch, 6, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------------------------- the protocol

@pytest.mark.parametrize("name", list(TARGETS))
def test_every_target_follows_the_protocol(name):
    target = TARGETS[name]
    assert target.name == name and target.summary and isinstance(target.contract, Contract)
    assert lookup(name) is target
    with pytest.raises(TypeError, match=f"target '{name}' does not take bogus"):
        target.check({"rewrites": "default", "bogus": 1})
    with pytest.raises(TypeError, match="dynamic takes None, True or False"):
        target.check({"dynamic": "yes"})
    assert target.contract.describe().count(";") == 6


def test_unknown_target_and_option_fail_before_anything_runs():
    with pytest.raises(ValueError, match="unknown target 'tvm'; available targets: native, onnxruntime, inductor, auto"):
        fxforge.optimize(small_model(), (x_of(0),), target="tvm")
    with pytest.raises(TypeError, match="target 'inductor' does not take tuning"):
        fxforge.optimize(small_model(), (x_of(0),), target="inductor", tuning=None)
    with pytest.raises(ValueError, match="targets= takes a non-empty list of native, onnxruntime, inductor"):
        fxforge.optimize(small_model(), (x_of(0),), target="auto", targets=["auto"])


def test_auto_reads_what_it_races_and_its_tie_order_from_the_contracts():
    auto = TARGETS["auto"]
    assert [t.name for t in auto.raced()] == [t for t in TARGETS if TARGETS[t].contract.raced]
    # live weights and gradients first; a target that writes a file before one that does not
    assert auto.preference() == ("native", "inductor", "onnxruntime")
    assert by_artifact(".pt2") is TARGETS["native"] and by_artifact(".onnx") is TARGETS["onnxruntime"]
    assert artifact_suffixes() == (".pt2", ".onnx")


def target_choices() -> tuple[str, ...]:
    """``fxforge optimize --target``'s choices, from a parser built now."""
    optimize = build_parser()._subparsers._group_actions[0].choices["optimize"]
    return tuple(next(a for a in optimize._actions if a.dest == "target").choices)


def test_the_cli_reads_the_targets():
    assert target_choices() == tuple(TARGETS)
    with pytest.raises(argparse.ArgumentTypeError, match=r"an \.onnx file is for --target onnxruntime \(native writes \.pt2\)"):
        check_target(argparse.Namespace(target="native", output="m.onnx"))
    with pytest.raises(argparse.ArgumentTypeError, match=r"a \.pt2 file is for --target native \(onnxruntime writes \.onnx\)"):
        check_target(argparse.Namespace(target="onnxruntime", output="m.pt2"))
    with pytest.raises(argparse.ArgumentTypeError, match="target inductor writes no file"):
        check_target(argparse.Namespace(target="inductor", output="m.pt2"))


class Halved(nn.Module):
    """A toy target's module: the model, scaled by one half and back (exact in floating point)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.report = None
        self.prepared = 0

    def prepare(self, *args, **kwargs):
        self.prepared += 1
        return self

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs) * 0.5 * 2.0


class HalvedTarget(Target):
    name, summary = "halved", "the model, halved and doubled"
    contract = Contract(dynamic="every size", artifact=None, decorates=False)
    options = ("scale",)

    def build(self, model, example_inputs, options):
        module = Halved(model)
        if example_inputs is not None:
            module.prepare(example_inputs)
        return module


def test_a_new_target_is_one_object_and_one_entry(monkeypatch, tmp_path):
    monkeypatch.setenv("FXFORGE_TARGET_CACHE", "0")
    monkeypatch.setitem(TARGETS, "halved", HalvedTarget())
    model, x = small_model(), x_of(1)
    built = fxforge.optimize(model, (x,), target="halved", scale=2)
    assert isinstance(built, Halved) and built.prepared == 1
    torch.testing.assert_close(built(x), model(x))
    with pytest.raises(TypeError, match="target 'halved' does not take tuning; it takes scale"):
        fxforge.optimize(model, (x,), target="halved", tuning=None)
    with pytest.raises(TypeError, match="target='halved' does not run"):
        fxforge.optimize(model.train(), (x,), target="halved", memory_budget="60%")
    model.eval()
    # auto races it with the others, and the CLI offers it
    raced = fxforge.optimize(model, (x,), target="auto", targets=["native", "halved"], budget_s=None)
    assert [c.target for c in raced.race.contenders] == ["eager", "native", "halved"]
    assert all(c.latency_ms for c in raced.race.contenders)
    assert "halved" in target_choices()


# --------------------------------------------------------------------------------------------- the contracts

CONTRACTED = ["native", "onnxruntime", "inductor"]


@pytest.fixture(scope="module")
def built():
    """Each raced target built once on its own copy of the model, for the example's sizes."""
    modules = {}
    for name in CONTRACTED:
        model = small_model(3)
        modules[name] = (model, fxforge.optimize(model, (x_of(0),), target=name, dynamic=False))
    return modules


@pytest.mark.parametrize("name", CONTRACTED)
def test_live_weights_are_read_exactly_when_the_contract_says(built, name):
    model, module = built[name]
    x = x_of(5)
    with torch.no_grad():
        before = module(x)
        saved = model[0].weight.clone()
        model[0].weight.mul_(-1.5)
        try:
            after, eager = module(x), model(x)
        finally:
            model[0].weight.copy_(saved)
    if TARGETS[name].contract.live_weights:
        torch.testing.assert_close(after, eager, rtol=1e-4, atol=1e-5)
    else:
        torch.testing.assert_close(after, before)  # the snapshot taken when it was built
        assert not torch.allclose(after, eager, atol=1e-3)


@pytest.mark.parametrize("name", CONTRACTED)
def test_forward_hooks_run_exactly_when_the_contract_says(built, name):
    model, module = built[name]
    x = x_of(6)
    with torch.no_grad():
        plain = model(x)
        handle = model.register_forward_hook(lambda m, args, out: out + 100.0)
        try:
            got = module(x)
        finally:
            handle.remove()
    expected = plain + 100.0 if TARGETS[name].contract.hooks else plain
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", CONTRACTED)
def test_gradients_are_eagers_exactly_when_the_contract_says(built, name):
    model, module = built[name]
    x = x_of(7)
    if not TARGETS[name].contract.gradients:
        assert not module(x).requires_grad  # a result outside autograd, not a wrong gradient
        return
    model.zero_grad()
    module(x).square().sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).square().sum().backward()
    for g, e in zip(got, (p.grad for p in model.parameters())):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
    model.zero_grad()


@pytest.mark.parametrize("name", CONTRACTED)
def test_the_contracts_artifact_is_written_whole_and_runs_like_the_model(built, name, tmp_path):
    model, module = built[name]
    target = TARGETS[name]
    x = x_of(8)
    if target.contract.artifact is None:
        with pytest.raises(TypeError, match=f"target '{name}' writes no file"):
            target.write(module, str(tmp_path / "m.bin"))
        return
    path = tmp_path / f"m{target.contract.artifact}"
    written = target.write(module, str(path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temporary file left
    assert written.validation and max(written.validation.values()) < 1e-4
    if target.contract.artifact == ".pt2":
        got = fxforge.load(path)(x)
    else:
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
        got = torch.from_numpy(got)
    with torch.no_grad():
        torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-5)
