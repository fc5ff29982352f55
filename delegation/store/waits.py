"""What a child waits for (design §21): its waits (input requests, event waits, sleeps),
the events sent to a conversation, and when a waiting child wakes.

Plain SQL both stores spell alike. A wait is named as its step is; ``inputs_open`` on
the child counts its input requests not yet answered nor closed, so that a read of a
child that never asked costs nothing more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from delegation.store.sql import Connection, run, stored_time

INPUT_KINDS = ("input", "approval")
_FIELDS = (
    "name, kind, prompt, options, tool_name, tool_call_id, input, event_key, expires_at,"
    " created_at, answered_at, answer, request_id, closed_at"
)


@dataclass(frozen=True, slots=True)
class WaitRow:
    name: str
    kind: str
    prompt: str
    options: str | None  # JSON list
    tool_name: str
    tool_call_id: str
    input: str
    event_key: str | None
    expires_at: float | None
    created_at: float
    answered_at: float | None
    answer: bytes | None  # JSON
    request_id: str | None
    closed_at: float | None

    @property
    def answered(self) -> bool:
        return self.answered_at is not None

    @property
    def closed(self) -> bool:
        return self.closed_at is not None

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at


def _row(row: Sequence[Any]) -> WaitRow:
    values = list(row)
    for i in (8, 9, 10, 13):  # the times
        if values[i] is not None:
            values[i] = stored_time(values[i])
    if values[11] is not None:
        values[11] = bytes(values[11])
    return WaitRow(*values)


def get(conn: Connection, child_id: int, name: str) -> WaitRow | None:
    found = run(
        conn, f"SELECT {_FIELDS} FROM waits WHERE child_id = ? AND name = ?", (child_id, name)
    ).fetchone()
    return None if found is None else _row(found)


def insert(
    conn: Connection,
    child_id: int,
    name: str,
    kind: str,
    now: float,
    *,
    prompt: str = "",
    options: str | None = None,
    tool_name: str = "",
    tool_call_id: str = "",
    input_text: str = "",
    event_key: str | None = None,
    expires_at: float | None = None,
) -> bool:
    """Record a new wait; False (nothing written) when the execution has one by that
    name already. An input request counts as open on its child."""
    inserted = run(
        conn,
        "INSERT INTO waits (child_id, name, kind, prompt, options, tool_name, tool_call_id,"
        " input, event_key, expires_at, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
        " ON CONFLICT (child_id, name) DO NOTHING RETURNING 1",
        (
            child_id, name, kind, prompt, options, tool_name, tool_call_id, input_text,
            event_key, expires_at, now,
        ),
    ).fetchone()  # fmt: skip
    if inserted is not None and kind in INPUT_KINDS:
        run(conn, "UPDATE children SET inputs_open = inputs_open + 1 WHERE id = ?", (child_id,))
    return inserted is not None


def open_inputs(conn: Connection, child_id: int) -> list[WaitRow]:
    """The execution's input requests neither answered nor closed, oldest first."""
    rows = run(
        conn,
        f"SELECT {_FIELDS} FROM waits WHERE child_id = ? AND kind IN ('input', 'approval')"
        " AND answered_at IS NULL AND closed_at IS NULL ORDER BY created_at, name",
        (child_id,),
    ).fetchall()
    return [_row(row) for row in rows]


def answer(
    conn: Connection, child_id: int, name: str, value: bytes, request_id: str | None, now: float
) -> bool:
    """Answer an open wait (an input request, or an event wait given its event); False
    when it was answered or closed already. An input request answered is no longer open."""
    changed = run(
        conn,
        "UPDATE waits SET answered_at = ?, answer = ?, request_id = ? WHERE child_id = ?"
        " AND name = ? AND answered_at IS NULL AND closed_at IS NULL RETURNING kind",
        (now, value, request_id, child_id, name),
    ).fetchone()
    if changed is not None and changed[0] in INPUT_KINDS:
        _one_less(conn, child_id)
    return changed is not None


def close(conn: Connection, child_id: int, name: str, now: float) -> None:
    """The run recorded the wait's step: it is over (an input request that was never
    answered, timed out, is no longer open either)."""
    closed = run(
        conn,
        "UPDATE waits SET closed_at = ? WHERE child_id = ? AND name = ? AND closed_at IS NULL"
        " RETURNING kind, answered_at IS NULL",
        (now, child_id, name),
    ).fetchone()
    if closed is not None and closed[0] in INPUT_KINDS and closed[1]:
        _one_less(conn, child_id)


def _one_less(conn: Connection, child_id: int) -> None:
    run(
        conn,
        "UPDATE children SET inputs_open = inputs_open - 1 WHERE id = ? AND inputs_open > 0",
        (child_id,),
    )


def ready(conn: Connection, child_id: int, conversation_id: str, now: float) -> bool:
    """Whether one of the execution's open waits can end now: answered, past its time,
    or an event wait whose event was sent and is not taken."""
    found = run(
        conn,
        "SELECT 1 FROM waits w WHERE w.child_id = ? AND w.closed_at IS NULL AND"
        " (w.answered_at IS NOT NULL OR w.expires_at <= ? OR (w.kind = 'event' AND EXISTS"
        " (SELECT 1 FROM signals s WHERE s.conversation_id = ? AND s.key = w.event_key"
        " AND s.taken_at IS NULL))) LIMIT 1",
        (child_id, now, conversation_id),
    ).fetchone()
    return found is not None


def earliest(conn: Connection, child_id: int) -> float | None:
    """The earliest time one of the execution's open waits ends by itself (a timeout, a
    sleep's wake time); None when only an answer or an event ends them."""
    value = run(
        conn,
        "SELECT MIN(expires_at) FROM waits WHERE child_id = ? AND closed_at IS NULL"
        " AND answered_at IS NULL",
        (child_id,),
    ).fetchone()[0]
    return None if value is None else stored_time(value)


def event_waits(conn: Connection, child_id: int, key: str) -> list[str]:
    """The names of the execution's open event waits for ``key``, oldest first."""
    rows = run(
        conn,
        "SELECT name FROM waits WHERE child_id = ? AND kind = 'event' AND event_key = ?"
        " AND answered_at IS NULL AND closed_at IS NULL ORDER BY created_at, name",
        (child_id, key),
    ).fetchall()
    return [name for (name,) in rows]


# --- events sent to a conversation -------------------------------------------------


def send(
    conn: Connection,
    conversation_id: str,
    key: str,
    payload: bytes,
    idempotency_key: str | None,
    now: float,
) -> int | None:
    """Keep an event for the conversation: its id, or None when one with this key is
    kept already and not taken (the first wins), or this idempotency key was sent."""
    found = run(
        conn,
        "INSERT INTO signals (conversation_id, key, payload, idempotency_key, sent_at)"
        " VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING RETURNING id",
        (conversation_id, key, payload, idempotency_key, now),
    ).fetchone()
    return None if found is None else int(found[0])


def was_sent(conn: Connection, conversation_id: str, idempotency_key: str) -> bool:
    """Whether an event with this idempotency key was kept for the conversation."""
    return (
        run(
            conn,
            "SELECT 1 FROM signals WHERE conversation_id = ? AND idempotency_key = ?",
            (conversation_id, idempotency_key),
        ).fetchone()
        is not None
    )


def untaken(conn: Connection, conversation_id: str) -> int:
    """How many events wait to be taken in the conversation."""
    return int(
        run(
            conn,
            "SELECT count(*) FROM signals WHERE conversation_id = ? AND taken_at IS NULL",
            (conversation_id,),
        ).fetchone()[0]
    )


def take(
    conn: Connection, conversation_id: str, key: str, child_id: int, now: float
) -> bytes | None:
    """Take the conversation's event ``key`` for the execution ``child_id``: its payload,
    or None when none is kept."""
    found = run(
        conn,
        "UPDATE signals SET taken_by = ?, taken_at = ? WHERE id = (SELECT id FROM signals"
        " WHERE conversation_id = ? AND key = ? AND taken_at IS NULL ORDER BY id LIMIT 1)"
        " RETURNING payload",
        (child_id, now, conversation_id, key),
    ).fetchone()
    return None if found is None else bytes(found[0])


# --- waking -------------------------------------------------------------------------


def wake_at(conn: Connection, child_id: int, at: float) -> bool:
    """Wake the waiting child at ``at`` (now: what it waited for came), unless it wakes
    earlier already; False when it is not waiting."""
    changed = run(
        conn,
        "UPDATE children SET wake_at = CASE WHEN wake_at IS NULL OR wake_at > ? THEN ?"
        " ELSE wake_at END WHERE id = ? AND state = 'waiting' RETURNING id",
        (at, at, child_id),
    ).fetchone()
    return changed is not None


def due(conn: Connection, instance_id: str, now: float, limit: int) -> list[int]:
    """This host instance's waiting children due to wake, earliest first."""
    rows = run(
        conn,
        "SELECT id FROM children WHERE state = 'waiting' AND engine_instance_id = ?"
        " AND wake_at <= ? ORDER BY wake_at LIMIT ?",
        (instance_id, now, limit),
    ).fetchall()
    return [int(child_id) for (child_id,) in rows]


def next_wake(conn: Connection, instance_id: str) -> float | None:
    """When this host instance's next waiting child wakes (None: none has a time)."""
    value = run(
        conn,
        "SELECT MIN(wake_at) FROM children WHERE state = 'waiting' AND engine_instance_id = ?"
        " AND wake_at IS NOT NULL",  # past the NULLs (no time) of ix_children_waking at once
        (instance_id,),
    ).fetchone()[0]
    return None if value is None or isinstance(value, str | bytes) else float(value)


def woken_by(conn: Connection, child_id: int) -> str:
    """Why a waiting execution wakes: ``input`` (an answer, or an input's timeout),
    ``event`` (an event, or its timeout) or ``sleep``: an answered wait first."""
    rows = run(
        conn,
        "SELECT kind, answer IS NOT NULL FROM waits WHERE child_id = ? AND closed_at IS NULL"
        " ORDER BY answer IS NULL, name",
        (child_id,),
    ).fetchall()
    kind = str(rows[0][0]) if rows else "sleep"
    return "input" if kind in INPUT_KINDS else kind if kind in ("event", "sleep") else "sleep"
