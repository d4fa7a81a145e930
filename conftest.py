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
_THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True)
def _threads_left_as_found(request):
    """A test that leaves torch on another number of threads fails by name, and the count is put back: every
    later test on its worker would otherwise compute on that many threads beside the other worker (a benchmark
    section that set two and kept them slowed the rest of its worker's files)."""
    yield
    left = torch.get_num_threads()
    if left != _THREADS:
        torch.set_num_threads(_THREADS)
        pytest.fail(f"{request.node.nodeid} left torch on {left} threads (it found {_THREADS})")


@pytest.fixture(autouse=True)
def _module_call_left_as_found(request):
    """A test that leaves ``nn.Module.__call__`` or ``__getattr__`` patched (a trace that did not put torch.fx's
    patches back) fails by name, and the originals are put back, so the tests after it on the same worker do not
    fail in its place."""
    import torch.fx._symbolic_trace as symbolic_trace

    yield
    call, getattr_ = torch.nn.Module.__call__, torch.nn.Module.__getattr__
    if call is symbolic_trace._orig_module_call and getattr_ is symbolic_trace._orig_module_getattr:
        return
    torch.nn.Module.__call__ = symbolic_trace._orig_module_call
    torch.nn.Module.__getattr__ = symbolic_trace._orig_module_getattr
    pytest.fail(f"{request.node.nodeid} left nn.Module.__call__ or __getattr__ patched "
                f"({getattr(call, '__qualname__', call)}, {getattr(getattr_, '__qualname__', getattr_)})")
