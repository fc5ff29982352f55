"""Control requests: an operator's cancel or steer, recorded by another process and
applied by the host that owns the database (design §11)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Connection

from delegation.store.sql import IN_LIST_MAX, chunks, run, spelling_of

_FIELDS = (
    "id, conversation_id, run_id, action, message, request_id, created_at, applied_at, outcome"
)


@dataclass(frozen=True, slots=True)
class ControlRecord:
    id: int
    conversation_id: str
    run_id: str | None
    action: str
    message: str
    request_id: str
    created_at: float
    applied_at: float | None
    outcome: str | None  # JSON, once applied


def submit(
    conn: Connection,
    conversation_id: str,
    run_id: str | None,
    action: str,
    message: str,
    request_id: str,
    now: float,
    *,
    notify: bool = False,
) -> int:
    """Record a control request; ``notify``: tell the hosts at commit (PostgreSQL's
    ``NOTIFY``; a SQLite host sees the file change by itself)."""
    if notify:
        wake(conn)
    cursor = run(
        conn,
        "INSERT INTO controls (conversation_id, run_id, action, message, request_id, created_at)"
        " VALUES (?, ?, ?, ?, ?, ?) RETURNING id",
        (conversation_id, run_id, action, message, request_id, now),
    )
    return int(cursor.fetchone()[0])


def submit_cancels(conn: Connection, keys: Sequence[tuple[str, str | None]], now: float) -> None:
    """Record a cancel request for each execution (conversation id, run id), up to 500 a
    statement, and tell the hosts at commit (as :func:`submit` with ``notify``)."""
    if not keys:
        return
    wake(conn)
    for part in chunks(keys):
        marks = ", ".join("(?, ?, 'cancel', '', '', ?)" for _ in part)
        params = [value for conversation, run_id in part for value in (conversation, run_id, now)]
        run(
            conn,
            "INSERT INTO controls (conversation_id, run_id, action, message, request_id,"
            f" created_at) VALUES {marks}",
            tuple(params),
        )


CHANNEL = "delegation"  # what hosts LISTEN to on PostgreSQL


def wake(conn: Connection) -> None:
    """Wake every host at commit ("c": a control request, or a steer, to look at)."""
    sql = spelling_of(conn).wake
    if sql is not None:
        run(conn, sql, (CHANNEL,))


def pending(conn: Connection) -> list[ControlRecord]:
    """Control requests not applied yet, oldest first (through ix_controls_pending)."""
    rows = run(
        conn, f"SELECT {_FIELDS} FROM controls WHERE applied_at IS NULL ORDER BY id"
    ).fetchall()
    return [ControlRecord(*row) for row in rows]


def get(conn: Connection, control_id: int) -> ControlRecord | None:
    row = run(conn, f"SELECT {_FIELDS} FROM controls WHERE id = ?", (control_id,)).fetchone()
    return None if row is None else ControlRecord(*row)


def applied(conn: Connection, control_id: int, outcome: str, now: float) -> None:
    run(
        conn,
        "UPDATE controls SET applied_at = ?, outcome = ? WHERE id = ? AND applied_at IS NULL",
        (now, outcome, control_id),
    )


def applied_many(conn: Connection, outcomes: Sequence[tuple[int, str]], now: float) -> None:
    """:func:`applied` of many (control id, outcome), one statement per 250."""
    for part in chunks(outcomes, IN_LIST_MAX // 2):
        values = ", ".join("(CAST(? AS BIGINT), CAST(? AS TEXT))" for _ in part)
        params = [value for pair in part for value in pair]
        run(
            conn,
            f"WITH v (cid, coutcome) AS (VALUES {values}) UPDATE controls"
            " SET applied_at = ?, outcome = v.coutcome FROM v"
            " WHERE controls.id = v.cid AND controls.applied_at IS NULL",
            (*params, now),
        )


def set_outcome(conn: Connection, control_id: int, outcome: str) -> None:
    run(conn, "UPDATE controls SET outcome = ? WHERE id = ?", (outcome, control_id))
