"""A rewind's rows (design §35): the point of an ended execution, and the copy that
seeds a new execution of the conversation from it.

The copy is a few ``INSERT … SELECT`` statements in the transaction that reserves the
new execution: the steps the source recorded before the point (with their versions and
times, never marked asked), the events up to the last one committed with them (the
same sequence numbers, the same bodies), the waits those steps closed (answered inputs
stay answered), and, offered again to the conversation, the events the source's later
waits took. The source's own rows are only read. The statements are plain SQL both
stores spell alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, text

from delegation.store.steps import PATCH_PREFIX
from delegation.wire import MAX_STEP_NAME_BYTES

# The point: the named step's place (every step when none is named) and the last event
# committed with the steps before it (NULL for steps recorded before revision 0018).
_STEP = text("SELECT ordinal FROM steps WHERE child_id = :source AND name = :name")
_BEFORE = text(
    "SELECT count(*), COALESCE(MAX(last_sequence), 0) FROM steps"
    " WHERE child_id = :source AND ordinal < :ordinal"
)
_ALL = text("SELECT COALESCE(MAX(ordinal), 0) FROM steps WHERE child_id = :source")
_STEPS = text(
    "INSERT INTO steps (child_id, name, ordinal, raw, value, recorded_at, version,"
    " first_sequence, last_sequence) SELECT :child, name, ordinal, raw, value, recorded_at,"
    " version, first_sequence, last_sequence FROM steps"
    " WHERE child_id = :source AND ordinal < :ordinal"
)
_EVENTS = text(
    "INSERT INTO events (child_id, sequence, body) SELECT :child, sequence, body"
    " FROM events WHERE child_id = :source AND sequence <= :last"
)
_WAITS = text(
    "INSERT INTO waits (child_id, name, kind, prompt, options, tool_name, tool_call_id,"
    " input, event_key, expires_at, created_at, answered_at, answer, request_id, closed_at)"
    " SELECT :child, w.name, w.kind, w.prompt, w.options, w.tool_name, w.tool_call_id,"
    " w.input, w.event_key, w.expires_at, w.created_at, w.answered_at, w.answer,"
    " w.request_id, w.closed_at FROM waits w JOIN steps s ON s.child_id = w.child_id"
    " AND s.name = w.name WHERE w.child_id = :source AND s.ordinal < :ordinal"
    " AND w.closed_at IS NOT NULL"
)
# The events the source's waits after the point took, offered again, oldest taken first:
# among those not taken, one a key is kept (the first wins, as a send), so an event
# sent meanwhile and not taken yet stays the one a wait for its key gets.
_OFFER = text(
    "INSERT INTO signals (conversation_id, key, payload, sent_at)"
    " SELECT :conversation, w.event_key, w.answer, :now FROM waits w"
    " WHERE w.child_id = :source AND w.kind = 'event' AND w.answered_at IS NOT NULL"
    " AND NOT EXISTS (SELECT 1 FROM steps s WHERE s.child_id = w.child_id"
    " AND s.name = w.name AND s.ordinal < :ordinal) ORDER BY w.answered_at, w.name"
    " ON CONFLICT DO NOTHING"
)
_COPIED = text(
    "SELECT (SELECT count(*) FROM steps WHERE child_id = :child),"
    " (SELECT COALESCE(MAX(sequence), 0) FROM events WHERE child_id = :child)"
)
_REWOUND_AS = text(
    "SELECT run_id FROM children WHERE rewound_from = :run_id ORDER BY id LIMIT :limit"
)


@dataclass(frozen=True, slots=True)
class Point:
    """Where a rewind of the execution ``source`` starts: its steps with an ordinal
    below ``ordinal`` are copied (``steps`` of them), with its events up to ``last``."""

    source: int
    ordinal: int
    steps: int
    last: int


def point(conn: Connection, source: int, step: str | None) -> Point | None:
    """The point before ``step`` of the execution ``source`` (after its last step when
    None); None when it recorded no step by that name (a patch marker is no point)."""
    if step is None:
        ordinal = int(conn.execute(_ALL, {"source": source}).scalar_one()) + 1
    else:
        if not step or step.startswith(PATCH_PREFIX[0]) or len(step) > MAX_STEP_NAME_BYTES:
            return None  # no recorded step has such a name (UTF-8 bytes >= characters)
        found = conn.execute(_STEP, {"source": source, "name": step}).scalar()
        if found is None:
            return None
        ordinal = int(found)
    count, last = conn.execute(_BEFORE, {"source": source, "ordinal": ordinal}).one()
    return Point(source, ordinal, int(count), int(last))


def seed(conn: Connection, child_id: int, conversation_id: str, at: Point, now: float) -> None:
    """Seed the new execution ``child_id`` from ``at`` (see the module); the caller
    writes its ``rewind`` event after ``at.last``."""
    copy = {"child": child_id, "source": at.source, "ordinal": at.ordinal}
    conn.execute(_STEPS, copy)
    conn.execute(_EVENTS, {"child": child_id, "source": at.source, "last": at.last})
    conn.execute(_WAITS, copy)
    offer = {"conversation": conversation_id, "source": at.source, "ordinal": at.ordinal}
    conn.execute(_OFFER, {**offer, "now": now})


def copied(conn: Connection, child_id: int) -> tuple[int, int]:
    """How many steps the execution holds, and its last event's sequence (a rewound
    execution's first run: what it was seeded with, and its ``rewind`` event)."""
    steps, last = conn.execute(_COPIED, {"child": child_id}).one()
    return int(steps), int(last)


def rewound_as(conn: Connection, run_id: str, limit: int = 100) -> list[str]:
    """The executions rewound from the execution ``run_id``, oldest first."""
    return [str(r) for (r,) in conn.execute(_REWOUND_AS, {"run_id": run_id, "limit": limit})]
