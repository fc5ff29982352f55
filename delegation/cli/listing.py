"""The tables of ``children`` and ``leases``: they fit the terminal (80 columns when
piped), and ``--wide`` shows every column with every id whole.

At the terminal's width a table keeps its narrow columns, shows each id by its shortest
beginning that no other id of its kind has (at least ``inspect.SHORT`` characters,
ended with ``…``; every command takes that prefix back, ``…`` and all), cuts names with
``…`` and gives what is left of the line to one column (the error or output), cut
with ``…`` too. No cell wraps, so one row is one line.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from rich import box
from rich.cells import cell_len
from rich.table import Table
from rich.text import Text

from delegation.cli.terminal import printable
from delegation.store.prefixes import Kind
from delegation.usecases.inspector import Inspector

R = TypeVar("R")
GAP = 2  # spaces between two columns
FILL_MIN = 10  # the filling column's least width, when the terminal is that narrow


@dataclass(frozen=True)
class Column(Generic[R]):
    """One column: its heading, and its cell of a row."""

    heading: str
    cell: Callable[[R], str]
    kind: Kind | None = None  # an id of this kind: shortened unless --wide
    narrow: bool = True  # shown at the terminal's width, not only with --wide
    fill: bool = False  # takes the width left over, at most (one column a table)
    most: int | None = None  # a name cut past this many characters unless --wide


def table(
    rows: Sequence[R], columns: Sequence[Column[R]], inspector: Inspector, width: int | None
) -> Table:
    """The table of ``rows`` in ``width`` columns: the narrow columns, ids shortened; or
    with no ``width`` (``--wide``) every column and every id whole."""
    wide = width is None
    shown = [column for column in columns if wide or column.narrow]
    values = [[column.cell(row) for column in shown] for row in rows]
    for n, column in enumerate(shown):
        if column.kind is not None and not wide:
            short = inspector.shortened(column.kind, {line[n] for line in values} - {""})
            for line in values:
                line[n] = short.get(line[n], line[n])
    lines = [[printable(value) for value in line] for line in values]
    widths = None if width is None else _widths(shown, lines, width)
    grid = Table(
        box=box.SIMPLE_HEAD,
        padding=(0, GAP - 1, 0, 0),
        pad_edge=False,
        show_edge=False,
        header_style="bold",
    )
    for n, column in enumerate(shown):
        fixed = None if widths is None else widths[n]
        grid.add_column(column.heading, no_wrap=True, overflow="ellipsis", width=fixed)
    for line in lines:
        grid.add_row(*(Text(value) for value in line))  # Text: never read as markup
    return grid


def _widths(columns: Sequence[Column[R]], lines: list[list[str]], width: int) -> list[int]:
    """Each column as wide as its widest cell (a name at most ``most``), the filling one
    as wide as what is left of ``width``; if that is still too wide (ids that begin
    alike for long), the widest columns give way one character at a time, down to
    their heading (the filling one to ``FILL_MIN``)."""
    widths, floors = [], []
    for n, column in enumerate(columns):
        widest = max([cell_len(column.heading), *(cell_len(line[n]) for line in lines)])
        widths.append(widest if column.most is None else min(widest, column.most))
        floors.append(min(widths[-1], FILL_MIN if column.fill else cell_len(column.heading)))
    room = width - GAP * (len(columns) - 1)
    for n, column in enumerate(columns):
        if column.fill:
            widths[n] = min(widths[n], max(floors[n], room - sum(widths) + widths[n]))
    while sum(widths) > room:
        n = max(range(len(widths)), key=lambda i: widths[i] - floors[i])
        if widths[n] <= floors[n]:
            break  # a terminal narrower than the headings: rich cuts the rest
        widths[n] -= 1
    return widths
