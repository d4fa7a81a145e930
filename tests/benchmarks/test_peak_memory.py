"""``benchmarks.memory``: the peak bytes PyTorch's allocator held during one call, above where it started."""

from __future__ import annotations

import doctest

import pytest
import torch
import torch.nn.functional as F

from benchmarks import memory
from benchmarks.memory import PeakMemory, peak_from_records, peak_memory

MIB = 2**20


def test_doctests():
    assert doctest.testmod(memory, extraglobs={"torch": torch}).failed == 0


def test_sequential_results_alive_together():
    x = torch.randn(256, 1024)  # 1 MiB, allocated before: not counted

    def two_alive(x):
        a = x + x  # 1 MiB (no Python number: a scalar operand is a small allocation of its own)
        b = a * x  # 1 MiB while a is alive
        return b

    result = peak_memory(two_alive, x)
    assert result == PeakMemory(2 * MIB, 2 * MIB, 2, "cpu")
    assert result.peak_mib == 2.0


def test_freed_temporaries_make_room():
    x = torch.randn(256, 1024)

    def chain(x):
        for _ in range(4):
            x = x + x  # each step frees the one before (but never the input)
        return x

    result = peak_memory(chain, x)
    assert result.allocated_bytes == 4 * MIB and result.allocations == 4
    assert result.peak_bytes == 2 * MIB  # the previous step's result and this one's


def test_outputs_count_inputs_and_weights_do_not():
    linear = torch.nn.Linear(1024, 1024, bias=False)  # 4 MiB of weights
    x = torch.randn(64, 1024)
    with torch.no_grad():
        assert peak_memory(linear, x).peak_bytes == 64 * 1024 * 4  # just the output
        assert peak_memory(lambda t: t, x).peak_bytes == 0


def test_sees_what_ops_do_not_return():
    """A kernel's scratch space counts: the peak of a fused attention exceeds its output."""
    q = torch.randn(1, 2, 512, 64)
    with torch.no_grad():
        result = peak_memory(F.scaled_dot_product_attention, q, q, q)
    assert result.peak_bytes > q.numel() * 4


def test_attention_matrix_is_seen():
    """Hand-written attention holds S x S scores: its peak grows ~4x when S doubles, SDPA's ~2x."""

    def eager(q):
        return torch.softmax(q @ q.transpose(-2, -1) * 0.125, dim=-1) @ q

    def peaks(fn):
        return [peak_memory(fn, torch.randn(1, 2, s, 32)).peak_bytes for s in (512, 1024)]

    with torch.no_grad():
        eager_peaks = peaks(eager)
        sdpa_peaks = peaks(lambda q: F.scaled_dot_product_attention(q, q, q))
    assert eager_peaks[0] >= 2 * 512 * 512 * 4  # at least one scores matrix
    assert eager_peaks[1] / eager_peaks[0] > 3.5
    assert sdpa_peaks[1] < eager_peaks[1] / 8


def test_peak_from_records_sorts_by_time():
    assert peak_from_records([]) == (0, 0, 0)
    assert peak_from_records([(3, -10), (1, 10), (2, 5)]) == (15, 15, 2)
    # A free of memory allocated before the call lowers the level below the start: the peak stays >= 0.
    assert peak_from_records([(1, -100), (2, 40)]) == (0, 40, 1)


def test_other_devices_refused():
    with pytest.raises(ValueError, match="cpu or cuda"):
        peak_memory(lambda: None, device="meta")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda():
    x = torch.randn(256, 1024, device="cuda")
    result = peak_memory(lambda x: (x * 2) + 1, x, device="cuda")
    assert result.device == "cuda" and result.peak_bytes >= 2 * MIB
