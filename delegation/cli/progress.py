"""Progress of long operations (``db upgrade``, ``bench``, ``soak``) for people.

It goes to stderr and only when stderr is a terminal, as git's does: a spinner, what is
being done, a bar when the steps are counted, and the time so far, on one line that is
redrawn and taken away at the end. Never with ``--json``: stdout then holds the JSON
alone, and stderr only errors. Piped or logged, nothing is drawn either.
"""

from __future__ import annotations

import sys
from typing import TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.progress import Progress as Live
from rich.table import Column
from rich.text import Text


class _Count(ProgressColumn):
    """``3/8``, or ``12/60 s`` with a unit; nothing while the total is unknown."""

    def __init__(self, unit: str) -> None:
        super().__init__()
        self.unit = unit

    def render(self, task: Task) -> Text:
        if task.total is None:
            return Text("")
        return Text(f"{task.completed:.0f}/{task.total:.0f}{self.unit}", style="progress.download")


class Progress:
    """One operation's progress line, or nothing at all (see the module)."""

    def __init__(
        self,
        what: str,
        total: float | None = None,
        *,
        unit: str = "",
        quiet: bool = False,
        stream: TextIO | None = None,
    ) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.quiet = quiet
        self.shown = not quiet and self.stream.isatty()
        self._live: Live | None = None
        self._task = TaskID(0)
        if self.shown:
            columns: list[ProgressColumn] = [
                SpinnerColumn(),
                # Cut, never wrapped: one line, whatever the terminal's width.
                TextColumn(
                    "{task.description}",
                    markup=False,
                    table_column=Column(no_wrap=True, overflow="ellipsis"),
                ),
                BarColumn(bar_width=12),  # a pulse until the total is known
                _Count(unit),
                TimeElapsedColumn(),
            ]
            console = Console(file=self.stream, highlight=False)
            self._live = Live(*columns, console=console, transient=True)
            self._task = self._live.add_task(what, total=total)

    def __enter__(self) -> Progress:
        if self._live is not None:
            self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.stop()

    def update(
        self, what: str | None = None, *, done: float | None = None, total: float | None = None
    ) -> None:
        """Say what is being done now, how much is done, or of how much. A new step is
        drawn at once: a short one would otherwise pass between two refreshes unseen."""
        if self._live is not None:
            self._live.update(
                self._task, description=what, completed=done, total=total, refresh=what is not None
            )

    def note(self, line: str) -> None:
        """A line that stays (a step's result): above the progress line, or on its own
        when none is drawn; never when quiet."""
        if self._live is not None:
            self._live.console.print(Text(line))
        elif not self.quiet:
            print(line, file=self.stream, flush=True)
