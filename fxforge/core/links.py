"""Communication in the cost model: the alpha-beta (latency-bandwidth) time of a collective on a link.

A collective over ``p`` ranks on a ring is a number of *steps* (each one message from every rank to its
neighbour, costing the link's latency ``alpha``) that together put a number of *bus bytes* on each rank's
link (costing ``bytes / bandwidth``). For a tensor of ``n`` bytes (the full, unsharded tensor: what an
all-reduce reduces, what an all-gather produces, what a reduce-scatter takes in):

=================  ===========  ==================  ==============================================
kind               steps        bus bytes per rank  algorithm
=================  ===========  ==================  ==============================================
``all_reduce``     ``2(p-1)``   ``2(p-1)/p * n``    ring reduce-scatter, then ring all-gather
``all_gather``     ``p-1``      ``(p-1)/p * n``     ring: each rank forwards one ``n/p`` block a step
``reduce_scatter`` ``p-1``      ``(p-1)/p * n``     ring: the all-gather's pattern, reducing
``broadcast``      ``p-1``      ``n``               pipelined ring (chain): ``n`` in small chunks
``reduce``         ``p-1``      ``n``               pipelined ring towards the root
``all_to_all``     ``p-1``      ``(p-1)/p * n``     pairwise exchange: ``n/p`` to each other rank
``send``           ``1``        ``n``               point to point (``ranks`` only says whether any)
=================  ===========  ==================  ==============================================

``seconds = alpha * steps + bus_bytes / bandwidth``; one rank (``ranks == 1``) costs nothing. The step
counts and volumes are the ring algorithms' of Thakur, Rabenseifner & Gropp, "Optimization of Collective
Communication Operations in MPICH" (IJHPCA 19(1), 2005), whose all-reduce is ``2(p-1)·alpha + 2(p-1)/p·n·beta``.
The bus bytes are NCCL's *bus bandwidth* convention (nccl-tests, ``doc/PERFORMANCE.md``: ``busbw = algbw ·
2(n-1)/n`` for all-reduce, ``(n-1)/n`` for all-gather, reduce-scatter and all-to-all, ``1`` for broadcast,
reduce and send/receive), so a link's ``bandwidth_gbs`` is directly comparable to the ``busbw`` column
nccl-tests prints and to a hardware link's per-direction bandwidth. The broadcast is modelled as a pipelined
chain (the first chunk reaches the last rank after ``p-1`` latencies, then the whole tensor streams at the
link's bandwidth), which is how NCCL runs it; a binomial tree (``log2 p`` steps of ``n`` bytes each) would
be slower for large tensors. Tree, NVLS (in-switch reduction) and hierarchical algorithms that NCCL picks
for some sizes do better than the ring at a few nodes: the model is a ring's, on purpose conservative.

**Inside a training step** a blocking collective costs more than the same collective timed after a barrier:
each rank arrives when its own compute since the previous collective is done, and waits for the last one
(on a shared CPU machine the ranks' compute times vary by some percent; the communication threads and the
compute also share the cores). A measured link carries that too: :attr:`Link.sync_s` per collective and
:attr:`Link.sync_fraction` of the compute between collectives (:meth:`Link.synced`), fitted
(:func:`fit_sync`) on streams of collectives that each follow a stretch of compute on every rank. On this
machine's gloo at 2 ranks, a 64 KiB all-reduce took 0.3-0.5 ms after a barrier, and 0.6-7 ms each in streams
of them after 0-24 ms of compute. Published links carry none (0: the data sheets say nothing of it).

**An asynchronous collective** (DDP's bucket all-reduces, started as each bucket's gradients are ready and
waited for after the backward) runs while the ranks compute: a measured link carries the share of its time that
compute hides (:attr:`Link.overlap`, timed on all-reduces started just before a stretch of compute, against the
same compute alone), and :meth:`Link.behind` prices a step's asynchronous collectives from it and from when
each is ready. Published links carry 0 (priced as blocking: the data sheets say nothing of it either).

A :class:`Link` is measured (:func:`fxforge.runtime.link_measure.measured_link`) or taken from public
figures (:data:`PUBLISHED`, for planning a cluster on paper); :func:`link_for` picks the link a group of
ranks runs on when a node holds some of them (:func:`spanning`: the slowest hop's, see there).

Example:
    >>> link = Link("toy", alpha_s=1e-5, bandwidth_gbs=1.0, source="made up")
    >>> link.seconds("all_reduce", 10**9, 4)          # 6 steps of 10 us + 1.5 GB at 1 GB/s
    1.50006
    >>> link.seconds("all_gather", 10**9, 4), link.seconds("send", 10**6, 2), link.seconds("all_reduce", 10**9, 1)
    (0.75003, 0.00101, 0.0)
    >>> round(PUBLISHED["nvlink4-h100"].seconds("all_reduce", 2**30, 8) * 1e3, 2)   # 1 GiB over 8 H100s, ms
    4.22
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "send")
"""The collectives :meth:`Link.seconds` prices."""


def ring_terms(kind: str, nbytes: float, ranks: int) -> tuple[int, float]:
    """The ``(steps, bus bytes per rank)`` of one collective (the table in the module docstring).

    Args:
        kind: one of :data:`KINDS`.
        nbytes: the full tensor's bytes (all-gather: the gathered output; reduce-scatter: the input).
        ranks: the group's size; 1 moves nothing.

    Example:
        >>> ring_terms("all_reduce", 800, 4), ring_terms("reduce_scatter", 800, 4), ring_terms("broadcast", 800, 4)
        ((6, 1200.0), (3, 600.0), (3, 800.0))
        >>> ring_terms("all_reduce", 800, 1)
        (0, 0.0)
    """
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}: expected one of {', '.join(KINDS)}")
    if ranks < 1 or int(ranks) != ranks:
        raise ValueError(f"ranks must be a whole number >= 1, not {ranks!r}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, not {nbytes!r}")
    p = int(ranks)
    if p == 1:
        return 0, 0.0
    if kind == "all_reduce":
        return 2 * (p - 1), 2.0 * (p - 1) / p * nbytes
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return p - 1, (p - 1) / p * nbytes
    if kind in ("broadcast", "reduce"):
        return p - 1, float(nbytes)
    return 1, float(nbytes)  # send


@dataclasses.dataclass(frozen=True)
class Link:
    """An alpha-beta model of the links between ranks: a latency per ring step and a per-rank bus bandwidth.

    Attributes:
        name: what it is (``"nvlink4-h100"``, ``"gloo 2 ranks on host"``).
        alpha_s: seconds per message step (latency, software overhead included).
        bandwidth_gbs: per-rank bus bandwidth in GB/s (1e9 bytes), one direction: NCCL's ``busbw``.
        source: where the figures come from: ``"measured gloo 2 ranks on <host> at <time> ..."`` or
            ``"published: <citation>"``, saying which figures are a data sheet's and which are estimates.
        by_kind: figures for particular collectives, ``((kind, alpha_s, bandwidth_gbs), ...)``, used instead
            of ``alpha_s``/``bandwidth_gbs`` for those kinds (a measured link whose all-reduce, which also
            adds on the CPU, runs at another rate than its all-gather).
        sync_s, sync_fraction: what a blocking collective inside a step costs beyond :meth:`seconds`: seconds
            per collective, and a fraction of the compute each rank did since the one before
            (:meth:`synced`; 0 where not measured).
        overlap: the share of an asynchronous collective's time that the ranks' compute hides, when it runs
            while they compute (DDP's bucket all-reduces during the backward; :meth:`behind`): 1 hides it all,
            0 (where not measured) prices it as blocking.

    Example:
        >>> link = Link("lan", 5e-5, 1.0, "made up", by_kind=(("all_reduce", 1e-4, 0.5),))
        >>> link.figures("all_reduce"), link.figures("all_gather")
        ((0.0001, 0.5), (5e-05, 1.0))
    """

    name: str
    alpha_s: float
    bandwidth_gbs: float
    source: str
    by_kind: tuple[tuple[str, float, float], ...] = ()
    sync_s: float = 0.0
    sync_fraction: float = 0.0
    overlap: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.overlap <= 1:
            raise ValueError(f"link {self.name!r}: overlap must be in [0, 1], not {self.overlap!r}")
        if not (self.sync_s >= 0 and self.sync_fraction >= 0 and math.isfinite(self.sync_s + self.sync_fraction)):
            raise ValueError(f"link {self.name!r}: sync figures must be >= 0 (got {self.sync_s!r} s, "
                             f"{self.sync_fraction!r} of the compute)")
        for kind, alpha, bandwidth in ((None, self.alpha_s, self.bandwidth_gbs), *self.by_kind):
            if kind is not None and kind not in KINDS:
                raise ValueError(f"unknown collective {kind!r} in by_kind: expected one of {', '.join(KINDS)}")
            if not (alpha >= 0 and math.isfinite(alpha)) or not bandwidth > 0:
                raise ValueError(f"link {self.name!r}: alpha must be >= 0 and bandwidth > 0 "
                                 f"(got alpha {alpha!r} s, bandwidth {bandwidth!r} GB/s{f' for {kind}' if kind else ''})")

    def figures(self, kind: str) -> tuple[float, float]:
        """``(alpha_s, bandwidth_gbs)`` for ``kind``: its own figures in :attr:`by_kind`, else the link's."""
        for name, alpha, bandwidth in self.by_kind:
            if name == kind:
                return alpha, bandwidth
        return self.alpha_s, self.bandwidth_gbs

    def seconds(self, kind: str, nbytes: float, ranks: int) -> float:
        """The time of one ``kind`` collective on a ``nbytes`` tensor over ``ranks`` ranks on this link:
        ``alpha * steps + bus_bytes / bandwidth`` (:func:`ring_terms`; see the module docstring).

        Args:
            kind: one of :data:`KINDS`.
            nbytes: the full (unsharded) tensor's bytes: all-gather's output, reduce-scatter's input.
            ranks: the group's size (1: no communication, 0 seconds).

        Example:
            >>> Link("x", 1e-6, 10.0, "made up").seconds("reduce_scatter", 8e6, 8)    # 7 us + 0.7 ms
            0.000707
        """
        steps, bus_bytes = ring_terms(kind, nbytes, ranks)
        if steps == 0:
            return 0.0
        alpha, bandwidth = self.figures(kind)
        return alpha * steps + bus_bytes / (bandwidth * 1e9)

    def synced(self, collectives: int, compute_s: float) -> float:
        """The waits ``collectives`` blocking collectives add to a step whose ranks each compute ``compute_s``
        seconds between them: ``collectives * sync_s + sync_fraction * compute_s`` (none without a collective).

        Example:
            >>> round(Link("x", 1e-4, 1.0, "made up", sync_s=5e-4, sync_fraction=0.05).synced(10, 0.2) * 1e3, 6)
            15.0
            >>> Link("x", 1e-4, 1.0, "made up", sync_s=5e-4, sync_fraction=0.05).synced(0, 0.2)
            0.0
        """
        if collectives <= 0:
            return 0.0
        return collectives * self.sync_s + self.sync_fraction * compute_s

    def behind(self, durations: Iterable[float], ready_s: Iterable[float], window_s: float) -> float:
        """The seconds asynchronous collectives add to a step: each of ``durations`` (seconds on the link, in the
        order issued) starts when it is ready (``ready_s``, seconds into a stretch of compute ``window_s`` long)
        and the one before it is done; while the compute goes on, :attr:`overlap` of its time is hidden, the rest
        taken from the compute; what runs after the compute ends is waited for whole.

        Example:
            >>> link = Link("x", 1e-4, 1.0, "made up", overlap=0.75)
            >>> round(link.behind([0.004, 0.004], [0.002, 0.010], 0.012), 6)  # the second outlasts it by 2 ms
            0.0035
            >>> Link("x", 1e-4, 1.0, "made up").behind([0.004, 0.004], [0.002, 0.010], 0.012)  # blocking
            0.008
        """
        free, added = 0.0, 0.0
        for seconds, ready in zip(durations, ready_s):
            start = max(float(ready), free)
            free = start + float(seconds)
            during = max(0.0, min(free, window_s) - start)
            added += during * (1 - self.overlap) + (float(seconds) - during)
        return added

    def derated(self, fraction: float, why: str) -> Link:
        """The same link at ``fraction`` of its bandwidth (a data sheet's peak to what software reaches).

        Example:
            >>> PUBLISHED["ib-ndr-400"].derated(0.8, "NCCL reaches ~80% of line rate").bandwidth_gbs
            40.0
        """
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], not {fraction!r}")
        return dataclasses.replace(
            self, name=f"{self.name} x{fraction:g}", bandwidth_gbs=self.bandwidth_gbs * fraction,
            by_kind=tuple((k, a, b * fraction) for k, a, b in self.by_kind),
            source=f"{self.source}; bandwidth x{fraction:g}: {why}")

    def to_dict(self) -> dict[str, Any]:
        """Plain values (what a cache file stores); :meth:`from_dict` reads them back.

        Example:
            >>> link = Link("x", 1e-6, 10.0, "made up", (("send", 2e-6, 5.0),), sync_s=1e-4, sync_fraction=0.02,
            ...             overlap=0.5)
            >>> Link.from_dict(link.to_dict()) == link
            True
        """
        return {"name": self.name, "alpha_s": self.alpha_s, "bandwidth_gbs": self.bandwidth_gbs,
                "source": self.source, "by_kind": [list(entry) for entry in self.by_kind],
                "sync_s": self.sync_s, "sync_fraction": self.sync_fraction, "overlap": self.overlap}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Link:
        """The link :meth:`to_dict` wrote (raises ``KeyError``/``TypeError``/``ValueError`` on anything else)."""
        by_kind = tuple((str(k), float(a), float(b)) for k, a, b in data.get("by_kind", ()))
        return cls(str(data["name"]), float(data["alpha_s"]), float(data["bandwidth_gbs"]), str(data["source"]),
                   by_kind, float(data.get("sync_s", 0.0)), float(data.get("sync_fraction", 0.0)),
                   float(data.get("overlap", 0.0)))


@dataclasses.dataclass(frozen=True)
class Timing:
    """One measured collective: its kind, the full tensor's bytes, the group's size and the median seconds.

    Example:
        >>> Timing("all_reduce", 4096, 2, 1e-4).kind
        'all_reduce'
    """

    kind: str
    nbytes: int
    ranks: int
    seconds: float


def fit_alpha_beta(timings: Iterable[Timing]) -> tuple[float, float]:
    """``(alpha_s, bandwidth_gbs)`` that best predict ``timings`` on the ring model, by least squares on the
    *relative* error (each timing weighs the same, whether microseconds or seconds); alpha is kept >= 0.

    Raises:
        ValueError: fewer than two timings of more than one rank, or timings that do not grow with the bytes.

    Example:
        >>> truth = Link("t", 2e-5, 3.0, "")
        >>> ts = [Timing(k, n, 2, truth.seconds(k, n, 2)) for k in ("all_reduce", "all_gather") for n in (4096, 2**20)]
        >>> alpha, bandwidth = fit_alpha_beta(ts)
        >>> round(alpha * 1e6, 3), round(bandwidth, 3)
        (20.0, 3.0)
    """
    rows = []
    for t in timings:
        steps, bus_bytes = ring_terms(t.kind, t.nbytes, t.ranks)
        if steps and t.seconds > 0:
            rows.append((steps / t.seconds, bus_bytes / t.seconds))
    if len(rows) < 2:
        raise ValueError("fitting a link needs at least two timings of more than one rank")
    # Minimise sum((alpha * s + beta * b) / t - 1)^2: the normal equations of a 2x2 system.
    ss = sum(s * s for s, _ in rows)
    sb = sum(s * b for s, b in rows)
    bb = sum(b * b for _, b in rows)
    s1 = sum(s for s, _ in rows)
    b1 = sum(b for _, b in rows)
    det = ss * bb - sb * sb
    alpha, beta = ((s1 * bb - b1 * sb) / det, (ss * b1 - sb * s1) / det) if det > 0 else (-1.0, 0.0)
    if alpha < 0 or beta <= 0:  # the latency alone, or the bandwidth alone, explains the timings best
        alpha, beta = 0.0, (b1 / bb if bb > 0 else 0.0)
    if beta <= 0:
        raise ValueError("the timings do not grow with the bytes moved: no bandwidth can be fitted")
    return alpha, 1.0 / beta / 1e9


def fit_link(timings: Iterable[Timing], *, name: str, source: str) -> Link:
    """The :class:`Link` of ``timings``: one fit over all of them (:func:`fit_alpha_beta`), plus one per kind
    timed (in :attr:`Link.by_kind`) where that kind has timings of at least two sizes.

    Example:
        >>> slow_reduce = Link("t", 1e-5, 2.0, "", (("all_reduce", 3e-5, 1.0),))
        >>> ts = [Timing(k, n, 2, slow_reduce.seconds(k, n, 2)) for k in ("all_reduce", "all_gather") for n in (4096, 2**22)]
        >>> link = fit_link(ts, name="fitted", source="doctest")
        >>> [(k, round(a * 1e6, 2), round(b, 2)) for k, a, b in link.by_kind]
        [('all_gather', 10.0, 2.0), ('all_reduce', 30.0, 1.0)]
    """
    timings = list(timings)
    alpha, bandwidth = fit_alpha_beta(timings)
    by_kind = []
    for kind in sorted({t.kind for t in timings}):
        mine = [t for t in timings if t.kind == kind]
        if len({t.nbytes for t in mine}) >= 2:
            by_kind.append((kind, *fit_alpha_beta(mine)))
    return Link(name, alpha, bandwidth, source, tuple(by_kind))


def fit_sync(points: Iterable[tuple[float, float]]) -> tuple[float, float]:
    """``(sync_s, sync_fraction)``: the line ``extra = sync_s + sync_fraction * compute`` through measured
    ``(compute seconds before a collective, its extra seconds over the link's own time of it)`` points, by
    least squares, both kept >= 0 (noise can put a point below the link's time).

    Example:
        >>> a, b = fit_sync([(0.001, 0.0006), (0.004, 0.0009), (0.016, 0.0021)])
        >>> round(a * 1e3, 3), round(b, 3)
        (0.5, 0.1)
        >>> fit_sync([(0.001, -0.001), (0.004, -0.002)])
        (0.0, 0.0)
    """
    points = [(float(x), float(y)) for x, y in points]
    if not points:
        return 0.0, 0.0
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx > 0 else 0.0
    if slope < 0:
        slope = 0.0
    intercept = my - slope * mx
    if intercept < 0:  # through the origin instead
        intercept = 0.0
        xx = sum(x * x for x, _ in points)
        slope = max(0.0, sum(x * y for x, y in points) / xx) if xx > 0 else 0.0
    return intercept, slope


def _published(name: str, alpha_s: float, bandwidth_gbs: float, citation: str) -> Link:
    return Link(name, alpha_s, bandwidth_gbs, f"published: {citation}")


_ALPHA_NOTE = "alpha {us} us per step is an estimate of NCCL's per-hop latency on such links, not a data-sheet figure"
PUBLISHED: dict[str, Link] = {link.name: link for link in (
    _published("nvlink5-b200", 3e-6, 900.0,
               "NVIDIA B200 / HGX B200 data sheet: fifth-generation NVLink, 1.8 TB/s per GPU bidirectional, i.e. "
               "900 GB/s each way (peak; NCCL's busbw is lower); " + _ALPHA_NOTE.format(us=3)),
    _published("nvlink4-h100", 3e-6, 450.0,
               "NVIDIA H100 Tensor Core GPU data sheet (SXM5): fourth-generation NVLink, 18 links, 900 GB/s per GPU "
               "bidirectional, i.e. 450 GB/s each way (peak; NCCL's all-reduce busbw on 8 GPUs reaches less); "
               + _ALPHA_NOTE.format(us=3)),
    _published("nvlink3-a100", 3e-6, 300.0,
               "NVIDIA A100 Tensor Core GPU data sheet (SXM4): third-generation NVLink, 12 links, 600 GB/s per GPU "
               "bidirectional, i.e. 300 GB/s each way (peak); " + _ALPHA_NOTE.format(us=3)),
    _published("ib-ndr-400", 5e-6, 50.0,
               "InfiniBand NDR, 400 Gb/s per port (NVIDIA ConnectX-7; DGX H100 has one per GPU): 50 GB/s each way "
               "per GPU (line rate); " + _ALPHA_NOTE.format(us=5)),
    _published("ib-hdr-200", 5e-6, 25.0,
               "InfiniBand HDR, 200 Gb/s per port (NVIDIA ConnectX-6; DGX A100 has one per GPU): 25 GB/s each way "
               "per GPU (line rate); " + _ALPHA_NOTE.format(us=5)),
    _published("pcie5-x16", 5e-6, 63.0,
               "PCI Express 5.0 x16 (PCI-SIG): 32 GT/s x 16 lanes, 128b/130b encoding, 63 GB/s each way (peak; "
               "GPU to GPU through the host bridge reaches less); " + _ALPHA_NOTE.format(us=5)),
    _published("pcie4-x16", 5e-6, 31.5,
               "PCI Express 4.0 x16 (PCI-SIG): 16 GT/s x 16 lanes, 128b/130b encoding, 31.5 GB/s each way (peak); "
               + _ALPHA_NOTE.format(us=5)),
    _published("ethernet-100g", 2.5e-5, 12.5,
               "100 Gigabit Ethernet (IEEE 802.3): 12.5 GB/s each way (line rate; TCP sockets reach less); "
               + _ALPHA_NOTE.format(us=25) + " (TCP)"),
    _published("ethernet-25g", 2.5e-5, 3.125,
               "25 Gigabit Ethernet (IEEE 802.3by): 3.125 GB/s each way (line rate); "
               + _ALPHA_NOTE.format(us=25) + " (TCP)"),
)}
"""Links from public figures, by name, for planning clusters on paper: bandwidths are data-sheet peaks per
direction per GPU (what the ``source`` says); use :meth:`Link.derated` for what software reaches."""


def spanning(intra: Link, inter: Link, ranks_per_node_in_group: int) -> Link:
    """The link of a ring whose ranks sit ``ranks_per_node_in_group`` to a node, nodes joined by ``inter``.

    The rule: a ring is as fast as its slowest hop. Each step's latency is the larger of the two alphas.
    For the bandwidth, NCCL builds one ring (channel) per network card on multi-card nodes, so the ``k``
    group members on a node send the node's outgoing share through ``k`` cards between them: per rank the
    bus bandwidth is ``min(intra, k * inter)`` (``inter`` per card, one card per GPU, as on DGX/HGX nodes).
    With ``k = 1`` every hop crosses the network: ``inter``'s figures alone. Per-kind figures (:attr:`Link.by_kind`) are combined the same way, kind by
    kind. At a few nodes NCCL's tree and NVLS algorithms beat the ring, so this is conservative there.

    Example:
        >>> one_per_node = spanning(PUBLISHED["nvlink4-h100"], PUBLISHED["ib-ndr-400"], 1)
        >>> one_per_node.bandwidth_gbs, one_per_node.alpha_s
        (50.0, 5e-06)
        >>> spanning(PUBLISHED["nvlink4-h100"], PUBLISHED["ib-ndr-400"], 8).bandwidth_gbs
        400.0
    """
    k = max(1, int(ranks_per_node_in_group))

    def combine(kind: str | None) -> tuple[float, float]:
        (a1, b1), (a2, b2) = ((link.figures(kind) if kind else (link.alpha_s, link.bandwidth_gbs))
                              for link in (intra, inter))
        if k == 1:  # one rank per node: every hop is a network hop
            return a2, b2
        return max(a1, a2), min(b1, k * b2)

    alpha, bandwidth = combine(None)
    kinds = sorted({kind for kind, _, _ in (*intra.by_kind, *inter.by_kind)})
    return Link(f"{intra.name} x{k} + {inter.name}", alpha, bandwidth,
                f"ring across nodes, {k} of its ranks per node: the slower hop's figures "
                f"(latency max, bandwidth min(intra, {k} x inter)); intra: {intra.source}; inter: {inter.source}",
                tuple((kind, *combine(kind)) for kind in kinds))


def link_for(group_ranks: int, ranks_per_node: int, intra: Link, inter: Link, *, stride: int = 1) -> Link:
    """The link a collective over a group of ``group_ranks`` ranks runs on, with ``ranks_per_node`` ranks to a
    node: ``intra`` when the whole group sits in one node, else :func:`spanning` (the slower hop's figures).

    Ranks are numbered node by node (``0 .. ranks_per_node-1`` on the first); a group is a device-mesh
    dimension whose members are ``stride`` apart (``stride``: the product of the mesh's inner dimensions,
    e.g. a data-parallel group over TP=8 has stride 8). Such a group fits in a node when
    ``group_ranks * stride <= ranks_per_node`` (or it is one rank); otherwise ``max(1, ranks_per_node // stride)`` of its members
    share each node.

    Example:
        >>> nv, ib = PUBLISHED["nvlink4-h100"], PUBLISHED["ib-ndr-400"]
        >>> link_for(8, 8, nv, ib).name                   # TP over one 8-GPU node
        'nvlink4-h100'
        >>> link_for(4, 8, nv, ib, stride=8).bandwidth_gbs    # DP over 4 nodes, one GPU of each
        50.0
        >>> link_for(16, 8, nv, ib).bandwidth_gbs         # 16 ranks over 2 nodes: 8 NICs per node
        400.0
    """
    for label, value in (("group_ranks", group_ranks), ("ranks_per_node", ranks_per_node), ("stride", stride)):
        if value < 1 or int(value) != value:
            raise ValueError(f"{label} must be a whole number >= 1, not {value!r}")
    if group_ranks == 1 or group_ranks * stride <= ranks_per_node:
        return intra
    return spanning(intra, inter, max(1, ranks_per_node // stride))
