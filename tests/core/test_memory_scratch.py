"""fxforge.core.memory's scratch model (the copies a matrix product makes) against the CPU allocator's records."""

from __future__ import annotations

import itertools

import pytest
import torch

from fxforge.core.memory import blas_copy_bytes, scratch_bytes
from fxforge.runtime.allocator import AllocatorRecords


def _layouts(rows: int, cols: int) -> dict[str, torch.Tensor]:
    """One matrix of each layout a graph can hand a matrix product."""
    return {
        "contiguous": torch.randn(rows, cols),
        "transposed": torch.randn(cols, rows).t(),
        "expanded scalar": torch.randn(()).expand(rows, cols),
        "expanded row": torch.randn(cols).expand(rows, cols),
        "expanded column": torch.randn(rows, 1).expand(rows, cols),
        "every other column": torch.randn(rows, 2 * cols)[:, ::2],
        "sliced columns": torch.randn(rows, cols + 3)[:, :cols],
        "transposed slice": torch.randn(cols, rows + 3)[:, :rows].t(),
    }


def _scratch_of_mm(a: torch.Tensor, b: torch.Tensor) -> int:
    """What ``torch.mm(a, b)`` held at its peak beyond its result, by the allocator's records."""
    with AllocatorRecords() as records:
        torch.mm(a, b)
    return records.peak_bytes() - a.shape[0] * b.shape[1] * a.element_size()


@pytest.mark.parametrize("m,k,n", [(64, 48, 32), (1, 48, 32), (64, 1, 32), (64, 48, 1)])
def test_blas_copies_are_what_the_allocator_sees(m, k, n):
    mismatches = []
    for (left, a), (right, b) in itertools.product(_layouts(m, k).items(), _layouts(k, n).items()):
        predicted = blas_copy_bytes(a) + blas_copy_bytes(b)
        measured = _scratch_of_mm(a, b)
        if predicted != measured:
            mismatches.append((left, right, predicted, measured))
    assert not mismatches


def test_the_gradient_of_a_sum_through_a_linear_layer_is_copied_in_the_backward_graph():
    from fxforge.training.step_graph import trace_step

    head = torch.nn.Linear(16, 500, bias=False)
    step = trace_step(head, (torch.randn(64, 16),), {})
    products = [n for n in step.backward.graph.nodes if n.target is torch.ops.aten.mm.default]
    # The weight's gradient reads the sum's gradient, expanded from a scalar: 64 x 500 floats are copied.
    assert [scratch_bytes(n, step.backward) for n in products] == [64 * 500 * 4]
