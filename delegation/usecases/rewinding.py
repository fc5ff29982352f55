"""Rewind (design §35): a new execution of a conversation seeded from a recorded step of
an ended one.

A follow-up that carries ``rewind: {runId, step?}`` is checked and reserved as every
follow-up is (:mod:`delegation.usecases.reservation`): under the caller's grant, frozen
to the conversation's first task, admitted like any start. This module adds what is the
rewind's own, in that transaction: the source (an execution of the conversation, found
before anything is written), the point (the named step's place; after the last step
when none is named), and the seed: the source's steps before the point, the events
committed with them (the same numbers), the waits they closed, the events its later
waits took offered again, and then a ``rewind`` event. The new execution then runs as
after a crash: the one replay path, from :func:`recovery`'s ``Recovery`` (reason
``rewind``); only its admission is a first one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from delegation import authority, errors
from delegation.config import EngineConfig
from delegation.records import REWIND_KIND, ChildRecord, GrantRecord
from delegation.store import children, grants, rewinds
from delegation.store.events import EventRow, insert_events
from delegation.store.sql import Connection
from delegation.usecases import versions
from delegation.wire import Rewind

REASON = "rewind"  # Recovery.reason of a rewound execution's first run

_encoder = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class Source:
    """The ended execution a rewind starts from, and the step it names (None: all)."""

    child: ChildRecord
    step: str | None


@dataclass(frozen=True, slots=True)
class Seeded:
    """What a rewound execution's first run resumes from: the steps copied, its last
    event (the ``rewind`` event) and the version that last ran the source."""

    steps: int
    last_sequence: int
    previous_version: str | None
    version_changed: bool


def source_of(executions: list[ChildRecord], rewind: Rewind) -> Source:
    """The execution of the conversation ``rewind`` names (``executions``: all of them).

    Raises:
        errors.RewindRunUnknown: none by that run id (never, or purged).
    """
    for execution in executions:
        if execution.run_id == rewind.run_id:
            step = None if rewind.step is msgspec.UNSET else rewind.step
            return Source(execution, step)
    raise errors.RewindRunUnknown()


def point_of(conn: Connection, source: Source) -> rewinds.Point:
    """Where the rewind starts (the source has ended: a follow-up checked that).

    Raises:
        errors.RewindStepUnknown: the source recorded no step by that name.
    """
    found = rewinds.point(conn, source.child.id, source.step)
    if found is None:
        raise errors.RewindStepUnknown()
    return found


def made_before(
    executions: list[ChildRecord], request_id: str, rewind: Rewind
) -> ChildRecord | None:
    """The rewound execution of the conversation ``request_id`` made before, if any.

    Raises:
        errors.RequestIdReused: it was made from another source or point.
    """
    for execution in executions:
        if execution.rewound_from is not None and execution.request_id == request_id:
            step = None if rewind.step is msgspec.UNSET else rewind.step
            if (execution.rewound_from, execution.rewound_step) != (rewind.run_id, step):
                raise errors.RequestIdReused()
            return execution
    return None


def lease_of(conn: Connection, now: float, executions: list[ChildRecord]) -> GrantRecord:
    """The live lease the conversation's newest execution holds: what the host's or an
    operator's rewind runs under (they hold no tool call of their own).

    Raises:
        errors.RewindNoAuthority: none (a foreground child, a lease released or expired).
    """
    last = executions[-1]
    lease = grants.get(conn, last.grant_id) if last.lease_id and last.grant_id else None
    if lease is None or not lease.is_lease or not authority.grant_live(lease, now):
        raise errors.RewindNoAuthority()
    return lease


def judge(conn: Connection, now: float, source: ChildRecord, step: str | None) -> None:
    """An operator's rewind from ``source``, judged when given: the refusals its
    reservation would raise now (see :func:`delegation.usecases.reservation.reserve_rewind`),
    nothing written."""
    executions = children.executions(conn, source.conversation_id)
    lease_of(conn, now, executions)
    if any(not e.terminal for e in executions):
        raise errors.ActiveSubmission()
    point_of(conn, Source(source, step))


def lineage(source: Source | None) -> dict[str, Any]:
    """The new execution's columns that say where it came from."""
    if source is None:
        return {}
    return {"rewound_from": source.child.run_id, "rewound_step": source.step}


def seed(
    conn: Connection,
    now: float,
    cfg: EngineConfig,
    child: ChildRecord,
    source: Source,
    at: rewinds.Point,
) -> None:
    """Seed the reserved execution ``child`` from ``at`` and write its ``rewind`` event,
    the next sequence after the events copied."""
    rewinds.seed(conn, child.id, child.conversation_id, at, now)
    place = f"before step {source.step!r}" if source.step is not None else "after its last step"
    text = f"rewound from {source.child.run_id} {place}: {at.steps} steps replay"
    if cfg.runner_version is not None:
        text += f" (runner version {cfg.runner_version})"
    body = _encoder.encode({"sequence": at.last + 1, "kind": REWIND_KIND, "text": text})
    insert_events(conn, [EventRow(child.id, at.last + 1, body, None)])


def seeded(conn: Connection, child: ChildRecord, cfg: EngineConfig) -> Seeded | None:
    """What the rewound execution ``child`` resumes from at its first run; None when it
    is no rewind (or its source is gone: its copy is its own, and the version unknown)."""
    if child.rewound_from is None:
        return None
    steps, last = rewinds.copied(conn, child.id)
    source = children.by_run(conn, child.rewound_from)
    host = versions.HostVersion.of(cfg)
    previous = None if source is None else versions.ran(source)
    changed = source is not None and versions.changed(source, host)
    return Seeded(steps, last, previous, changed)
