"""The CLI's inputs (issue 48 item 6): named and nested ``--input``, the ``--inputs`` factory, ``--dynamic``, and
a model with a data-dependent branch through every command."""

import textwrap

import onnx
import pytest
import torch
from cli_helpers import REPO, run_cli

from fxforge.cli import main
from fxforge.cli.args import parse_dynamic
from fxforge.cli.inputs import InputError, build_inputs, parse_input, reshaped, signature_of

CORPUS = REPO / "tests" / "user_models" / "hand_written.py"

# Models in styles the corpus does not hold: a list of frames, keyword-only options, an HF-style signature
# called by names only, a factory returning (args, kwargs).
STYLES = textwrap.dedent('''
    import torch
    from torch import nn

    class Frames(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Linear(6, 4)
        def forward(self, frames, *, scale=1.0):
            return torch.stack([self.enc(f) for f in frames], 1) * scale

    class HFStyle(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(30, 8)
            self.type_emb = nn.Embedding(2, 8)
            self.out = nn.Linear(8, 2)
        def forward(self, input_ids=None, attention_mask=None, token_type_ids=None):
            x = self.emb(input_ids)
            if token_type_ids is not None:
                x = x + self.type_emb(token_type_ids)
            m = attention_mask.unsqueeze(-1).float()
            return self.out((x * m).sum(1) / m.sum(1))

    def hf_inputs():
        ids = torch.randint(0, 30, (2, 7))
        return (ids,), {"attention_mask": torch.ones(2, 7, dtype=torch.long)}

    def tower_inputs():
        return ({"image": torch.randn(2, 3, 16, 16), "tokens": torch.randint(0, 50, (2, 6))},)
''')


@pytest.fixture
def styles(tmp_path):
    path = tmp_path / "styles.py"
    path.write_text(STYLES)
    return path


def test_names_and_paths_parse_as_a_user_writes_them():
    assert parse_input("2x3").path == () and parse_input("2x3").dtype is None
    assert parse_input("image=2x3x8x8").path == ("image",)
    assert parse_input("batch.tokens=2x6:int64") == ((2, 6), torch.int64, ("batch", "tokens"))
    assert parse_input("batch[tokens]=2x6").path == ("batch", "tokens")
    assert parse_input("frames[1]=2x6").path == ("frames", 1)
    assert parse_dynamic("batch,seq") == ("batch", "length") and parse_dynamic("1,0") == (0, 1)


def test_named_inputs_become_forward_arguments(styles):
    from fxforge.cli.args import load_model

    frames = load_model(f"{styles}:Frames")
    built = build_inputs([parse_input("frames[0]=2x6"), parse_input("frames[1]=2x6")], signature_of(frames))
    assert isinstance(built, tuple) and isinstance(built[0], tuple) and len(built[0]) == 2
    hf = load_model(f"{styles}:HFStyle")
    built = build_inputs([parse_input("input_ids=2x7:int64"), parse_input("token_type_ids=2x7:int64"),
                          parse_input("attention_mask=2x7:int64")], signature_of(hf))
    assert isinstance(built, tuple) and [t.shape for t in built] == [(2, 7)] * 3  # all three, in forward's order
    built = build_inputs([parse_input("token_type_ids=2x7:int64"), parse_input("input_ids=2x7:int64")],
                         signature_of(hf))
    assert list(built) == ["input_ids", "token_type_ids"]  # a gap (no attention_mask): keyword inputs
    with pytest.raises(InputError, match="frames\\[...\\]: a list input needs the indices 0 to n-1"):
        build_inputs([parse_input("frames[1]=2x6")], signature_of(frames))


def test_the_factory_is_only_reshaped_within_its_values():
    inputs = {"ids": torch.randint(5, 9, (2, 4)), "mask": torch.ones(2, 4, dtype=torch.long)}
    out = reshaped(inputs, [parse_input("ids=3x10"), parse_input("mask=3x10")], None, "f.py:g")
    assert out["ids"].shape == (3, 10) and out["ids"].dtype == torch.int64
    assert 5 <= int(out["ids"].min()) and int(out["ids"].max()) <= 8  # token ids stay in the factory's range
    assert bool((out["mask"] == 1).all())  # a constant mask stays one
    with pytest.raises(InputError, match="f.py:g gives no tensor at idz \\(it gives ids, mask\\)"):
        reshaped(inputs, [parse_input("idz=3x10")], None, "f.py:g")


@pytest.mark.parametrize(("args", "message"), [
    (["--input", "image=2x3x8x8"], "has no argument 'image' (its arguments: batch)"),
    (["--input", "batch..image=2x3"], "malformed input name 'batch..image'"),
    (["--input", "batch.image=2x3x16x16", "--input", "batch.image=2x3x16x16"], "batch.image is given twice"),
])
def test_an_input_that_does_not_fit_is_one_usage_line_with_exit_2(capsys, args, message):
    try:
        code = main(["show", f"{CORPUS}:TwoTower", *args])
    except SystemExit as exit_info:  # argparse's own usage errors
        code = exit_info.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and message in err[-1], err


@pytest.mark.parametrize(("args", "message"), [
    (["--input", "2x8", "-o", "m.pt2", "--dynamic", "batch,length"], "a .pt2 file takes --dynamic batch or none"),
    (["--input", "2x8", "--dynamic", "0"], "--dynamic 0: it is for the file -o writes"),
    (["--input", "2x8", "-o", "m.onnx", "--dynamic", "height"], "unknown dim 'height'"),
])
def test_dynamic_usage_errors(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["optimize", "m.py:Net", *args])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_dict_input_optimizes_from_the_command_line(out):
    result = run_cli("optimize", f"{CORPUS}:TwoTower", "--input", "batch.image=2x3x16x16",
                     "--input", "batch.tokens=2x6:int64", "--target", "native", "--no-bench", cwd=out)
    assert result.returncode == 0, result.stderr
    assert "TwoTower (batch.image=2x3x16x16 batch.tokens=2x6:int64)" in result.stdout
    assert "conv_bn_fold x1" in result.stdout


def test_factory_with_kwargs_exports_with_batch_and_length_dynamic_by_default(styles, out):
    result = run_cli("export", f"{styles}:HFStyle", "--inputs", f"{styles}:hf_inputs", "--input",
                     "input_ids=3x9:int64", "--input", "attention_mask=3x9:int64", "-o", "hf.onnx", cwd=out)
    assert result.returncode == 0, result.stderr
    assert "input_ids=3x9:int64 attention_mask=3x9:int64" in result.stdout
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
            for i in onnx.load(out / "hf.onnx").graph.input}
    assert all(isinstance(d, str) for shape in dims.values() for d in shape), dims  # batch and length
    static = run_cli("export", f"{styles}:HFStyle", "--inputs", f"{styles}:hf_inputs", "--dynamic", "none",
                     "-o", "static.onnx", cwd=out)
    assert static.returncode == 0, static.stderr
    dims = [[d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
            for i in onnx.load(out / "static.onnx").graph.input]
    assert dims == [[2, 7], [2, 7]]


def test_data_dependent_branch_through_every_command(out):
    line = next(i for i, text in enumerate(CORPUS.read_text().splitlines(), 1) if "if h.sum() > 0:" in text)
    where = f"hand_written.py:{line} (if h.sum() > 0:)"
    model = f"{CORPUS}:BranchOnData"
    for command, extra in (("export", ["-o", "b.onnx"]), ("optimize", ["-o", "b.pt2"])):  # a file holds one graph
        result = run_cli(command, model, "--input", "2x3x16x16", *extra, cwd=out)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and len(lines) == 1, (command, result.stderr)
        assert where in lines[0] and "torch.where" in lines[0] and "holds one graph" in lines[0], (command, lines[0])
    assert not list(out.iterdir())  # nothing written
    # (show, memory and profile graph by graph: tests/cli/test_cli_breaks.py, in-process)
    optimize = run_cli("optimize", model, "--input", "2x3x16x16", "--target", "native", "--report", "r.html", cwd=out)
    assert optimize.returncode == 0, optimize.stderr
    assert "captured with dynamo" in optimize.stdout and where in " ".join(optimize.stdout.split())
    assert "torch.where" in (out / "r.html").read_text()


FIXED_BATCH = textwrap.dedent('''
    import torch
    class FixedBatch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
        def forward(self, x):
            return self.lin(x).reshape(4, 2, 4).sum(1)
''')


def test_a_model_that_fixes_its_batch_gets_a_static_file_by_default_and_an_error_when_asked(tmp_path, out):
    path = tmp_path / "fixed.py"
    path.write_text(FIXED_BATCH)
    default = run_cli("optimize", f"{path}:FixedBatch", "--input", "4x8", "-o", "f.onnx", "--no-bench", cwd=out)
    assert default.returncode == 0, default.stderr
    assert "note: the file is static: its batch and length could not stay dynamic" in default.stdout
    assert [[d.dim_value for d in i.type.tensor_type.shape.dim] for i in onnx.load(out / "f.onnx").graph.input] == [[4, 8]]
    asked = run_cli("optimize", f"{path}:FixedBatch", "--input", "4x8", "-o", "g.onnx", "--dynamic", "0",
                    "--no-bench", cwd=out)
    assert asked.returncode == 1 and len(asked.stderr.strip().splitlines()) == 1, asked.stderr
    assert not (out / "g.onnx").exists()
