"""Rotary embeddings of a causal self-attention move into ONNX Runtime's GroupQueryAttention, with the model's
values (NaN rows included), and only where the tables are ones GroupQueryAttention reads the same way."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ir_graphs import onnx_applied, onnx_refused, run_graph
from onnxscript import ir
from test_onnx import onnx_ops
from test_onnx_dynamic import assert_matches_eager
from torch import nn

from fxforge import export_onnx
from fxforge.exporters.ort_module import OnnxRuntimeModule
from fxforge.exporters.rotary import (
    ROTARY,
    _rotary_attention_graph,
    fuse_rotary_embeddings,
    group_query_attention_rotates,
)


def llama(head: int = 16, heads: int = 4, kv_heads: int = 2, use_cache: bool = False) -> nn.Module:
    """A two-layer transformers LLaMA (eager attention; returning its KV cache with ``use_cache``) with random
    weights."""
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(vocab_size=128, hidden_size=head * heads, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
                         attn_implementation="eager", use_cache=use_cache)
    torch.manual_seed(0)
    return LlamaModel(config).eval()


class RotaryCrossAttention(nn.Module):
    """LLaMA's rotate-half embedding on q (from ``x``) and k (from ``memory``), causal attention written out:
    a NaN in ``x`` is a NaN in one query row only (the attention rewrite's guard gives eager's NaN there)."""

    def __init__(self, head: int = 16, heads: int = 2):
        super().__init__()
        self.heads, self.head = heads, head
        self.q, self.k, self.v = (nn.Linear(heads * head, heads * head) for _ in range(3))
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, head, 2).float() / head))

    def forward(self, x, memory):
        b, length, _ = x.shape
        angles = torch.arange(length).float()[:, None] * self.inv_freq[None]
        emb = torch.cat([angles, angles], -1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        q, k, v = (p(t).view(b, length, self.heads, self.head).transpose(1, 2)
                   for p, t in ((self.q, x), (self.k, memory), (self.v, memory)))
        q, k = (t * cos + torch.cat([-t[..., self.head // 2:], t[..., : self.head // 2]], -1) * sin for t in (q, k))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head)
        scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
        return (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(b, length, -1)


def rotating_attentions(path: str) -> int:
    """How many GroupQueryAttention nodes of the file rotate their inputs themselves."""
    graph = onnx.load(path).graph
    return sum(1 for node in graph.node if node.op_type == "GroupQueryAttention"
               and any(a.name == "do_rotary" and a.i == 1 for a in node.attribute))


def test_the_probe_finds_that_onnxruntime_rotates_as_eager():
    assert group_query_attention_rotates()


def test_the_probe_would_see_another_rotation():
    """The probe's comparison tells rotations apart: GroupQueryAttention told to rotate interleaved pairs
    (GPT-J's form) answers differently from the rotate-half form computed beforehand."""
    cos, sin = _tables(length=5, head=16, base=100.0)
    feeds = _feeds(5, 16, heads=2, kv_heads=1, seed=0)
    expected = _run(_rotary_attention_graph(cos, sin), feeds)
    graph = _rotary_attention_graph(cos, sin)
    assert fuse_rotary_embeddings(graph, rotates=True) == (1, [])
    np.testing.assert_allclose(_run(graph, feeds), expected, rtol=1e-5, atol=1e-5)
    attention = next(node for node in graph if node.op_type == "GroupQueryAttention")
    attention.attributes["rotary_interleaved"] = ir.AttrInt64("rotary_interleaved", 1)
    assert not np.allclose(_run(graph, feeds), expected, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_llama_rotations_move_into_the_attention(dynamic, tmp_path):
    model = llama()
    path = str(tmp_path / "llama.onnx")
    result = export_onnx(model, path, {"input_ids": torch.randint(1, 128, (2, 12))}, dynamic=dynamic)
    assert f"{ROTARY}: 2" in onnx_applied(result.report), result.report
    assert rotating_attentions(path) == 2
    assert onnx_ops(path)["Neg"] == 0  # no rotate_half left for q or k
    module = OnnxRuntimeModule(path, result.io)
    for batch, length in [(2, 12)] + ([(1, 5), (3, 30)] if dynamic else []):
        assert_matches_eager(model, module, input_ids=torch.randint(1, 128, (batch, length)))


def test_a_returned_cache_is_read_from_the_attentions_present_key(tmp_path):
    """The model returns its rotated keys (the KV cache): the file reads them from GroupQueryAttention's
    present_key instead of rotating k a second time, and the cache is eager's."""
    model = llama(use_cache=True)
    path = str(tmp_path / "llama.onnx")
    result = export_onnx(model, path, {"input_ids": torch.randint(1, 128, (2, 12))})
    assert f"{ROTARY}: 2" in onnx_applied(result.report), result.report
    assert onnx_ops(path)["Neg"] == 0
    outputs = {node.output[1] for node in onnx.load(path).graph.node if node.op_type == "GroupQueryAttention"}
    assert outputs <= {value.name for value in onnx.load(path).graph.output}  # both layers' keys
    assert_matches_eager(model, OnnxRuntimeModule(path, result.io), input_ids=torch.randint(1, 128, (2, 12)))


def test_a_nan_token_gives_eagers_nan_rows(tmp_path):
    model = llama()
    with torch.no_grad():
        model.embed_tokens.weight[7] = float("nan")  # token 7's rows are NaN from the first layer on
    path = str(tmp_path / "llama.onnx")
    result = export_onnx(model, path, {"input_ids": torch.randint(8, 128, (2, 12))})
    assert rotating_attentions(path) == 2
    ids = torch.randint(8, 128, (2, 12))
    ids[0, 3] = 7
    with torch.no_grad():
        expected = model(input_ids=ids)[0]
        actual = OnnxRuntimeModule(path, result.io)(input_ids=ids)[0]
    assert expected[0].isnan().any() and not expected[1].isnan().any()
    assert torch.equal(expected.isnan(), actual.isnan())
    torch.testing.assert_close(actual.nan_to_num(), expected.nan_to_num(), rtol=1e-4, atol=1e-4)


def test_the_nan_row_guard_reads_the_unrotated_query(tmp_path):
    """GroupQueryAttention answers a number in a query row holding a NaN; the guard that gives eager's NaN
    there now reads q before its rotation, and still finds exactly that row."""
    torch.manual_seed(0)
    model = RotaryCrossAttention().eval()
    path = str(tmp_path / "cross.onnx")
    result = export_onnx(model, path, (torch.randn(2, 8, 32), torch.randn(2, 8, 32)))
    assert f"{ROTARY}: 1" in onnx_applied(result.report), result.report
    assert onnx_ops(path)["IsNaN"] == 1 and onnx_ops(path)["Neg"] == 0
    x = torch.randn(2, 8, 32)
    x[1, 5, 3] = float("nan")
    memory = torch.randn(2, 8, 32)
    with torch.no_grad():
        expected, actual = model(x, memory), OnnxRuntimeModule(path)(x, memory)
    assert int(expected.isnan().all(-1).sum()) == 1
    assert torch.equal(expected.isnan(), actual.isnan())
    torch.testing.assert_close(actual.nan_to_num(), expected.nan_to_num(), rtol=1e-4, atol=1e-5)


def test_a_head_size_onnxruntime_cannot_rotate_keeps_the_rotations(tmp_path):
    model = llama(head=8)
    path = str(tmp_path / "llama.onnx")
    result = export_onnx(model, path, {"input_ids": torch.randint(1, 128, (1, 10))})
    reason = "head size 8 is not a multiple of 16 (GroupQueryAttention rotates only those)"
    assert sum(reason in line for line in onnx_refused(result.report)) == 2, result.report
    assert rotating_attentions(path) == 0 and onnx_ops(path)["com.microsoft:GroupQueryAttention"] == 2
    assert_matches_eager(model, OnnxRuntimeModule(path, result.io), input_ids=torch.randint(1, 128, (1, 10)))


# ------------------------------------------------------------------------------------------- IR-level rule

def _tables(length: int, head: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    angles = np.arange(length)[:, None] * (base ** (-np.arange(head // 2) / (head // 2)))[None]
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _feeds(length: int, head: int, heads: int, kv_heads: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal((1, n, length, head)).astype(np.float32)
            for name, n in (("q", heads), ("k", kv_heads), ("v", kv_heads))}


def _run(graph: ir.Graph, feeds: dict[str, np.ndarray]) -> np.ndarray:
    return run_graph(graph, feeds)[0]


def _refusal(graph: ir.Graph) -> str:
    done, refused = fuse_rotary_embeddings(graph, rotates=True)
    assert done == 0 and len(refused) == 1, (done, refused)
    return refused[0]


def _table_value(graph: ir.Graph, name: str) -> ir.Value:
    return next(value for value in graph.initializers.values() if value.name == name)


def test_tables_whose_halves_differ_are_refused():
    cos, sin = _tables(4, 16, 100.0)
    cos[:, 8:] = cos[:, 8:] * 0.5  # not cat(freqs, freqs): GroupQueryAttention would read only the first half
    assert "the cos table's second half is not its first" in _refusal(_rotary_attention_graph(cos, sin))


def test_a_table_that_broadcasts_over_the_sequence_is_refused():
    cos, sin = _tables(4, 16, 100.0)
    graph = _rotary_attention_graph(cos, sin)
    for name, table in (("cos", cos), ("sin", sin)):
        _table_value(graph, name).const_value = ir.tensor(table[:1][None, None])  # one row for every position
    assert "does not hold one row of 16 per position of the sequence (4)" in _refusal(graph)


def test_a_table_holding_nan_is_refused():
    cos, sin = _tables(4, 16, 100.0)
    sin[2, 3] = sin[2, 11] = np.nan
    assert "the sin table holds a NaN or an infinity" in _refusal(_rotary_attention_graph(cos, sin))


def test_a_table_from_a_graph_input_is_refused():
    """A table computed at run time must be seen to repeat its halves."""
    cos, sin = _tables(4, 16, 100.0)
    graph = _rotary_attention_graph(cos, sin)
    fed = ir.Value(name="fed_cos", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, 1, 4, 16]))
    graph.inputs.append(fed)
    old = _table_value(graph, "cos")
    for user, index in list(old.uses()):
        user.replace_input_with(index, fed)
    assert "computed at run time and not seen to be an elementwise function of cat(freqs, freqs)" in _refusal(graph)


def test_a_rotated_query_with_a_plain_key_is_refused():
    cos, sin = _tables(4, 16, 100.0)
    graph = _rotary_attention_graph(cos, sin)
    attention = next(node for node in graph if node.op_type == "GroupQueryAttention")
    value_flat = attention.inputs[2]  # v's Reshape(Transpose(v)), a key that is not rotated
    attention.replace_input_with(1, value_flat)
    assert _refusal(graph).endswith("only the query is rotated")


def test_a_runtime_that_does_not_rotate_changes_nothing():
    graph = _rotary_attention_graph(*_tables(4, 16, 100.0))
    done, refused = fuse_rotary_embeddings(graph, rotates=False)
    assert done == 0 and "does not rotate as eager does" in refused[0]
    assert all(node.attributes.get_int("do_rotary", 0) == 0 for node in graph)


@settings(max_examples=20, deadline=None)
@given(length=st.integers(1, 24), head=st.sampled_from([16, 32, 64]),
       heads=st.sampled_from([(2, 1), (4, 2), (2, 2), (4, 1)]), base=st.sampled_from([10.0, 1e4, 5e5]),
       seed=st.integers(0, 2**16))
def test_random_rotary_attentions_answer_as_before(length, head, heads, base, seed):
    cos, sin = _tables(length, head, base)
    feeds = _feeds(length, head, *heads, seed=seed)
    expected = _run(_rotary_attention_graph(cos, sin, *heads), feeds)
    graph = _rotary_attention_graph(cos, sin, *heads)
    assert fuse_rotary_embeddings(graph, rotates=True) == (1, [])
    np.testing.assert_allclose(_run(graph, feeds), expected, rtol=1e-4, atol=1e-5)
