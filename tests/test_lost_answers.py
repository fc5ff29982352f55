"""A commit whose answer is lost (design §19): the server committed, and the host saw its
connection end before the answer came. A server restart, a failover and a cut network
all do this to a commit in flight; a proxy (tests/pgproxy.py) does it exactly here.

What the host committed it must act on as committed: a reservation is run (its start
answers once it is admitted, never with a child nothing runs), an end stays recorded.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from delegation import ChildContext, Engine, Event, errors
from tests import rows
from tests.pgproxy import proxied
from tests.support import ScriptRunner, open_harness, wait_terminal


async def said_hello(ctx: ChildContext) -> None:
    await ctx.admit()
    ctx.emit(Event(kind="result", text="hello"))


async def test_a_reservation_whose_answer_was_lost_runs(postgres_db: str, workspace: Path) -> None:
    """A start under no lease is one statement, its own transaction: it committed, the
    answer was lost, the host ran the start again and found its own reservation."""
    runner = ScriptRunner(script=said_hello)
    with proxied(postgres_db) as (url, proxy):
        async with Engine(url, runner=runner) as engine:
            h = await open_harness(engine, runner, workspace)
            proxy.cut_answer("INSERT INTO children")
            started = await h.start("q1")
            assert proxy.cuts == 1
            assert not started.queued and runner.started == 1
            record = await wait_terminal(engine, started.conversation_id, timeout=20)
    assert (record.state, record.error) == ("done", "")
    assert runner.started == 1 and len(runner.prepared) == 1
    found = rows.rows(postgres_db, "SELECT state, admitted_at IS NOT NULL FROM children")
    assert found == [("done", True)]


async def test_a_start_whose_commit_answer_was_lost_runs_when_replayed(
    postgres_db: str, workspace: Path
) -> None:
    """A start under a lease is a transaction: its COMMIT committed, its answer was lost.
    The caller is told the store was away; its replay finds the child and runs it."""
    runner = ScriptRunner(script=said_hello)
    with proxied(postgres_db) as (url, proxy):
        async with Engine(url, runner=runner) as engine:
            h = await open_harness(engine, runner, workspace)
            proxy.cut_answer("INSERT INTO children", then="COMMIT")
            with pytest.raises(errors.StoreError):
                await h.start("q1", lease_id="lease-1")
            assert proxy.cuts == 1 and runner.started == 0
            assert rows.rows(postgres_db, "SELECT state FROM children") == [("prepared",)]
            again = await asyncio.wait_for(h.start("q1", lease_id="lease-1"), 20)
            record = await wait_terminal(engine, again.conversation_id, timeout=20)
    assert (record.state, record.error) == ("done", "")
    assert runner.started == 1


async def test_an_end_whose_answer_was_lost_stays_recorded(
    postgres_db: str, workspace: Path
) -> None:
    go = asyncio.Event()

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        await go.wait()
        ctx.emit(Event(kind="result", text="bye"))

    runner = ScriptRunner(script=run)
    with proxied(postgres_db) as (url, proxy):
        async with Engine(url, runner=runner) as engine:
            h = await open_harness(engine, runner, workspace)
            started = await h.start("q1")
            proxy.cut_answer("UPDATE children SET state = CASE")
            go.set()
            record = await wait_terminal(engine, started.conversation_id, timeout=20)
            assert proxy.cuts == 1
    assert (record.state, record.error) == ("done", "")
    assert rows.rows(postgres_db, "SELECT state FROM children") == [("done",)]
