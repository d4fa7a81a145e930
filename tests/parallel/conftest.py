"""Fixtures of the parallel tests."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore


@pytest.fixture
def fake_world(request):
    """A fake process group of ``request.param`` ranks (no communication: LocalTensorMode computes)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=request.param)
    yield request.param
    dist.destroy_process_group()
