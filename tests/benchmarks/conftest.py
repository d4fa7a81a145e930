"""Make the repository root importable, so that ``import benchmarks`` works under any pytest invocation; and
keep the heap a worker built before a test file out of the file's garbage collections."""

import gc
import os
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)


@pytest.fixture(scope="module", autouse=True)
def _earlier_heap_frozen():
    """The sections collect garbage before every measured call (``benchmarks.memory.peak_memory``, the
    training steps, the timed rounds): each ``gc.collect()`` walks every object, and a pytest-xdist worker
    that ran other files first holds millions (1.5 s a collection, seen in ``test_peak_memory``). What is
    alive when a file starts (its garbage collected first) is frozen out of those collections until the file
    ends: they see the file's own objects, and no garbage can be freed inside a measured call either way."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()
