"""Progress of the steps that can take seconds (capture, rewrite with verify and autotune, export, timing).

On a terminal each running step shows a ``rich`` spinner on stderr and leaves one line when done. When
stderr is not a terminal (a pipe, a CI log) the finished steps are logged as plain lines on stdout
instead, so stderr carries only an error, if any.

Example:
    >>> steps = Steps(live=False)
    >>> with steps.step("capture") as step:
    ...     step.note("fx")  # doctest: +ELLIPSIS
    - capture: fx (... s)
    >>> [name for name, _, _ in steps.done]
    ['capture']
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator

from rich.console import Console


class Step:
    """One running step; ``note()`` adds what it found (shown after its name when done).

    Example:
        >>> s = Step("capture"); s.note("fx"); s.notes
        ['fx']
    """

    def __init__(self, name: str):
        self.name = name
        self.notes: list[str] = []

    def note(self, text: str) -> None:
        """Add a short note (``"captured with fx"``)."""
        self.notes.append(text)


class Steps:
    """Shows and logs the command's steps.

    Args:
        live: spinners on stderr (default: when stderr is a terminal).
        quiet: log nothing (the steps are still recorded in ``done``).

    Example:
        >>> steps = Steps(live=False, quiet=True)
        >>> with steps.step("export"):
        ...     pass
        >>> steps.done[0][0]
        'export'
    """

    def __init__(self, live: bool | None = None, quiet: bool = False):
        self.live = sys.stderr.isatty() if live is None else live
        self.quiet = quiet
        self.stderr = Console(stderr=True, highlight=False)
        self.stdout = Console(highlight=False, soft_wrap=True)
        self.done: list[tuple[str, float, list[str]]] = []

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[Step]:
        """Run the block as the step ``name``; logs it with its time once the block returns."""
        step = Step(name)
        start = time.perf_counter()
        if self.live and not self.quiet:
            with self.stderr.status(f"{name}...", spinner="dots"):
                yield step
        else:
            yield step
        seconds = time.perf_counter() - start
        self.done.append((name, seconds, step.notes))
        if self.quiet:
            return
        notes = f": {'; '.join(step.notes)}" if step.notes else ""
        if self.live:
            self.stderr.print(f"[green]✓[/green] {name}{notes} [dim]({seconds:.2f} s)[/dim]")
        else:
            self.stdout.print(f"- {name}{notes} ({seconds:.2f} s)", markup=False)
