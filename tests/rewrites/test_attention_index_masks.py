"""The causal proof for symbolic sizes (fxforge.rewrites.attention.index_masks): masks built from index ranges
are read as formulas over positions, on shape-generic exported graphs and on traced ones; a mask is causal
only when it keeps exactly ``key <= query`` for every size."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.export import Dim

from fxforge.core.shapes import annotate
from fxforge.rewrites.attention.index_masks import causal_for_every_size, read_mask

NEG = float("-inf")


def _positions(q):
    """key index [1, S] and query index [S, 1] of q [B, S, E]."""
    idx = torch.arange(q.shape[1], device=q.device)
    return idx[None, :], idx[:, None]


def _packed(q, step: int = 1, diff_dim: int = -1):
    """transformers' packed-sequence causal mask, built when a decoder gets no attention mask: positions that
    do not step by 1 start a new sequence, a key is kept within its query's sequence and at or before it."""
    length = q.shape[1]
    pos = torch.arange(length)[None, :] * step  # position ids [1, S]
    seq = torch.cumsum(torch.diff(pos, dim=diff_dim, prepend=pos[:, :1] - 1) != 1, -1)
    b, qi, kv = torch.arange(1)[:, None, None], torch.arange(length)[None, :, None], torch.arange(length)[None, None, :]
    return ((seq[b, qi] == seq[b, kv]) & (pos[b, kv] <= pos[b, qi])).view(length, length)


MASKS = {  # name -> (mask builder on q [B, S, E], causal for every size)
    "key_le_query": (lambda q, k, i: k <= i, True),
    "query_ge_key": (lambda q, k, i: i >= k, True),
    "key_lt_query_plus_one": (lambda q, k, i: k < i + 1, True),
    "not_key_gt_query": (lambda q, k, i: ~(k > i), True),
    "additive_where": (lambda q, k, i: torch.where(k <= i, 0.0, NEG), True),
    "masked_fill_of_zeros": (lambda q, k, i: torch.zeros(q.shape[1], q.shape[1]).masked_fill(k > i, -1e9), True),
    "strict": (lambda q, k, i: k < i, False),
    "one_ahead": (lambda q, k, i: k <= i + 1, False),
    "sliding_window": (lambda q, k, i: (k <= i) & (i - k < 3), False),
    "upper": (lambda q, k, i: k >= i, False),
    "fill_too_small": (lambda q, k, i: torch.where(k <= i, 0.0, -5.0), False),
    "packed_one_sequence": (lambda q, k, i: _packed(q), True),  # positions step by 1: one sequence
    "packed_every_position": (lambda q, k, i: _packed(q, step=2), False),  # each position its own sequence
    "packed_diff_dim_counted_from_the_left": (lambda q, k, i: _packed(q, diff_dim=1), True),
}


class Scores(nn.Module):
    def __init__(self, build):
        super().__init__()
        self.build = build

    def forward(self, q):
        key, query = _positions(q)
        return q @ q.mT, self.build(q, key, query)


def _exported(build) -> torch.fx.GraphModule:
    q = torch.randn(2, 6, 4)
    program = torch.export.export(Scores(build), (q,), dynamic_shapes=({1: Dim("seq", min=2, max=512)},))
    return program.module()


@pytest.mark.parametrize("name", list(MASKS))
def test_masks_from_index_ranges_are_read_for_every_size(name):
    build, causal = MASKS[name]
    gm = _exported(build)
    scores, mask = _outputs(gm)
    assert isinstance(scores.meta["val"].shape[-1], torch.SymInt)  # the proof is about a symbolic S
    assert causal_for_every_size([mask], scores) is causal
    # the verdict agrees with the mask's values at sizes other than the example's (a fill of -5 hides nothing)
    for s in (5, 7, 12):
        _, value = Scores(build)(torch.randn(2, s, 4))
        keep = value if value.dtype == torch.bool else value == 0
        tril = torch.equal(keep, torch.ones(s, s, dtype=torch.bool).tril())
        assert tril is (causal or name == "fill_too_small")


def _outputs(gm):
    out = gm.graph.output_node().args[0]
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    scores = next(n for n in nodes if "matmul" in str(n.target) or "bmm" in str(n.target))
    # the mask: the last value the output reaches that is not the scores (a flat output after export)
    flat = [a for a in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(a, torch.fx.Node)]
    mask = next(a for a in flat if a is not scores and "matmul" not in str(a.target))
    return scores, mask


def test_a_key_offset_by_a_symbolic_length_is_not_causal():
    # keys [past + S] against queries [S]: kv_idx <= q_idx + past is causal only for past = 0
    class Cached(nn.Module):
        def forward(self, q, past):
            s, p = q.shape[1], past.shape[1]
            key, query = torch.arange(s + p)[None, :], torch.arange(s)[:, None] + p
            return q @ torch.cat([past, q], 1).mT, key <= query

    q, past = torch.randn(2, 4, 8), torch.randn(2, 3, 8)
    program = torch.export.export(Cached(), (q, past), dynamic_shapes=(
        {1: Dim("seq", min=2, max=64)}, {1: Dim("past", min=2, max=64)}))
    gm = program.module()
    scores, mask = _outputs(gm)
    assert read_mask(mask) is not None  # read, with the symbolic offset
    assert not causal_for_every_size([mask], scores)


def test_traced_graphs_read_too():
    gm = torch.fx.symbolic_trace(Scores(lambda q, k, i: torch.where(k <= i, 0.0, NEG)))
    annotate(gm, (torch.randn(2, 5, 4),), {})
    scores, mask = _outputs(gm)
    assert causal_for_every_size([mask], scores)


def test_a_causal_bool_added_to_the_scores_is_no_causal_mask():
    # scores + (kv_idx <= q_idx) adds 1 to the kept keys and hides nothing: in a shape-generic plan it was taken
    # for a causal mask (and the pass rolled back by verification); it is a 0/1 float mask
    import fxforge

    class Added(nn.Module):
        def forward(self, q, k, v):
            index = torch.arange(q.shape[-2])
            return (q @ k.mT + (index[None, :] <= index[:, None])).softmax(-1) @ v

    q = torch.randn(2, 2, 6, 8)
    opt = fxforge.optimize(Added(), (q, q, q), dynamic=True)
    (what,) = [m.what for m in opt.report.matches if m.rule == "attention"]
    assert "is_causal" not in what and "attn_mask=<float>" in what and not opt.report.rolled_back
    x = torch.randn(2, 2, 9, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x, x, x), Added()(x, x, x), rtol=1e-5, atol=1e-5)


ALWAYS = {  # name -> (mask builder, true at every position for every size)
    "query_ge_zero": (lambda q, k, i: i >= 0, True),  # transformers spreading a padding mask over the queries
    "key_plus_one_gt_zero": (lambda q, k, i: k + 1 > 0, True),
    "ones_and_query_ge_zero": (lambda q, k, i: q.new_ones((), dtype=torch.bool) & (i >= 0), True),
    "query_gt_zero": (lambda q, k, i: i > 0, False),  # false in the first row
    "key_le_query": (lambda q, k, i: k <= i, False),
    "zero_ge_query": (lambda q, k, i: 0 >= i, False),
}


@pytest.mark.parametrize("name", list(ALWAYS))
def test_conditions_true_everywhere_are_proven_for_every_size(name):
    from fxforge.rewrites.attention.index_masks import Keep, holds_everywhere

    build, always = ALWAYS[name]
    _, mask = _outputs(_exported(build))
    keep = read_mask(mask)
    assert isinstance(keep, Keep) and holds_everywhere(keep) is always
    for s in (2, 5, 9):  # the verdict agrees with the values
        _, value = Scores(build)(torch.randn(2, s, 4))
        assert bool(value.all()) is always


def test_a_padding_mask_of_a_shape_generic_bert_reaches_sdpa_without_an_s_by_s_tensor():
    transformers = pytest.importorskip("transformers")
    import fxforge

    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                     intermediate_size=64, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    ids, mask = torch.randint(1, 100, (2, 12)), torch.ones(2, 12, dtype=torch.long)
    mask[1, 7:] = 0
    opt = fxforge.optimize(model, {"input_ids": ids, "attention_mask": mask}, dynamic=True)
    sdpa = [n for n in opt.cache.last.captured.graph_module.graph.nodes if "scaled_dot_product" in str(n.target)]
    attn_mask = sdpa[0].kwargs["attn_mask"].meta["val"]
    assert attn_mask.shape[-2] == 1 and isinstance(attn_mask.shape[-1], torch.SymInt)  # [B, 1, 1, S]
    assert len(sdpa) == 3 and len({n.kwargs["attn_mask"] for n in sdpa}) == 1  # narrowed once, for every layer
    with torch.no_grad():
        ids, mask = torch.randint(1, 100, (3, 20)), torch.ones(3, 20, dtype=torch.long)
        mask[0, 5:] = 0
        valid = mask.bool()
        torch.testing.assert_close(opt(input_ids=ids, attention_mask=mask)[0][valid],
                                   model(input_ids=ids, attention_mask=mask)[0][valid], rtol=1e-4, atol=1e-5)
