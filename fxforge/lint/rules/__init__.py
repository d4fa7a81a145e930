"""The built-in lint rules, one per module, each a :class:`~fxforge.lint.rule.Rule` called ``RULE``.

Read top to bottom, by the kind of bug: shapes, dtypes, layout, wasted work, host syncs, modes.

Example:
    >>> list(BUILTIN)[:3]
    ['broadcast-blowup', 'reduce-size-one', 'softmax-dim']
"""

from fxforge.lint.rules import (
    broadcast,
    computed_twice,
    dead_code,
    dropout_mode,
    float64,
    hoistable,
    host_sync,
    inplace_saved,
    integer_division,
    layout_copy,
    low_precision,
    mode_unreached,
    reduce_size_one,
    softmax_dim,
    unused_parameter,
    upcast,
)

BUILTIN = {module.RULE.name: module.RULE for module in (
    broadcast, reduce_size_one, softmax_dim,
    float64, integer_division, low_precision, upcast,
    layout_copy,
    hoistable, dead_code, unused_parameter, computed_twice,
    host_sync,
    dropout_mode, mode_unreached, inplace_saved,
)}
