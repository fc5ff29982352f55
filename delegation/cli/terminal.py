"""What the command line prints for people: text escaped, at the terminal's width.

Children write much of what is printed (events, errors, outputs, ids). Nothing of it may
drive the terminal: control characters are shown escaped (:func:`printable`), and rich
never reads it as markup (:func:`cells` hands it over as ``Text``).
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

from rich.console import Console
from rich.text import Text

# Tables fit the terminal; piped (to grep, less) they fit this many columns.
PIPED_WIDTH = 80
# What no line printed as a whole (an event, a --wide table) is wrapped at.
UNBOUNDED = 10_000

# C0, DEL and C1 controls (ESC, BEL, CSI U+009B...), line and paragraph separators,
# and the bidirectional overrides and isolates that reorder what a reader sees.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: str) -> str:
    """``text`` with every character that could drive a terminal shown escaped:
    ``\\n``, ``\\t``, ``\\r``, ``\\x1b``, ``\\u202e``. Printable text is unchanged."""
    return _UNPRINTABLE.sub(_escape, text)


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def printable_json(value: Any) -> str:
    """Indented JSON whose layout keeps its newlines; JSON escapes C0 controls in
    strings itself, but not DEL, C1 or the Unicode ones."""
    lines = json.dumps(value, indent=2, ensure_ascii=False).split("\n")
    return "\n".join(printable(line) for line in lines)


def cells(*values: str) -> list[Text]:
    # Text, not str: rich would read "[...]" in an error message as markup.
    return [Text(printable(value)) for value in values]


def sized() -> bool:
    """Whether the width to fit is known: a terminal, or ``$COLUMNS``."""
    return sys.stdout.isatty() or "COLUMNS" in os.environ


def table_console(*, wide: bool = False) -> Console:
    """For a table: the terminal's width (``$COLUMNS``), else ``PIPED_WIDTH``; a
    ``--wide`` table is as wide as its rows, whatever the terminal (which wraps it)."""
    if wide:
        return Console(width=UNBOUNDED, highlight=False)
    return Console(width=None if sized() else PIPED_WIDTH, highlight=False)


def line_console() -> Console:
    """For one line per item (events): wrapped at a terminal's width; piped, each item
    stays one line for grep."""
    return Console(width=None if sized() else UNBOUNDED, highlight=False)
