"""The section protocol: what every benchmark plugs into ``python -m benchmarks --suite NAME``.

A :class:`Section` is data: a name, one line for ``--list``, a function that adds the section's options
to the harness's parser, and a function that runs it on the parsed options and returns the exit status.
The harness (:mod:`benchmarks.harness`) builds one parser per run (its own ``--suite`` and ``--list``
plus the section's options), parses the command line once, sets :attr:`argparse.Namespace.command` (the
command as typed, for the results files) and ``args.argv`` (the arguments) and calls :attr:`Section.run`. A section that finds its options
inconsistent raises :class:`UsageError`; the harness reports it as a usage error (exit status 2).

Example:
    >>> import argparse
    >>> def add(parser): parser.add_argument("--n", type=int, default=1)
    >>> def run(args): return 0 if args.n > 0 else 1
    >>> section = Section("demo", "a demonstration", add, run)
    >>> parser = argparse.ArgumentParser(); section.add_arguments(parser)
    >>> section.run(parser.parse_args(["--n", "3"]))
    0
    >>> csv_list(" a, b,,c ")
    ['a', 'b', 'c']
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass


class UsageError(Exception):
    """The options given to a section do not make sense together (the message says why)."""


@dataclass(frozen=True)
class Section:
    """One benchmark of ``python -m benchmarks``.

    Attributes:
        name: the ``--suite`` value.
        description: one line for ``python -m benchmarks --list``.
        add_arguments: ``(parser) -> None``: adds the section's options (not ``--suite``, ``--list``).
        run: ``(args) -> exit status``; ``args.command`` is the command line as typed, ``args.argv`` its
            arguments. Writes its own
            results (JSON under ``benchmarks/out/``, its block of ``RESULTS.md``) and prints its table.
    """

    name: str
    description: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def csv_list(text: str) -> list[str]:
    """The non-empty, stripped items of a comma-separated option value."""
    return [t.strip() for t in text.split(",") if t.strip()]
