"""Which input dims are the batch and the sequence: one rule for capture (the dims an export keeps dynamic)
and for the plan cache (the dims a plan for token inputs keeps dynamic from the start).

Inputs are read as ``(shape, dtype)`` pairs, so the rule serves tensors and input signatures alike.

Example:
    >>> ids, pixels = ((2, 7), torch.int64), ((2, 3, 8, 8), torch.float32)
    >>> batch, seq = batch_and_sequence([ids, pixels])
    >>> batch, seq, sequence_axes(*ids, batch, seq), sequence_axes(*pixels, batch, seq)
    (2, 7, {0: 'batch', 1: 'seq'}, {0: 'batch'})
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import torch

BATCH, SEQUENCE = "batch", "seq"  # the names of the dims dynamic=True makes dynamic (and the ONNX file's)

Leaf = tuple[Sequence[int], torch.dtype]


def _counts_as_tokens(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex)


def has_tokens(leaves: Sequence[Leaf | None]) -> bool:
    """Whether some input is an integer or bool tensor of rank >= 2 (token ids, attention masks, positions).

    Example:
        >>> has_tokens([((2, 7), torch.int64)]), has_tokens([((2, 7), torch.float32), None])
        (True, False)
    """
    return any(leaf is not None and len(leaf[0]) >= 2 and _counts_as_tokens(leaf[1]) for leaf in leaves)


def batch_and_sequence(leaves: Sequence[Leaf | None]) -> tuple[int | None, int | None]:
    """The batch size (the most common dim 0 among the tensors) and the sequence length (the most common dim 1
    among the integer and bool tensors of rank >= 2, else among the float tensors of rank 3, ``[batch, seq,
    hidden]``); None where there is none. ``leaves``: ``(shape, dtype)`` per tensor, None for other inputs.

    Example:
        >>> batch_and_sequence([((4, 3), torch.float32), ((4,), torch.float32), ((1, 9), torch.bool)])
        (4, 9)
    """
    tensors = [leaf for leaf in leaves if leaf is not None]
    batches = [shape[0] for shape, _ in tensors if len(shape) > 0]
    wide = [(shape, dtype) for shape, dtype in tensors if len(shape) >= 2]
    integers = [shape[1] for shape, dtype in wide if _counts_as_tokens(dtype)]
    floats = [shape[1] for shape, dtype in wide if dtype.is_floating_point and len(shape) == 3]
    sequences = integers or floats
    return (collections.Counter(batches).most_common(1)[0][0] if batches else None,
            collections.Counter(sequences).most_common(1)[0][0] if sequences else None)


def sequence_axes(shape: Sequence[int], dtype: torch.dtype, batch: int | None, seq: int | None) -> dict[int, str]:
    """``{axis: "batch" | "seq"}`` for one input: dim 0 when it is ``batch``; dim 1 when it is ``seq`` and the
    input is of rank >= 2 and not a float tensor of rank > 3 (an image's dim 1 is its channels).

    Example:
        >>> sequence_axes((2, 5), torch.float32, 2, 5), sequence_axes((2, 5, 5, 5), torch.float32, 2, 5)
        ({0: 'batch', 1: 'seq'}, {0: 'batch'})
    """
    if len(shape) == 0:
        return {}
    axes = {}
    if batch is not None and shape[0] == batch:
        axes[0] = BATCH
    if seq is not None and len(shape) >= 2 and shape[1] == seq and not (dtype.is_floating_point and len(shape) > 3):
        axes[1] = SEQUENCE
    return axes
