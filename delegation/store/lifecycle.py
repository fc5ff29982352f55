"""The set-based SQL of the engine's own use cases: boot reconciliation, lease expiry
and retention (design §7). :mod:`delegation.usecases.maintenance` orders them; each statement
acts on every row it concerns at once, so a boot stays fast with thousands of children.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from typing import NamedTuple

import msgspec
from sqlalchemy import Connection, TextClause, text

from delegation import errors
from delegation.machine import TERMINAL, Outcome, State, Trigger, sources, target
from delegation.records import RECOVERY_KIND, Resumable
from delegation.store import children, events
from delegation.store.children import ACTIVE_TERM
from delegation.store.sql import Spelling, chunks, spelling_of

_encoder = msgspec.json.Encoder()


# Where a statement reads the unfinished children through ix_children_one_active: a
# named field each store's ``Spelling.active`` fills (see ``_q``).
ACTIVE = "{active}"


def q(conn: Connection, sql: str) -> TextClause:
    """``sql``, reading the unfinished children as ``conn``'s store spells it: compiled
    once per store and statement."""
    return _statement(spelling_of(conn), sql)


@cache
def _statement(spelling: Spelling, sql: str) -> TextClause:
    return text(sql.format(active=spelling.active))


def _recovery_event(sequence: int, message: str) -> bytes:
    return _encoder.encode({"sequence": sequence, "kind": RECOVERY_KIND, "text": message})


PREPARED, ADMITTED, RUNNING = State.PREPARED.value, State.ADMITTED.value, State.RUNNING.value
WAITING, QUEUED = State.WAITING.value, State.QUEUED.value


def _fire(trigger: Trigger, among: list[str]) -> str:
    """``state = <target>`` for firing ``trigger`` from the states ``among``, taken from
    the state table (:mod:`delegation.machine`): a boot statement cannot move a child
    along a transition the table does not have.

    Raises:
        ValueError: ``trigger`` cannot fire from one of ``among``.
    """
    if not {State(name) for name in among} <= sources(trigger):
        raise ValueError(f"{trigger.value} cannot fire from {among}")
    return f"state = '{target(trigger).value}'"


_DUE = "kind = 'lease' AND revoked_at IS NULL AND expires_at < :now"
# The expiry reaches the children of due leases through their grant's index alone, so
# its plan needs no statistics. ``state IN (<unfinished>)`` implies the predicate of
# ix_children_one_active, and on a new database's statistics PostgreSQL read that whole
# index once per due lease beside the grant's (0.9 ms a lease: 4.6 s of 5,000); the
# unfinished named by what they are not (the same rows: ck_children_state) imply no
# partial index.
_UNENDED = f"state NOT IN ({', '.join(repr(s.value) for s in sorted(TERMINAL))})"
TAKEOVER_LOCK = 0x64656C6567617466  # PostgreSQL advisory lock key ("delegatf")
INSTANCE_LOCKS = 0x6465  # a host instance's own lock: (INSTANCE_LOCKS, hashtext(its id))
# The children a takeover acts on: owned by no instance, or by one that was taken over
# (by this host now, or by any earlier: what a fenced host wrote after its takeover is
# picked up by the next). A live host's children are never among them (design §12).
_BUSY_RETRY_S = 1.0  # another host holds the expiry: look again this much later
LOST = (
    "(engine_instance_id IS NULL OR engine_instance_id IN"
    " (SELECT id FROM engine_instances WHERE taken_by IS NOT NULL AND id != :me))"
)


def db_clock(conn: Connection) -> str:
    """SQL for the database's clock in epoch seconds: heartbeats and their deadlines
    are the database's, never a host's (hosts' clocks differ)."""
    return spelling_of(conn).clock


def take_instances(
    conn: Connection,
    me: str,
    now: float,
    timeout_s: float,
    *,
    everyone: bool,
    locks: bool = True,
    suspect_s: float = 0.0,
) -> list[str]:
    """Mark the instances this host takes over: closed ones not taken yet, and those
    without a heartbeat for ``timeout_s`` (``everyone``: every other one, as at the boot
    of the only host a SQLite file can have). Returns their ids.

    Only one host takes an instance (``taken_by``): on PostgreSQL the caller holds the
    takeover lock, and the rows are locked as they are marked.
    """
    # Dead: no heartbeat for timeout_s, or (PostgreSQL) nobody holds its lock any more,
    # which the server frees as soon as the host's process is gone (kill -9 included).
    # A restart or a failover frees every lock too, and so does any session the server
    # ends: once this host's own connection was lost and made again (not ``locks``), a
    # free lock may be a live host's that it has not taken again yet (it does before its
    # next heartbeat), so only the timeout counts.
    # A free lock counts only once the instance's heartbeat is older than two beats: a
    # live host whose session the server ended (a restart, pg_terminate_backend) holds
    # its lock again before its next beat, and a host that booted after that moment
    # never lost a connection of its own to tell it so.
    freed = spelling_of(conn).instance_lock_freed.format(clock=db_clock(conn)) if locks else ""
    dead = (
        "TRUE" if everyone else f"(COALESCE(heartbeat_at, 0) < {db_clock(conn)} - :timeout{freed})"
    )
    rows = conn.execute(
        text(
            "UPDATE engine_instances SET taken_by = :me, closed_at = COALESCE(closed_at, :now)"
            f" WHERE id != :me AND taken_by IS NULL AND (closed_at IS NOT NULL OR {dead})"
            " RETURNING id"
        ),
        {
            "me": me,
            "now": now,
            "timeout": timeout_s,
            "suspect": suspect_s,
            "locks": INSTANCE_LOCKS,
        },
    ).all()
    return [row[0] for row in rows]


def unproven_dead(conn: Connection, me: str, suspect_s: float) -> float:
    """Seconds until every other open instance whose lock is free has had no heartbeat
    for ``suspect_s``, on a server up for as long (0: none is waiting). A booting host
    waits that long before its takeover, so that a live host whose session the server
    just ended, or that the server's restart cut off (its lock free until its next
    beat), is not taken for dead, and a dead one is (PostgreSQL; 0 on SQLite)."""
    spelling = spelling_of(conn)
    free = spelling.instance_lock_free
    if not free:
        return 0.0
    clock = db_clock(conn)
    since = f"GREATEST(COALESCE(heartbeat_at, 0), {spelling.server_started})"
    sql = (
        f"SELECT MAX({since} + :suspect - {clock}) FROM engine_instances"
        " WHERE id != :me AND taken_by IS NULL AND closed_at IS NULL"
        f" AND {since} > {clock} - :suspect AND {free}"
    )
    value = conn.execute(
        text(sql), {"me": me, "suspect": suspect_s, "locks": INSTANCE_LOCKS}
    ).scalar()
    return min(max(float(value or 0.0), 0.0), suspect_s)


def heartbeat(conn: Connection, me: str) -> float | None:
    """Record this instance's heartbeat: the database's time of it, or None once
    another host has taken this instance over.

    On PostgreSQL only while its lock is held (by its host's lock connection): a beat
    then proves the lock was held on this server after it, so a free lock later proves
    the host's session ended (see :func:`take_instances`).

    Raises:
        errors.StoreUnavailable: the lock is not held (its session ended: the next beat
            takes it again first).
    """
    held = spelling_of(conn).instance_lock_held
    value = conn.execute(
        text(
            f"UPDATE engine_instances SET heartbeat_at = {db_clock(conn)}"
            f" WHERE id = :me AND taken_by IS NULL{held} RETURNING heartbeat_at"
        ),
        {"me": me, "locks": INSTANCE_LOCKS},
    ).scalar()
    if value is not None:
        return float(value)
    if held and _not_taken(conn, me):
        raise errors.StoreUnavailable()
    return None


def _not_taken(conn: Connection, me: str) -> bool:
    row = conn.execute(text("SELECT taken_by FROM engine_instances WHERE id = :me"), {"me": me})
    found = row.first()
    return found is not None and found[0] is None


def server_time(conn: Connection) -> float:
    """The database's clock, in epoch seconds."""
    return float(conn.execute(text(f"SELECT {db_clock(conn)}")).scalar_one())


EXPIRY_LOCK = TAKEOVER_LOCK + 1  # PostgreSQL: one host expires leases at a time
PURGE_LOCK = TAKEOVER_LOCK + 2  # and one purges


def first_to(conn: Connection, key: int) -> bool:
    """Whether this transaction may do the work ``key`` names now: on PostgreSQL, no
    other host is doing it (a transaction advisory lock, not waited for); SQLite has
    one host per file."""
    sql = spelling_of(conn).first_to
    return sql is None or bool(conn.execute(text(sql), {"k": key}).scalar())


def lost_processes(conn: Connection, me: str) -> list[tuple[int, int, str]]:
    """The recorded processes of the children a takeover acts on."""
    return [
        (int(pid), int(start), str(boot))
        for pid, start, boot in conn.execute(
            q(
                conn,
                "SELECT pid, start_ticks, boot_id FROM processes"
                f" WHERE child_id IN (SELECT id FROM {ACTIVE} WHERE {ACTIVE_TERM} AND {LOST})",
            ),
            {"me": me},
        )
    ]


def lock_lost(conn: Connection, me: str) -> bool:
    """Hold the rows of the children a takeover acts on until it commits (PostgreSQL):
    a cancel or finish another host commits meanwhile waits, then sees the takeover's
    result, instead of being overwritten between its statements. Whether there is any
    (SQLite: only looked for, its write transaction already excludes other writers)."""
    lock = spelling_of(conn).for_update
    # In the rows' order, which makes a deadlock with another host's bulk update rarer
    # (that one's order is its plan's); a heartbeat's takeover that meets one anyway
    # is undone alone (maintenance.heartbeat).
    sql = f"SELECT id FROM {ACTIVE} WHERE {ACTIVE_TERM} AND {LOST} ORDER BY id{lock}"
    return bool(conn.execute(q(conn, sql), {"me": me}).all())


def forget_lost_processes(conn: Connection, me: str) -> None:
    conn.execute(
        q(
            conn,
            "DELETE FROM processes WHERE child_id IN"
            f" (SELECT id FROM {ACTIVE} WHERE {ACTIVE_TERM} AND {LOST})",
        ),
        {"me": me},
    )


_LIVE_LEASE_CHILDREN = (
    "SELECT c.id FROM children c JOIN grants g ON g.id = c.grant_id"
    " WHERE g.kind = 'lease' AND g.revoked_at IS NULL AND g.expires_at >= :now"
)


def end_unadmitted(conn: Connection, me: str, error: str, now: float) -> dict[Outcome, int]:
    """Lost children never admitted end: cancelled if asked to, else done with ``error``.
    Returns how many ended, by outcome."""
    ended: dict[Outcome, int] = {}
    for outcome, statement in (
        (
            Outcome.CANCELLED,
            f"UPDATE {ACTIVE} SET {_fire(Trigger.STOP, [PREPARED])}, error = cancel_reason,"
            f" finished_at = :now, updated_at = :now WHERE {ACTIVE_TERM}"
            f" AND state = '{PREPARED}' AND cancel_requested_at IS NOT NULL AND {LOST}",
        ),
        # A cancel another host commits meanwhile is not overwritten: such a child stays
        # lost, and the next takeover ends it by the statement above.
        (
            Outcome.FAILED,
            f"UPDATE {ACTIVE} SET {_fire(Trigger.FINISH, [PREPARED])}, error = :error,"
            f" finished_at = :now, updated_at = :now WHERE {ACTIVE_TERM}"
            f" AND state = '{PREPARED}' AND cancel_requested_at IS NULL AND {LOST}",
        ),
    ):
        values = {"now": now, "error": error, "me": me}
        ended[outcome] = _count(conn.execute(q(conn, statement), values).rowcount)
    return ended


def _count(rowcount: int) -> int:
    return max(rowcount, 0)  # -1: a driver that cannot tell (never for an UPDATE here)


def settle_for_resume(
    conn: Connection, me: str, max_attempts: int, interrupted: str, now: float
) -> dict[Outcome, int]:
    """After a restart: finish the cancelled, suspend the running, and end what cannot
    be resumed (no live lease, or resumed ``max_attempts`` times). What is left lost and
    ``admitted`` is to resume (:func:`begin_resume`); a lost child left ``waiting`` or
    ``queued`` is this instance's now, as it was (design §21, §22: nothing of it runs).
    Returns how many ended, by outcome."""
    statements = (
        # Asked to cancel, and nothing runs them any more.
        f"UPDATE {ACTIVE} SET {_fire(Trigger.STOP, [ADMITTED, RUNNING, WAITING, QUEUED])},"
        " error = cancel_reason, finished_at = :now, updated_at = :now WHERE"
        f" {ACTIVE_TERM} AND state IN ('{ADMITTED}', '{RUNNING}', '{WAITING}', '{QUEUED}')"
        f" AND cancel_requested_at IS NOT NULL AND {LOST}",
        # Their host instance is gone.
        f"UPDATE {ACTIVE} SET {_fire(Trigger.SUSPEND, [RUNNING])}, updated_at = :now"
        f" WHERE {ACTIVE_TERM} AND state = '{RUNNING}' AND {LOST}",
        # Not under a live lease, or resumed too often: interrupted for good.
        f"UPDATE {ACTIVE} SET {_fire(Trigger.FINISH, [ADMITTED])}, error = :interrupted,"
        f" finished_at = :now, updated_at = :now WHERE {ACTIVE_TERM} AND state = '{ADMITTED}'"
        f" AND (id NOT IN ({_LIVE_LEASE_CHILDREN}) OR recovery_attempts >= :max) AND {LOST}",
    )
    values = {
        "now": now,
        "max": max_attempts,
        "interrupted": interrupted,
        "me": me,
    }
    ended: dict[Outcome, int] = {}
    for statement, outcome in zip(
        statements, (Outcome.CANCELLED, None, Outcome.FAILED), strict=True
    ):
        params = {k: v for k, v in values.items() if f":{k}" in statement}
        changed = conn.execute(q(conn, statement), params).rowcount
        if outcome is not None:
            ended[outcome] = _count(changed)
    conn.execute(
        q(
            conn,
            f"UPDATE {ACTIVE} SET engine_instance_id = :me, updated_at = :now"
            f" WHERE {ACTIVE_TERM} AND state IN ('{WAITING}', '{QUEUED}') AND {LOST}",
        ),
        {"me": me, "now": now},
    )
    return ended


class Stored(NamedTuple):
    """What a child left to resume stored, as stored."""

    id: int
    run_id: str
    request: bytes
    preset: bytes
    options: bytes | None
    policy: bytes | None  # its grant's


def stored_to_resume(conn: Connection, me: str) -> list[Stored]:
    """What each child left to resume (after :func:`settle_for_resume`) stored."""
    rows = conn.execute(
        q(
            conn,
            "SELECT c.id, c.run_id, c.request, c.preset, c.options, g.policy FROM (SELECT id,"
            f" run_id, grant_id, request, preset, options FROM {ACTIVE} WHERE {ACTIVE_TERM}"
            f" AND state = '{ADMITTED}' AND {LOST}) c LEFT JOIN grants g ON g.id = c.grant_id"
            " ORDER BY c.id",
        ),
        {"me": me},
    ).all()
    return [
        Stored(int(i), run_id, bytes(request), bytes(preset), _bytes(options), _bytes(policy))
        for i, run_id, request, preset, options, policy in rows
    ]


def _bytes(value: bytes | memoryview | None) -> bytes | None:
    return None if value is None else bytes(value)


def end_lost(conn: Connection, me: str, child_ids: list[int], error: str, now: float) -> int:
    """End these lost children left to resume ``done`` with ``error`` instead; returns
    how many ended."""
    ended = 0
    for ids in chunks(child_ids):
        marks = ", ".join(f":i{n}" for n in range(len(ids)))
        statement = (
            f"UPDATE {ACTIVE} SET {_fire(Trigger.FINISH, [ADMITTED])}, error = :error,"
            f" finished_at = :now, updated_at = :now WHERE {ACTIVE_TERM}"
            f" AND state = '{ADMITTED}' AND {LOST} AND id IN ({marks})"
        )
        values = {"error": error, "now": now, "me": me, **{f"i{n}": i for n, i in enumerate(ids)}}
        ended += _count(conn.execute(q(conn, statement), values).rowcount)
    return ended


def to_resume(conn: Connection, me: str) -> list[int]:
    """The children left to resume (after :func:`settle_for_resume`), by id."""
    rows = conn.execute(
        q(
            conn,
            f"SELECT id FROM {ACTIVE} WHERE {ACTIVE_TERM} AND state = '{ADMITTED}' AND {LOST}"
            " ORDER BY id",
        ),
        {"me": me},
    ).all()
    return [int(row[0]) for row in rows]


def begin_resume(
    conn: Connection, me: str, recovery_text: str, notes: Mapping[int, str] | None = None
) -> None:
    """Count one more recovery attempt of every child left to resume, and commit its
    ``recovery`` event (ended with its ``notes``, by child id: a new runner version)."""
    conn.execute(
        q(
            conn,
            f"UPDATE {ACTIVE} SET recovery_attempts = recovery_attempts + 1"
            f" WHERE {ACTIVE_TERM} AND state = '{ADMITTED}' AND {LOST}",
        ),
        {"me": me},
    )
    # The recovery events are encoded here, as the engine encodes events, so that both
    # stores hold the same bytes (SQLite's json_object and PostgreSQL's differ).
    resumed = conn.execute(
        q(
            conn,
            "SELECT id, recovery_attempts, COALESCE((SELECT MAX(sequence) FROM events e"
            f" WHERE e.child_id = children.id), 0) + 1 FROM {ACTIVE}"
            f" WHERE {ACTIVE_TERM} AND state = '{ADMITTED}' AND {LOST}",
        ),
        {"me": me},
    ).all()
    events.insert_events(
        conn,
        [
            events.EventRow(
                child_id,
                seq,
                _recovery_event(
                    seq, f"{recovery_text} (attempt {attempts}){(notes or {}).get(child_id, '')}"
                ),
                None,
            )
            for child_id, attempts, seq in resumed
        ],
    )


def expire_due(conn: Connection, reason: str, now: float) -> tuple[list[int], float | None]:
    """Expire every lease past its deadline: cancel its children, remove the lease.

    A lease is live at exactly ``expires_at`` and expired one tick after. Returns the
    children whose cancellation was requested and the next deadline, if any.
    """
    if not first_to(conn, EXPIRY_LOCK):  # another host expires them right now
        deadline = next_deadline(conn)
        return [], None if deadline is None else max(deadline, now + _BUSY_RETRY_S)
    under_due = f"grant_id IN (SELECT id FROM grants WHERE {_DUE})"
    affected = sorted(
        conn.execute(
            q(conn, f"SELECT id FROM children WHERE {_UNENDED} AND {under_due}"), {"now": now}
        ).scalars()
    )
    if affected:
        conn.execute(
            q(
                conn,
                "UPDATE children SET cancel_requested_at = :now, cancel_reason = :reason,"
                f" updated_at = :now, grant_id = NULL WHERE {_UNENDED}"
                f" AND cancel_requested_at IS NULL AND {under_due}",
            ),
            {"now": now, "reason": reason},
        )
    # What the leases' removal does to their children (ON DELETE SET NULL), set-based:
    # PostgreSQL's foreign key would run one UPDATE per lease (0.3 s of 5,000).
    conn.execute(q(conn, f"UPDATE children SET grant_id = NULL WHERE {under_due}"), {"now": now})
    conn.execute(q(conn, f"DELETE FROM grants WHERE {_DUE}"), {"now": now})
    return affected, next_deadline(conn)


def next_deadline(conn: Connection) -> float | None:
    """The earliest expiry of a live lease (None: none). SQLite orders every number
    before any text, so a text here means no lease has an expiry that is a number."""
    value = conn.execute(
        q(conn, "SELECT MIN(expires_at) FROM grants WHERE kind = 'lease' AND revoked_at IS NULL")
    ).scalar()
    return None if value is None or isinstance(value, str | bytes) else float(value)


def resumables(conn: Connection, instance_id: str, now: float) -> list[Resumable]:
    """Every lost child left admitted, set running under this instance in one statement."""
    lost = f"{ACTIVE_TERM} AND state = '{ADMITTED}' AND {LOST}"
    return _resumables(conn, lost, {"me": instance_id}, instance_id, now)


def woken(conn: Connection, child_ids: list[int], instance_id: str, now: float) -> list[Resumable]:
    """These children, just woken (admitted under this instance), set running here."""
    found: list[Resumable] = []
    for ids in chunks(child_ids):
        marks = ", ".join(f":i{n}" for n in range(len(ids)))
        where = (
            f"{ACTIVE_TERM} AND state = '{ADMITTED}' AND engine_instance_id = :me"
            f" AND id IN ({marks})"
        )
        params = {"me": instance_id, **{f"i{n}": i for n, i in enumerate(ids)}}
        # By their ids, not through the index of every unfinished child: with 100,000
        # children waiting, that index is the slow way to a handful (waiting_100k).
        found += _resumables(conn, where, params, instance_id, now, source="children")
    return found


def _resumables(
    conn: Connection,
    where: str,
    params: dict[str, object],
    instance_id: str,
    now: float,
    source: str = ACTIVE,
) -> list[Resumable]:
    """The admitted children ``where`` names, with what each resumes with (its last
    event, its steers, its grant's policy, its steps), set running under this instance.
    Their attempt is their recovery attempts and wakes (design §21) together."""
    rows = conn.execute(
        q(
            conn,
            "SELECT id, recovery_attempts + wakes, (SELECT MAX(sequence) FROM events e"
            " WHERE e.child_id = children.id) AS last, (SELECT count(*) FROM steps s"
            f" WHERE s.child_id = children.id) AS steps FROM {source} WHERE {where} ORDER BY id",
        ),
        params,
    ).all()
    if not rows:
        return []
    ids = [int(row[0]) for row in rows]
    # Many (a takeover's thousands): all admitted at once; a few (a wake): by id.
    few = children.of_ids(conn, ids) if len(ids) <= 64 else children.by_state(conn, "admitted")
    found = {child.id: child for child in few}
    queued: dict[int, list[tuple[int, str]]] = {}
    delivered: dict[int, list[str]] = {}
    for child_id, steer_id, message, handed in conn.execute(
        q(
            conn,
            "SELECT s.child_id, s.id, s.message, s.delivered_at IS NOT NULL FROM steers s"
            f" WHERE s.child_id IN (SELECT id FROM {source} WHERE {where})"
            " AND s.outcome = 'injected' ORDER BY s.id",
        ),
        params,
    ):
        if handed:
            delivered.setdefault(child_id, []).append(message)
        else:
            queued.setdefault(child_id, []).append((steer_id, message))
    policies: dict[int, bytes] = {
        child_id: bytes(raw)
        for child_id, raw in conn.execute(
            q(
                conn,
                "SELECT c.id, g.policy FROM grants g JOIN"
                f" (SELECT id, grant_id FROM {source} WHERE {where}) c ON g.id = c.grant_id"
                " WHERE g.policy IS NOT NULL",
            ),
            params,
        )
    }
    conn.execute(
        q(
            conn,
            f"UPDATE {source} SET {_fire(Trigger.RUN, [ADMITTED])}, engine_instance_id = :me,"
            f" updated_at = :now WHERE {where}",
        ),
        {**params, "me": instance_id, "now": now},
    )
    return [
        Resumable(
            found[child_id],
            int(attempt),
            int(last),
            tuple(queued.get(child_id, ())),
            policies.get(child_id),
            tuple(delivered.get(child_id, ())),
            int(steps),
        )
        for child_id, attempt, last, steps in rows
    ]
