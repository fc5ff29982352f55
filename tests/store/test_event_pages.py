"""A page of events as the store joins it (``events.joined_page``, what ``child.read``
reads), on both stores: the bodies of ``events.page`` in sequence order whatever order
they were written in, as one JSON array, with their count; and the page a read answers
from it, cut by the byte bound body by body as before."""

from __future__ import annotations

import json

import msgspec
from sqlalchemy import create_engine

from delegation.store import events
from delegation.store.events import EventRow
from delegation.store.sql import run
from delegation.usecases import queries
from delegation.wire import Event
from tests.harness.support import Harness


def _body(sequence: int, text: str) -> bytes:
    return msgspec.json.encode({"sequence": sequence, "kind": "text", "text": text})


def _filled(url: str, sequences: list[int]) -> None:
    """A runner, a grant and a child with events of ``sequences``, written in that order."""
    engine = create_engine(url)
    with engine.begin() as conn:
        child = int(run(conn, "SELECT max(id) FROM children").fetchone()[0])
        rows = [EventRow(child, n, _body(n, f'é{n}\u2028"\\'), None) for n in sequences]
        events.insert_events(conn, rows)
    engine.dispose()


def _pages(url: str, after: int, limit: int) -> tuple[tuple[bytes, int], list[bytes]]:
    engine = create_engine(url)
    with engine.connect() as conn:
        child = int(run(conn, "SELECT max(id) FROM children").fetchone()[0])
        joined = events.joined_page(conn, child, after, limit)
        found = joined, events.page(conn, child, after, limit)
    engine.dispose()
    return found


async def test_a_joined_page_is_the_pages_bodies_in_order_whatever_order_they_came(
    harness: Harness, db_url: str
) -> None:
    await harness.start("q1")
    # Written out of order, in two statements: neither rowid nor insertion order is
    # the sequence's.
    _filled(db_url, [7, 3, 9, 1, 5])
    _filled(db_url, [2, 8, 4, 10, 6])
    for after, limit in [(0, 128), (0, 4), (3, 5), (9, 128), (10, 128), (2**64 - 1, 128)]:
        (joined, count), bodies = _pages(db_url, after, limit)
        assert joined == b"[" + b",".join(bodies) + b"]"
        assert count == len(bodies)
        sequences = [item["sequence"] for item in json.loads(joined)]
        assert sequences == list(range(after + 1, min(10, after + limit) + 1))


async def test_a_read_answers_the_joined_page_and_cuts_one_past_the_bound(
    harness: Harness, db_url: str
) -> None:
    started = await harness.start("q1")
    _filled(db_url, list(range(1, 41)))
    child = await harness.engine.get_child(started.conversation_id)
    assert child is not None

    def read(max_bytes: int, limit: int = 128) -> queries.PagedResult:
        return queries.page_of(conn, child, 0, limit, max_bytes)

    engine = create_engine(db_url)
    with engine.connect() as conn:
        whole = read(1 << 20)
        assert [e.sequence for e in whole.events] == list(range(1, 41))
        assert whole.events[0] == Event(sequence=1, kind="text", text='é1\u2028"\\')
        assert not whole.more
        assert read(1 << 20, limit=40).more  # a full page says more may follow
        # Past the bound: the bodies that keep the Result's encoding within it.
        size = len(msgspec.json.encode(whole.result))
        cut = read(size - 1)
        assert 0 < len(cut.events) < 40 and cut.more
        assert cut.events == whole.events[: len(cut.events)]
        assert len(msgspec.json.encode(cut.result)) <= size - 1
        assert [e.sequence for e in read(1).events] == [1]  # the first always comes
    engine.dispose()
