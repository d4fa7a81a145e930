"""``attention``: hand-written attention becomes one ``scaled_dot_product_attention`` call.

The pass anchors at each softmax, walks back to the product that made the scores and forward to the
product that applies the probabilities to the values, and replaces the chain with
``F.scaled_dot_product_attention`` (``aten.scaled_dot_product_attention`` in exported graphs, so they stay
ATen)::

    softmax(q @ k^T * scale + mask) @ v   ->   scaled_dot_product_attention(q, k, v, mask, scale=scale)

What it reads, top to bottom; each op in every call form (functions, methods, modules, operators, aten):

- the softmax: ``F.softmax``, ``torch.softmax``, ``x.softmax``, ``nn.Softmax``, ``aten.softmax``/``_softmax``,
  with or without ``dtype``, over the last dim;
- the scores product: ``matmul``/``@``/``bmm`` with K given as any swap of its last two dims
  (``transpose(-2, -1)``, ``transpose(2, 3)``, ``permute``, ``mT``) or as any other [.., D, S] tensor, or an
  ``einsum`` contracting one head dim, in any layout (``bqhd,bkhd->bhqk``);
- between scores and softmax, :data:`~fxforge.rewrites.attention.steps.SCORE_STEPS`: casts; scaling by mul
  or div with a Python number, a number computed from shapes (``math.sqrt(q.size(-1))``, ``d ** -0.5``) or
  a tensor with one number per score matrix (a temperature, one per head: ``scale.view(1, H, 1, 1)``);
  additive masks of any broadcastable shape (``+``, ``-``): float, or bool and integer ones that torch
  promotes (``scores + keep`` adds 0/1); ``masked_fill``/``where`` with a boolean mask and ``-inf``,
  ``finfo.min`` or another value <= -1e4 (:data:`LARGE_NEGATIVE`), in place (``masked_fill_``) too; masks
  expanded to the scores' shape (``mask.expand_as(scores)`` reads only their shape); views that regroup
  only the batch dims (MBart's ``bmm(q, k^T).view(B, H, L, S) + mask``, Swin's windows), each mask brought
  back to the product's layout as eager broadcast it;
- between softmax and the value product: casts and dropout;
- the value product: ``matmul``/``@``/``bmm`` or an ``einsum`` with its output in any layout;
- K and V repeated per head for grouped-query attention (``repeat_interleave(n, dim=1)``, or
  ``[:, :, None].expand(...).reshape(...)`` as transformers' ``repeat_kv``) become ``enable_gqa=True`` with
  the un-repeated tensors, where this torch has it; otherwise the repeated tensors are used.

How the replacement stays exact:

- **Scale.** The product of the factors applied to the scores is passed as ``scale=`` (1.0 when there are
  none, never SDPA's default). Numbers computed from shapes stay graph values; one-element tensors (a
  learned temperature) multiply q instead, so their gradients flow. Scales applied to Q or K before the
  product are part of q and k and stay where they are.
- **Masks.** Additive masks are summed, each multiplied by the scales applied after it, and passed as a float
  mask: SDPA computes ``q @ k^T * scale + mask`` as eager does. Fills alone (``masked_fill``/``where``)
  become a boolean keep-mask: masked keys get weight exactly 0 in both, as long as a kept score is not
  within ~100 of the fill value (for -1e4 that needs scores near -1e4; for ``finfo.min`` and ``-inf``
  never). A row in which every key is masked is uniform in eager (the mean of v) or NaN (``-inf``), and 0 in
  SDPA, so the output is patched with ``where(row has a kept key, sdpa, mean of v or NaN)`` unless the mask
  is a constant proven to have no such row; outputs and gradients then equal eager's. Fills combined with
  additive masks become one float mask ``where(mask, fill, additive)``; that is exact when the fill is
  ``-inf`` or ``finfo.min`` of float32/bfloat16/float64 (the score it replaces is absorbed by rounding), so
  other fill values are refused there. A row an additive (or combined) mask hides entirely gives NaN in eager
  where every key is ``-inf`` and 0 in SDPA (torch's safe softmax), and in float16/bfloat16 where every key
  is hidden by a finite value eager's scores are absorbed into the mask value by rounding (a uniform
  softmax: the mean of v) while SDPA adds in float32: both are patched in (``where`` on the mask's rows,
  which costs a pass over the mask, not over the scores), unless the mask is a constant proven to have no
  such row, or a mask computed from the inputs that can hold no ``-inf`` (``where(keep, 0, finfo.min)``, read
  by :mod:`~fxforge.rewrites.attention.finite`; float32 and float64, where a row hidden by finite values is
  uniform in both). A query row holding a NaN gives NaN in eager and 0 in SDPA's fused CPU kernel: every
  replacement ends with ``where(isnan((q * 0).sum(-1)), NaN, out)`` (rows with a NaN or an infinity, both
  NaN in eager; not in a row every key of which a fill hides: eager's fill replaced the NaN scores there). One difference remains, by design: a NaN in a *key* that a fill hides is
  replaced by the fill in eager, so its row stays finite when that key's value is finite, while SDPA adds the
  mask to the NaN score and the row is NaN: NaN, never another number. A condition AND-ed into a
  mask that constants prove all-True (transformers' ``q_idx >= 0`` spreading a [B, 1, 1, S] padding mask
  over the queries) is dropped, so SDPA broadcasts the small mask and no S x S tensor is built.
- **Causal.** A mask whose inputs are only shapes, dtypes, constants and buffers is computed at rewrite time
  (graphs are specialised to their input signature). ``x.new_ones(...)``/``zeros_like(x)`` count as
  constants even for a graph input x; graph inputs, parameters, buffers the graph changes, module calls,
  random ops and Python numbers read from tensor data (``.item()``) do not. Entries are kept (0 / True) or
  masked (``-inf``, <= -1e4 / False); if the kept ones are exactly the lower triangle of a square [L, L]
  mask for every batch and head, the mask is not materialised and ``is_causal=True`` is passed; if every
  key is kept the mask is dropped.
- **Dropout.** Dropout that does not drop (eval mode, ``training=False``, p = 0) is left out. Active dropout
  on the probabilities (training, p > 0) is refused: SDPA's dropout draws different random numbers, so its
  result could not be checked against eager, and the pipeline compares passes under the same seed.
- **Layout.** SDPA returns its own memory layout; where the value product's metadata says eager's
  differs (an einsum writing its output in another order), the output is copied into eager's, so a dropout
  that follows draws its mask over the same elements.
- **Subgraphs.** The pass also runs inside the subgraphs of higher-order ops that run them as plain code
  (``torch.utils.checkpoint``, ``no_grad`` and disabled-autocast regions, ``torch.cond``'s branches); attention
  in an enabled autocast region is a near miss.
- **Training.** The replacement holds in training: SDPA has autograd, and its gradients are eager's. One
  exception, where eager itself computes garbage: a row in which an *additive* mask hides every key
  (``finfo.min`` everywhere, e.g. a left-padded query) has eager's output, but its gradients are the number
  of keys times eager's (torch's fused CPU kernel recomputes the probabilities from a log-sum-exp the fill
  absorbed, so each is 1 where eager's uniform softmax has 1/S; ``tests/fuzz`` leaves that case out).

Refusals, each a near miss with its reason (only where a softmax sits between two products):
softmax over another dim; a non-linear function or an element-wise tensor gate on the scores; anything
other than casts and dropout between softmax and the value product; scores or probabilities also used
elsewhere; an einsum that does not contract one head dim (scores) or the key dim (values); probabilities
as the second operand of the value product; batch dims that broadcast; dtypes that differ; masks that are
not masks; active dropout in training; an input changed in place; views that change the query or key dims
or do not come back to the product's layout; an input of the replacement computed from the scores (beyond
their dtype), such as a mask reshaped by sizes read from the scores and used elsewhere.

The modules, in the order the pass uses them:

- :mod:`~fxforge.rewrites.attention.readers`: single nodes (the softmax, casts, what a node calls);
- :mod:`~fxforge.rewrites.attention.operands`: q, k and v of the two products, in SDPA's layout;
- :mod:`~fxforge.rewrites.attention.constants`: what depends only on shapes, constants and buffers;
- :mod:`~fxforge.rewrites.attention.steps`: the steps between the scores product and the softmax;
- :mod:`~fxforge.rewrites.attention.walks`: the walks from the softmax to both products;
- :mod:`~fxforge.rewrites.attention.checks`: one attention found, and the checks it must pass;
- :mod:`~fxforge.rewrites.attention.folds`: the masks the steps make, as tensors or as nodes;
- :mod:`~fxforge.rewrites.attention.masks`: how the masks reach SDPA (causal, dropped, row fixes);
- :mod:`~fxforge.rewrites.attention.builders`: the SDPA call and the report's line;
- :mod:`~fxforge.rewrites.attention.rewrite`: the pass itself, :data:`ATTENTION`.

Example:
    >>> import torch
    >>> import torch.nn.functional as F
    >>> from fxforge.rewrites.passes import PassContext
    >>> gm = torch.fx.symbolic_trace(lambda q, k, v: F.softmax(q @ k.transpose(-2, -1) / 8, dim=-1) @ v)
    >>> from fxforge.core.shapes import annotate
    >>> _ = annotate(gm, (torch.randn(1, 2, 4, 8),) * 3, {})
    >>> ctx = PassContext("attention", training=False, method="fx")
    >>> replace_attention(gm, ctx); [m.what for m in ctx.matches]
    ['attention -> scaled_dot_product_attention(scale=0.125)']
"""

from fxforge.rewrites.attention.checks import SDPA_HAS_GQA
from fxforge.rewrites.attention.masks import LARGE_NEGATIVE
from fxforge.rewrites.attention.rewrite import ATTENTION, replace_attention

__all__ = ["ATTENTION", "LARGE_NEGATIVE", "SDPA_HAS_GQA", "replace_attention"]
