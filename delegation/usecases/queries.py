"""Read models: the Result of a child, and the records tools and the CLI list.

Each function is one read transaction on a WAL reader, so it only ever sees
committed rows.
"""

from __future__ import annotations

import datetime
import json
from typing import Any, NamedTuple

import msgspec

from delegation import errors
from delegation.codec import encode
from delegation.records import ChildFilter, ChildRecord, ChildSummary, LeaseRecord
from delegation.store import admission, children, events, grants, steps, waits
from delegation.store.sql import Connection, run
from delegation.wire import Event, InputRequest, Result

_events = msgspec.json.Decoder(list[Event])


def decode_events(bodies: list[bytes]) -> list[Event]:
    if not bodies:
        return []
    return _events.decode(events.array(bodies))


# What a non-empty page adds to the encoding of its Result without events (the
# events field is omitted when empty, and comes last): ``,"events":[`` and ``]``.
_EVENTS_FIELD = len(b',"events":[]')
# A Result's encoding besides its strings (each character of which takes at most six
# bytes): field names, quotes, commas, booleans, and the events field's own.
_MOST_BESIDES = 512


class PagedResult(NamedTuple):
    """A child's Result with one page of its events, and whether more events were
    committed already when it was read (the page was cut by count or by bytes)."""

    result: Result
    more: bool

    @property
    def events(self) -> list[Event]:
        return self.result.events

    @property
    def done(self) -> bool:
        return self.result.done


def result_of(
    child: ChildRecord,
    bodies: list[bytes],
    max_bytes: int | None = None,
    *,
    strict: bool = True,
    inputs: dict[str, InputRequest] | None = None,
    queue_position: int = 0,
) -> Result:
    """A child's wire Result with the events of ``bodies``, as many as fit within
    ``max_bytes`` (see :func:`fit`), and its open ``inputs`` (design §21); a child that
    ended unadmitted answers AdmissionFailed (unless not ``strict``: the host's own
    view, which owes no caller an admission)."""
    fields, texts = _fields(child, strict, inputs, queue_position)
    if (
        max_bytes is not None
        and bodies
        and _may_pass(texts, sum(map(len, bodies)) + len(bodies), max_bytes)
    ):
        bodies = fit(Result(**fields), bodies, max_bytes)
    # One Result with its events, not one made without them and then replaced.
    return Result(**fields, events=decode_events(bodies))


def _fields(
    child: ChildRecord,
    strict: bool,
    inputs: dict[str, InputRequest] | None,
    queue_position: int,
) -> tuple[dict[str, Any], int]:
    """A Result's fields but its events, and the length of its texts (what its encoding
    may take besides them, see :func:`_may_pass`)."""
    # A child that waited its turn was answered (``queued``) before it ended (§22).
    if strict and child.terminal and child.admitted_at is None and child.queued_at is None:
        raise errors.AdmissionFailed(child.error)
    identity: dict[str, Any] = child.identity_fields()
    pinned = child.pinned_version or ""
    fields = dict(
        identity,
        done=child.terminal,
        cancelled=child.state == "cancelled",
        error=child.error,
        output=child.output,
        input_requests=inputs or {},
        queued=queue_position > 0,
        queue_position=queue_position,
        pinned_version="" if child.terminal else pinned,
    )
    texts = sum(map(len, identity.values())) + len(child.output) + len(child.error)
    return fields, texts + len(pinned)


def _may_pass(texts: int, events: int, max_bytes: int) -> bool:
    """Whether a Result of ``texts`` characters and events of ``events`` bytes (their
    bodies and a comma each) may be encoded past ``max_bytes``: most pages are far
    below the bound, and only those that may pass it are measured."""
    return _MOST_BESIDES + 6 * texts + events > max_bytes


def fit(result: Result, bodies: list[bytes], max_bytes: int) -> list[bytes]:
    """The first of ``bodies`` (always one, if any) that keep ``result``'s encoding
    with them as events within ``max_bytes``.

    A stored body is the event's wire encoding, so its length is what the event adds
    (plus a comma); a body written otherwise only shrinks when it is encoded again (no
    JSON spelling of a string is shorter than the encoder's), so the bound holds.
    """
    size = len(encode(result)) + _EVENTS_FIELD - 1  # the first event takes no comma
    for count, body in enumerate(bodies):
        size += len(body) + 1
        if size > max_bytes and count > 0:
            return bodies[:count]
    return bodies


def page(
    conn: Connection,
    child_id: int,
    after: int,
    limit: int,
    max_bytes: int,
    *,
    strict: bool = True,
) -> PagedResult:
    child = children.get(conn, child_id)
    if child is None:
        raise errors.ChildPurged()
    return page_of(conn, child, after, limit, max_bytes, strict=strict)


def page_of(
    conn: Connection,
    child: ChildRecord,
    after: int,
    limit: int,
    max_bytes: int,
    *,
    strict: bool = True,
) -> PagedResult:
    """The page of a child already read in this transaction: up to ``limit`` events
    after ``after`` whose encoded Result stays within ``max_bytes``."""
    joined, count = events.joined_page(conn, child.id, after, limit)
    inputs = input_requests(conn, child) if child.inputs_open else None
    place = _place(conn, child) if child.state == "queued" else 0
    fields, texts = _fields(child, strict, inputs, place)
    # ``[a,b]``: the bodies and a comma each is the array but its first byte.
    if not count or not _may_pass(texts, len(joined) - 1, max_bytes):
        return PagedResult(Result(**fields, events=_events.decode(joined)), count >= limit)
    # A page that may pass the bound is cut body by body (read again: it may have
    # grown since, never changed; a page is the events after ``after``).
    bodies = events.page(conn, child.id, after, limit)
    result = result_of(child, bodies, max_bytes, strict=strict, inputs=inputs, queue_position=place)
    return PagedResult(result, len(result.events) < len(bodies) or len(bodies) >= limit)


def _place(conn: Connection, child: ChildRecord) -> int:
    tag = admission.tag_of(conn, child.id)
    return 0 if tag is None else admission.position(conn, child.id, tag)


def input_requests(conn: Connection, child: ChildRecord | ChildSummary) -> dict[str, InputRequest]:
    """A child's open input requests as its Result carries them, by inputId."""
    found: dict[str, InputRequest] = {}
    if child.terminal:
        return found
    for row in waits.open_inputs(conn, child.id):
        options = json.loads(row.options) if row.options else []
        expires = "" if row.expires_at is None else rfc3339(row.expires_at)
        found[row.name] = InputRequest(
            kind=row.kind,
            prompt=row.prompt,
            tool_name=row.tool_name,
            tool_call_id=row.tool_call_id,
            input=row.input,
            options=options,
            expires_at=expires,
        )
    return found


def rfc3339(seconds: float) -> str:
    """Epoch seconds as an RFC 3339 UTC time, to the millisecond."""
    moment = datetime.datetime.fromtimestamp(seconds, datetime.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def child_by_id(conn: Connection, child_id: int) -> ChildRecord | None:
    return children.get(conn, child_id)


def find_child(conn: Connection, conversation_id: str, run_id: str | None) -> ChildRecord | None:
    return children.find(conn, conversation_id, run_id)


def list_children(conn: Connection, wanted: ChildFilter) -> list[ChildRecord]:
    return children.listing(conn, wanted)


def patch_values(conn: Connection, name: str, limit: int) -> list[tuple[ChildRecord, bool | None]]:
    """The live (unfinished) executions, newest first, each with the value it recorded
    for the patch ``name`` (design §34; None: not asked yet)."""
    found = steps.patch_values(conn, name, limit)
    records = {child.id: child for child in children.of_ids(conn, [i for i, _ in found])}
    return [(records[i], value) for i, value in found if i in records]


def pinned(conn: Connection, limit: int) -> list[ChildRecord]:
    """The children pinned to a runner version (design §34), newest first."""
    # Pinned and still waiting: a pinned child that ended (cancelled, its lease expired)
    # keeps the column as history, and is no longer pinned.
    sql = (
        "SELECT id FROM children WHERE pinned_version IS NOT NULL AND state = 'waiting'"
        " ORDER BY id DESC LIMIT ?"
    )
    ids = [int(row[0]) for row in run(conn, sql, (limit,), planned_each_time=True).fetchall()]
    return sorted(children.of_ids(conn, ids), key=lambda c: c.id, reverse=True)


def drift(conn: Connection, child: ChildRecord) -> list[str] | None:
    """The recorded steps the execution's newest attempt never asked for (design §34);
    None while an attempt may still ask (only an attempt that ended or waits is whole)."""
    if not child.terminal and child.state != "waiting":
        return None
    return steps.drift(conn, child.id)


def child_events(
    conn: Connection, conversation_id: str, run_id: str | None, after: int, limit: int
) -> list[Event]:
    child = children.find(conn, conversation_id, run_id)
    if child is None:
        return []
    return _events.decode(events.joined_page(conn, child.id, after, limit)[0])


def active_under_lease(conn: Connection, runner_id: str, lease_id: str) -> list[int]:
    return children.active_under_lease(conn, runner_id, lease_id)


def leases(conn: Connection, runner_id: str | None = None) -> list[LeaseRecord]:
    """Live leases and tombstones, newest first, with how many children each holds."""
    return grants.leases_with_counts(conn, runner_id)
