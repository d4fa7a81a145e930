"""Byte sizes and memory budgets as people write them: the one parser every argument and option uses.

The convention (IEC 80000-13 and SI, as ``nvidia-smi``, ``free -h`` and PyTorch's memory summaries print):

- a unit with an ``i`` is binary: ``KiB`` = 1024 bytes, ``MiB`` = 1024², ``GiB`` = 1024³, ``TiB`` = 1024⁴;
- a unit without is decimal: ``kB``/``KB`` = 1000 bytes, ``MB`` = 1000², ``GB`` = 1000³, ``TB`` = 1000⁴;
- ``B`` or no unit is bytes; units are case-insensitive; spaces between number and unit are allowed;
- the number may have a fraction (``1.5GiB``); the size is rounded down to whole bytes, at least 1.

A budget is a size or a percentage (``"60%"``: of whatever the caller measures it against; a Python float in
(0, 1] is the same fraction).

Example:
    >>> parse_bytes("2GiB"), parse_bytes("512MB"), parse_bytes("1.5 kib"), parse_bytes(4096)
    (2147483648, 512000000, 1536, 4096)
    >>> parse_budget("60%"), parse_budget("1.5GiB"), parse_budget(0.25)
    (('fraction', 0.6), ('bytes', 1610612736.0), ('fraction', 0.25))
    >>> format_bytes(3 * 2**20)
    '3.0 MiB'
"""

from __future__ import annotations

import re
from typing import Any

UNITS: dict[str, int] = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
                         "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
"""Bytes per unit, by the unit's lower-case spelling (see the module docstring for the convention)."""

_SIZE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*(%|[a-z]+)?$", re.IGNORECASE)
_HINT = "write a percentage ('60%') or a size ('2GiB', '512MiB', '1.5GB' or bytes)"


def _split(text: str) -> tuple[float, str] | None:
    """``"1.5 GiB"`` -> ``(1.5, "gib")``; ``"60%"`` -> ``(60.0, "%")``; None when it is neither."""
    match = _SIZE.match(text.strip())
    if match is None:
        return None
    unit = (match.group(2) or "b").lower()
    return (float(match.group(1)), unit) if unit == "%" or unit in UNITS else None


def _whole_bytes(number: float, unit: str, value: Any, name: str) -> int:
    size = int(number * UNITS[unit])
    if size < 1:
        raise ValueError(f"{name} {value!r}: a size must be at least 1 byte")
    return size


def parse_bytes(value: Any, *, name: str = "size") -> int:
    """A byte size: an int, or a string with a unit (``"2GiB"``, ``"512MB"``, ``"3000000"``), as whole bytes.

    Args:
        value: the size (an int of bytes, or a string in the convention of this module).
        name: what the value is, for the error message (``"memory_per_stage"``, ``"--budget"``...).

    Raises:
        ValueError: not a size (a bool, a float, a percentage, an unknown unit), or less than 1 byte.

    Example:
        >>> parse_bytes("16GiB") == 16 * 2**30, parse_bytes("1.5GB")
        (True, 1500000000)
        >>> parse_bytes("60%", name="memory_per_stage")
        Traceback (most recent call last):
        ...
        ValueError: memory_per_stage '60%': give a size ('2GiB', '512MiB', '1.5GB' or bytes), not a percentage
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return _whole_bytes(float(value), "b", value, name)
    parts = _split(value) if isinstance(value, str) else None
    if parts is None:
        raise ValueError(f"malformed {name} {value!r}: give a size ('2GiB', '512MiB', '1.5GB' or bytes)")
    number, unit = parts
    if unit == "%":
        raise ValueError(f"{name} {value!r}: give a size ('2GiB', '512MiB', '1.5GB' or bytes), not a percentage")
    return _whole_bytes(number, unit, value, name)


def parse_budget(value: Any, *, name: str = "memory_budget") -> tuple[str, float]:
    """A memory budget: ``("fraction", f)`` for ``"60%"`` or a float in (0, 1]; ``("bytes", n)`` for a size
    (:func:`parse_bytes`: an int or ``"2GiB"``), ``n`` whole bytes as a float.

    Args:
        value: the budget.
        name: what the value is, for the error message.

    Raises:
        ValueError: neither a percentage nor a size, a percentage outside (0, 100], or a size under 1 byte.

    Example:
        >>> parse_budget("60%"), parse_budget("2 MiB"), parse_budget(1000)
        (('fraction', 0.6), ('bytes', 2097152.0), ('bytes', 1000.0))
        >>> parse_budget("120%", name="budget")
        Traceback (most recent call last):
        ...
        ValueError: budget '120%': a percentage must be above 0% and at most 100%
    """
    if isinstance(value, float):
        if 0 < value <= 1:
            return "fraction", value
        raise ValueError(f"malformed {name} {value!r}: a fraction must be above 0 and at most 1; {_HINT}")
    if isinstance(value, int) and not isinstance(value, bool):
        return "bytes", float(parse_bytes(value, name=name))
    parts = _split(value) if isinstance(value, str) else None
    if parts is None:
        raise ValueError(f"malformed {name} {value!r}: {_HINT}")
    number, unit = parts
    if unit == "%":
        if not 0 < number <= 100:
            raise ValueError(f"{name} {value!r}: a percentage must be above 0% and at most 100%")
        return "fraction", number / 100
    return "bytes", float(_whole_bytes(number, unit, value, name))


def format_bytes(nbytes: float) -> str:
    """Bytes in the binary unit that reads best: ``512 B``, ``3.2 KiB``, ``12.5 MiB``, ``1.25 GiB``.

    Example:
        >>> format_bytes(512), format_bytes(3277), format_bytes(1.25 * 2**30), format_bytes(-2048)
        ('512 B', '3.2 KiB', '1.25 GiB', '-2.0 KiB')
    """
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{int(nbytes)} B"
