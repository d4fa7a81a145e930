"""Repository-wide pytest setup: names available to the docstring examples (run as doctests)."""

import pytest
import torch

import fxforge


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    doctest_namespace["torch"] = torch
    doctest_namespace["fxforge"] = fxforge
