"""How an optimized module's plans treat input sizes, and how many it holds: :class:`ShapePolicy` and the
limits a :class:`~fxforge.runtime.plans.PlanCache` keeps to.

Example:
    >>> ShapePolicy(dynamic=False).max_plans == MAX_PLANS
    True
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable
from typing import Any

from fxforge.capture.dims import image_siblings
from fxforge.core.sequence_dims import batch_and_sequence
from fxforge.runtime.signature import differing_dims, sizes_of, token_dims

# After this many rebuilds because the model's state changed, the model runs eagerly (with one warning):
# something sets its attributes on every call, and each rebuild costs a capture.
MAX_REBUILDS = 8
# Plans one module holds at most (torch.compile's recompile limit is 8 too); calls no plan serves past it run
# eagerly, after one warning.
MAX_PLANS = 8
# Input signatures remembered as served by a shape-generic plan (the first call of a signature checks the
# plan's shape guard; later ones find it here): the oldest are forgotten past this many.
MAX_SERVED = 4096


@dataclasses.dataclass(frozen=True)
class ShapePolicy:
    """How an optimized module's plans treat input sizes.

    Attributes:
        dynamic: None (as ``torch.compile``): the first call's sizes are static; a later call that differs
            only in sizes is served by a torch.fx plan of the family once checked against eager (a symbolic
            trace computes sizes with ops; see :func:`~fxforge.runtime.first_use.fx_plan_of_family`), else the
            dims that changed become dynamic, with the batch and an image's sibling spatial dims
            (:func:`grown_dims`), and one shape-generic plan serves all their sizes. Calls with token inputs
            (integer or bool tensors of rank >= 2: ids, masks) are the exception: their batch and sequence dims
            (:func:`~fxforge.runtime.signature.token_dims`) are dynamic from the first plan, since every
            request has its own length. A size of 1 is never specialised: it is captured at a stand-in of 2
            and checked against eager on its first call. True: the first plan is shape-generic in every input
            dim already. False: one plan per input signature.
        dynamic_shapes: torch.export's ``dynamic_shapes`` for the first plan (the user knows the ranges).
        max_plans: plans held at most; calls that no plan serves past it run eagerly, after one warning.

    Example:
        >>> ShapePolicy().max_plans
        8
    """

    dynamic: bool | None = None
    dynamic_shapes: Any = None
    max_plans: int = MAX_PLANS


def leaves_of(signature: Hashable) -> list[tuple[tuple, Any] | None]:
    """``(shape, dtype)`` of each input leaf of an input signature (None for a leaf that is not a tensor)."""
    return [(key[1], key[3]) if key[0] == "tensor" else None for key in signature[1]]


def grown_dims(signature: Hashable, changed: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """The input dims ``(leaf, dim)`` a new shape-generic plan keeps dynamic when ``changed`` changed: those,
    the batch (dim 0 of every input whose dim 0 is the batch size), and an image's sibling spatial dims (a
    floating-point input of rank >= 4 whose H or W changed gets H and W, or D, H and W, dynamic together), so
    that one re-plan serves every new image size and batch instead of one per dim that changes next.
    Sizes of 1 are kept: capture traces them at a stand-in size of 2 (see
    :func:`~fxforge.capture.dynamic.capture_with_dims`).

    Example:
        >>> import torch
        >>> from fxforge.runtime.signature import input_signature
        >>> sig = input_signature((torch.ones(1, 3, 64, 48),), {}, False)
        >>> sorted(grown_dims(sig, {(0, 3)}))
        [(0, 0), (0, 2), (0, 3)]
        >>> sorted(grown_dims(input_signature((torch.ones(2, 12, 6),), {}, False), {(0, 1)}))
        [(0, 0), (0, 1)]
    """
    if not changed:
        return set()
    leaves = leaves_of(signature)
    batch = batch_and_sequence(leaves)[0]
    dims = set(changed)
    dims.update((leaf, 0) for leaf, entry in enumerate(leaves) if entry is not None and len(entry[0]) > 0
                and entry[0][0] == batch)
    for leaf, dim in changed:
        shape, dtype = leaves[leaf]
        dims.update((leaf, axis) for axis in image_siblings(shape, dtype, {dim}))
    return dims


def dims_for(policy: ShapePolicy, signature: Hashable, built: list[Hashable], made: set) -> Any:
    """What a new plan for ``signature`` keeps dynamic: None (its sizes only), a frozenset of input dims, or the
    user's ``dynamic_shapes``; ``built``: the signatures of its family that plans were built for, ``made``:
    the dims made dynamic so far (see :attr:`ShapePolicy.dynamic`).

    Example:
        >>> import torch
        >>> from fxforge.runtime.signature import input_signature
        >>> ids = input_signature((torch.ones(1, 64, dtype=torch.long),), {}, False)
        >>> sorted(dims_for(ShapePolicy(), ids, [], set()))   # a batch of 1 stays dynamic
        [(0, 0), (0, 1)]
    """
    if policy.dynamic is False:
        return None
    if policy.dynamic_shapes is not None and not built:
        return policy.dynamic_shapes  # the user's ranges, for the first plan; calls outside them as below
    sizes = sizes_of(signature)
    if policy.dynamic is True:
        return frozenset((leaf, dim) for leaf, entry in enumerate(sizes) if entry is not None
                         for dim in range(len(entry[0])))
    if not built:
        # Token inputs: every request has its own length, so the batch and sequence dims are dynamic from the
        # first plan (a static one would be rebuilt at the second call, seconds on the call path).
        return frozenset(token_dims(signature)) or None
    changed = set(made)
    for other in built:
        changed |= differing_dims(signature, other)
    return frozenset(grown_dims(signature, changed)) or None


def numel(sizes: list) -> int:
    """The elements of a call's tensors, from :func:`~fxforge.runtime.signature.sizes_of`."""
    return sum(int(math.prod(leaf[0])) for leaf in sizes if leaf is not None)


def smaller_example(example: tuple | None, signature: Hashable, dynamic: Any) -> tuple | None:
    """The remembered inputs ``(signature, args, kwargs)`` of a family to build a plan keeping the input dims
    ``dynamic`` on, instead of the call's own: where they are smaller, differ from the call only in those
    dims, and are over 1 in each of them. None otherwise.

    Example:
        >>> smaller_example(None, None, frozenset()) is None
        True
    """
    if not isinstance(dynamic, frozenset) or example is None:
        return None
    theirs, ours = sizes_of(example[0]), sizes_of(signature)
    if not differing_dims(example[0], signature) <= dynamic:
        return None
    if any(theirs[leaf][0][dim] <= 1 for leaf, dim in dynamic):
        return None
    return example if numel(theirs) < numel(ours) else None


def kept_dims(shapes: Any) -> set[tuple[int, int]]:
    """The input dims ``(leaf, dim)`` a plan's :class:`~fxforge.core.symbolic.ShapeGuard` keeps symbolic (none
    for a plan of one input signature, ``shapes`` None).

    Example:
        >>> kept_dims(None)
        set()
    """
    if shapes is None:
        return set()
    return {(leaf, dim) for leaf, entry in enumerate(shapes.inputs) if entry is not None
            for dim, size in enumerate(entry[0]) if not isinstance(size, int)}
