"""Control requests: an operator's cancel, steer, answer, event, unpin or rewind, recorded
by another process and applied by the host that owns the database (design §11, §21, §33).

The controls are declared here once, as types (:data:`Control`), and decoded once from
a row (:func:`decoded`): a control is kept as its action (the tag), a message and a
request id, as the table has always held them: a steer's message is its text, an
answer's, an event's and a rewind's are their fields as JSON (``{"inputId", "decision",
"text"}``, ``{"key", "payload"}``, ``{"step"}``). Rows written by earlier versions
decode the same."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from sqlalchemy import Connection

from delegation import errors
from delegation.store.sql import IN_LIST_MAX, chunks, run, spelling_of


class Cancel(msgspec.Struct, frozen=True, tag="cancel"):
    """Cancel the execution (its run is stopped; ``state`` ``cancelled``)."""


class Steer(msgspec.Struct, frozen=True, tag="steer"):
    """Give the running execution a new heading (idempotent per request id)."""

    message: str


class InputAnswer(msgspec.Struct, frozen=True, tag="input", rename="camel"):
    """Answer the execution's open input request ``input_id``: ``decision`` one of its
    options (an approval's ``approve`` or ``deny``), or ``text`` for one without."""

    input_id: str
    decision: str = ""
    text: str = ""


class EventSend(msgspec.Struct, frozen=True, tag="event"):
    """Send the event ``key`` with ``payload`` (any JSON) to the conversation's live
    execution, for a ``ctx.wait_event``; the request id, if any, sends it once."""

    key: str
    payload: Any = None


class Unpin(msgspec.Struct, frozen=True, tag="unpin"):
    """Let the current code resume a child its version pinned (design §34)."""


class Rewind(msgspec.Struct, frozen=True, tag="rewind"):
    """Run the conversation again from its ended execution (the control's run id):
    seeded with the steps it recorded before ``step`` (None: every step), under the
    conversation's live lease (design §35); the request id makes it once."""

    step: str | None = None


Control = Cancel | Steer | InputAnswer | EventSend | Unpin | Rewind

ACTIONS = ("cancel", "steer", "input", "event", "unpin", "rewind")
_object = msgspec.json.Decoder(dict[str, Any])
_encoder = msgspec.json.Encoder()


def message_of(control: Control) -> tuple[str, str]:
    """The action and message a control is kept as."""
    match control:
        case Cancel():
            return "cancel", ""
        case Unpin():
            return "unpin", ""
        case Steer(message=message):
            return "steer", message
        case InputAnswer() | EventSend() | Rewind():
            fields = msgspec.to_builtins(control)
            action = fields.pop("type")
            return action, _encoder.encode(fields).decode()


def decoded(action: str, message: str) -> Control:
    """The control kept as ``action`` and ``message``.

    Raises:
        errors.MalformedInput: a row no version of this code writes.
    """
    if action == "cancel":
        return Cancel()
    if action == "unpin":
        return Unpin()
    if action == "steer":
        return Steer(message)
    if action not in ACTIONS:
        raise errors.MalformedInput(f"malformed control request: unknown action {action!r}")
    try:
        # Earlier versions wrote the field not given as null ({"decision": null, ...}).
        fields = {k: v for k, v in _object.decode(message).items() if v is not None}
        fields["type"] = action  # the tag is kept in its own column
        control: Control = msgspec.convert(fields, Control)
        return control
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise errors.MalformedInput(f"malformed control request: {exc}") from None


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


def listed(
    conn: Connection, conversation_id: str | None, limit: int, *, pending_only: bool = False
) -> list[ControlRecord]:
    """The newest ``limit`` control requests, of one conversation or of all (through
    ix_controls_conversation, or the primary key), newest first; ``pending_only``: those
    not applied yet."""
    where = ["applied_at IS NULL"] if pending_only else []
    params: list[object] = []
    if conversation_id is not None:
        where.append("conversation_id = ?")
        params.append(conversation_id)
    clause = f" WHERE {' AND '.join(where)}" if where else ""
    rows = run(
        conn, f"SELECT {_FIELDS} FROM controls{clause} ORDER BY id DESC LIMIT ?", (*params, limit)
    ).fetchall()
    return [ControlRecord(*row) for row in rows]


def by_request(
    conn: Connection, conversation_id: str, action: str, request_id: str
) -> ControlRecord | None:
    """The control request given with ``request_id`` for the conversation, if any."""
    row = run(
        conn,
        f"SELECT {_FIELDS} FROM controls WHERE conversation_id = ? AND action = ?"
        " AND request_id = ? ORDER BY id LIMIT 1",
        (conversation_id, action, request_id),
    ).fetchone()
    return None if row is None else ControlRecord(*row)


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
