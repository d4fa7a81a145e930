"""A GPU cluster described on paper: how many GPUs, how many to a node, each one's bf16 peak and memory,
and the links inside a node and between nodes, each figure with where it comes from.

:func:`fxforge.parallelize` takes one as ``cluster=`` to plan a model (usually built on the meta device)
for a machine that is not here (:mod:`fxforge.parallel.paper`): compute from the step's FLOPs at
:attr:`Cluster.efficiency` of the peak, each collective on the link its group spans
(:meth:`Cluster.group_link`), memory against :attr:`Cluster.memory_gib`.

Example:
    >>> h100 = PUBLISHED_CLUSTERS["h100-sxm-8x"].scaled(64)
    >>> h100.gpus, h100.nodes, h100.peak_tflops
    (64, 8, 989.4)
    >>> h100.group_link(8, stride=1).name == h100.intra.name     # TP over one node: NVLink
    True
    >>> round(h100.group_link(8, stride=8).bandwidth_gbs, 1)      # FSDP over 8 nodes, one GPU each: IB
    40.0
"""

from __future__ import annotations

import dataclasses

from fxforge.core.links import PUBLISHED, Link, link_for

_NCCL_REACH = ("NCCL's ring reaches about 80% of a link's peak (nccl-tests busbw); an estimate, "
               "not a data-sheet figure")


@dataclasses.dataclass(frozen=True)
class Cluster:
    """GPUs joined by links, as a data sheet gives them.

    Attributes:
        gpus: how many GPUs the cluster has.
        gpus_per_node: GPUs joined by ``intra`` (NVLink) in one node.
        peak_tflops: one GPU's dense bf16 tensor-core peak, TFLOP/s (no sparsity).
        memory_gib: one GPU's memory, GiB.
        intra: the link between GPUs of a node; ``inter``: between nodes (per GPU: one NIC each).
        name: what it is; ``source``: where the figures come from.
        efficiency: the fraction of ``peak_tflops`` the step's kernels are assumed to sustain (an
            assumption, not a measurement: ``efficiency_source`` says what it rests on).
        hbm_tbs: one GPU's memory bandwidth, TB/s (prices the optimizer's step, which is memory bound).
    """

    gpus: int
    gpus_per_node: int
    peak_tflops: float
    memory_gib: float
    intra: Link
    inter: Link
    name: str
    source: str
    efficiency: float = 0.4
    efficiency_source: str = "assumed"
    hbm_tbs: float = 2.0

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(f"cluster {self.name!r}: gpus and gpus_per_node must be >= 1")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"cluster {self.name!r}: efficiency must be in (0, 1], not {self.efficiency!r}")

    @property
    def nodes(self) -> int:
        """Nodes the GPUs fill (the last may be partly used)."""
        return -(-self.gpus // self.gpus_per_node)

    @property
    def peak_flops(self) -> float:
        """One GPU's dense bf16 peak, FLOP/s."""
        return self.peak_tflops * 1e12

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2**30)

    def scaled(self, gpus: int, efficiency: float | None = None) -> Cluster:
        """The same cluster with ``gpus`` GPUs (and, if given, another assumed ``efficiency``).

        Example:
            >>> PUBLISHED_CLUSTERS["a100-sxm-8x"].scaled(1024).nodes
            128
        """
        changes = {"gpus": gpus, "name": f"{self.name.split(' x')[0]} x{gpus}"}
        if efficiency is not None:
            changes.update(efficiency=efficiency, efficiency_source=f"{efficiency:g} given")
        return dataclasses.replace(self, **changes)

    def group_link(self, ranks: int, stride: int) -> Link:
        """The link a collective over ``ranks`` GPUs ``stride`` apart runs on (ranks numbered node by node:
        a mesh's inner axes first), :func:`~fxforge.core.links.link_for`."""
        return link_for(ranks, self.gpus_per_node, self.intra, self.inter, stride=stride)

    def describe(self) -> str:
        """One line: the GPUs, the links and the assumed efficiency, with sources."""
        return (f"{self.name}: {self.gpus} GPUs, {self.gpus_per_node} per node, {self.peak_tflops:g} TFLOP/s bf16 "
                f"dense, {self.memory_gib:g} GiB each ({self.source}); intra {self.intra.name}, inter "
                f"{self.inter.name}; compute at {self.efficiency:.0%} of peak ({self.efficiency_source})")


_H100_EFFICIENCY = (
    "torchtitan measures 33% to 39% MFU for Llama 3.1 8B under FSDP on 8 and 128 H100s in bf16 (selective "
    "activation checkpointing; benchmarks/llama3_h100_202412_torchtitan.md, pytorch/torchtitan, on 500 W "
    "HBM2e H100s whose peak lies below the SXM figure); 0.40 of the SXM peak is taken as the rate of the step's "
    "kernels, recomputation included")
_A100_EFFICIENCY = (
    "torchtitan reports 56.8% to 58.2% MFU for Llama 3 8B and 51.7% for 70B under FSDP on 64 A100s "
    "(docs/performance.md at pytorch/torchtitan 9dec370); 0.55 of the peak is taken as the rate of the step's "
    "kernels")

PUBLISHED_CLUSTERS: dict[str, Cluster] = {c.name: c for c in (
    Cluster(8, 8, 989.4, 79.6, PUBLISHED["nvlink4-h100"].derated(0.8, _NCCL_REACH),
            PUBLISHED["ib-ndr-400"].derated(0.8, _NCCL_REACH), "h100-sxm-8x",
            "NVIDIA H100 Tensor Core GPU data sheet (SXM5): BF16 tensor core 1,979 TFLOPS with sparsity, i.e. "
            "989.4 dense; 80 GB HBM3 (nvidia-smi: 81,559 MiB, 79.6 GiB), 3.35 TB/s; DGX/HGX H100: 8 GPUs per "
            "node on NVLink 4, one 400 Gb/s ConnectX-7 (InfiniBand NDR) per GPU",
            0.40, _H100_EFFICIENCY, 3.35),
    Cluster(8, 8, 312.0, 80.0, PUBLISHED["nvlink3-a100"].derated(0.8, _NCCL_REACH),
            PUBLISHED["ib-hdr-200"].derated(0.8, _NCCL_REACH), "a100-sxm-8x",
            "NVIDIA A100 Tensor Core GPU data sheet (SXM4 80GB): BF16 tensor core 312 TFLOPS dense (624 with "
            "sparsity); 80 GB HBM2e, 2,039 GB/s; DGX A100: 8 GPUs per node on NVLink 3, one 200 Gb/s "
            "ConnectX-6 (InfiniBand HDR) per GPU",
            0.55, _A100_EFFICIENCY, 2.039),
)}
"""Clusters from public figures, by name, one node each (:meth:`Cluster.scaled` sets the GPU count). The
links are the data-sheet peaks derated to what NCCL's ring reaches (the ``source`` of each says so)."""
