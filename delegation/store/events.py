"""Event rows: appended in batches by the writer, paged by readers."""

from __future__ import annotations

from typing import NamedTuple

from sqlalchemy import Connection

from delegation._struct import I64_MAX
from delegation.store.sql import run, run_many, spelling_of

_INSERT = "INSERT INTO events (child_id, sequence, body) VALUES (?, ?, ?)"
_OUTPUT = "UPDATE children SET output = ? WHERE id = ?"
_PAGE = "SELECT body FROM events WHERE child_id = ? AND sequence > ? ORDER BY sequence LIMIT ?"
# The sizes alone (SQLite's length() and PostgreSQL's of a TOASTed value read no body).
_SIZES = (
    "SELECT sequence, length(body) FROM events WHERE child_id = ? AND sequence > ?"
    " ORDER BY sequence LIMIT ?"
)
_UP_TO = (
    "SELECT body FROM events WHERE child_id = ? AND sequence > ? AND sequence <= ?"
    " ORDER BY sequence"
)

# The newest first (sizes only): a tail is measured from its newest end.
_NEWEST_SIZES = (
    "SELECT sequence, length(body) FROM events WHERE child_id = ? ORDER BY sequence DESC LIMIT ?"
)

_NUMBERED = (
    "SELECT sequence, body FROM events WHERE child_id = ? AND sequence > ? AND sequence <= ?"
    " ORDER BY sequence"
)


class EventRow(NamedTuple):
    child_id: int
    sequence: int
    # The event's wire JSON, sequence included; empty for a ``result`` its execution
    # committed before (a replay's, or a rewind's copy): only its ``output`` is written.
    body: bytes
    output: str | None  # the untruncated text of a ``result`` event


def insert_events(conn: Connection, rows: list[EventRow]) -> None:
    """Insert a batch of events and keep each child's ``output`` current (in the
    batch's order: the last ``result`` appended wins)."""
    run_many(conn, _INSERT, [(r.child_id, r.sequence, r.body) for r in rows if r.body])
    outputs = {r.child_id: r.output for r in rows if r.output is not None}
    if outputs:
        run_many(conn, _OUTPUT, [(text, child) for child, text in outputs.items()])


def page(conn: Connection, child_id: int, after: int, limit: int) -> list[bytes]:
    """Up to ``limit`` event bodies with ``sequence > after``, oldest first."""
    # ``after`` is a wire uint64; SQLite binds int64 only, and no sequence is larger.
    after = min(after, I64_MAX)
    return [body for (body,) in run(conn, _PAGE, (child_id, after, limit)).fetchall()]


def array(bodies: list[bytes]) -> bytes:
    """Stored event bodies as one JSON array (each body is an event's wire JSON)."""
    return b"[" + b",".join(bodies) + b"]"


def joined_page(conn: Connection, child_id: int, after: int, limit: int) -> tuple[bytes, int]:
    """:func:`page`'s bodies as one JSON :func:`array` (``b"[]"``: none), and how many it
    holds: joined by the store where that is faster (SQLite: one row read, not one a
    body)."""
    sql = spelling_of(conn).joined_page
    if sql is None:
        bodies = page(conn, child_id, after, limit)
        return array(bodies), len(bodies)
    joined, count = run(conn, sql, (child_id, min(after, I64_MAX), limit)).fetchone()
    return (b"[]", 0) if joined is None else (bytes(joined), int(count))


def last_sequence(conn: Connection, child_id: int) -> int:
    """The sequence of the execution's newest event (0: none yet)."""
    row = run(conn, "SELECT max(sequence) FROM events WHERE child_id = ?", (child_id,)).fetchone()
    return int(row[0] or 0) if row is not None else 0


def sizes(conn: Connection, child_id: int, after: int, limit: int) -> list[tuple[int, int]]:
    """The sequence and stored size of up to ``limit`` events after ``after``, oldest
    first; no body is read."""
    rows = run(conn, _SIZES, (child_id, min(after, I64_MAX), limit)).fetchall()
    return [(int(sequence), int(size)) for sequence, size in rows]


def page_within(
    conn: Connection, child_id: int, after: int, limit: int, max_bytes: int
) -> tuple[list[bytes], bool]:
    """:func:`page`, also stopped before the body that would take the page past
    ``max_bytes`` (the first always comes, whatever its size), and whether it stopped
    there with more committed: no more bodies than that are ever read."""
    after = min(after, I64_MAX)
    last, total, count = after, 0, 0
    found = sizes(conn, child_id, after, limit)
    for sequence, size in found:
        if count and total + size > max_bytes:
            break
        last, total, count = sequence, total + size, count + 1
    if not count:
        return [], False
    bodies = [body for (body,) in run(conn, _UP_TO, (child_id, after, last)).fetchall()]
    return bodies, count < len(found)


def tail_within(
    conn: Connection, child_id: int, count: int, max_bytes: int
) -> tuple[list[bytes], bool]:
    """The newest ``count`` event bodies, oldest first, no more than ``max_bytes`` of them
    counted from the newest (which always comes), and whether older ones of the ``count``
    were left out for that bound: no more bodies than that are ever read."""
    rows = run(conn, _NEWEST_SIZES, (child_id, count)).fetchall()
    found = [(int(sequence), int(size)) for sequence, size in rows]
    first, total = None, 0
    for sequence, size in found:
        if first is not None and total + size > max_bytes:
            break
        first, total = sequence, total + size
    if first is None:
        return [], False
    bodies = run(conn, _UP_TO, (child_id, first - 1, found[0][0])).fetchall()
    return [body for (body,) in bodies], len(bodies) < len(found)


def numbered_within(
    conn: Connection, child_id: int, after: int, last: int, limit: int, max_bytes: int
) -> list[tuple[int, bytes]]:
    """The sequence and body of up to ``limit`` events after ``after``, up to ``last``,
    oldest first, stopped as :func:`page_within` stops (before the body that would take
    them past ``max_bytes``; the first always comes)."""
    after = min(after, I64_MAX)
    total, end = 0, after
    for sequence, size in sizes(conn, child_id, after, limit):
        if sequence > last or (end > after and total + size > max_bytes):
            break
        end, total = sequence, total + size
    if end == after:
        return []
    rows = run(conn, _NUMBERED, (child_id, after, end)).fetchall()
    return [(int(sequence), bytes(body)) for sequence, body in rows]
