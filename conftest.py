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
