"""Admission's rows (design §22): the policies by scope, and the queue in ``children``.

Plain SQL both stores spell alike. The queue is every ``queued`` child in the order of
its ``queue_tag`` (its turn plus its priority's head start, see
:mod:`delegation.usecases.admission`), then its id; the slots of a scope are its
children a policy admitted that are ``admitted`` or ``running``, counted through
``ix_children_admission`` (each statement repeats that index's own term, so SQLite
reads through it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from delegation.config import AdmissionPolicy, parse_scope
from delegation.store.sql import Connection, run, spelling_of
from delegation.store.tables import ADMISSION

_SLOTTED = f"{ADMISSION} AND state IN ('admitted', 'running')"
_QUEUED_HERE = f"{ADMISSION} AND state = 'queued'"


@dataclass(slots=True)
class PolicyRow:
    """One stored policy, with its rate tokens as last written."""

    scope: str
    policy: AdmissionPolicy
    tokens: float | None
    refilled_at: float | None


def policies(conn: Connection, *, lock: bool = False) -> dict[str, PolicyRow]:
    """Every policy by scope. ``lock``: held until the transaction ends (PostgreSQL),
    so that admissions on every host of the database are decided one at a time."""
    sql = (
        "SELECT scope, concurrency, rate_n, rate_s, max_queued, queue_timeout_s, max_priority,"
        " tokens, refilled_at FROM admission ORDER BY scope"
    )
    if lock:
        sql += spelling_of(conn).for_update
    found: dict[str, PolicyRow] = {}
    for scope, concurrency, rate_n, rate_s, max_queued, timeout, cap, tokens, refilled in run(
        conn, sql
    ).fetchall():
        rate = None if rate_n is None else (int(rate_n), float(rate_s))
        policy = AdmissionPolicy(
            None if concurrency is None else int(concurrency),
            rate,
            int(max_queued),
            None if timeout is None else float(timeout),
            None if cap is None else int(cap),
        )
        found[scope] = PolicyRow(
            scope,
            policy,
            None if tokens is None else float(tokens),
            None if refilled is None else float(refilled),
        )
    return found


def scopes(conn: Connection) -> frozenset[str]:
    return frozenset(row[0] for row in run(conn, "SELECT scope FROM admission").fetchall())


def put(conn: Connection, scope: str, policy: AdmissionPolicy, now: float) -> None:
    """Store ``policy`` for ``scope``; a new rate's tokens start full, an unchanged
    one's are kept."""
    parse_scope(scope)
    n, per = policy.rate if policy.rate is not None else (None, None)
    old = run(
        conn, "SELECT rate_n, rate_s, tokens, refilled_at FROM admission WHERE scope = ?", (scope,)
    ).fetchone()
    tokens, refilled = (n, now)
    same = old is not None and old[0] == n and (old[1] is None) == (per is None)
    if same and (per is None or abs(float(old[1]) - per) < 1e-9):
        tokens, refilled = old[2], old[3]
    limits = (policy.concurrency, n, per, policy.max_queued, policy.queue_timeout_s)
    params = (*limits, policy.max_priority, tokens)
    # One statement either way: hosts booting together with the same configuration
    # store it side by side (the last one's tokens win).
    run(
        conn,
        "INSERT INTO admission (concurrency, rate_n, rate_s, max_queued, queue_timeout_s,"
        " max_priority, tokens, refilled_at, updated_at, scope)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
        " ON CONFLICT (scope) DO UPDATE SET concurrency = excluded.concurrency,"
        " rate_n = excluded.rate_n, rate_s = excluded.rate_s,"
        " max_queued = excluded.max_queued, queue_timeout_s = excluded.queue_timeout_s,"
        " max_priority = excluded.max_priority,"
        " tokens = excluded.tokens, refilled_at = excluded.refilled_at,"
        " updated_at = excluded.updated_at",
        (*params, refilled, now, scope),
    )


def remove(conn: Connection, scope: str) -> bool:
    return run(conn, "DELETE FROM admission WHERE scope = ?", (scope,)).rowcount > 0


def save_tokens(conn: Connection, scope: str, tokens: float, refilled_at: float) -> None:
    run(
        conn,
        "UPDATE admission SET tokens = ?, refilled_at = ? WHERE scope = ?",
        (tokens, refilled_at, scope),
    )


def _where(scope: str) -> tuple[str, tuple[str, ...]]:
    kind, ids = parse_scope(scope)
    if kind == "parent":
        return "parent_conversation_id = ?", ids
    names = ("runner_id", "extension_id", "profile")[: len(ids)]
    return " AND ".join(f"{name} = ?" for name in names), ids


def slots_in_use(conn: Connection, scope: str) -> int:
    where, params = _where(scope)
    sql = f"SELECT COUNT(*) FROM children WHERE {where} AND {_SLOTTED}"
    return int(run(conn, sql, params).fetchone()[0])


def queued_in(conn: Connection, scope: str, most: int | None = None) -> int:
    """How many children of ``scope`` are queued, counted up to ``most`` at most (a
    start asks only whether its queue is full: it never counts a long queue whole)."""
    where, params = _where(scope)
    if most is None:
        sql = f"SELECT COUNT(*) FROM children WHERE {where} AND {_QUEUED_HERE}"
        return int(run(conn, sql, params).fetchone()[0])
    sql = (
        f"SELECT COUNT(*) FROM (SELECT 1 FROM children WHERE {where} AND {_QUEUED_HERE} LIMIT ?) q"
    )
    return int(run(conn, sql, (*params, most)).fetchone()[0])


def served_turn(conn: Connection) -> float | None:
    """The newest turn served: of a child that entered the queue and left it."""
    row = run(
        conn,
        "SELECT queue_turn FROM children WHERE queue_turn IS NOT NULL AND state != 'queued'"
        " ORDER BY queue_turn DESC LIMIT 1",
    ).fetchone()
    return None if row is None else float(row[0])


def parent_turn(conn: Connection, parent: str) -> float | None:
    """One parent's newest turn, queued or served."""
    row = run(
        conn,
        "SELECT queue_turn FROM children WHERE parent_conversation_id = ?"
        " AND queue_turn IS NOT NULL ORDER BY queue_turn DESC LIMIT 1",
        (parent,),
    ).fetchone()
    return None if row is None else float(row[0])


def enqueue(
    conn: Connection,
    child_id: int,
    sources: str,
    now: float,
    place: tuple[float, float],
    expires: float | None,
) -> bool:
    """``sources`` (a state) → ``queued`` at ``place`` (its turn and tag); whether it
    matched."""
    turn, tag = place
    sql = (
        "UPDATE children SET state = 'queued', queued_at = ?, queue_turn = ?, queue_tag = ?,"
        f" queue_expires_at = ?, updated_at = ? WHERE id = ? AND state = '{sources}'"
    )
    return run(conn, sql, (now, turn, tag, expires, now, child_id)).rowcount == 1


@dataclass(frozen=True, slots=True)
class Queued:
    """What the pump needs of a queued child to decide on it: its place and scopes."""

    id: int
    tag: float
    runner_id: str
    extension_id: str
    profile: str
    parent_conversation_id: str
    admitted_before: bool  # woken from ``waiting``: it resumes
    cancel_requested: bool  # asked to end (a cancel, a release, an expiry)


def head(conn: Connection, limit: int, after: tuple[float, int] | None = None) -> list[Queued]:
    """The next ``limit`` children of the queue in order (after ``after``: a tag and an
    id), only the columns a decision reads."""
    where = ""
    params: list[Any] = [limit]
    if after is not None:
        where = " AND (queue_tag > ? OR (queue_tag = ? AND id > ?))"
        params = [after[0], after[0], after[1], limit]
    rows = run(
        conn,
        "SELECT id, queue_tag, runner_id, extension_id, profile, parent_conversation_id,"
        " admitted_at IS NOT NULL, cancel_requested_at IS NOT NULL"
        f" FROM children WHERE state = 'queued'{where}"
        " ORDER BY queue_tag, id LIMIT ?",
        tuple(params),
    ).fetchall()
    return [
        Queued(int(r[0]), float(r[1]), r[2], r[3], r[4], r[5], bool(r[6]), bool(r[7])) for r in rows
    ]


def position(conn: Connection, child_id: int, tag: float) -> int:
    """A queued child's place in the queue (1: next)."""
    row = run(
        conn,
        "SELECT COUNT(*) FROM children WHERE state = 'queued'"
        " AND (queue_tag < ? OR (queue_tag = ? AND id <= ?))",
        (tag, tag, child_id),
    ).fetchone()
    return int(row[0])


def tag_of(conn: Connection, child_id: int) -> float | None:
    row = run(conn, "SELECT queue_tag FROM children WHERE id = ?", (child_id,)).fetchone()
    return None if row is None or row[0] is None else float(row[0])


def positions(conn: Connection, limit: int = 10_000) -> dict[int, int]:
    """The first ``limit`` queued children's places, by child id."""
    rows = run(
        conn,
        "SELECT id FROM children WHERE state = 'queued' ORDER BY queue_tag, id LIMIT ?",
        (limit,),
    ).fetchall()
    return {int(row[0]): n for n, row in enumerate(rows, 1)}


def due(conn: Connection, now: float, limit: int) -> tuple[list[int], list[int]]:
    """Children whose queue wait timed out, and those past their deadline that nothing
    runs (queued or waiting)."""
    timed_out = run(
        conn,
        "SELECT id FROM children WHERE queue_expires_at IS NOT NULL AND state = 'queued'"
        " AND queue_expires_at <= ? ORDER BY queue_expires_at LIMIT ?",
        (now, limit),
    ).fetchall()
    late = run(
        conn,
        "SELECT id FROM children WHERE deadline_at IS NOT NULL AND state IN ('queued', 'waiting')"
        " AND deadline_at <= ? ORDER BY deadline_at LIMIT ?",
        (now, limit),
    ).fetchall()
    return [int(r[0]) for r in timed_out], [int(r[0]) for r in late]


def next_due(conn: Connection) -> float | None:
    """When the next queue wait times out, or deadline passes, of what nothing runs."""
    values = [
        run(
            conn,
            "SELECT MIN(queue_expires_at) FROM children"
            " WHERE queue_expires_at IS NOT NULL AND state = 'queued'",
        ).fetchone()[0],
        run(
            conn,
            "SELECT MIN(deadline_at) FROM children"
            " WHERE deadline_at IS NOT NULL AND state IN ('queued', 'waiting')",
        ).fetchone()[0],
    ]
    found = [float(v) for v in values if v is not None]
    return min(found) if found else None


def any_queued(conn: Connection) -> bool:
    row = run(conn, "SELECT 1 FROM children WHERE state = 'queued' LIMIT 1").fetchone()
    return row is not None


def stop_cancelled(conn: Connection, child_ids: Iterable[int], now: float) -> list[int]:
    """End these queued children whose cancellation was requested, with its reason."""
    ended: list[int] = []
    for child_id in child_ids:
        row = run(
            conn,
            "UPDATE children SET state = 'cancelled', error = COALESCE(cancel_reason, ''),"
            " finished_at = ?, updated_at = ? WHERE id = ? AND state = 'queued'"
            " AND cancel_requested_at IS NOT NULL RETURNING id",
            (now, now, child_id),
        ).fetchone()
        if row is not None:
            ended.append(int(row[0]))
    return ended


def stop_ids(conn: Connection, child_ids: Iterable[int], now: float, reason: str) -> list[int]:
    """End these children, queued or waiting, ``cancelled`` with ``reason`` (nothing
    runs them); returns those it ended."""
    ended: list[int] = []
    for child_id in child_ids:
        row = run(
            conn,
            "UPDATE children SET state = 'cancelled', error = ?, cancel_requested_at ="
            " COALESCE(cancel_requested_at, ?), cancel_reason = COALESCE(cancel_reason, ?),"
            " finished_at = ?, updated_at = ?, wake_at = NULL"
            " WHERE id = ? AND state IN ('queued', 'waiting') RETURNING id",
            (reason, now, reason, now, now, child_id),
        ).fetchone()
        if row is not None:
            ended.append(int(row[0]))
    return ended


def unseen(conn: Connection, scope: str) -> str | None:
    """What ``scope`` names that this database has never seen (``runner 'R'``,
    ``extension 'R/E'``, ``preset 'R/E/P'``: the widest unknown part), or None.

    A runner is seen once registered, or named by a grant or a child; an extension once
    a grant or a child names it; a preset once a tool call offered it or a child ran
    under it. A parent conversation is not judged: a new one may start any moment.
    """
    kind, ids = parse_scope(scope)
    if kind == "parent":
        return None
    runner = ids[0]
    if not (
        _any(conn, "runners WHERE runner_id = ?", runner)
        or _any(conn, "grants WHERE runner_id = ?", runner)
        or _any(conn, "children WHERE runner_id = ?", runner)
    ):
        return f"runner {runner!r}"
    if kind == "runner":
        return None
    owner = (runner, ids[1])
    if not (
        _any(conn, "grants WHERE runner_id = ? AND extension_id = ?", *owner)
        or _any(conn, "children WHERE runner_id = ? AND extension_id = ?", *owner)
    ):
        return f"extension {'/'.join(owner)!r}"
    if kind == "extension" or _any(
        conn, "children WHERE runner_id = ? AND extension_id = ? AND profile = ?", *ids
    ):
        return None
    offered = run(
        conn,
        "SELECT DISTINCT presets FROM grants WHERE runner_id = ? AND extension_id = ?"
        " AND presets IS NOT NULL",
        owner,
    ).fetchall()
    if any(ids[2] in _preset_names(raw) for (raw,) in offered):
        return None
    return f"preset {scope.partition(':')[2]!r}"


def _any(conn: Connection, where: str, *params: str) -> bool:
    return run(conn, f"SELECT 1 FROM {where} LIMIT 1", params).fetchone() is not None


def _preset_names(raw: bytes) -> set[str]:
    """The names of a grant's presets (a JSON list of presets, as the grant stored it)."""
    try:
        presets = msgspec.json.decode(bytes(raw))
    except msgspec.DecodeError:  # unreadable: it names none, so the scope may warn
        return set()
    if not isinstance(presets, list):
        return set()
    return {p["name"] for p in presets if isinstance(p, dict) and isinstance(p.get("name"), str)}
