"""Runs' ends written together (delegation/engine/ends.py, service.finish): a lease
expiry of hundreds ends every child once, each with what its own run left, across the
set-based statement's chunks; one child's refusal never holds back another's end."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event

from delegation import ChildContext, Engine, EngineConfig, Event, errors
from delegation.clock import ManualClock
from delegation.os_processes import ProcessId
from delegation.store import lifecycle, processes
from delegation.usecases import service
from tests.harness.rows import rows, scalar
from tests.harness.support import ScriptRunner, hold, open_harness

LEASE_EXPIRED = "cancelled: lease expired"
PER_LEASE = 60
LEASES = 10  # 600 children: more than two chunks of the set-based UPDATE (250 each)


def _script(failing: asyncio.Event) -> object:
    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        ctx.emit(Event(kind="text", text="working"))
        if ctx.request.message == "fails":
            await failing.wait()
            raise RuntimeError("boom")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            if ctx.request.message == "raises":
                raise RuntimeError("stopping") from None
            raise

    return run


async def test_a_lease_expiry_of_hundreds_ends_each_child_once_with_its_own_end(
    db_url: str, workspace: Path, clock: ManualClock
) -> None:
    failing = asyncio.Event()
    runner = ScriptRunner(script=_script(failing))  # type: ignore[arg-type]
    config = EngineConfig(release_drain_s=1.0, max_children_per_grant=PER_LEASE + 5)
    async with Engine(db_url, runner=runner, config=config, clock=clock) as engine:
        h = await open_harness(engine, runner, workspace)
        expiring: list[str] = []
        for lease in range(LEASES):
            message = "raises" if lease % 2 else "holds"
            started = await asyncio.gather(
                *(
                    h.start(f"q{lease}-{n}", message=message, lease_id=f"L{lease}")
                    for n in range(PER_LEASE)
                )
            )
            expiring += [child.conversation_id for child in started]
        clock.advance(10)  # a lease that outlives the others, whose runs fail meanwhile
        failed = [
            (await h.start(f"f{n}", message="fails", lease_id="later")).conversation_id
            for n in range(20)
        ]
        clock.advance(config.lease_lifetime_s - 10)
        clock.set(math.nextafter(clock.now(), math.inf))

        failing.set()  # these runs end in the same turns as the expired ones
        await engine.expire_due()

        ended = {c: await h.wait_done(c) for c in expiring + failed}
        for conversation in expiring:
            record = ended[conversation]
            assert (record.state, record.error) == ("cancelled", LEASE_EXPIRED), record
            assert record.finished_at is not None
        for conversation in failed:
            assert (ended[conversation].state, ended[conversation].error) == ("done", "boom")
        assert [lease.lease_id for lease in await engine.leases()] == ["later"]

    counts = dict(rows(db_url, "SELECT state, COUNT(*) FROM children GROUP BY state"))
    assert counts == {"cancelled": PER_LEASE * LEASES, "done": 20}
    assert scalar(db_url, "SELECT COUNT(*) FROM children WHERE finished_at IS NULL") == 0


async def test_one_childs_refusal_leaves_the_others_ends_written(
    db_url: str, workspace: Path
) -> None:
    """service.finish of several runs: ended ones get their record, one ended already
    keeps its own, a purged one gets the refusal its end alone would have had, and the
    process a tracked run recorded is forgotten."""
    gate = asyncio.Event()

    async def script(ctx: ChildContext) -> None:
        await ctx.admit()
        if ctx.request.message == "quick":
            return
        await gate.wait()

    runner = ScriptRunner(script=script)
    async with Engine(db_url, runner=runner, config=EngineConfig()) as engine:
        h = await open_harness(engine, runner, workspace)
        held = [
            (await h.start(f"h{n}", message="hold", lease_id="L")).conversation_id for n in range(2)
        ]
        quick = (await h.start("q", message="quick")).conversation_id
        done = await h.wait_done(quick)
    # Closed: the leased children stay running in the database, resumable.
    select = "SELECT id FROM children WHERE conversation_id = :c"
    ids = {c: scalar(db_url, select, {"c": c}) for c in [*held, quick]}
    gone = max(ids.values()) + 1000
    store = create_engine(db_url)
    try:
        with store.begin() as conn:
            processes.record(conn, ids[held[0]], ProcessId(4242, 7, "boot"), 1.0)
            ends = [(ids[held[0]], "", True), (gone, "", False), (ids[quick], "late", False),
                    (ids[held[1]], "it broke", False)]  # fmt: skip
            found = service.finish(conn, 2_000_000_000.0, ends)
    finally:
        store.dispose()

    first, second = found[ids[held[0]]], found[ids[held[1]]]
    assert not isinstance(first, errors.DelegationError)
    assert not isinstance(second, errors.DelegationError)
    assert (first.state, first.error, first.finished_at) == ("done", "", 2_000_000_000.0)
    assert (second.state, second.error) == ("done", "it broke")
    again = found[ids[quick]]
    assert not isinstance(again, errors.DelegationError)
    assert (again.state, again.error, again.finished_at) == ("done", "", done.finished_at)
    assert isinstance(found[gone], errors.ChildPurged)
    assert scalar(db_url, "SELECT COUNT(*) FROM processes") == 0
    states = rows(db_url, "SELECT state, error FROM children ORDER BY id")
    assert states == [("done", ""), ("done", "it broke"), ("done", "")]


async def test_every_end_of_a_batch_is_written_across_the_statements_chunks(
    db_url: str, workspace: Path
) -> None:
    """501 ends in one service.finish: two full chunks of the set-based UPDATE and one
    of a single row, each child ended once."""
    size = 501
    gate = asyncio.Event()

    async def script(ctx: ChildContext) -> None:
        await ctx.admit()
        await gate.wait()

    runner = ScriptRunner(script=script)
    config = EngineConfig(max_children_per_grant=size)
    async with Engine(db_url, runner=runner, config=config) as engine:
        h = await open_harness(engine, runner, workspace)
        await asyncio.gather(*(h.start(f"q{n}", lease_id="L") for n in range(size)))
    ids = [row[0] for row in rows(db_url, "SELECT id FROM children ORDER BY id")]
    assert len(ids) == size
    store = create_engine(db_url)
    try:
        with store.begin() as conn:
            found = service.finish(conn, 5.0, [(i, f"e{i}", False) for i in ids])
    finally:
        store.dispose()
    assert sorted(found) == ids
    ended = rows(db_url, "SELECT id, state, error, finished_at FROM children ORDER BY id")
    assert ended == [(i, "done", f"e{i}", 5.0) for i in ids]


async def test_a_lease_expiry_reaches_children_through_their_grant_alone(
    postgres_db: str, workspace: Path
) -> None:
    """The expiry's statements on children cannot read ix_children_one_active (every
    unfinished child): on a new database's statistics PostgreSQL read that index once
    per due lease, seconds for thousands. Planned here with the grant's index dropped
    and sequential scans disabled, where any index whose predicate the statement
    implies would be taken (the drop is rolled back)."""
    runner = ScriptRunner(script=hold(asyncio.Event()))
    async with Engine(postgres_db, runner=runner, config=EngineConfig()) as engine:
        h = await open_harness(engine, runner, workspace)
        await asyncio.gather(*(h.start(f"q{n}", lease_id=f"L{n % 2}") for n in range(4)))
    store = create_engine(postgres_db)
    ran: list[tuple[str, Any]] = []

    def seen(_c: Any, _cursor: Any, sql: str, params: Any, *_: Any) -> None:
        ran.append((sql, params))

    event.listen(store, "before_cursor_execute", seen)
    try:
        with store.connect() as conn:
            affected, _ = lifecycle.expire_due(conn, LEASE_EXPIRED, 2_000_000_000.0)
            assert len(affected) == 4
            on_children = [(sql, params) for sql, params in ran if "children" in sql]
            conn.exec_driver_sql("DROP INDEX ix_children_grant_request")
            conn.exec_driver_sql("SET LOCAL enable_seqscan = off")
            for sql, params in on_children:
                plan = "\n".join(conn.exec_driver_sql(f"EXPLAIN {sql}", params).scalars())
                assert "ix_children_one_active" not in plan, (sql, plan)
            conn.rollback()
    finally:
        store.dispose()
