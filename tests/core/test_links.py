"""The alpha-beta communication model (fxforge.core.links): ring formulas in NCCL's bus-bandwidth convention,
published link figures, fitting measured timings, and the link a group spanning nodes runs on (issue 52)."""

from __future__ import annotations

import math
import random

import pytest

from fxforge.core.links import (
    KINDS,
    PUBLISHED,
    Link,
    Timing,
    fit_alpha_beta,
    fit_link,
    link_for,
    ring_terms,
    spanning,
)

# 1 us per step, 1 GB/s: seconds are easy to compute by hand.
UNIT = Link("unit", alpha_s=1e-6, bandwidth_gbs=1.0, source="test")
N = 1_000_000  # bytes: 1 ms at 1 GB/s


@pytest.mark.parametrize(("kind", "expected"), [
    # 4 ranks: all-reduce 6 steps and 2*3/4*N bus bytes; all-gather/reduce-scatter/all-to-all 3 steps, 3/4*N;
    # broadcast/reduce 3 steps (pipelined chain), N; send 1 step, N.
    ("all_reduce", 6e-6 + 1.5e-3),
    ("all_gather", 3e-6 + 0.75e-3),
    ("reduce_scatter", 3e-6 + 0.75e-3),
    ("all_to_all", 3e-6 + 0.75e-3),
    ("broadcast", 3e-6 + 1e-3),
    ("reduce", 3e-6 + 1e-3),
    ("send", 1e-6 + 1e-3),
])
def test_formulas_by_hand(kind, expected):
    assert UNIT.seconds(kind, N, 4) == pytest.approx(expected, rel=1e-12)


def test_two_ranks_by_hand():
    # 2 ranks, 8 MB at 4 GB/s, 50 us: all-reduce 2 steps + 8 MB / 4 GB/s = 100 us + 2 ms.
    link = Link("lan", 5e-5, 4.0, "test")
    assert link.seconds("all_reduce", 8e6, 2) == pytest.approx(1e-4 + 2e-3)
    assert link.seconds("all_gather", 8e6, 2) == pytest.approx(5e-5 + 1e-3)
    assert ring_terms("all_reduce", 8e6, 2) == (2, 8e6)


def test_one_rank_costs_nothing():
    for kind in KINDS:
        assert UNIT.seconds(kind, 10**9, 1) == 0.0
        assert PUBLISHED["ethernet-25g"].seconds(kind, 10**9, 1) == 0.0
        assert ring_terms(kind, 10**9, 1) == (0, 0.0)


def test_monotone_in_bytes_and_ranks():
    for kind in KINDS:
        by_bytes = [UNIT.seconds(kind, n, 8) for n in (0, 1, 10**3, 10**6, 10**9)]
        assert by_bytes == sorted(by_bytes) and by_bytes[0] < by_bytes[-1]
        by_ranks = [UNIT.seconds(kind, 10**6, p) for p in (1, 2, 3, 4, 8, 64, 1024)]
        assert by_ranks == sorted(by_ranks)
    # Bus bytes per rank approach 2n (all-reduce) and n (all-gather), never more.
    assert ring_terms("all_reduce", 100, 10**6)[1] < 200 and ring_terms("all_gather", 100, 10**6)[1] < 100
    # A slower link is slower.
    assert PUBLISHED["ib-ndr-400"].seconds("all_reduce", 2**30, 8) > PUBLISHED["nvlink4-h100"].seconds("all_reduce", 2**30, 8)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="unknown collective 'allreduce'"):
        UNIT.seconds("allreduce", 10, 2)
    with pytest.raises(ValueError, match="ranks must be a whole number >= 1"):
        UNIT.seconds("all_reduce", 10, 0)
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        UNIT.seconds("all_reduce", -1, 2)
    with pytest.raises(ValueError, match="bandwidth > 0"):
        Link("bad", 1e-6, 0.0, "test")
    with pytest.raises(ValueError, match="alpha must be >= 0"):
        Link("bad", -1e-6, 1.0, "test")
    with pytest.raises(ValueError, match="unknown collective 'gather'"):
        Link("bad", 1e-6, 1.0, "test", by_kind=(("gather", 1e-6, 1.0),))


def test_per_kind_figures_override():
    link = Link("cpu", 1e-4, 2.0, "test", by_kind=(("reduce_scatter", 3e-4, 0.5),))
    assert link.seconds("reduce_scatter", N, 2) == pytest.approx(3e-4 + 0.5 * N / 0.5e9)
    assert link.seconds("all_gather", N, 2) == pytest.approx(1e-4 + 0.5 * N / 2e9)
    assert Link.from_dict(link.to_dict()) == link
    slower = link.derated(0.5, "test")
    assert slower.seconds("all_gather", N, 2) == pytest.approx(1e-4 + 0.5 * N / 1e9)
    assert slower.figures("reduce_scatter") == (3e-4, 0.25) and "x0.5: test" in slower.source


def test_published_figures_have_sources():
    expected = {"nvlink5-b200": 900.0, "nvlink4-h100": 450.0, "nvlink3-a100": 300.0, "ib-ndr-400": 50.0,
                "ib-hdr-200": 25.0, "pcie5-x16": 63.0, "pcie4-x16": 31.5, "ethernet-100g": 12.5, "ethernet-25g": 3.125}
    assert {name: link.bandwidth_gbs for name, link in PUBLISHED.items()} == expected
    for name, link in PUBLISHED.items():
        assert link.name == name
        assert link.source.startswith("published: ") and "each way" in link.source
        assert "estimate" in link.source  # the alphas are not data-sheet figures, and say so
        assert 1e-7 < link.alpha_s < 1e-4
    assert "900 GB/s per GPU bidirectional" in PUBLISHED["nvlink4-h100"].source
    assert "400 Gb/s" in PUBLISHED["ib-ndr-400"].source


def test_fit_recovers_the_model():
    truth = Link("truth", 1.5e-4, 0.8, "test")
    timings = [Timing(kind, n, 2, truth.seconds(kind, n, 2)) for kind in ("all_reduce", "all_gather")
               for n in (4096, 65536, 2**20, 2**24)]
    alpha, bandwidth = fit_alpha_beta(timings)
    assert alpha == pytest.approx(1.5e-4, rel=1e-9) and bandwidth == pytest.approx(0.8, rel=1e-9)
    # With 20% noise the relative-error fit stays close on every point.
    rng = random.Random(0)
    noisy = [Timing(t.kind, t.nbytes, 2, t.seconds * rng.uniform(0.8, 1.2)) for t in timings]
    link = fit_link(noisy, name="noisy", source="test")
    for t in noisy:
        assert 0.7 < link.seconds(t.kind, t.nbytes, 2) / t.seconds < 1.4
    assert [kind for kind, _, _ in link.by_kind] == ["all_gather", "all_reduce"]


def test_fit_keeps_alpha_non_negative_and_refuses_nonsense():
    # Pure bandwidth (times proportional to bytes, a little convex): alpha would come out negative.
    timings = [Timing("all_reduce", n, 2, n / 1e9 * (1 + n / 2**26)) for n in (2**20, 2**22, 2**24)]
    alpha, bandwidth = fit_alpha_beta(timings)
    assert alpha == 0.0 and 0.5 < bandwidth < 1.0
    with pytest.raises(ValueError, match="at least two timings"):
        fit_alpha_beta([Timing("all_reduce", 4096, 2, 1e-4), Timing("all_reduce", 4096, 1, 1e-4)])
    with pytest.raises(ValueError, match="do not grow with the bytes"):
        fit_alpha_beta([Timing("all_reduce", 0, 2, 1e-4), Timing("all_gather", 0, 2, 1e-4)])


def test_link_for_one_node_is_the_intra_link():
    nv, ib = PUBLISHED["nvlink4-h100"], PUBLISHED["ib-ndr-400"]
    assert link_for(8, 8, nv, ib) is nv
    assert link_for(2, 8, nv, ib, stride=4) is nv  # ranks r, r+4 for r < 4: one node
    assert link_for(1, 8, nv, ib, stride=64) is nv


def test_link_for_across_nodes_takes_the_slower_hop():
    nv, ib = PUBLISHED["nvlink4-h100"], PUBLISHED["ib-ndr-400"]
    # A DP group over TP=8 nodes: one member per node, every hop on the network.
    dp = link_for(16, 8, nv, ib, stride=8)
    assert (dp.alpha_s, dp.bandwidth_gbs) == (ib.alpha_s, ib.bandwidth_gbs)
    assert dp.seconds("all_reduce", 10**9, 16) == pytest.approx(30 * 5e-6 + 2 * 15 / 16 * 10**9 / 50e9)
    # 16 ranks filling 2 nodes: 8 cards per node carry the ring: min(450, 8 x 50) = 400 GB/s, latency the larger.
    flat = link_for(16, 8, nv, ib)
    assert (flat.alpha_s, flat.bandwidth_gbs) == (5e-6, 400.0)
    assert "ring across nodes, 8 of its ranks per node" in flat.source and ib.source in flat.source
    # 4 members per node (stride 2 on 8-GPU nodes): min(450, 4 x 50).
    assert link_for(8, 8, nv, ib, stride=2).bandwidth_gbs == 200.0
    # A slow intra link bounds it: PCIe 4 inside, 8 x IB NDR outside.
    assert spanning(PUBLISHED["pcie4-x16"], ib, 8).bandwidth_gbs == 31.5
    # Per-kind figures combine kind by kind.
    cpu = Link("cpu", 1e-4, 2.0, "test", by_kind=(("reduce_scatter", 3e-4, 0.5),))
    both = spanning(cpu, PUBLISHED["ethernet-25g"], 2)
    assert both.figures("reduce_scatter") == (3e-4, 0.5) and both.figures("all_gather") == (1e-4, 2.0)
    with pytest.raises(ValueError, match="ranks_per_node must be a whole number"):
        link_for(4, 0, nv, ib)


def test_time_scale_of_a_real_plan():
    # Sanity against the formulas' textbook form: a 7B model's fp32 gradients (28 GB) all-reduced over 8 H100s
    # on NVLink 4 at the data-sheet 450 GB/s take 2*7/8*28e9/450e9 s, about 109 ms.
    assert PUBLISHED["nvlink4-h100"].seconds("all_reduce", 28e9, 8) == pytest.approx(2 * 7 / 8 * 28e9 / 450e9 + 14 * 3e-6)
    assert math.isclose(PUBLISHED["nvlink4-h100"].seconds("all_reduce", 28e9, 8), 0.109, rel_tol=0.01)


def test_in_step_waits_are_a_line_through_the_measured_points():
    from fxforge.core.links import fit_sync

    truth = [(c, 4e-4 + 0.06 * c) for c in (0.0, 0.0015, 0.0056, 0.022)]
    a, b = fit_sync(truth)
    assert a == pytest.approx(4e-4) and b == pytest.approx(0.06)
    # noise below the barrier's time at short stretches: the fit stays >= 0 everywhere
    a, b = fit_sync([(0.0, 3e-4), (0.0015, -1e-4), (0.0056, 3e-4), (0.022, 2.4e-3)])
    assert a >= 0 and b > 0
    assert fit_sync([(0.001, 2e-3), (0.02, 1e-3)]) == (pytest.approx(1.5e-3), 0.0)   # falling: no fraction
    assert fit_sync([]) == (0.0, 0.0)


def test_in_step_waits_add_per_collective_and_with_the_compute():
    link = Link("x", 1e-4, 1.0, "made up", sync_s=5e-4, sync_fraction=0.05)
    assert link.synced(4, 0.1) == pytest.approx(4 * 5e-4 + 0.005)
    assert link.synced(0, 0.1) == 0.0
    assert Link("x", 1e-4, 1.0, "made up").synced(10, 1.0) == 0.0       # published links carry none
    with pytest.raises(ValueError, match="sync figures must be >= 0"):
        Link("x", 1e-4, 1.0, "made up", sync_fraction=-0.1)
    assert Link.from_dict({"name": "old", "alpha_s": 1e-4, "bandwidth_gbs": 1.0, "source": "v1 cache"}).sync_s == 0


def test_asynchronous_collectives_are_hidden_by_the_links_overlap_while_the_compute_lasts():
    hiding = Link("x", 1e-4, 1.0, "made up", overlap=0.8)
    # all within the compute: a fifth of each shows
    assert hiding.behind([0.002, 0.003], [0.001, 0.004], 0.05) == pytest.approx(0.2 * 0.005)
    # ready together: the second waits for the first, and what runs past the compute shows whole
    assert hiding.behind([0.004, 0.004], [0.009, 0.009], 0.010) == pytest.approx(0.2 * 0.001 + 0.003 + 0.004)
    # ready after the compute (a bucket of the first layer's gradients): whole
    assert hiding.behind([0.004], [0.010], 0.010) == pytest.approx(0.004)
    blocking = Link("x", 1e-4, 1.0, "made up")
    assert blocking.overlap == 0 and blocking.behind([0.002, 0.003], [0.0, 0.0], 1.0) == pytest.approx(0.005)
    assert Link("x", 1e-4, 1.0, "made up", overlap=1.0).behind([0.002], [0.0], 1.0) == 0.0
    with pytest.raises(ValueError, match=r"overlap must be in \[0, 1\]"):
        Link("x", 1e-4, 1.0, "made up", overlap=1.5)
    assert Link.from_dict(hiding.to_dict()) == hiding
    assert Link.from_dict({"name": "old", "alpha_s": 1e-4, "bandwidth_gbs": 1.0, "source": "v2 cache"}).overlap == 0
