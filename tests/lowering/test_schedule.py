"""Independent branches and the order that runs them together (fxforge.lowering.schedule)."""

import torch
import torch.nn.functional as F
from torch import nn

from examples.models.branchy import BRANCHY
from fxforge.lowering.schedule import Region, grouped, independent_branches, schedule


class Inception(nn.Module):
    """Four branches of different depth from one input, concatenated."""

    def __init__(self, c=8):
        super().__init__()
        self.a = nn.Conv2d(c, c, 1)
        self.b1, self.b2 = nn.Conv2d(c, c, 1), nn.Conv2d(c, c, 3, padding=1)
        self.c1, self.c2, self.c3 = nn.Conv2d(c, c, 1), nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=1)
        self.d = nn.Conv2d(c, c, 1)

    def forward(self, x):
        a = self.a(x)
        b = self.b2(F.relu(self.b1(x)))
        c = self.c3(self.c2(self.c1(x)))
        d = self.d(F.max_pool2d(x, 3, 1, 1))
        return torch.cat([a, b, c, d], 1)


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        return F.relu(x + self.conv2(F.relu(self.conv1(x))))


class Attention(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        q, k, v = self.q(x).view(2, 3, 4, 4), self.k(x).view(2, 3, 4, 4), self.v(x).view(2, 3, 4, 4)
        weights = (q @ k.transpose(-1, -2)).softmax(-1)
        return self.o((weights @ v).reshape(2, 3, 16))


def names(region: Region) -> list[list[str]]:
    return region.names()


def test_inception_block_has_four_branches_from_its_input():
    gm = torch.fx.symbolic_trace(Inception().eval())
    (region,) = independent_branches(gm)
    assert region.fork.name == "x"
    assert sorted(names(region)) == sorted([["a"], ["b1", "relu", "b2"], ["c1", "c2", "c3"], ["max_pool2d", "d"]])
    assert next(n.name for n in region.inputs(1)) == "x"
    assert [n.name for b in range(4) for n in region.outputs(b)] == ["a", "b2", "c3", "d"]


def test_a_residual_block_is_a_chain_not_a_region():
    # x feeds conv1 and the add; the add also reads conv2: only one branch (conv1 -> conv2) descends from x alone
    assert independent_branches(torch.fx.symbolic_trace(Residual().eval())) == []


def test_attention_projections_are_three_branches_until_they_meet():
    (region,) = independent_branches(torch.fx.symbolic_trace(Attention().eval()))
    assert sorted(b[0] for b in names(region)) == ["k", "q", "v"]
    assert all(len(b) >= 2 for b in names(region))  # each projection with its view (k with its transpose)
    assert not any("matmul" in n for b in names(region) for n in b)


def test_effectful_nodes_never_join_a_branch_and_keep_their_side():
    class Mutating(nn.Module):
        def forward(self, x):
            a = x.sin()
            b = x.cos()
            a.add_(1)          # in-place on branch a's value: a's readers must see it
            return a * 2 + b.exp()

    gm = torch.fx.symbolic_trace(Mutating())
    for region in independent_branches(gm):
        assert "add_" not in [n for b in names(region) for n in b]
    steps = schedule(independent_branches(gm), gm.graph, [n for n in gm.graph.nodes if n.name == "add_"])
    assert steps is None or _valid(steps, gm.graph)
    x = torch.randn(3)
    assert torch.equal(gm(x), Mutating()(x))


def test_random_ops_are_not_branches():
    class Noisy(nn.Module):
        def forward(self, x):
            return F.dropout(x.sin(), 0.5, training=True) + torch.rand_like(x.cos())

    region_nodes = [n for r in independent_branches(torch.fx.symbolic_trace(Noisy())) for b in names(r) for n in b]
    assert "dropout" not in region_nodes and "rand_like" not in region_nodes


def _valid(steps, graph) -> bool:
    done = set()
    for step in steps:
        nodes = [step] if isinstance(step, torch.fx.Node) else sorted(step[0].nodes(), key=list(graph.nodes).index)
        inside = set(nodes)
        for node in nodes:
            if any(source not in done and source not in inside for source in node.all_input_nodes):
                return False
        done |= inside
    return len(done) == len(graph.nodes)


def test_schedule_is_a_valid_order_on_every_branchy_model():
    for name, factory in BRANCHY.items():
        if name == "synthetic_2000":
            continue
        model, _args = factory()
        gm = torch.fx.symbolic_trace(model.eval())
        regions = independent_branches(gm)
        steps = schedule(regions, gm.graph)
        assert steps is not None and _valid(steps, gm.graph), name
        claimed = [n for r in regions for n in r.nodes()]
        assert len(claimed) == len(set(claimed)), name  # no node in two regions


def test_randomly_wired_networks_have_regions():
    model, _ = BRANCHY["randwire_n16"]()
    assert len(independent_branches(torch.fx.symbolic_trace(model.eval()))) >= 2


def test_modules_in_training_mode_are_opaque_to_the_schedule():
    # a module in training mode may draw random numbers or update statistics: it is never moved
    assert independent_branches(torch.fx.symbolic_trace(Inception().train())) == []


def test_grouped_balances_and_puts_the_critical_path_first():
    assert grouped([1.0, 9.0, 2.0, 3.0], 2) == [[1], [0, 2, 3]]
    assert grouped([4.0, 4.0, 4.0], 4) == [[0], [1], [2]]
    assert grouped([1.0, 2.0], 1) == [[0, 1]]


def test_a_graph_of_two_thousand_nodes_is_scheduled_in_a_fraction_of_its_capture():
    import time

    from examples.models.branchy import synthetic_2000

    model, _ = synthetic_2000()
    gm = torch.fx.symbolic_trace(model.eval())
    start = time.perf_counter()
    regions = independent_branches(gm)
    seconds = time.perf_counter() - start
    assert len(regions) > 10 and _valid(schedule(regions, gm.graph), gm.graph)
    assert seconds < 5.0, seconds  # 0.26 s here; the scan stops where the fork's branches all met


class TwoTowerRetrieval(nn.Module):
    """CLIP-style: an image tower and a text tower that meet only in the similarity."""

    def __init__(self):
        super().__init__()
        self.image = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 16))
        self.embed = nn.Embedding(50, 16)
        self.text = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))

    def forward(self, pixels, ids, mask):
        text = (self.text(self.embed(ids)) * mask.unsqueeze(-1)).sum(1)
        return self.image(pixels) @ text.t()


def test_towers_that_read_inputs_of_their_own_are_one_region():
    gm = torch.fx.symbolic_trace(TwoTowerRetrieval().eval())
    regions = independent_branches(gm)
    inputs = [r for r in regions if r.fork is None]
    assert len(inputs) == 1 and inputs[0].label == "the inputs"
    image, text = sorted(inputs[0].names(), key=len)
    assert image[0] == "image_0" and "matmul" not in image + text
    assert "embed" in text and "mul" in text  # the mask joins the text tower (ids and mask are read together)
    assert _valid(schedule(regions, gm.graph), gm.graph)
