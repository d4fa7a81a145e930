"""Every hand-written user model through fxforge the way a new user drives it: optimize (native, and auto for
some), the ONNX Runtime target and the file export, training mode, and the command line — each time compared
with eager on fresh inputs of new shapes.

A model that cannot be one graph (a branch on a tensor's value) must still run like eager through
``optimize`` and be refused by the exporters with its source line.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path

import pytest
import torch
from hand_written import USER_MODELS, fresh_calls
from torch.utils import _pytree as pytree

import fxforge
from fxforge.cli import main as cli_main
from fxforge.exporters import OnnxRuntimeModule

HERE = Path(__file__).resolve().parent
MODEL_FILE = HERE / "hand_written.py"
NAMES = sorted(USER_MODELS)
# Models the native target and ONNX Runtime take whole (the others run eagerly or are refused).
CAPTURABLE = [n for n in NAMES if USER_MODELS[n]().capturable]
EXPORTABLE = [n for n in NAMES if USER_MODELS[n]().exportable]


def example_of(case):
    """What a user passes as ``example_inputs``: the positional tuple, or a dict when the model takes keywords."""
    if case.kwargs:
        names = list(case.model.forward.__code__.co_varnames[1 : 1 + len(case.inputs)])
        return {**dict(zip(names, case.inputs)), **case.kwargs}
    return case.inputs


def assert_close(got, want, *, atol=1e-4, rtol=1e-4, what=""):
    got_leaves, want_leaves = pytree.tree_leaves(got), pytree.tree_leaves(want)
    assert pytree.tree_structure(got) == pytree.tree_structure(want), what
    for g, w in zip(got_leaves, want_leaves):
        assert g.shape == w.shape, what
        torch.testing.assert_close(g, w, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def same_shapes_new_values(inputs):
    """New values of the same shapes: floats drawn again, integers within the example's range (a mask of ones
    stays ones)."""
    def fresh(t):
        if t.is_floating_point():
            return torch.randn_like(t)
        return torch.randint_like(t, int(t.min()), int(t.max()) + 1)
    return pytree.tree_map(fresh, inputs)


def call(module, example):
    """``module`` called with an example in the form ``example_of`` gives (keywords for a dict)."""
    return module(**example) if isinstance(example, dict) else module(*example)


@pytest.mark.parametrize("name", NAMES)
def test_native_serves_fresh_inputs_like_eager(name):
    case = USER_MODELS[name]()
    opt = fxforge.optimize(case.model, example_of(case))
    with torch.inference_mode():
        for inputs, kwargs in [(case.inputs, case.kwargs), *fresh_calls(case)]:
            shapes = pytree.tree_map(lambda t: tuple(t.shape), (inputs, kwargs))
            assert_close(opt(*inputs, **kwargs), case.model(*inputs, **kwargs), what=f"{name} at {shapes}")
    # Changed weights are the model's: the optimized module follows them.
    with torch.no_grad():
        for p in case.model.parameters():
            p.mul_(0.5)
        inputs = case.fresh[0]
        assert_close(opt(*inputs), case.model(*inputs), what=f"{name} after the weights changed")


@pytest.mark.parametrize("name", ["unet", "gpt", "custom_autograd", "siamese", "lstm"])
def test_training_mode_outputs_and_gradients_match_eager(name):
    case = USER_MODELS[name]()
    model = case.model.train()
    opt = fxforge.optimize(model, example_of(case))
    inputs = case.fresh[0]
    float_inputs = [t for t in pytree.tree_leaves(inputs) if t.is_floating_point()]
    torch.manual_seed(1)
    got = opt(*inputs)
    grads_got = torch.autograd.grad(sum(t.float().sum() for t in pytree.tree_leaves(got)), list(model.parameters()),
                                    allow_unused=True)
    torch.manual_seed(1)
    want = model(*inputs)
    grads_want = torch.autograd.grad(sum(t.float().sum() for t in pytree.tree_leaves(want)), list(model.parameters()),
                                     allow_unused=True)
    assert_close(got, want, what=name)
    for g, w in zip(grads_got, grads_want):
        if w is None:
            assert g is None
        else:
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    del float_inputs


@pytest.mark.parametrize("name", [n for n in EXPORTABLE if n in CAPTURABLE])
def test_onnxruntime_target_serves_fresh_inputs_like_eager(name):
    case = USER_MODELS[name]()
    ort = fxforge.optimize(case.model, example_of(case), target="onnxruntime")
    for inputs, kwargs in [(case.inputs, case.kwargs), *fresh_calls(case)]:
        if case.kwargs and set(kwargs) != set(case.kwargs):
            continue  # an ONNX file takes the inputs it was exported with
        assert_close(ort(*inputs, **kwargs), case.model(*inputs, **kwargs), atol=1e-4, rtol=1e-3,
                     what=f"{name} in ONNX Runtime")


@pytest.mark.parametrize("name", [n for n in EXPORTABLE if n in CAPTURABLE])
def test_export_onnx_writes_a_file_that_matches_eager(name, tmp_path):
    case = USER_MODELS[name]()
    path = tmp_path / f"{name}.onnx"
    result = fxforge.export_onnx(case.model, path, example_of(case), dynamic_batch=True)
    module = OnnxRuntimeModule(str(path), result.io)
    example = same_shapes_new_values(example_of(case))
    inputs, kwargs = ((), example) if isinstance(example, dict) else (example, {})
    assert_close(module(*inputs, **kwargs), case.model(*inputs, **kwargs), atol=1e-4, rtol=1e-3,
                 what=f"{name}'s file")


@pytest.mark.parametrize("name", [n for n in NAMES if not USER_MODELS[n]().exportable])
def test_export_refuses_with_the_users_line(name, tmp_path):
    case = USER_MODELS[name]()
    path = tmp_path / f"{name}.onnx"
    with pytest.raises(Exception) as info:
        fxforge.export_onnx(case.model, path, example_of(case))
    assert "hand_written.py:" in str(info.value)
    assert not path.exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["unet", "gpt", "lstm", "siamese", "kwargs_input"])
def test_auto_never_narrows_the_inputs_served_nor_loses_to_eager(name):
    case = USER_MODELS[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        best = fxforge.optimize(case.model, example_of(case), target="auto")
    with torch.inference_mode():
        for inputs, kwargs in fresh_calls(case):
            assert_close(best(*inputs, **kwargs), case.model(*inputs, **kwargs), atol=1e-4, rtol=1e-3,
                         what=f"{name} through auto")


def run_cli(*argv: str) -> tuple[int, str]:
    """``fxforge ARGV`` in this process: its exit code and everything it printed."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        try:
            code = cli_main(list(argv))
        except SystemExit as exit_:
            code = exit_.code
    return code, buffer.getvalue()


CLI_MODELS = ["custom_autograd", "dict_input", "gpt", "kwargs_input", "lstm", "siamese", "unet"]


def cli_model(name: str) -> list[str]:
    """MODEL and its arguments for the command line: the same seeded model as ``USER_MODELS[name]``."""
    case = USER_MODELS[name]()
    inputs = [a for spec in case.cli_inputs for a in ("--input", spec)]
    return [f"{MODEL_FILE}:user_model", "--model-args", f'{{"name": "{name}"}}', *inputs]


@pytest.mark.parametrize("name", CLI_MODELS)
def test_cli_optimize_writes_a_native_file_that_matches_eager(name, tmp_path):
    case = USER_MODELS[name]()
    out = tmp_path / f"{name}.pt2"
    code, text = run_cli("optimize", *cli_model(name), "-o", str(out))
    assert code == 0, text
    loaded = fxforge.load(out)
    example = same_shapes_new_values(example_of(case))
    with torch.inference_mode():
        assert_close(call(loaded, example), call(case.model, example), what=f"{name} loaded from the CLI's .pt2")


@pytest.mark.parametrize("name", CLI_MODELS)
def test_cli_export_writes_an_onnx_file_that_matches_eager(name, tmp_path):
    import onnxruntime

    case = USER_MODELS[name]()
    out = tmp_path / f"{name}.onnx"
    code, text = run_cli("export", *cli_model(name), "-o", str(out))
    assert code == 0, text
    session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    example = same_shapes_new_values(example_of(case))
    feed = {i.name: t.numpy() for i, t in zip(session.get_inputs(), pytree.tree_leaves(example))}
    got = session.run(None, feed)
    want = pytree.tree_leaves(call(case.model, example))
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.from_numpy(g), w.detach(), atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("name", CLI_MODELS)
def test_cli_profile_and_show(name, tmp_path):
    code, text = run_cli("profile", *cli_model(name))
    assert code == 0, text
    code, text = run_cli("show", *cli_model(name), "-o", str(tmp_path / "graph.html"))
    assert code == 0, text
    assert (tmp_path / "graph.html").exists()


def test_cli_on_a_data_dependent_branch_names_the_line(tmp_path):
    code, text = run_cli("export", f"{MODEL_FILE}:BranchOnData", "--input", "2x3x16x16",
                         "-o", str(tmp_path / "b.onnx"))
    assert code == 1
    assert "hand_written.py:" in text
    assert not list(tmp_path.iterdir())
