"""Which kernel torch's ``scaled_dot_product_attention`` would run on a replacement's inputs, asked of torch itself.

SDPA is faster than attention written out only where it runs a fused kernel (flash attention on CPU; flash,
memory-efficient or cuDNN on CUDA). Where torch picks its math kernel, SDPA computes what the written-out
ops compute, through more ops (q and k scaled apart, a safe softmax), and the rewrite adds the guards that
keep eager's NaN rows: slower than leaving the attention as it was. On CPU torch's flash kernel refuses q/k
and v head dims that differ (LeViT: 16 and 64), operands whose last dim is not contiguous, masks of 3 dims
and active dropout.

The choice is torch's own (``torch._fused_sdp_choice``), made on stand-ins: tensors of the operands' dtype,
device, batch and head dims, whose query and key lengths are cut to at most 4 (the checks read ranks, head
dims, strides and dtypes, not lengths), so asking costs nothing whatever the sequence length.

Example:
    >>> q = torch.empty(2, 4, 16, 16); v = torch.empty(2, 4, 16, 64)
    >>> fused_kernel_refusal(q, q, v, None)
    'SDPA would run its math kernel (q and k have head dim 16, v 64): slower than the attention as written'
    >>> fused_kernel_refusal(q, q, q, torch.empty(1, 4, 16, 16)) is None
    True
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend

from fxforge.core.symbolic import hint

_CUT = 4  # the query and key lengths of the stand-ins


def strided_last_dim(value: torch.Tensor) -> bool:
    """Whether ``value``'s last dim (of more than one element) is not contiguous in memory: torch's fused SDPA
    kernels need a unit stride there.

    Example:
        >>> strided_last_dim(torch.empty(2, 3).t()), strided_last_dim(torch.empty(3, 2))
        (True, False)
    """
    return value.ndim >= 2 and hint(value.shape[-1]) > 1 and hint(value.stride(-1)) != 1


def _stand_in(value: torch.Tensor, lengths: dict[int, int]) -> torch.Tensor:
    """A small real tensor like ``value``: each dim in ``lengths`` (by position) cut to its new length, the
    last dim transposed in memory where ``value``'s is not contiguous."""
    shape = [lengths.get(i, hint(d)) for i, d in enumerate(value.shape)]
    if strided_last_dim(value):
        swapped = [*shape[:-2], shape[-1], shape[-2]]
        return torch.empty(swapped, dtype=value.dtype, device=value.device).transpose(-2, -1)
    return torch.empty(shape, dtype=value.dtype, device=value.device)


def chosen_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  is_causal: bool = False, enable_gqa: bool = False) -> SDPBackend:
    """The kernel torch picks for SDPA on inputs like these (fake or real tensors; no dropout).

    Example:
        >>> q = torch.empty(1, 2, 8, 16)
        >>> chosen_kernel(q, q, q, None) == SDPBackend.FLASH_ATTENTION
        True
    """
    length, keys = hint(q.shape[-2]), hint(k.shape[-2])
    cut_q, cut_k = min(length, _CUT), min(keys, _CUT)
    q_small = _stand_in(q, {q.ndim - 2: cut_q})
    k_small, v_small = _stand_in(k, {k.ndim - 2: cut_k}), _stand_in(v, {v.ndim - 2: cut_k})
    mask_small = None
    if mask is not None:
        cuts = {}
        if mask.ndim >= 2 and hint(mask.shape[-2]) == length:
            cuts[mask.ndim - 2] = cut_q
        if mask.ndim >= 1 and hint(mask.shape[-1]) == keys:
            cuts[mask.ndim - 1] = cut_k
        mask_small = _stand_in(mask, cuts)
    kwargs = {"enable_gqa": True} if enable_gqa else {}
    with torch.no_grad():
        choice = torch._fused_sdp_choice(q_small, k_small, v_small, mask_small, 0.0, is_causal, **kwargs)
    return SDPBackend(choice)


def fused_kernel_refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                         is_causal: bool = False, enable_gqa: bool = False) -> str | None:
    """Why SDPA would not be faster here (torch would run its math kernel), or None.

    Example:
        >>> q = torch.empty(1, 2, 8, 16)
        >>> fused_kernel_refusal(q, q, q, torch.empty(2, 8, 8))
        'SDPA would run its math kernel (a 3-d mask): slower than the attention as written'
    """
    if q.device.type not in ("cpu", "cuda"):
        return None
    if chosen_kernel(q, k, v, mask, is_causal, enable_gqa) != SDPBackend.MATH:
        return None
    if hint(q.shape[-1]) != hint(v.shape[-1]):
        why = f"q and k have head dim {hint(q.shape[-1])}, v {hint(v.shape[-1])}"
    elif mask is not None and mask.ndim not in (2, 4):
        why = f"a {mask.ndim}-d mask"
    elif any(map(strided_last_dim, (q, k, v))):
        why = "an operand whose last dim is not contiguous"
    else:
        why = f"{q.dtype} on {q.device.type}, as torch chose"
    return f"SDPA would run its math kernel ({why}): slower than the attention as written"
