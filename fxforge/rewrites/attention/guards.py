"""The guard of query rows holding a NaN, as one op a target's translation can drop where its kernel makes it
redundant.

Torch's fused CPU SDPA gives 0 in a query row holding a NaN or an infinity, where eager attention gives NaN,
so every attention the rewrite replaces ends with ``where(isnan(sum(q * 0, -1)), NaN, out)``. A kernel that
gives NaN there itself (ONNX Runtime's ``MultiHeadAttention`` on its CPU provider) makes that guard cost passes
over q and the output for nothing. When the calls the graph serves say so
(:attr:`fxforge.core.plan.CallConditions.guards_as_ops`: an export whose translation chooses the kernel), the
rewrite writes the guard as one call of ``torch.ops.fxforge.nan_rows(out, q)`` on SDPA's own output: it
computes exactly the guard (so the rewrite is verified against eager as before), and the export's translation
of it (:mod:`fxforge.exporters.translations`) is nothing where it translated that SDPA to a kernel that keeps
NaN rows, and the guard's ops elsewhere. Nothing has to recognise the guard afterwards.

Example:
    >>> out, q = torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 8)
    >>> q[0, 1, 2, 5] = float("nan")
    >>> torch.ops.fxforge.nan_rows(out, q).isnan().all(-1).nonzero().tolist()
    [[0, 1, 2]]
"""

from __future__ import annotations

import math

import torch


@torch.library.custom_op("fxforge::nan_rows", mutates_args=())
def nan_rows(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``out`` with NaN in every row whose query row in ``q`` holds a NaN or an infinity (``q * 0`` is NaN
    there; the sum spreads it over the row), as eager attention gives; ``q``'s rows broadcast against
    ``out``'s.

    Example:
        >>> nan_rows(torch.zeros(2, 3), torch.tensor([[1.0, 2.0], [float("inf"), 0.0]])).tolist()
        [[0.0, 0.0, 0.0], [nan, nan, nan]]
    """
    return torch.where(torch.isnan((q * 0).sum(-1, keepdim=True)), math.nan, out)


@nan_rows.register_fake
def _(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return torch.empty(torch.broadcast_shapes(out.shape, (*q.shape[:-1], 1)), dtype=out.dtype, device=out.device)


NAN_ROWS = torch.ops.fxforge.nan_rows.default
