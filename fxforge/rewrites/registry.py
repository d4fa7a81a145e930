"""The built-in rewrites by name, and how ``rewrites=`` is resolved.

``rewrites`` takes ``"default"``, a list of built-in names, or pass objects (anything with a ``name``
and an ``apply(graph_module, ctx)`` method, such as :class:`~fxforge.rewrites.passes.Pass`), mixed freely.

Example:
    >>> [p.name for p in resolve("default")]
    ['cleanup', 'conv_bn_fold', 'binary_fold', 'conv_activation', 'attention', 'weight_fold', 'memory_reorder']
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fxforge.rewrites.attention import ATTENTION
from fxforge.rewrites.binary_fold import BINARY_FOLD
from fxforge.rewrites.cleanup import CLEANUP
from fxforge.rewrites.conv_activation import CONV_ACTIVATION
from fxforge.rewrites.conv_bn_fold import CONV_BN_FOLD
from fxforge.rewrites.memory_reorder import MEMORY_REORDER
from fxforge.rewrites.passes import Pass
from fxforge.rewrites.weight_subgraphs import WEIGHT_FOLD

# Read top to bottom: the order in which "default" runs them.
BUILTIN: dict[str, Pass] = {
    CLEANUP.name: CLEANUP,
    CONV_BN_FOLD.name: CONV_BN_FOLD,
    BINARY_FOLD.name: BINARY_FOLD,
    CONV_ACTIVATION.name: CONV_ACTIVATION,
    ATTENTION.name: ATTENTION,
    WEIGHT_FOLD.name: WEIGHT_FOLD,
    MEMORY_REORDER.name: MEMORY_REORDER,
}
# binary_fold runs after conv_bn_fold (bn(conv(x)) * c folds fully) and folds the BatchNorms its own folds put
# right after a convolution (bn(conv(x) * c)).
# weight_fold runs after attention, which reads masks as constants where the model keeps them.
DEFAULT: list[str] = ["cleanup", "conv_bn_fold", "binary_fold", "conv_activation", "attention", "weight_fold",
                      "memory_reorder"]


class UnknownRewriteError(ValueError):
    """A rewrite name that is not built in; the message lists the valid names.

    Example:
        >>> print(UnknownRewriteError("nope"))  # doctest: +NORMALIZE_WHITESPACE
        unknown rewrite 'nope'; built-in rewrites: cleanup, conv_bn_fold, binary_fold, conv_activation, attention,
        weight_fold, memory_reorder
    """

    def __init__(self, name: str):
        super().__init__(f"unknown rewrite {name!r}; built-in rewrites: {', '.join(BUILTIN)}")
        self.name = name


def resolve(rewrites: str | Iterable[Any] | None) -> list[Any]:
    """Turn ``rewrites=`` into a list of pass objects, in order.

    Raises:
        UnknownRewriteError: a name that is not built in.
        TypeError: an entry that is neither a name nor a pass object.

    Example:
        >>> [p.name for p in resolve(["cleanup"])]
        ['cleanup']
    """
    if rewrites is None:
        return []
    if isinstance(rewrites, str):
        names = DEFAULT if rewrites == "default" else [n.strip() for n in rewrites.split(",") if n.strip()]
        return resolve(list(names))
    resolved = []
    for entry in rewrites:
        if isinstance(entry, str):
            if entry == "default":
                resolved.extend(resolve("default"))
            elif entry in BUILTIN:
                resolved.append(BUILTIN[entry])
            else:
                raise UnknownRewriteError(entry)
        elif hasattr(entry, "apply") and hasattr(entry, "name"):
            resolved.append(entry)
        else:
            raise TypeError(f"rewrites entries must be names or objects with .name and .apply(), got {entry!r}")
    return resolved


def register(rule: Any) -> Any:
    """Make a rule or pass selectable by name (``rewrites=["default", "my_rule"]``); returns it unchanged.

    Example:
        >>> from fxforge.rewrites.pattern import Rule
        >>> _ = register(Rule("demo_double", lambda x: x + x, lambda x: x * 2)); "demo_double" in BUILTIN
        True
        >>> del BUILTIN["demo_double"]
    """
    BUILTIN[rule.name] = rule
    return rule
