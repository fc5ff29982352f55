"""Children this host instance holds that no run of it runs (design §32): what a commit
whose answer was lost leaves behind while the host lives on.

The server committed, the connection ended before the answer came, and the host took
the write for undone: a start's reservation (``prepared``), a queue's admission
(``admitted`` by the pump's turn) or a wake-up (``running`` here again) is then the
host's in the database, and nothing runs it until its next boot or a takeover. Once the
database is back, the host reads what it holds (:func:`held`), keeps those no run of
its own has (the engine knows), and adopts them here (:func:`adopt`): a child never
run is spawned as at its admission, one that ran is resumed from its journal.
"""

from __future__ import annotations

from dataclasses import dataclass

from delegation import errors
from delegation.machine import State, Trigger
from delegation.records import ChildRecord, Resumable
from delegation.store import children, lifecycle
from delegation.store.sql import Connection
from delegation.store.tables import children as children_table
from delegation.usecases import admission, stored

_UNREADABLE = errors.ChildUnreadable.default_message()
# The states a run of this host holds its child in: reserved, admitted, running.
_RUN_HELD = (State.PREPARED.value, State.ADMITTED.value, State.RUNNING.value)


@dataclass(frozen=True, slots=True)
class Adopted:
    """What :func:`adopt` committed: children to spawn fresh (with their grant's policy),
    to resume (set ``running`` here again), and those ended instead."""

    instance_id: str  # the instance they were adopted under
    fresh: list[tuple[ChildRecord, bytes | None]]
    resumable: list[Resumable]
    unreadable: list[str]  # run ids of children ended: their record no longer decodes
    ended: list[int]  # asked to end meanwhile: ended cancelled, as a takeover would


def held(conn: Connection, instance_id: str) -> list[int]:
    """The children ``instance_id`` holds in a state a run of it holds them in."""
    return children.active_ids(
        conn,
        children_table.c.engine_instance_id == instance_id,
        children_table.c.state.in_(_RUN_HELD),
    )


def adopt(conn: Connection, now: float, instance_id: str, child_ids: list[int]) -> Adopted:
    """Adopt ``child_ids`` (held by ``instance_id``, no run of it runs them, as the engine
    found): a reserved or admitted child, never run, is to be spawned as at its
    admission; a running one is suspended and resumed here at once (its attempt as the
    lost wake-up counted it); one asked to end ends cancelled, one whose record no longer
    decodes ends ``done`` with that error. What moved since it was read is left alone."""
    fresh: list[tuple[ChildRecord, bytes | None]] = []
    running: list[int] = []
    unreadable: list[str] = []
    ended: list[int] = []
    for child in children.of_ids(conn, child_ids):
        if child.engine_instance_id != instance_id or child.state not in _RUN_HELD:
            continue
        if child.cancel_requested_at is not None:
            children.transition(conn, child.id, Trigger.STOP, now, error=child.cancel_reason or "")
            ended.append(child.id)
            continue
        policy = admission.grant_policy(conn, child)
        try:
            stored.for_run(child.request, child.preset, child.options, policy)
        except errors.ChildUnreadable:
            children.transition(conn, child.id, Trigger.FINISH, now, error=_UNREADABLE)
            unreadable.append(child.run_id)
            continue
        if child.state == State.RUNNING:
            children.transition(conn, child.id, Trigger.SUSPEND, now)
            running.append(child.id)
        else:
            fresh.append((child, policy))
    resumable = lifecycle.woken(conn, running, instance_id, now) if running else []
    return Adopted(instance_id, fresh, resumable, unreadable, ended)
