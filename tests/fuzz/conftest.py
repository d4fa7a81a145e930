"""Hypothesis profiles for the differential fuzz suite: ``short`` in ``make test``, ``long`` in ``make fuzz``
(``FXFORGE_FUZZ=long``)."""

import os

from hypothesis import HealthCheck, settings

_COMMON = {"deadline": None, "derandomize": False, "print_blob": True,
           "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.function_scoped_fixture]}
settings.register_profile("short", max_examples=12, **_COMMON)
settings.register_profile("long", max_examples=250, **_COMMON)
settings.load_profile(os.environ.get("FXFORGE_FUZZ", "short"))
