"""cleanup's dead rows: a one-row read moves up through the ops that compute rows independently, so the rows
nobody reads are not computed; every read form, every refusal, real classifiers, and eager's answers."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxforge
from fxforge.core.plan import CallConditions
from fxforge.core.vocabulary import op_name
from fxforge.rewrites.dead_rows import WHAT

ROWS = "rows no output reads"


def _rewrite(model, inputs, method="fx", rewrites=("cleanup",)):
    cap = fxforge.capture(model, inputs, method=method)
    return cap, fxforge.rewrite(cap, list(rewrites))


def _moved(report):
    return [m.nodes[0] for m in report.matches if m.what.startswith(WHAT)]


def _computed_rows(gm, kind):
    """The size along the token dimension of every ``kind`` node's result (linear, layer_norm...), in any
    call form."""
    return [n.meta["val"].shape[-2] for n in gm.graph.nodes if op_name(n, gm) == kind and "val" in n.meta]


class Block(nn.Module):
    """A pre-norm transformer MLP block: LayerNorm, Linear, GELU, Linear, residual."""

    def __init__(self, dim):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Reader(nn.Module):
    """Blocks over tokens, a final norm, then one token read in the drawn form and a head."""

    def __init__(self, read, dim=8, blocks=2):
        super().__init__()
        self.read = read
        self.blocks = nn.Sequential(*(Block(dim) for _ in range(blocks)))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 3)

    def forward(self, x):
        y = self.norm(self.blocks(x))
        if self.read == "getitem":
            y = y[:, 0]
        elif self.read == "last":
            y = y[:, -1]
        elif self.read == "select":
            y = y.select(1, 2)
        elif self.read == "torch.select":
            y = torch.select(y, -2, 1)
        elif self.read == "transposed":
            y = y.transpose(0, 1)[0]
        return self.head(y)


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize("read", ["getitem", "last", "select", "torch.select", "transposed"])
def test_every_read_form_computes_one_row_of_the_blocks(method, read):
    model = Reader(read).eval()
    _cap, new = _rewrite(model, (torch.randn(2, 5, 8),), method)
    moved = _moved(new.report)
    assert len(moved) >= 11, moved  # final norm, and per block: add, down, gelu, up, norm
    assert set(_computed_rows(new.graph_module, "linear")) <= {1, 2}  # the head's batch of 2, or one token
    for seed in range(3):
        x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(new.graph_module(x), model(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_moved_nodes_carry_their_new_shapes(method):
    """Module calls too (fx): no node keeps the shape it had before it computed one row."""
    model = Reader("last").eval()
    _cap, new = _rewrite(model, (torch.randn(2, 5, 8),), method)
    for node in new.graph_module.graph.nodes:
        if node.name in _moved(new.report):
            assert node.meta["val"].shape[1] == 1, node.name


def test_the_last_token_read_in_onnx_runtime(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    model = Reader("last").eval()
    path = tmp_path / "last.onnx"
    fxforge.export_onnx(model, str(path), (torch.randn(2, 5, 8),))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = torch.randn(2, 5, 8)
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    torch.testing.assert_close(torch.from_numpy(out), model(x).detach(), rtol=1e-5, atol=1e-5)


def test_the_rows_come_back_from_the_graph_before_the_first_block():
    model = Reader("getitem", blocks=1).eval()
    _cap, new = _rewrite(model, (torch.randn(2, 5, 8),))
    code = new.graph_module.code
    # the input itself is read at one row before anything is computed on it
    assert "torch.ops.aten.slice.Tensor(x, 1, 0, 1)" in code, code


class KeywordShape(nn.Module):
    """A reshape whose sizes are a keyword (``torch.reshape(x, shape=...)``) between two row-local ops."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 8), nn.Linear(4, 4)

    def forward(self, x):
        y = torch.reshape(self.up(x), shape=(x.shape[0], x.shape[1], 2, 4))
        return self.down(y)[:, 0]


def test_a_reshape_with_keyword_sizes_moves_the_row():
    model = KeywordShape().eval()
    _cap, new = _rewrite(model, (torch.randn(2, 5, 8),))
    assert any("up" in name for name in _moved(new.report)), _moved(new.report)
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(new.graph_module(x), model(x))


class Returned(Reader):
    """Returns the whole hidden states besides the head's read: every row is read."""

    def forward(self, x):
        y = self.norm(self.blocks(x))
        return y, self.head(y[:, 0])


def test_a_value_read_whole_keeps_every_row():
    model = Returned("getitem").eval()
    _cap, new = _rewrite(model, (torch.randn(2, 5, 8),))
    assert not _moved(new.report)
    assert set(_computed_rows(new.graph_module, "linear")) == {5, 2}


class Mixing(nn.Module):
    """One op that mixes rows along the read dimension, after a row-local block."""

    def __init__(self, mix):
        super().__init__()
        self.mix = mix
        self.up, self.down = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = self.up(x)
        if self.mix == "cumsum":
            y = y.cumsum(1)
        elif self.mix == "softmax over tokens":
            y = y.softmax(1)
        elif self.mix == "merging reshape":
            y = y.reshape(y.shape[0], -1, 16).reshape(y.shape[0], -1, 8)
        elif self.mix == "causal attention":
            q = y.view(y.shape[0], y.shape[1], 2, 4).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(y.shape)
        elif self.mix == "linear over tokens":
            y = self.down(y.transpose(1, 2)).transpose(1, 2)
        elif self.mix == "norm over tokens":
            y = F.layer_norm(y.transpose(1, 2), (8,)).transpose(1, 2)
        return torch.relu(y)[:, 1]


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize("mix", ["cumsum", "softmax over tokens", "merging reshape", "causal attention",
                                 "linear over tokens", "norm over tokens"])
def test_an_op_that_mixes_rows_stops_the_row(method, mix):
    model = Mixing(mix).eval()
    _cap, new = _rewrite(model, (torch.randn(2, 8, 8),), method)
    assert any("relu" in name for name in _moved(new.report))  # the row moves above the pointwise relu only
    assert 8 in _computed_rows(new.graph_module, "linear")  # and stays below the mixing op: up runs on every row
    x = torch.randn(2, 8, 8)
    torch.testing.assert_close(new.graph_module(x), model(x), rtol=1e-6, atol=1e-6)


class Attending(nn.Module):
    """Non-causal attention whose output is read at one query row: the row reaches the query projection."""

    def __init__(self, masked):
        super().__init__()
        self.masked = masked
        self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))

    def split(self, t):
        return t.view(t.shape[0], t.shape[1], 2, 4).transpose(1, 2)

    def forward(self, x, keep):
        mask = keep[:, None, :, None] & keep[:, None, None, :] if self.masked else None
        a = F.scaled_dot_product_attention(self.split(self.q(x)), self.split(self.k(x)), self.split(self.v(x)),
                                           attn_mask=mask)
        return self.o(a.transpose(1, 2).reshape(x.shape))[:, 0]


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize("masked", [False, True])
def test_attention_computes_one_query_row(method, masked):
    model = Attending(masked).eval()
    keep = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    _cap, new = _rewrite(model, (torch.randn(2, 6, 8), keep), method)
    moved = _moved(new.report)
    assert any("scaled_dot_product_attention" in name for name in moved), moved
    # q's projection runs on one row, k's and v's on all six
    assert sorted(_computed_rows(new.graph_module, "linear")) == [1, 1, 6, 6], new.graph_module.code
    for seed in range(2):
        x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(seed))
        x[1, 3, 0] = float("nan")  # another token's NaN reaches row 0 through attention, as in eager
        torch.testing.assert_close(new.graph_module(x, keep), model(x, keep), equal_nan=True)


class InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 8)

    def forward(self, x):
        y = self.up(x)
        y.relu_()
        return y[:, 0]


def test_an_in_place_op_keeps_its_rows():
    model = InPlace().eval()
    _cap, new = _rewrite(model, (torch.randn(2, 5, 8),))
    assert not _moved(new.report)
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(new.graph_module(x), model(x))


def test_a_nan_in_an_unread_row_stays_out_as_in_eager():
    model = Reader("getitem").eval()
    opt = fxforge.optimize(model, (torch.randn(2, 5, 8),))
    x = torch.randn(2, 5, 8)
    x[:, 3] = float("nan")
    with torch.no_grad():
        out, expected = opt(x), model(x)
    assert not expected.isnan().any()
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_calls_that_record_gradients_keep_every_row_for_eagers_gradients(mode):
    """Eager's backward multiplies an unread row by a zero gradient: a NaN there makes the norms' and linears'
    gradients NaN. The plan for such calls keeps the rows (and says why), so the gradients are eager's; the
    same module's plan for no_grad calls computes one row."""
    model = Reader("getitem")
    getattr(model, mode)()
    eager = Reader("getitem")
    eager.load_state_dict(model.state_dict())
    getattr(eager, mode)()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = fxforge.optimize(model, (torch.randn(2, 5, 8),))
        x = torch.randn(2, 5, 8)
        x[1, 3, 2] = float("nan")  # an unread row
        xs = (x.clone().requires_grad_(), x.clone().requires_grad_())
        out, expected = opt(xs[0]), eager(xs[1])
    torch.testing.assert_close(out, expected)
    assert not expected.isnan().any()
    out.square().sum().backward()
    expected.square().sum().backward()
    torch.testing.assert_close(xs[0].grad, xs[1].grad, equal_nan=True)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, equal_nan=True, msg=name)
    assert eager.blocks[0].norm.weight.grad.isnan().any()  # what computing one row would have lost

    cap = fxforge.capture(Reader("getitem").eval(), (x,))
    for_gradients = fxforge.rewrite(cap, ["cleanup"], conditions=CallConditions(gradients=True))
    assert not _moved(for_gradients.report)
    assert any("reaches the parameters' gradients" in m.reason for m in for_gradients.report.near_misses)
    assert _moved(fxforge.rewrite(cap, ["cleanup"]).report)
    with torch.no_grad():
        torch.testing.assert_close(opt.eval()(x), eager.eval()(x), equal_nan=True)


def test_dynamic_lengths_keep_one_row():
    """A shape-generic graph (``dynamic=True``) moves the row too, and serves every length."""
    model = Attending(False).eval()
    make = lambda n: (torch.randn(2, n, 8), torch.ones(2, n, dtype=torch.bool))
    opt = fxforge.optimize(model, make(6), dynamic=True)
    assert any(m.what.startswith(WHAT) for m in opt.report.matches)
    for n in (3, 6, 11):
        inputs = make(n)
        with torch.no_grad():
            torch.testing.assert_close(opt(*inputs), model(*inputs))


# ------------------------------------------------------------------------------------------- real models


def _vit(attention):
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=64, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                       attn_implementation=attention)
    return ViTForImageClassification(config).eval()


def _bert(attention):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, num_labels=3, attn_implementation=attention)
    return BertForSequenceClassification(config).eval()


def _text(length, seed):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.ones(2, length, dtype=torch.int64)
    mask[1, length // 2:] = 0
    return {"input_ids": torch.randint(1, 128, (2, length), generator=gen), "attention_mask": mask}


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_vit_classifier_computes_its_last_block_for_the_class_token(attention):
    model = _vit(attention)
    x = torch.randn(2, 3, 32, 32)
    opt = fxforge.optimize(model, (x,))
    moved = _moved(opt.report)
    assert len(moved) >= 12, moved  # the last block's MLP, norms, output projection, attention, query
    assert opt.report.counts.get("attention", 0) == (2 if attention == "eager" else 0)  # both still replaced
    for seed in range(2):
        fresh = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            torch.testing.assert_close(opt(fresh).logits, model(fresh).logits)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_bert_classifier_at_new_lengths(attention):
    model = _bert(attention)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = fxforge.optimize(model, _text(8, 0))
        assert _moved(opt.report)
        for length, seed in ((8, 1), (12, 2), (5, 3)):
            inputs = _text(length, seed)
            with torch.no_grad():
                torch.testing.assert_close(opt(**inputs).logits, model(**inputs).logits)


def test_vit_classifier_onnx_file_answers_as_eager(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    import onnx

    model = _vit("sdpa")
    x = torch.randn(1, 3, 32, 32)
    plain, ours = tmp_path / "plain.onnx", tmp_path / "ours.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fxforge.export_onnx(model, str(plain), (x,), rewrites=[])
        fxforge.export_onnx(model, str(ours), (x,))
    fresh = torch.randn(1, 3, 32, 32)
    session = ort.InferenceSession(str(ours), providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {session.get_inputs()[0].name: fresh.numpy()})[:1]
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(logits), model(fresh).logits, rtol=1e-4, atol=1e-5)
    slices = [n for n in onnx.load(str(ours), load_external_data=False).graph.node if n.op_type == "Slice"]
    assert len(slices) > len([n for n in onnx.load(str(plain), load_external_data=False).graph.node
                              if n.op_type == "Slice"])
