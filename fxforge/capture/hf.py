"""Support for transformers models: their cache objects as pytrees.

Decoder models (GPT-2, LLaMA, ...) return a ``DynamicCache`` in their output by default. torch.export can
only return values whose type is a registered pytree node, and fxforge's output comparison flattens
outputs as pytrees, so the cache types are registered here, with transformers' own flatten functions
(the ones its exporters use). Nothing happens unless transformers is already imported, so capturing a
plain PyTorch model never imports it.

Example:
    >>> import torch
    >>> register_transformers_pytrees(torch.nn.Linear(1, 1))
    False
"""

from __future__ import annotations

import sys

from torch import nn


def _is_transformers_model(module: nn.Module) -> bool:
    if "transformers" not in sys.modules:
        return False
    return any(cls.__module__.startswith("transformers.") for cls in type(module).__mro__) or any(
        type(m).__module__.startswith("transformers.") for m in module.modules()
    )


def register_transformers_pytrees(module: nn.Module) -> bool:
    """Register transformers' cache classes as pytree nodes when ``module`` is (or holds) a transformers
    model. Idempotent (transformers skips types already registered); returns whether it is one.

    ``DynamicCache`` gets the flatten functions of ``transformers.integrations.executorch`` (keys and
    values per layer); every other ``Cache`` subclass gets the generic ones of
    ``transformers.exporters.exporter_dynamo`` where that module exists.
    """
    if not _is_transformers_model(module):
        return False
    try:
        from transformers.integrations.executorch import register_dynamic_cache_export_support

        register_dynamic_cache_export_support()
    except ImportError:  # an older or newer transformers without it: the generic registration below
        pass
    try:
        from transformers.exporters.exporter_dynamo import register_cache_pytrees_for_model

        register_cache_pytrees_for_model(module)
    except ImportError:
        pass
    return True
