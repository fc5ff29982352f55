"""Read models: the Result of a child, and the records tools and the CLI list.

Each function is one read transaction on a WAL reader, so it only ever sees
committed rows.
"""

from __future__ import annotations

from typing import Any

import msgspec

from delegation import errors
from delegation.records import ChildRecord, LeaseRecord
from delegation.store import Connection, children, events, grants
from delegation.wire import Event, Result

_events = msgspec.json.Decoder(list[Event])


def decode_events(bodies: list[bytes]) -> list[Event]:
    if not bodies:
        return []
    return _events.decode(b"[" + b",".join(bodies) + b"]")


def result_of(child: ChildRecord, bodies: list[bytes], *, strict: bool = True) -> Result:
    """A child's wire Result; a child that ended unadmitted answers AdmissionFailed
    (unless not ``strict``: the host's own view, which owes no caller an admission)."""
    if strict and child.terminal and child.admitted_at is None:
        raise errors.AdmissionFailed(child.error)
    return Result(
        **child.identity_fields(),
        done=child.terminal,
        cancelled=child.state == "cancelled",
        error=child.error,
        output=child.output,
        events=decode_events(bodies),
    )


def page(conn: Connection, child_id: int, after: int, limit: int, *, strict: bool = True) -> Result:
    child = children.get(conn, child_id)
    if child is None:
        raise errors.ChildPurged()
    return page_of(conn, child, after, limit, strict=strict)


def page_of(
    conn: Connection, child: ChildRecord, after: int, limit: int, *, strict: bool = True
) -> Result:
    """The Result of a child already read in this transaction."""
    return result_of(child, events.page(conn, child.id, after, limit), strict=strict)


def child_by_id(conn: Connection, child_id: int) -> ChildRecord | None:
    return children.get(conn, child_id)


def find_child(conn: Connection, conversation_id: str, run_id: str | None) -> ChildRecord | None:
    return children.find(conn, conversation_id, run_id)


def list_children(conn: Connection, **filters: Any) -> list[ChildRecord]:
    return children.listing(conn, **filters)


def child_events(
    conn: Connection, conversation_id: str, run_id: str | None, after: int, limit: int
) -> list[Event]:
    child = children.find(conn, conversation_id, run_id)
    if child is None:
        return []
    return decode_events(events.page(conn, child.id, after, limit))


def active_under_lease(conn: Connection, runner_id: str, lease_id: str) -> list[int]:
    return children.active_under_lease(conn, runner_id, lease_id)


def leases(conn: Connection, runner_id: str | None = None) -> list[LeaseRecord]:
    """Live leases and tombstones, newest first, with how many children each holds."""
    return grants.leases_with_counts(conn, runner_id)
