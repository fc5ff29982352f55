"""The arguments several commands share: a database, ids, JSON, and the types of
numbers given on the command line. Light to import: ``--help`` loads nothing else."""

from __future__ import annotations

import argparse
import math

# What a number given on the command line may be at most: past this a lifetime
# overflows the scheduler's datetimes and a count the platform's sizes.
MAX_SECONDS = 10**9  # about 31 years
MAX_COUNT = 10**9


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
