"""Pipeline partitioning: cost-balanced split points for ``torch.distributed.pipelining``.

:func:`fxforge.partition` (:mod:`fxforge.parallel.partition`) cuts a model into stages that balance
forward + backward time and fit a memory cap; :meth:`Partition.build_stage` builds this rank's stage on
PyTorch's own engine, and :mod:`fxforge.parallel.launch` runs all stages as local processes.
"""

from fxforge.parallel.partition import Partition, partition

__all__ = ["Partition", "partition"]
