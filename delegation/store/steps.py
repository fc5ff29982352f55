"""The step journal (design §15): each step an execution recorded, by child and name.

Each step also keeps the runner version that recorded it and the newest attempt that
asked for it (design §34): a replayed step's attempt is written in batches, with the
next step recorded or when the attempt ends or waits (:func:`mark_asked`).

A patch marker (``ctx.patched``, design §34) is a step of a reserved kind: its name
begins with :data:`PATCH_PREFIX`, a control character no step a run names may begin
with (the journal refuses it), so a marker and a step can never share a name. A prefix
rather than a column of its own: the name is the step's key, so the uniqueness of
(child, name) keeps one marker of a name per execution with no new index, and every
read of a step reads a marker alike.

The statements are plain SQL both stores spell alike (named parameters, ``ON CONFLICT``
as SQLite and PostgreSQL both write it).
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Connection, bindparam, text

from delegation import errors
from delegation.records import RecordedStep, StepRow
from delegation.store.children import ACTIVE_TERM
from delegation.store.sql import chunks, run, stored_time

# What a patch marker's name begins with (see the module): U+001F, the unit separator.
PATCH_PREFIX = "\x1fpatch:"

_RECORD = text(
    "INSERT INTO steps (child_id, name, ordinal, raw, value, recorded_at, version,"
    " asked_attempt, first_sequence, last_sequence) VALUES (:child_id, :name, :ordinal,"
    " :raw, :value, :now, :version, :attempt, :first_sequence, :last_sequence)"
    " ON CONFLICT (child_id, name) DO NOTHING"
)
# The events the execution's steps' own functions emitted: never matched on a resume.
_OWN = (
    "SELECT first_sequence, last_sequence FROM steps WHERE child_id = ?"
    " AND last_sequence > first_sequence ORDER BY first_sequence"
)
_ASKED = text(
    "UPDATE steps SET asked_attempt = :attempt WHERE child_id = :child_id"
    " AND name IN :names AND (asked_attempt IS NULL OR asked_attempt < :attempt)"
).bindparams(bindparam("names", expanding=True))
_VERSIONS = text(
    "SELECT ordinal, version FROM steps WHERE child_id = :child_id"
    " AND ordinal IN :ordinals AND version IS NOT NULL"
).bindparams(bindparam("ordinals", expanding=True))
# The steps the newest attempt (recovery attempts and wakes) never asked for; none
# unless one step of the execution has an attempt (those before design §34 have none).
_DRIFT = text(
    "SELECT s.name FROM steps s JOIN children c ON c.id = s.child_id"
    " WHERE s.child_id = :child_id AND substr(s.name, 1, 1) <> :reserved"
    " AND COALESCE(s.asked_attempt, -1) < c.recovery_attempts + c.wakes"
    " AND EXISTS (SELECT 1 FROM steps t WHERE t.child_id = :child_id"
    " AND t.asked_attempt IS NOT NULL) ORDER BY s.ordinal LIMIT :limit"
)
_PATCH = text(
    "SELECT c.id, s.raw, s.value FROM children c LEFT JOIN steps s"
    " ON s.child_id = c.id AND s.name = :name"
    f" WHERE c.{ACTIVE_TERM} ORDER BY c.id DESC LIMIT :limit"
)
_VALUE = text("SELECT raw, value FROM steps WHERE child_id = :child_id AND name = :name")
_NAMES = text("SELECT name FROM steps WHERE child_id = :child_id ORDER BY ordinal")
_LIST = text(
    "SELECT name, ordinal, length(value), recorded_at FROM steps"
    " WHERE child_id = :child_id ORDER BY ordinal LIMIT :limit"
)
_LATEST = text(
    "SELECT name, ordinal, length(value), recorded_at FROM steps"
    " WHERE child_id = :child_id ORDER BY ordinal DESC LIMIT :limit"
)
_OF_RUN = text(
    "SELECT s.raw, s.value FROM steps s JOIN children c ON c.id = s.child_id"
    " WHERE c.run_id = :run_id AND c.conversation_id = :conversation AND s.name = :name"
)
_RUN_OF = text("SELECT 1 FROM children WHERE run_id = :run_id AND conversation_id = :conversation")
_PREVIOUS = text(
    "SELECT run_id FROM children WHERE conversation_id = :conversation AND id < :child_id"
    " ORDER BY id DESC LIMIT 1"
)
_COUNT = text("SELECT count(*) FROM steps WHERE child_id = :child_id")


def record(
    conn: Connection,
    child_id: int,
    name: str,
    ordinal: int,
    step: RecordedStep,
    now: float,
    *,
    version: str | None = None,
    attempt: int | None = None,
    sequences: tuple[int | None, int | None] = (None, None),
) -> RecordedStep:
    """Record a step, by the runner ``version`` (None: unversioned) in ``attempt`` (0:
    the first run), with ``sequences``: the execution's last numbered event when its
    function began and when it returned (the events between are its own; those up to
    the second are what a rewind to a later step copies with it, design §35); what is
    recorded under the name: this one, or (if another process recorded the name first)
    that one — a step is recorded at most once."""
    params = {
        "child_id": child_id,
        "name": name,
        "ordinal": ordinal,
        "raw": int(step.raw),
        "value": step.value,
        "now": now,
        "version": version,
        "attempt": attempt,
        "first_sequence": sequences[0],
        "last_sequence": sequences[1],
    }
    if conn.execute(_RECORD, params).rowcount == 1:
        return step
    first = value(conn, child_id, name)
    assert first is not None  # the conflict was this row; steps leave only with the child
    return first


def own_events(conn: Connection, child_id: int) -> list[tuple[int, int]]:
    """The ranges of sequences (after the first, up to the second) the execution's steps'
    own functions emitted, by their start (none for steps recorded before 0018)."""
    return [(int(a), int(b)) for a, b in run(conn, _OWN, (child_id,)).fetchall()]


def mark_asked(conn: Connection, child_id: int, names: Sequence[str], attempt: int) -> None:
    """Attempt ``attempt`` asked for these recorded steps (replayed them): one statement
    per thousand names; a newer attempt's mark is never lowered."""
    for part in chunks(list(names)):
        conn.execute(_ASKED, {"child_id": child_id, "names": part, "attempt": attempt})


def versions(conn: Connection, child_id: int, ordinals: Sequence[int]) -> dict[int, str]:
    """The runner version that recorded each of these steps, by ordinal (an unversioned
    step is left out)."""
    found: dict[int, str] = {}
    for part in chunks(list(ordinals)):
        rows = conn.execute(_VERSIONS, {"child_id": child_id, "ordinals": part})
        found.update({int(ordinal): str(version) for ordinal, version in rows})
    return found


def drift(conn: Connection, child_id: int, limit: int = 10_000) -> list[str]:
    """The recorded steps the execution's newest attempt never asked for, oldest first
    (patch markers left out: a marker no code asks for any more is a patch retired)."""
    params = {"child_id": child_id, "reserved": PATCH_PREFIX[0], "limit": limit}
    return [name for (name,) in conn.execute(_DRIFT, params)]


def patch_values(conn: Connection, name: str, limit: int) -> list[tuple[int, bool | None]]:
    """The live (unfinished) executions, newest first, and the value each recorded for
    the patch ``name`` (None: not asked yet)."""
    params = {"name": PATCH_PREFIX + name, "limit": limit}
    return [
        (int(child_id), None if value is None else bytes(value) == b"true")
        for child_id, _, value in conn.execute(_PATCH, params)
    ]


def value(conn: Connection, child_id: int, name: str) -> RecordedStep | None:
    row = conn.execute(_VALUE, {"child_id": child_id, "name": name}).first()
    return None if row is None else RecordedStep(bool(row[0]), bytes(row[1]))


def of_run(conn: Connection, conversation_id: str, run_id: str, name: str) -> RecordedStep | None:
    """A step of the execution ``run_id`` of the conversation (a follow-up's history).

    Raises:
        errors.ChildNotFound: no execution ``run_id`` in this conversation.
    """
    params = {"run_id": run_id, "conversation": conversation_id, "name": name}
    row = conn.execute(_OF_RUN, params).first()
    if row is not None:
        return RecordedStep(bool(row[0]), bytes(row[1]))
    if conn.execute(_RUN_OF, params).first() is None:
        raise errors.ChildNotFound(f"child not found: no execution {run_id} in this conversation")
    return None


def previous_run_id(conn: Connection, conversation_id: str, child_id: int) -> str | None:
    """The execution of the conversation before ``child_id``'s, if any."""
    params = {"conversation": conversation_id, "child_id": child_id}
    return conn.execute(_PREVIOUS, params).scalar()


def names(conn: Connection, child_id: int) -> list[str]:
    """The names an execution recorded, in the order it recorded them."""
    return [name for (name,) in conn.execute(_NAMES, {"child_id": child_id})]


def count(conn: Connection, child_id: int) -> int:
    return int(conn.execute(_COUNT, {"child_id": child_id}).scalar_one())


def listing(conn: Connection, child_id: int, limit: int = 10_000) -> list[StepRow]:
    """Each step's name, place, size and time (never its value), oldest first."""
    rows = conn.execute(_LIST, {"child_id": child_id, "limit": limit})
    return [StepRow(name, ordinal, int(size), stored_time(at)) for name, ordinal, size, at in rows]


def latest(conn: Connection, child_id: int, limit: int) -> list[StepRow]:
    """The last ``limit`` steps of :func:`listing`, oldest first (what an execution
    did last, when it recorded more than an operator's view shows)."""
    rows = conn.execute(_LATEST, {"child_id": child_id, "limit": limit})
    found = [StepRow(name, ordinal, int(size), stored_time(at)) for name, ordinal, size, at in rows]
    return found[::-1]
