"""``python -m benchmarks``: the one command line of the benchmarks.

``python -m benchmarks --suite NAME [options]`` runs the section ``NAME`` of :data:`benchmarks.sections.SECTIONS`
(without ``--suite``: the ``default`` section, the model suite against every contender);
``python -m benchmarks --list`` lists the sections; ``python -m benchmarks --suite NAME --help`` shows a
section's options. The command line is parsed once, by one parser holding the harness's options and the
section's (:class:`benchmarks.section.Section`); the section gets the parsed options with
``args.command``, the command as typed (it goes into the results files), and ``args.argv``, the
arguments themselves (a section that reruns itself in another environment passes them on).

Example:
    >>> from benchmarks.section import Section
    >>> demo = Section("demo", "says hello", lambda p: p.add_argument("--name", default="x"),
    ...                lambda args: print(f"hello {args.name} ({args.command})") or 0)
    >>> main(["--suite", "demo", "--name", "y"], sections={"demo": demo, "default": demo})
    hello y (python -m benchmarks --suite demo --name y)
    0
"""

from __future__ import annotations

import argparse
import shlex
import sys

from benchmarks.section import Section, UsageError

PROG = "python -m benchmarks"
DEFAULT = "default"


def _harness_options(parser: argparse.ArgumentParser, sections: dict[str, Section]) -> None:
    parser.add_argument("--suite", choices=list(sections), default=DEFAULT, metavar="NAME",
                        help=f"the section to run (default {DEFAULT}; --list shows them all)")
    parser.add_argument("--list", action="store_true", help="list the sections, then exit")


def build_parser(section: Section, sections: dict[str, Section]) -> argparse.ArgumentParser:
    """The parser of a run of ``section``: the harness's options, then the section's."""
    parser = argparse.ArgumentParser(prog=PROG, description=f"--suite {section.name}: {section.description}")
    _harness_options(parser, sections)
    section.add_arguments(parser)
    return parser


def list_sections(sections: dict[str, Section], out=None) -> None:
    """One line per section: its ``--suite`` name and what it measures."""
    out = sys.stdout if out is None else out
    width = max(len(name) for name in sections)
    for name, section in sections.items():
        print(f"  {name:{width}s}  {section.description}", file=out)
    print(f"Run one with `{PROG} --suite NAME`; its options: `{PROG} --suite NAME --help`.", file=out)


def main(argv: list[str] | None = None, *, sections: dict[str, Section] | None = None) -> int:
    """Parse the command line and run the section it names; returns the exit status.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).
        sections: the sections to choose from (default :data:`benchmarks.sections.SECTIONS`).
    """
    if sections is None:
        from benchmarks.sections import SECTIONS as sections
    argv = list(sys.argv[1:] if argv is None else argv)
    # First which section (its options are not known yet, so the rest is left alone), then the one parse.
    chooser = argparse.ArgumentParser(prog=PROG, add_help=False)
    _harness_options(chooser, sections)
    chosen, _ = chooser.parse_known_args(argv)
    if chosen.list:
        list_sections(sections)
        return 0
    section = sections[chosen.suite]
    parser = build_parser(section, sections)
    args = parser.parse_args(argv)
    args.command = f"{PROG} {shlex.join(argv)}".strip()
    args.argv = argv
    try:
        return section.run(args)
    except UsageError as exc:
        parser.error(str(exc))
        return 2  # parser.error exits; kept for readers
