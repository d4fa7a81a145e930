"""target="auto": every target built, checked against eager and timed; the fastest returned with the race in
its report; the choice remembered on disk per model structure and signature, re-timed and re-raced when
contradicted; a budget and a targets list bound the search."""

import json
import logging
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import fxforge
from fxforge.core.target_cache import target_cache
from fxforge.runtime import race as race_module
from fxforge.runtime.race import RaceWarning
from fxforge.targets import TARGETS
from fxforge.targets.auto import AutoTarget, EagerModule
from fxforge.targets.base import Contract, Target

sys.path.insert(0, str(Path(__file__).parent / "user_models"))
from hand_written import USER_MODELS


class ConvNet(nn.Module):
    """A small conv net with BatchNorm whose forward returns a dict (the output structure must survive)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        features = self.body(x)
        return {"logits": self.head(features.mean((2, 3))), "features": features}


def conv_net(seed):
    torch.manual_seed(seed)
    model = ConvNet()
    model.train()
    with torch.no_grad():
        for _ in range(3):  # BatchNorm statistics from data, not the random init
            model(torch.randn(4, 3, 16, 16))
    return model.eval()


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FXFORGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FXFORGE_TARGET_CACHE", "1")
    monkeypatch.setattr(race_module, "machine_load", lambda: 0.0)  # a quiet machine: timings are remembered
    return tmp_path


def agrees_with_eager(model, optimized, x):
    with torch.no_grad():
        expected, actual = model(x), optimized(x)
    assert set(actual) == {"logits", "features"}
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-4, atol=1e-4)


def test_auto_races_every_target_returns_the_fastest_and_remembers_the_choice(cache_dir, monkeypatch):
    steady = {"eager": 2.0, "native": 1.0, "onnxruntime": 0.8, "inductor": 0.9}  # a quiet machine's timings
    monkeypatch.setattr(race_module, "time_in_blocks", lambda calls, **_: {name: steady[name] for name in calls})
    x = torch.randn(2, 3, 16, 16)
    model = conv_net(0)
    opt = fxforge.optimize(model, (x,), target="auto", targets=["native", "onnxruntime", "inductor"])
    race = opt.report.race
    assert opt.race is race and not race.remembered
    assert [c.target for c in race.contenders] == ["eager", "native", "onnxruntime", "inductor"]
    for contender in race.contenders[1:]:
        assert not contender.refused, contender
        assert contender.latency_ms > 0 and contender.prepare_s > 0 and contender.max_abs_err < 1e-4
        assert contender.vs_eager == pytest.approx(race.eager_ms / contender.latency_ms)
    latencies = {c.target: c.latency_ms for c in race.contenders[1:]}
    assert race.winner == race_module.choose(latencies, race.eager_ms,
                                             preference=TARGETS["auto"].preference())[0]
    assert race.winner == "onnxruntime" and race.why.startswith(f"{latencies[race.winner]:.3g} ms: ")
    expected_type = {"onnxruntime": "OnnxRuntimeModule"}.get(race.winner, "OptimizedModule")
    assert type(opt).__name__ == expected_type
    agrees_with_eager(model, opt, torch.randn(2, 3, 16, 16))
    assert f"target auto: {race.winner}" in str(opt.report) and "Target race" in opt.report._repr_html_()

    # Another instance of the same structure, other weights: only the winner is built, re-timed and checked.
    other = conv_net(1)
    again = fxforge.optimize(other, (torch.randn(2, 3, 16, 16),), target="auto")
    second = again.report.race
    assert second.remembered and second.winner == race.winner and "remembered from the race of" in second.why
    built = [c for c in second.contenders if c.prepare_s is not None]
    assert [c.target for c in built] == [race.winner]
    assert sorted(c.target for c in second.contenders) == ["eager", "inductor", "native", "onnxruntime"]
    agrees_with_eager(other, again, torch.randn(2, 3, 16, 16))  # its own weights, not the first model's

    # Another input signature is another race.
    third = fxforge.optimize(other, (torch.randn(1, 3, 8, 8),), target="auto", targets=["native", "onnxruntime"])
    assert not third.report.race.remembered


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_races_a_model_on_the_gpu_with_float_inputs(cache_dir):
    """Float inputs on the GPU are checked on fresh GPU inputs (they were drawn on the CPU and failed every
    vision model of the targets suite on an H200); an ONNX Runtime without its CUDA provider is not raced."""
    import onnxruntime as ort

    model, x = conv_net(0).cuda(), torch.randn(2, 3, 16, 16, device="cuda")
    opt = fxforge.optimize(model, (x,), target="auto", targets=["native", "onnxruntime"])
    race = opt.report.race
    assert race.winner == "native" or "CUDAExecutionProvider" in ort.get_available_providers()
    ort_line = next(c for c in race.contenders if c.target == "onnxruntime")
    assert ("CUDAExecutionProvider" in ort.get_available_providers()) != ort_line.refused.startswith("not raced")
    agrees_with_eager(model, opt, torch.randn(2, 3, 16, 16, device="cuda"))


def test_a_remembered_choice_contradicted_by_its_new_timing_is_raced_again(cache_dir, monkeypatch):
    steady = {"eager": 2.0, "native": 1.0, "onnxruntime": 0.8}  # a quiet machine where the targets beat eager
    monkeypatch.setattr(race_module, "time_in_blocks", lambda calls, **_: {name: steady[name] for name in calls})
    x = torch.randn(2, 3, 16, 16)
    fxforge.optimize(conv_net(0), (x,), target="auto", targets=["native", "onnxruntime"])
    (key, entry), = json.loads((cache_dir / "targets.json").read_text()).items()
    # as though the winner had once run 100x faster than eager: today's timing contradicts that
    target_cache().put(key, {**entry, "eager_ms": entry["latency_ms"][entry["winner"]] * 100})
    opt = fxforge.optimize(conv_net(0), (x,), target="auto", targets=["native", "onnxruntime"])
    race = opt.report.race
    assert not race.remembered and len(race.contenders) == 3
    assert race.notes[0].startswith(f"the remembered choice {entry['winner']} (100.00x eager when chosen) was "
                                    "raced again: it ran at ")


def test_the_target_cache_can_be_turned_off(cache_dir, monkeypatch):
    monkeypatch.setenv("FXFORGE_TARGET_CACHE", "0")
    x = torch.randn(2, 3, 16, 16)
    for _ in range(2):
        opt = fxforge.optimize(conv_net(0), (x,), target="auto", targets=["native", "onnxruntime"])
        assert not opt.report.race.remembered and len(opt.report.race.contenders) == 3
    assert not (cache_dir / "targets.json").exists()


def test_the_budget_skips_inductor_when_its_compile_would_not_fit(cache_dir):
    opt = fxforge.optimize(conv_net(0), (torch.randn(2, 3, 16, 16),), target="auto",
                           targets=["native", "inductor"], budget_s=0.5)
    native, inductor = opt.report.race.contenders[1:]
    assert opt.report.race.winner in ("native", "eager") and not native.refused
    assert inductor.refused.startswith("skipped: ") and "budget of 0 s" in inductor.refused
    assert inductor.prepare_s is None  # nothing compiled


def test_a_model_in_training_mode_races_without_an_onnx_snapshot_and_keeps_its_statistics(cache_dir):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.BatchNorm1d(16), nn.ReLU()).train()
    stats = model[2].running_mean.clone(), model[2].num_batches_tracked.clone()
    opt = fxforge.optimize(model, (torch.randn(4, 8),), target="auto", targets=["native", "onnxruntime"])
    race = opt.report.race
    native, ort = race.contenders[1:]
    assert race.winner in ("native", "eager") and not native.refused, race  # dropout drew the same numbers as eager
    assert ort.refused.startswith("not raced: the model is in training mode")
    assert torch.equal(model[2].running_mean, stats[0]) and torch.equal(model[2].num_batches_tracked, stats[1])


def test_keyword_inputs_reach_every_target(cache_dir):
    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x, scale=None):
            return self.lin(x).sigmoid() * scale

    model = Gate().eval()
    inputs = {"x": torch.randn(3, 8), "scale": torch.rand(3, 8)}
    opt = fxforge.optimize(model, inputs, target="auto", targets=["native", "onnxruntime"])
    assert all(not c.refused for c in opt.report.race.contenders), opt.report.race
    fresh = {"x": torch.randn(3, 8), "scale": torch.rand(3, 8)}
    with torch.no_grad():
        torch.testing.assert_close(opt(**fresh), model(**fresh))


@pytest.mark.parametrize("call, error, text", [
    (lambda: fxforge.optimize(nn.ReLU(), target="auto"), TypeError, "needs example_inputs"),
    (lambda: fxforge.optimize(target="auto")(nn.ReLU), TypeError, "not as a decorator"),
    (lambda: fxforge.optimize(nn.ReLU(), (torch.ones(1),), target="auto", targets=["tvm"]), ValueError,
     "targets= takes a non-empty list of native, onnxruntime, inductor; got ['tvm']"),
    (lambda: fxforge.optimize(nn.ReLU(), (torch.ones(1),), target="auto", tuning=None), TypeError,
     "target 'auto' does not take tuning"),
])
def test_auto_usage_errors_name_the_cause(call, error, text):
    with pytest.raises(error, match=None) as raised:
        call()
    assert text in str(raised.value)


@pytest.mark.parametrize("name", ["unet", "lstm"])
def test_auto_never_returns_a_module_that_rejects_a_new_size_native_serves(cache_dir, name):
    """Issue 48: a U-Net optimized on 1x3x64x64 and an LSTM on length 12 got ONNX Runtime files that raised
    InputShapeError at 2x3x64x48, 1x3x96x96 and length 25. The file is exported with the dims eager serves at
    other sizes dynamic (and checked on them in the race); whatever auto returns serves every fresh input."""
    case = USER_MODELS[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RaceWarning)  # eager may win here: opt.fastest is then the file checked
        opt = fxforge.optimize(case.model, case.inputs, target="auto", targets=["native", "onnxruntime"])
    race = opt.report.race
    ort = next(c for c in race.contenders if c.target == "onnxruntime")
    if name == "unet":  # exports with its batch, H and W dynamic
        assert not ort.refused, race
    else:  # torch.export specialises the LSTM's length: refused, and the reason names the dims
        assert not ort.refused or ort.refused.startswith(
            "not raced: it cannot serve the sizes eager serves: exporting it with input 0 dim 0 2->4, input 0 dim 1 "
            "12->24 dynamic failed: "), ort.refused
    runs_ort = opt if race.winner == "onnxruntime" else opt.fastest if race.winner == "eager" else None
    for module in filter(None, (opt, runs_ort)):
        for fresh in case.fresh:
            with torch.no_grad():
                torch.testing.assert_close(module(*fresh), case.model(*fresh), rtol=1e-4, atol=1e-4)
    if runs_ort is not None and type(runs_ort).__name__ == "OnnxRuntimeModule":
        assert runs_ort.exports == 1  # the first file served them all: no export again on a call


class AudioNet(nn.Module):
    """Not in the hand-written corpus: a strided Conv1d stack over a waveform of any length, pooled, with a
    padding mask passed by keyword (the style of torchaudio recipes)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv1d(1, 8, 9, stride=4, padding=4), nn.GELU(),
                                  nn.Conv1d(8, 16, 5, stride=2, padding=2), nn.GELU())
        self.head = nn.Linear(16, 4)

    def forward(self, wave, mask=None):
        features = self.conv(wave)
        if mask is not None:
            features = features * mask[:, None, ::8][..., :features.shape[-1]]
        return self.head(features.mean(-1))


def test_a_waveform_model_keeps_every_length_and_batch_through_auto(cache_dir):
    torch.manual_seed(0)
    model = AudioNet().eval()
    example = {"wave": torch.randn(1, 1, 400), "mask": torch.ones(1, 400)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RaceWarning)
        opt = fxforge.optimize(model, example, target="auto", targets=["native", "onnxruntime"])
    ort = next(c for c in opt.report.race.contenders if c.target == "onnxruntime")
    assert not ort.refused or ort.refused.startswith("not raced: it cannot serve the sizes eager serves"), ort
    for batch, length in ((3, 256), (2, 1000), (1, 400)):
        fresh = {"wave": torch.randn(batch, 1, length), "mask": (torch.rand(batch, length) > 0.2).float()}
        with torch.no_grad():
            torch.testing.assert_close(opt(**fresh), model(**fresh), rtol=1e-4, atol=1e-4)


class _Slow(nn.Module):
    """The model, then a sleep: a target measured slower than eager."""

    def __init__(self, model, delay):
        super().__init__()
        self.model, self.delay = model, delay

    def forward(self, *args, **kwargs):
        time.sleep(self.delay)
        return self.model(*args, **kwargs)

    def prepare(self, *args, **kwargs):
        return self


class _SlowTarget(Target):
    name, summary = "native", "the model, slowed"
    contract = Contract(dynamic="every size")

    def build(self, model, example_inputs, options):
        return _Slow(model, 0.003)


class _BrokenTarget(Target):
    name, summary = "onnxruntime", "a target whose build fails"
    contract = Contract(dynamic="every size")

    def build(self, model, example_inputs, options):
        raise RuntimeError("no translation for aten::frobnicate")


def test_a_target_slower_than_eager_is_never_returned_and_auto_says_so(cache_dir):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    auto = AutoTarget({"native": _SlowTarget(), "onnxruntime": _BrokenTarget()})
    with pytest.warns(RaceWarning, match="returns Sequential as it is: no target beat eager"):
        opt = auto.build(model, (torch.randn(4, 8),), {})
    race = opt.report.race
    assert isinstance(opt, EagerModule) and race.winner == "eager" and opt.race is race
    assert [c.target for c in race.contenders] == ["eager", "native", "onnxruntime"]
    eager, slow, broken = race.contenders
    assert slow.vs_eager < 1 and slow.latency_ms > eager.latency_ms and not slow.refused
    assert broken.refused == "failed: RuntimeError: no translation for aten::frobnicate"
    assert race.refused == [broken] and "onnxruntime: failed: RuntimeError" in str(opt.report)
    assert opt.report.notes[-1] == ("target='auto' runs the model as it is: no target beat eager (this report is the "
                                    "fastest target's, native)")
    html = opt.report._repr_html_()
    assert "x eager" in html and "no translation for aten::frobnicate" in html
    x = torch.randn(3, 8)  # the model itself: every size, live weights, its state_dict keys
    torch.testing.assert_close(opt(x), model(x))
    assert list(opt.state_dict()) == list(model.state_dict()) and isinstance(opt.fastest, _Slow)
    with torch.no_grad():
        model[0].weight.mul_(2)
    torch.testing.assert_close(opt(x), model(x))


class _CountedSlowTarget(_SlowTarget):
    builds = 0

    def build(self, model, example_inputs, options):
        type(self).builds += 1
        return super().build(model, example_inputs, options)


def test_an_eager_win_is_remembered_and_the_next_optimize_builds_nothing(cache_dir):
    """The race that chose eager is remembered like any other: the next optimize of the model (another instance,
    the same inputs) returns it as it is at once, saying so; the fastest target is built only where its file or
    graph is asked for."""
    auto = AutoTarget({"native": _CountedSlowTarget()})
    with pytest.warns(RaceWarning, match="no target beat eager"):
        first = auto.build(nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval(), (torch.randn(4, 8),), {})
    assert first.report.race.winner == "eager" and _CountedSlowTarget.builds == 1
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    with pytest.warns(RaceWarning, match="remembered from the race of .*no target beat eager .*the fastest, native"):
        again = auto.build(model, (torch.randn(4, 8),), {})
    race = again.report.race
    assert isinstance(again, EagerModule) and race.remembered and race.winner == "eager"
    assert _CountedSlowTarget.builds == 1 and again.fastest is None  # nothing built, nothing timed
    assert [c.target for c in race.contenders] == ["eager", "native"] and race.contenders[1].vs_eager < 1
    x = torch.randn(3, 8)
    torch.testing.assert_close(again(x), model(x))  # its own weights
    assert isinstance(again.built_fastest(), _Slow) and _CountedSlowTarget.builds == 2  # built when asked for


def test_auto_logs_its_progress_on_the_fxforge_logger(cache_dir, caplog):
    with caplog.at_level(logging.INFO, logger="fxforge"):
        fxforge.optimize(nn.Linear(8, 8).eval(), (torch.randn(4, 8),), target="auto",
                         targets=["native", "onnxruntime"])
    messages = [r.getMessage() for r in caplog.records if r.name == "fxforge"]
    for expected in ("finding the input sizes eager serves ...", "building native ...",
                     "building onnxruntime (export to ONNX) ...", "timing eager, native, onnxruntime on the example inputs ..."):
        assert expected in messages, messages


def test_inductor_is_skipped_when_it_cannot_pay_back_its_compile(cache_dir, monkeypatch):
    """A model whose eager call takes microseconds: Inductor's compile (about 0.1 s a node here) could never
    pay itself back, so the default race skips it and says why, instead of compiling for a minute."""
    monkeypatch.setattr(race_module, "PAYBACK_CALLS", 100)
    opt = fxforge.optimize(nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval(), (torch.randn(4, 8),), target="auto")
    inductor = next(c for c in opt.report.race.contenders if c.target == "inductor")
    assert inductor.refused.startswith("skipped: it cannot pay back its build: about ") and inductor.prepare_s is None


def test_auto_with_a_precision_races_reduced_targets_held_to_the_tolerance(cache_dir, monkeypatch):
    from fxforge.exporters import onnx_precision
    from fxforge.lowering import int8_speed, precision_stage

    steady = {"eager": 2.0, "native": 1.0, "onnxruntime": 0.8, "inductor": 0.9}
    monkeypatch.setattr(race_module, "time_in_blocks", lambda calls, **_: {name: steady[name] for name in calls})
    reduced_wins = lambda calls, *a, **k: {n: (1.0 if n == "float32" else 0.5) for n in calls}
    monkeypatch.setattr(precision_stage, "time_interleaved", reduced_wins)
    monkeypatch.setattr(int8_speed, "time_interleaved", reduced_wins)
    monkeypatch.setattr(onnx_precision, "time_interleaved", reduced_wins)
    model, x = conv_net(0), torch.randn(8, 3, 16, 16)
    tolerance = {"relative_error": 0.05, "top1": None}
    opt = fxforge.optimize(model, (x,), target="auto", targets=["native", "onnxruntime"], precision="int8",
                           tolerance=tolerance)
    race = opt.report.race
    contenders = {c.target: c for c in race.contenders}
    # int8 answers differ from eager by more than float32's rounding: held to the tolerance instead
    assert not contenders["native"].refused, contenders["native"]
    assert not contenders["onnxruntime"].refused or "outside the precision tolerance" in contenders["onnxruntime"].refused
    assert race.winner in ("native", "onnxruntime")
    with torch.no_grad():
        fresh = torch.randn(8, 3, 16, 16)
        error = (opt(fresh)["features"] - model(fresh)["features"]).abs().max() / model(fresh)["features"].abs().max()
    assert 0 < error <= 0.1
    native = fxforge.optimize(model, (x,), target="auto", targets=["native"], precision="auto", tolerance=tolerance)
    assert native.report.race.winner == "native" and any(n.startswith(("precision int8: ", "precision bf16: "))
                                                        for n in native.report.notes), native.report.notes
    with pytest.raises(ValueError, match="precision='int4'"):
        fxforge.optimize(model, (x,), target="auto", precision="int4")
