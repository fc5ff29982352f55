"""The arguments several commands share: a database, ids, JSON, and the types of
numbers given on the command line. Light to import: ``--help`` loads nothing else."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

# What a number given on the command line may be at most: past this a lifetime
# overflows the scheduler's datetimes and a count the platform's sizes.
MAX_SECONDS = 10**9  # about 31 years
MAX_COUNT = 10**9

# Every command's exit codes (docs/cli.md, "Exit codes"): done; refused or failed (the
# command was well formed, and the database, a child, a host or this machine said no);
# a usage error (what was typed cannot be right, judged before anything is read or
# written: argparse's own errors exit 2 too). Ctrl-C exits 130, as shells expect.
OK, REFUSED, USAGE = 0, 1, 2


def usage(message: str) -> int:
    """A refused command line: one line on stderr; returns :data:`USAGE`."""
    print(f"delegation: {message}", file=sys.stderr)
    return USAGE


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds above zero, at most ``MAX_SECONDS``."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    if value > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{text!r} is more than {MAX_SECONDS} seconds")
    return value


def user_id(text: str) -> int:
    """An argparse type: a user id (0 to 2**32 - 2; -1 is no user's)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2**32 - 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a user id (0 to {2**32 - 2})")
    return value


def positive_int(text: str) -> int:
    """An argparse type: a whole number above zero, at most ``MAX_COUNT``."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    if value > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{text!r} is more than {MAX_COUNT}")
    return value


def count(text: str) -> int:
    """An argparse type: a whole number, zero or more, at most ``MAX_COUNT``."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number (0 or more)")
    if value > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{text!r} is more than {MAX_COUNT}")
    return value


def priority(text: str) -> int:
    """An argparse type: a priority, a whole number from 0 to 9."""
    if text.strip() not in tuple("0123456789"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a priority (0 to 9)")
    return int(text)


def rate(text: str) -> tuple[int, float]:
    """An argparse type: ``N/SECONDS``, N admissions per SECONDS (``10/60``). A bare
    ``N`` is refused: per second or per minute, it would be a guess."""
    n, slash, per = text.partition("/")
    try:
        given = (positive_int(n), positive_seconds(per))
    except argparse.ArgumentTypeError:
        given = None
    if not slash or given is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not N/SECONDS (N admissions per SECONDS, both above zero, e.g. 10/60)"
        )
    return given


def json_value(text: str) -> Any:
    """An argparse type: a JSON document (``--data``)."""
    try:
        return json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {exc}") from None


DEFAULT_DB = "./delegation.db"
# Every local user reads every process's command line (ps, /proc/PID/cmdline); the
# environment and a 0600 password file are the owner's alone (design §17).
PASSWORD_ON_COMMAND_LINE = (
    "a database password on the command line is visible to every local process:"
    " use DELEGATION_DB or a libpq password file"
)


def add_db(parser: argparse.ArgumentParser) -> None:
    # Before the command or after it; unset, DELEGATION_DB, then ./delegation.db.
    parser.add_argument(
        "--db",
        default=argparse.SUPPRESS,
        help="database file, or a URL such as postgresql+psycopg://user@host/db, without a"
        f" password (default $DELEGATION_DB, else {DEFAULT_DB})",
    )


# Every id argument takes a unique prefix of the id too (delegation.cli.show.resolve_ids).
CHILD_HELP = "the child's conversationId, or a unique prefix of it"
RUN_HELP = "one execution (runId, or a unique prefix of it); default the newest"


def add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="one JSON document for scripts")


def add_wide(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--wide", action="store_true", help="every column, ids whole, lines as long as they need"
    )


def wait_seconds(text: str) -> float:
    """An argparse type: seconds to wait, zero or more, at most ``MAX_SECONDS``."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (0 or more)")
    if value > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{text!r} is more than {MAX_SECONDS} seconds")
    return value
