"""The check a plan passes before it serves sizes it was not built at: its outputs against eager's.

Example:
    >>> relu = torch.nn.ReLU()
    >>> gm = torch.fx.symbolic_trace(relu)
    >>> against_eager(gm, relu, relu, [], ((torch.randn(3),), {}), random=True).ok
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import nn

from fxforge.core.hooks import silenced_hooks
from fxforge.core.plan import Plan
from fxforge.core.source import first_line
from fxforge.core.verify import Comparison, compare_outputs, isolated, random_like
from fxforge.runtime.signature import family_of, sizes_of


def against_eager(executable: Callable[..., Any], eager: Callable[..., Any], module: nn.Module,
                  watched: Sequence[nn.Module], inputs: tuple[tuple, dict], *, random: bool = False) -> Comparison:
    """Run ``executable`` and ``eager`` on ``inputs`` (and, with ``random``, on random inputs of the same
    sizes: :func:`~fxforge.core.verify.random_like`), both isolated (same random numbers, the module's state
    put back, ``watched`` modules' hooks silenced for eager, which the caller's call runs around both) and
    compare. An exception of ``executable`` where eager ran is a difference, with its message as the reason;
    one of eager propagates (the inputs are the caller's mistake).
    """
    checks = [inputs] + ([random_like(inputs, seed=1)] if random else [])
    result = Comparison(True, 0.0)
    for args, kwargs in checks:
        with torch.no_grad():
            with isolated(module, inputs=(args, kwargs)), silenced_hooks(watched):
                expected = eager(*args, **kwargs)
            try:
                with isolated(module, inputs=(args, kwargs)):
                    result = compare_outputs(expected, executable(*args, **kwargs))
            except Exception as error:  # noqa: BLE001 - a graph that cannot run these sizes differs from eager
                result = Comparison(False, math.inf, f"it raised {type(error).__name__}: {first_line(error)}")
        if not result.ok:
            return result
    return result


def at(values: frozenset) -> str:
    """Symbols and their values, for notes: ``s0 = 1, s1 = 1``.

    Example:
        >>> at(frozenset({("s1", 1), ("s0", 1)}))
        's0 = 1, s1 = 1'
    """
    return ", ".join(f"{s} = {v}" for s, v in sorted(values, key=str))


def sizes(signature: Hashable) -> str:
    """An input signature's tensor sizes, for notes: ``(2x3x64x48)``.

    Example:
        >>> from fxforge.runtime.signature import input_signature
        >>> sizes(input_signature((torch.ones(2, 3), 1), {}, False))
        '(2x3)'
    """
    return "(" + ", ".join("x".join(map(str, leaf[0])) for leaf in sizes_of(signature) if leaf is not None) + ")"


def fx_plan_of_family(plans: dict[Hashable, Plan | None], key: Hashable) -> Plan | None:
    """A plan among ``plans`` (keyed ``(signature, modes, conditions)``) for calls of ``key``'s family (the same
    but for sizes) whose graph torch.fx's symbolic trace captured: such a trace records sizes as the ops that
    read them, so its graph usually computes the model at other sizes too, and a new size then costs a check
    against eager (:func:`against_eager`) instead of a capture. Not for calls that record gradients, nor a
    plan whose executable is not a graph (a compiled one recompiles at new sizes).

    Example:
        >>> fx_plan_of_family({}, None) is None
        True
    """
    if key is None:
        return None
    family = (family_of(key[0]), *key[1:])
    for other, plan in plans.items():
        if (plan is not None and plan.shapes is None and not other[2].gradients and plan.captured.method == "fx"
                and isinstance(plan.executable, torch.fx.GraphModule) and (family_of(other[0]), *other[1:]) == family):
            return plan
    return None
