"""torch.export's suggested fixes, taken instead of failing: a model with 64 positions is exported with
``Dim("seq", max=64)``, dims the model ties together become one, a dim it needs at one size static.

Example:
    >>> seq = torch.export.Dim("seq", min=1)
    >>> def export(spec):  # a model with 64 positions, as torch.export reports it
    ...     if spec["ids"][1].max > 64:
    ...         raise RuntimeError("Constraints violated (seq)!\\nSuggested fixes:\\n  seq = Dim('seq', max=64)")
    ...     return "exported"
    >>> export_refining(export, {"ids": {1: seq}}, refine=True)
    ('exported', {'ids': {1: Dim('seq', min=1, max=64)}})
"""

from __future__ import annotations

import re
from typing import Any

import torch

# torch.export's report of a guard that excludes one value of a dim's range, e.g. a model slicing ``bias[:T]``
# of 64 positions guards ``T != 64`` within ``seq <= 64`` and suggests no fix.
_EXCLUDED = re.compile(r"Not all values of (\w+) = (\S+) in the specified range [^\n]*? satisfy the generated "
                       r"guard (\S+) != (\d+)\.?")


def _dims_in(spec: Any) -> list[Any]:
    if isinstance(spec, dict):
        return [d for value in spec.values() for d in _dims_in(value)]
    if isinstance(spec, (list, tuple)):
        return [d for value in spec for d in _dims_in(value)]
    return [spec] if isinstance(spec, torch.export.Dim) else []


def _map_dims(spec: Any, fn: Any) -> Any:
    """``spec`` with every Dim ``d`` replaced by ``fn(d)``; a per-axis entry that becomes None is dropped."""
    if isinstance(spec, dict):
        mapped = {key: _map_dims(value, fn) for key, value in spec.items()}
        return {k: v for k, v in mapped.items() if v is not None or not isinstance(k, int)}
    if isinstance(spec, (list, tuple)):
        return type(spec)(_map_dims(value, fn) for value in spec)
    return fn(spec) if isinstance(spec, torch.export.Dim) else spec


def suggested_fixes(error: BaseException) -> list[str]:
    """The lines under "Suggested fixes:" in a torch.export constraint violation (``seq = Dim('seq', max=64)``,
    ``n = 8``, ``b = a``), or [].

    Example:
        >>> suggested_fixes(RuntimeError("Constraints violated (seq)!\\nSuggested fixes:\\n  seq = Dim('seq', max=64)\\n\\nmore"))
        ["seq = Dim('seq', max=64)"]
    """
    text = str(error)
    if "Suggested fixes:" not in text:
        return []
    fixes = []
    for line in text.split("Suggested fixes:", 1)[1].splitlines():
        if not line.strip():
            if fixes:
                break
            continue
        if " = " not in line:
            break
        fixes.append(line.strip())
    return fixes


_GUARDED = re.compile(r"Not all values of (\w+) = ")


def excluded_value_fixes(error: BaseException, dynamic_shapes: Any) -> list[str]:
    """Fixes for guards that exclude one end of a dim's range, which torch.export reports without suggesting a
    fix: ``seq != 64`` within ``seq <= 64`` (a model slicing 64 positions to the length) narrows the range to
    ``max=63``; ``!= min`` raises the minimum. [] when the excluded value is inside the range.

    Example:
        >>> seq = torch.export.Dim("seq", max=64)
        >>> error = RuntimeError("Not all values of seq = L['x'].size()[1] in the specified range seq <= 64 "
        ...                      "satisfy the generated guard L['x'].size()[1] != 64.")
        >>> excluded_value_fixes(error, {"x": {1: seq}})
        ["seq = Dim('seq', min=0, max=63)"]
    """
    dims = {d.__name__: d for d in _dims_in(dynamic_shapes) if not hasattr(d, "root")}
    fixes = []
    for name, source, guarded, value in _EXCLUDED.findall(str(error)):
        dim, value = dims.get(name), int(value)
        if dim is None or guarded != source:
            return []
        if value == dim.max:
            fixes.append(f"{name} = Dim('{name}', min={dim.min}, max={value - 1})")
        elif value == dim.min:
            fixes.append(f"{name} = Dim('{name}', min={value + 1}, max={dim.max})")
        else:
            return []
    return fixes


def refined_dynamic_shapes(error: BaseException, dynamic_shapes: Any, required: Any = None) -> Any:
    """``dynamic_shapes`` with torch.export's suggested fixes applied, or None when it suggests none, or fixes
    a dim in ``required`` (default: every dim) to one size.

    Ranges are narrowed (``Dim("seq", max=64)`` for a model with 64 positions; the minimum of 1 is kept) and
    dims the model ties together become one (torch's
    ``torch.export.dynamic_shapes.refine_dynamic_shapes_from_suggested_fixes``); a dim that is not required
    and that the model needs at one size becomes static.

    Example:
        >>> seq = torch.export.Dim("seq", min=1)
        >>> error = RuntimeError("Suggested fixes:\\n  seq = Dim('seq', max=64)")
        >>> refined_dynamic_shapes(error, {"ids": {1: seq}})
        {'ids': {1: Dim('seq', min=1, max=64)}}
        >>> refined_dynamic_shapes(RuntimeError("Suggested fixes:\\n  seq = 8"), {"ids": {1: seq}}) is None
        True
        >>> guard = RuntimeError("Not all values of seq = L['ids'].size()[1] in the specified range satisfy the "
        ...                      "generated guard (L['ids'].size()[1] / 1) == 8.0.")
        >>> batch = torch.export.Dim("batch")
        >>> refined_dynamic_shapes(guard, {"ids": {0: batch, 1: seq}}, {"batch"})
        {'ids': {0: Dim('batch', min=0)}}
    """
    from torch.export.dynamic_shapes import refine_dynamic_shapes_from_suggested_fixes

    names = {d.__name__ for d in _dims_in(dynamic_shapes)}
    required = names if required is None else set(required)
    fixes = suggested_fixes(error) or excluded_value_fixes(error, dynamic_shapes)
    if not fixes:
        # a guard torch.export cannot turn into a range (a size the model reads as a Python number, e.g. for
        # numpy): a dim that need not stay dynamic becomes static
        fixes = [f"{name} = 0" for name in sorted(set(_GUARDED.findall(str(error))) & (names - required))]
    if not fixes:
        return None
    static = {name.strip() for name, expr in (fix.split(" = ", 1) for fix in fixes) if expr.strip().lstrip("-").isdigit()}
    if static & required:
        return None
    spec = _map_dims(dynamic_shapes, lambda d: None if d.__name__ in static else d)
    others = [fix for fix in fixes if fix.split(" = ", 1)[0].strip() not in static]
    if others:
        try:
            spec = refine_dynamic_shapes_from_suggested_fixes("Suggested fixes:\n" + "\n".join(others), spec)
        except Exception:  # noqa: BLE001 - fixes torch cannot apply: the original error stands
            return None
    minimum = {d.__name__: d.min for d in _dims_in(dynamic_shapes) if not hasattr(d, "root")}
    kept: dict[str, Any] = {}

    def keep_minimum(dim: Any) -> Any:
        if hasattr(dim, "root") or dim.__name__ not in minimum or dim.min >= minimum[dim.__name__]:
            return dim
        if dim.__name__ not in kept:
            kept[dim.__name__] = torch.export.Dim(dim.__name__, min=minimum[dim.__name__], max=dim.max)
        return kept[dim.__name__]

    return _map_dims(spec, keep_minimum)


def export_refining(export: Any, dynamic_shapes: Any, refine: Any = False, attempts: int = 4) -> tuple[Any, Any]:
    """``(export(dynamic_shapes), the dynamic_shapes used)``; with ``refine``, a constraint violation is
    answered by trying again with :func:`refined_dynamic_shapes` (``refine``: True, every dim must stay
    dynamic; or the names of those that must), up to ``attempts`` exports in all.

    Raises:
        Exception: what the last export raised.

    Example:
        >>> export_refining(lambda spec: spec, {"x": None})
        ({'x': None}, {'x': None})
    """
    for attempt in range(attempts):
        try:
            return export(dynamic_shapes), dynamic_shapes
        except Exception as error:
            refined = None
            if refine is not False and attempt + 1 < attempts:
                refined = refined_dynamic_shapes(error, dynamic_shapes, None if refine is True else refine)
            if refined is None or refined == dynamic_shapes:
                raise
            dynamic_shapes = refined
    raise AssertionError("unreachable")  # pragma: no cover
