"""Repository-wide pytest setup: names available to the docstring examples (run as doctests), and
autotune's on-disk cache off, so every test measures (or fakes) its own timings and nothing is written to
the home directory (tests of the cache turn it on in a temporary directory)."""

import os

import pytest
import torch

import fxforge

os.environ.setdefault("FXFORGE_AUTOTUNE_CACHE", "0")


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    doctest_namespace["torch"] = torch
    doctest_namespace["fxforge"] = fxforge

# Under pytest-xdist (`make test` runs two workers on a two-core machine) each worker computes on one
# thread: two workers of two threads each would fight over the cores, and an OpenMP thread that spins
# waiting for a busy core makes every op slower.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
