"""The warnings an optimized module gives when it runs the model eagerly or without its inference rewrites.

Both are ``UserWarning``: they tell the user about their model (a capture the tracers refuse, a call that
records gradients), once per reason; tests pin them with ``pytest.warns``.

Example:
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warnings.warn("fxforge: running Net eagerly", FallbackWarning)
    >>> caught[0].category.__name__, issubclass(GradientsWarning, UserWarning)
    ('FallbackWarning', True)
"""

from __future__ import annotations


class FallbackWarning(UserWarning):
    """fxforge could not capture a model for some inputs and runs it eagerly instead.

    Example:
        >>> issubclass(FallbackWarning, UserWarning)
        True
    """


class GradientsWarning(UserWarning):
    """A call recorded gradients, so it runs a plan without the rewrites that would stop them (folding
    parameters, fused kernels): slower than the inference plan, as exact as eager.

    Example:
        >>> issubclass(GradientsWarning, UserWarning)
        True
    """
