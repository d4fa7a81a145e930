"""ONNX files with dynamic shapes: ``export_onnx(..., dynamic=True)`` (batch and sequence dims), validation at
three sizes, fused attention at any length, and the ``onnxruntime`` target's ``dynamic`` (True / None / False).

Every file here is exported at one size and then run in ONNX Runtime at other batch sizes and lengths against
eager PyTorch, and its ops are counted, so a file that holds the example's sizes somewhere, or that lost its
fused attention, fails.
"""

from __future__ import annotations

import gc
import weakref

import onnx
import pytest
import torch
import torch.nn.functional as F
from test_onnx import all_onnx_ops
from torch import nn

import fxforge
from fxforge import export_onnx
from fxforge.capture.dims import (
    changed_dynamic_shapes,
    sequence_dynamic_shapes,
    sequence_length,
    trace_inputs,
)
from fxforge.capture.refine import refined_dynamic_shapes
from fxforge.core.verify import compare_outputs
from fxforge.exporters import ExportError, InputShapeError, OnnxRuntimeModule

ATOL = 1e-4
MHA, GQA = "com.microsoft:MultiHeadAttention", "com.microsoft:GroupQueryAttention"
# (batch, length) the files are run at besides the sizes export_onnx validated them on
SIZES = [(1, 3), (4, 13), (3, 1), (2, 40)]


def text_inputs(batch: int, length: int, vocab: int = 128, seed: int = 0) -> dict[str, torch.Tensor]:
    """Token ids and an attention mask whose last row is padded (when there is room for it)."""
    gen = torch.Generator().manual_seed(seed + 97 * batch + length)
    mask = torch.ones(batch, length, dtype=torch.int64)
    if length > 2:
        mask[-1, -2:] = 0
    return {"input_ids": torch.randint(1, vocab, (batch, length), generator=gen), "attention_mask": mask}


def assert_matches_eager(model: nn.Module, module: nn.Module, *args, **kwargs) -> None:
    with torch.no_grad():
        expected = model(*args, **kwargs)
    actual = module(*args, **kwargs)
    result = compare_outputs(expected, actual, rtol_scale=10.0)
    assert result.ok and result.max_abs_err < ATOL, (result.reason, result.max_abs_err)


# ---------------------------------------------------------------------------------------------- models

class TokenAttention(nn.Module):
    """Embedding + one attention layer over a [B, S] padding mask (or causal without one): the shape of a
    transformer block's attention, small enough to export in a second."""

    def __init__(self, causal: bool = False, heads: int = 4, kv_heads: int = 4, head_size: int = 8):
        super().__init__()
        hidden = heads * head_size
        self.embed = nn.Embedding(64, hidden)
        self.q = nn.Linear(hidden, hidden)
        self.kv = nn.Linear(hidden, 2 * kv_heads * head_size)
        self.out = nn.Linear(hidden, hidden)
        self.causal, self.heads, self.kv_heads, self.head_size = causal, heads, kv_heads, head_size

    def forward(self, input_ids, attention_mask=None):
        x = self.embed(input_ids)
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_size).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.head_size).permute(2, 0, 3, 1, 4)
        mask = None if attention_mask is None else attention_mask[:, None, None, :].bool()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal,
                                           enable_gqa=self.kv_heads != self.heads)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        return torch.relu(self.conv(x)).mean((2, 3))


class Signal(nn.Module):
    """A 1-d conv over [B, C, L] floats: dim 1 is channels, fixed by the weights (not a sequence)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 6, 3, padding=1)

    def forward(self, x):
        return self.conv(x)


@pytest.fixture(scope="module")
def corpus():
    from models import TRANSFORMERS  # tests/corpus, put on the path by conftest.py

    return TRANSFORMERS


# ---------------------------------------------------------------------------------------------- transformers

@pytest.fixture(scope="module")
def bert_export(corpus, tmp_path_factory):
    model, inputs = corpus["bert"]()  # batch 2, length 8, the second row padded
    path = str(tmp_path_factory.mktemp("bert") / "bert.onnx")
    return model, export_onnx(model, path, inputs, dynamic=True)


@pytest.fixture(scope="module")
def llama_export(corpus, tmp_path_factory):
    model, inputs = corpus["llama"]()  # causal, 4 query heads sharing 2 key/value heads
    path = str(tmp_path_factory.mktemp("llama") / "llama.onnx")
    return model, export_onnx(model, path, inputs, dynamic=True)


@pytest.mark.parametrize("name", ["bert", "llama"])
def test_transformers_dynamic_validated_at_three_sizes(name, request):
    _, result = request.getfixturevalue(f"{name}_export")
    assert result.dynamic == {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}
    assert list(result.validation) == ["example inputs", "batch 3, seq 9", "batch 1, seq 4"]
    assert all(error < ATOL for error in result.validation.values()), result.validation
    assert str(result).splitlines()[0].endswith("dynamic input_ids{0: 'batch', 1: 'seq'}, "
                                                "attention_mask{0: 'batch', 1: 'seq'}")


@pytest.mark.parametrize("name", ["bert", "llama"])
def test_transformers_fused_attention_at_any_length(name, request):
    model, result = request.getfixturevalue(f"{name}_export")
    # both layers' attention is ONNX Runtime's kernel, the mask (BERT's padding, LLaMA's causal + padding, built
    # from the inputs' shapes) as its attention_bias. BERT's padding mask reaches it as [B, 1, 1, S] (the
    # condition spreading it over the queries is proven true for every size): checked at run time, one
    # MultiHeadAttention without it (flash) and one with it under an If, per layer
    assert "attention -> com.microsoft.MultiHeadAttention: 2" in result.translations, result.translations
    checked = any(t.startswith("attention mask checked at run time") for t in result.translations)
    assert checked is (name == "bert"), result.translations
    ops = all_onnx_ops(result.path)
    assert ops[MHA] == (4 if checked else 2) and "Softmax" not in ops, ops
    module = OnnxRuntimeModule(result.path, result.io)
    for batch, length in SIZES:
        assert_matches_eager(model, module, **text_inputs(batch, length))


def test_bert_length_range_from_the_model(bert_export):
    # BERT has 64 positions: torch.export asks for seq <= 64 and the export takes that range (refined) instead of
    # failing; the file then serves the longest length the model has.
    model, result = bert_export
    assert_matches_eager(model, OnnxRuntimeModule(result.path, result.io), **text_inputs(1, 64))


def test_causal_attention_stays_group_query_at_any_length(tmp_path):
    torch.manual_seed(0)
    model = TokenAttention(causal=True, heads=4, kv_heads=2).eval()
    path = str(tmp_path / "causal.onnx")
    result = export_onnx(model, path, (torch.randint(0, 64, (2, 6)),), dynamic=True)
    assert result.translations == ["attention -> com.microsoft.GroupQueryAttention (causal): 1"]
    assert list(result.validation) == ["example inputs", "batch 3, seq 7", "batch 1, seq 3"]
    ops = all_onnx_ops(path)
    assert ops[GQA] == 1 and MHA not in ops and "Softmax" not in ops
    # seqlens_k and total_sequence_length come from the input's shape, not the example's 6
    graph = onnx.load(path, load_external_data=False).graph
    gqa = next(n for n in graph.node if n.op_type == "GroupQueryAttention")
    constants = {o for n in graph.node if n.op_type == "Constant" for o in n.output} | {i.name for i in graph.initializer}
    assert gqa.input[5] not in constants and gqa.input[6] not in constants
    module = OnnxRuntimeModule(path, result.io)
    for batch, length in SIZES:
        assert_matches_eager(model, module, torch.randint(0, 64, (batch, length)))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_an_unpadded_transformers_decoder_is_group_query_at_any_length(name, corpus, tmp_path):
    # transformers builds the causal mask from arange(S) in the graph: proven causal for every S (index_masks),
    # so the file runs ONNX Runtime's causal kernel with no S x S mask, at every length
    model, inputs = corpus[name]()
    ids = {"input_ids": inputs["input_ids"]}
    result = export_onnx(model, str(tmp_path / "m.onnx"), ids, dynamic=True)
    assert "attention -> com.microsoft.GroupQueryAttention (causal): 2" in result.translations, result.translations
    assert all(error < ATOL for error in result.validation.values()), result.validation
    module = OnnxRuntimeModule(result.path, result.io)
    for batch, length in SIZES:
        ids = {"input_ids": text_inputs(batch, length)["input_ids"]}
        assert_matches_eager(model, module, **ids)


def test_padding_mask_attention_at_any_length(tmp_path):
    torch.manual_seed(0)
    model = TokenAttention().eval()
    inputs = text_inputs(2, 6, vocab=64)
    path = str(tmp_path / "masked.onnx")
    result = export_onnx(model, path, inputs, dynamic=True)
    assert result.dynamic == {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}
    assert all_onnx_ops(path)[MHA] == 2  # the If's two branches: the mask checked at run time
    module = OnnxRuntimeModule(path, result.io)
    for batch, length in SIZES:
        assert_matches_eager(model, module, **text_inputs(batch, length, vocab=64))
        # a mask that masks nothing: the other branch
        assert_matches_eager(model, module, **{**text_inputs(batch, length, vocab=64),
                                               "attention_mask": torch.ones(batch, length, dtype=torch.int64)})


def test_batch_and_length_of_one_are_traced_grown(tmp_path):
    torch.manual_seed(0)
    model = TokenAttention().eval()
    path = str(tmp_path / "one.onnx")
    result = export_onnx(model, path, text_inputs(1, 1, vocab=64), dynamic=True)
    assert result.dynamic == {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}
    assert list(result.validation) == ["example inputs", "batch 2, seq 2", "batch 3, seq 3"]
    module = OnnxRuntimeModule(path, result.io)
    for batch, length in SIZES:
        assert_matches_eager(model, module, **text_inputs(batch, length, vocab=64))


class SlicedCausalMask(nn.Module):
    """nanoGPT's mask: a buffer of 16 positions sliced to the length (torch.export guards ``T != 16`` inside
    ``T <= 16`` and suggests no fix)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.register_buffer("bias", torch.tril(torch.ones(16, 16)).view(1, 1, 16, 16))

    def forward(self, idx):
        x = self.embed(idx)
        t = idx.size(1)
        att = (x @ x.transpose(-2, -1)).unsqueeze(1)
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf")).softmax(-1)
        return (att @ x.unsqueeze(1)).squeeze(1)


def test_a_guard_excluding_the_end_of_a_range_narrows_it(tmp_path):
    torch.manual_seed(0)
    model = SlicedCausalMask().eval()
    path = str(tmp_path / "sliced.onnx")
    result = export_onnx(model, path, (torch.randint(0, 32, (1, 5)),), dynamic=True)
    assert result.dynamic == {"idx": {0: "batch", 1: "seq"}}
    module = OnnxRuntimeModule(path, result.io)
    for batch, length in [(2, 9), (3, 15), (1, 2)]:
        assert_matches_eager(model, module, torch.randint(0, 32, (batch, length)))


def test_images_get_only_the_batch_dim(tmp_path):
    model = SmallCNN().eval()
    path = str(tmp_path / "cnn.onnx")
    result = export_onnx(model, path, (torch.randn(2, 3, 8, 8),), dynamic=True)
    assert result.dynamic == {"x": {0: "batch"}}
    assert list(result.validation) == ["example inputs", "batch 3", "batch 1"]
    assert_matches_eager(model, OnnxRuntimeModule(path, result.io), torch.randn(5, 3, 8, 8))


def test_dynamic_batch_and_dynamic_shapes_validated_at_three_sizes(tmp_path):
    model = nn.Linear(4, 2).eval()
    result = export_onnx(model, str(tmp_path / "a.onnx"), (torch.randn(2, 4),), dynamic_batch=True)
    assert list(result.validation) == ["example inputs", "batch 3", "batch 1"]
    rows = torch.export.Dim("rows", min=2, max=5)  # sizes chosen within the Dim's range
    result = export_onnx(model, str(tmp_path / "b.onnx"), (torch.randn(4, 4),), dynamic_shapes={"input": {0: rows}})
    assert list(result.validation) == ["example inputs", "rows 5", "rows 2"]
    assert all(error < ATOL for error in result.validation.values())


def test_a_model_that_fixes_the_length_is_refused(tmp_path):
    class FixedLength(nn.Module):  # mixes positions with an [S, 4] weight: the length must be 6
        def __init__(self):
            super().__init__()
            self.embed, self.mix = nn.Embedding(10, 3), nn.Linear(6, 4)

        def forward(self, ids):
            return self.mix(self.embed(ids).transpose(1, 2))

    with pytest.raises(ExportError, match="suggested fixes: seq = 6") as info:
        export_onnx(FixedLength().eval(), str(tmp_path / "m.onnx"), (torch.randint(0, 10, (2, 6)),), dynamic=True)
    assert info.value.stage == "torch.export"
    assert list(tmp_path.iterdir()) == []


def test_bad_arguments(tmp_path):
    model, inputs = nn.Linear(4, 2).eval(), (torch.randn(2, 4),)
    with pytest.raises(ValueError, match="one of dynamic=True, dynamic_batch=True, dynamic_shapes"):
        export_onnx(model, str(tmp_path / "m.onnx"), inputs, dynamic=True, dynamic_batch=True)
    with pytest.raises(ValueError, match="one of dynamic=True"):
        export_onnx(model, str(tmp_path / "m.onnx"), inputs, dynamic=True, dynamic_shapes={"input": None})
    with pytest.raises(ValueError, match="one of dynamic=True"):
        fxforge.optimize(model, inputs, target="onnxruntime", dynamic=True, dynamic_batch=True)
    with pytest.raises(TypeError, match="dynamic takes"):
        fxforge.optimize(model, inputs, target="onnxruntime", dynamic="yes")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------- the dims

def test_sequence_dims_chosen():
    ids, mask = torch.ones(2, 5, dtype=torch.long), torch.ones(2, 5, dtype=torch.bool)
    hidden, image, other = torch.randn(2, 5, 8), torch.randn(2, 5, 8, 8), torch.randn(3, 5)
    assert sequence_length((ids, mask, hidden, image), {}) == 5
    assert sequence_length((image,), {}) is None and sequence_length((hidden,), {}) == 5
    gm = torch.fx.symbolic_trace(lambda ids, mask, hidden, image, other: ids)
    spec = sequence_dynamic_shapes(gm, (ids, mask, hidden, image, other), {}, 2, 5)
    assert {name: {axis: d.__name__ for axis, d in axes.items()} if axes else None for name, axes in spec.items()} == {
        "ids": {0: "batch", 1: "seq"}, "mask": {0: "batch", 1: "seq"}, "hidden": {0: "batch", 1: "seq"},
        "image": {0: "batch"}, "other": {1: "seq"}}
    assert spec["ids"][1] is spec["hidden"][1] and spec["ids"][0] is spec["image"][0]  # shared Dims
    (grown,), _ = trace_inputs(nn.Linear(1, 1), (torch.tensor([[7]]),), {},
                               {"input": {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")}})
    assert grown.tolist() == [[7, 7], [7, 7]]


def test_refinement_keeps_required_dims():
    seq, batch = torch.export.Dim("seq", min=1), torch.export.Dim("batch", min=1)
    spec = {"x": {0: batch, 1: seq}}
    narrowed = refined_dynamic_shapes(RuntimeError("Suggested fixes:\n  seq = Dim('seq', max=64)\n\nmore"), spec)
    assert (narrowed["x"][1].min, narrowed["x"][1].max) == (1, 64) and narrowed["x"][0] is batch
    fixed = RuntimeError("Suggested fixes:\n  seq = 4")
    assert refined_dynamic_shapes(fixed, spec) is None  # every dim required
    assert refined_dynamic_shapes(fixed, spec, required={"batch"}) == {"x": {0: batch}}
    assert refined_dynamic_shapes(RuntimeError("Constraints violated"), spec) is None
    assert changed_dynamic_shapes(nn.Linear(4, 2), ((torch.ones(2, 4),), {}), ((torch.ones(2, 4),), {})) is None
    assert changed_dynamic_shapes(nn.Linear(4, 2), ((torch.ones(2, 4),), {}), ((torch.ones(2, 4, 1),), {})) is None


def test_refinement_makes_a_dim_the_model_reads_as_a_number_static_when_not_required():
    seq, batch = torch.export.Dim("seq", min=1), torch.export.Dim("batch", min=1)
    guard = RuntimeError("Not all values of seq = L['x'].size()[1] in the specified range satisfy the generated "
                         "guard (L['x'].size()[1] / 1) == 8.0.")
    assert refined_dynamic_shapes(guard, {"x": {0: batch, 1: seq}}, required={"batch"}) == {"x": {0: batch}}
    assert refined_dynamic_shapes(guard, {"x": {0: batch, 1: seq}}) is None  # seq required: the error stands


# ---------------------------------------------------------------------------------------------- onnxruntime target

LENGTHS = [(2, 9), (2, 3), (5, 12), (1, 1), (3, 20), (2, 6)]


def test_onnxruntime_automatic_dynamic_exports_once_more():
    torch.manual_seed(0)
    model = TokenAttention().eval()
    opt = fxforge.optimize(model, text_inputs(2, 6, vocab=64), target="onnxruntime")  # dynamic=None
    assert opt.exports == 1 and opt.onnx_export.dynamic == {}
    first = weakref.ref(opt.session)
    assert_matches_eager(model, opt, **text_inputs(2, 6, vocab=64))  # the exported size: no new export
    assert opt.exports == 1
    for batch, length in LENGTHS:
        assert_matches_eager(model, opt, **text_inputs(batch, length, vocab=64))
    assert opt.exports == 2  # exactly one more, whatever the lengths after it
    assert opt.onnx_export.dynamic == {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}
    assert len(opt.onnx_export.validation) == 3
    gc.collect()
    assert first() is None  # the first session was freed
    with pytest.raises(AttributeError):
        opt.exports = 0
    with pytest.raises(InputShapeError, match="3 dims"):  # another rank: not a size change, no export
        opt(input_ids=torch.randint(0, 64, (2, 3, 4)), attention_mask=torch.ones(2, 3, 4, dtype=torch.int64))
    assert opt.exports == 2


def test_onnxruntime_dynamic_true_exports_once():
    torch.manual_seed(0)
    model = TokenAttention(causal=True).eval()
    opt = fxforge.optimize(model, (torch.randint(0, 64, (2, 6)),), target="onnxruntime", dynamic=True)
    for batch, length in LENGTHS:
        assert_matches_eager(model, opt, torch.randint(0, 64, (batch, length)))
    assert opt.exports == 1 and opt.onnx_export.dynamic == {"input_ids": {0: "batch", 1: "seq"}}
    assert "attention -> com.microsoft.GroupQueryAttention (causal): 1" in opt.onnx_export.translations
    with pytest.raises(InputShapeError, match="3 dims"):
        opt(torch.randint(0, 64, (2, 3, 4)))
    assert opt.exports == 1


def test_onnxruntime_dynamic_false_keeps_the_example_shapes():
    model = TokenAttention().eval()
    opt = fxforge.optimize(model, text_inputs(2, 6, vocab=64), target="onnxruntime", dynamic=False)
    with pytest.raises(InputShapeError, match=r"takes \(2, 6\).*dynamic=True"):
        opt(**text_inputs(2, 7, vocab=64))
    assert opt.exports == 1


def test_onnxruntime_automatic_dynamic_on_the_dims_that_changed():
    # An image's height and width change: those dims (and the batch) become dynamic, exported once more.
    model = SmallCNN().eval()
    opt = fxforge.optimize(model, (torch.randn(2, 3, 8, 8),), target="onnxruntime")
    for shape in [(2, 3, 12, 12), (4, 3, 16, 10), (1, 3, 5, 7)]:
        assert_matches_eager(model, opt, torch.randn(*shape))
    assert opt.exports == 2
    assert set(opt.onnx_export.dynamic["x"]) == {0, 2, 3}


def test_onnxruntime_automatic_dynamic_leaves_dims_the_model_fixes():
    # [B, C, L] floats: dim 1 looks like a sequence but the weights fix it; only the batch changed, so the
    # export keeps C static (torch.export's suggested fix) instead of failing.
    model = Signal().eval()
    opt = fxforge.optimize(model, (torch.randn(2, 4, 4),), target="onnxruntime")
    assert_matches_eager(model, opt, torch.randn(5, 4, 4))
    assert_matches_eager(model, opt, torch.randn(1, 4, 4))
    assert opt.exports == 2 and opt.onnx_export.dynamic == {"x": {0: "batch"}}


def test_onnxruntime_explicit_dims_are_not_changed():
    # dynamic_batch=True with dynamic=None: the batch dim only, no second export for another length
    opt = fxforge.optimize(nn.Linear(4, 2).eval(), (torch.randn(2, 4),), target="onnxruntime", dynamic_batch=True)
    assert opt(torch.randn(7, 4)).shape == (7, 2)
    with pytest.raises(InputShapeError):
        opt(torch.randn(7, 5))
    assert opt.exports == 1


def test_onnxruntime_automatic_dynamic_adds_the_dims_that_change_later():
    """A batch that changes, then an image's height: each export keeps the dims that varied so far and adds the
    new ones (H with W), so every later size is served by the third file."""
    torch.manual_seed(0)
    model = SmallCNN().eval()
    ort = fxforge.optimize(model, (torch.randn(1, 3, 16, 16),), target="onnxruntime")
    for shape in [(2, 3, 16, 16), (2, 3, 24, 16), (5, 3, 16, 24), (3, 3, 9, 31)]:
        x = torch.randn(shape)
        assert_matches_eager(model, ort, x)
    assert ort.exports == 3


def test_decorated_class_exports_once_more():
    @fxforge.optimize(target="onnxruntime")
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            return torch.tanh(self.fc(x))

    net = Net().eval()
    for rows in (2, 5, 1, 7):
        x = torch.randn(rows, 4)
        with torch.no_grad():
            expected = torch.tanh(net.fc(x))
        torch.testing.assert_close(net(x), expected, atol=ATOL, rtol=ATOL)
    assert net.fxforge_onnxruntime.exports == 2
