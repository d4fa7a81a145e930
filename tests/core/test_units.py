"""Byte sizes and budgets (fxforge.core.units): one convention, one parser, used by every option that takes one."""

from __future__ import annotations

import argparse
import pathlib
import re

import pytest

from fxforge.cli.args import parse_budget as cli_budget
from fxforge.core.units import UNITS, format_bytes, parse_budget, parse_bytes

ROOT = pathlib.Path(__file__).resolve().parents[2] / "fxforge"


@pytest.mark.parametrize("text, expected", [
    ("1B", 1), ("1", 1), (" 7 ", 7), ("1KiB", 1024), ("1kib", 1024), ("1 KIB", 1024), ("1kB", 1000), ("1KB", 1000),
    ("2MiB", 2 * 2**20), ("512MB", 512 * 10**6), ("2GiB", 2 * 2**30), ("1.5GB", 1_500_000_000),
    ("1TiB", 2**40), ("1tb", 10**12), (".5KiB", 512), ("1.3kB", 1300), ("1.9", 1), (4096, 4096),
])
def test_sizes_follow_one_convention_binary_with_i_decimal_without(text, expected):
    assert parse_bytes(text) == expected
    assert parse_budget(text) == ("bytes", float(expected))


@pytest.mark.parametrize("bad, message", [
    ("lots", "malformed size 'lots'"), ("5 parsecs", "malformed size '5 parsecs'"), ("1.2.3GB", "malformed"),
    ("-1GiB", "malformed"), (True, "malformed size True"), (1.5, "malformed size 1.5"), (None, "malformed"),
    ("0GiB", "size '0GiB': a size must be at least 1 byte"), ("0.5", "at least 1 byte"), (0, "at least 1 byte"),
    (-5, "size -5: a size must be at least 1 byte"), ("60%", "not a percentage"),
])
def test_a_malformed_size_is_refused_with_the_value(bad, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_bytes(bad)


@pytest.mark.parametrize("value, expected", [
    ("60%", ("fraction", 0.6)), ("100%", ("fraction", 1.0)), ("12.5 %", ("fraction", 0.125)),
    (0.25, ("fraction", 0.25)), (1.0, ("fraction", 1.0)), (4096, ("bytes", 4096.0)),
])
def test_budgets_are_a_fraction_or_bytes(value, expected):
    assert parse_budget(value) == expected


@pytest.mark.parametrize("bad, message", [
    ("0%", "a percentage must be above 0% and at most 100%"), ("120%", "at most 100%"),
    (1.5, "a fraction must be above 0 and at most 1"), (0.0, "a fraction"), ("half", "malformed memory_budget 'half'"),
    (True, "malformed memory_budget True"), (0, "at least 1 byte"),
])
def test_a_malformed_budget_names_the_option_and_the_value(bad, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_budget(bad)
    with pytest.raises(ValueError, match="^(malformed )?stage_cap "):
        parse_budget(bad, name="stage_cap")


@pytest.mark.parametrize("text", ["60%", "2GiB", "1.5kb", "4096", "512MB", "1TiB", "33.3%", "lots", "0GiB", "0%"])
def test_the_command_line_reads_budgets_with_the_core_parser(text):
    try:
        expected = parse_budget(text, name="budget")
    except ValueError as error:
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(str(error))):
            cli_budget(text)
        return
    got = cli_budget(text)
    if expected[0] == "fraction":
        assert isinstance(got, str) and float(got[:-1]) / 100 == pytest.approx(expected[1])
    else:
        assert isinstance(got, int) and got == expected[1]


def test_format_bytes_reads_back_in_the_same_convention():
    for nbytes in (1, 1023, 1024, 5 * 2**20, 3 * 2**30):
        text = format_bytes(nbytes)
        assert parse_bytes(text.replace(" ", "")) == pytest.approx(nbytes, rel=0.01)


# A module that parses sizes itself keeps a table of units: "gib": 2**30 (or "GiB"), or a regex naming them.
_UNIT_TABLE = re.compile(r"""["'](?:gib|GiB)["']\s*:|\(\?:?[^)]*\bgib\|""", re.IGNORECASE)


def test_no_module_keeps_a_unit_table_of_its_own():
    owners = {str(path.relative_to(ROOT)) for path in ROOT.rglob("*.py") if _UNIT_TABLE.search(path.read_text())}
    assert owners == {"core/units.py"}, owners
    assert set(UNITS) == {"b", "kib", "mib", "gib", "tib", "kb", "mb", "gb", "tb"}
