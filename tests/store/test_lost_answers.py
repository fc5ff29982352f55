"""A commit whose answer is lost (design §19): the server committed, and the host saw its
connection end before the answer came. A server restart, a failover and a cut network
all do this to a commit in flight; a proxy (tests/harness/pgproxy.py) does it exactly here.

What the host committed it must act on as committed: a reservation is run (its start
answers once it is admitted, never with a child nothing runs), an end stays recorded.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from delegation import AdmissionPolicy, ChildContext, Engine, EngineConfig, Event, errors
from tests.harness import rows
from tests.harness.pgproxy import proxied
from tests.harness.support import ScriptRunner, open_harness, wait_terminal


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


@pytest.mark.parametrize("replayed", [True, False])
async def test_a_start_whose_commit_answer_was_lost_runs(
    postgres_db: str, workspace: Path, replayed: bool
) -> None:
    """A start under a lease is a transaction: its COMMIT committed, its answer was lost.
    The caller is told the store was away; its replay finds the child and runs it. Not
    replayed (its caller went away), the host runs the child it holds once the database
    answers again (design §32). Either way it runs once."""
    runner = ScriptRunner(script=said_hello)
    with proxied(postgres_db) as (url, proxy):
        async with Engine(url, runner=runner) as engine:
            h = await open_harness(engine, runner, workspace)
            proxy.cut_answer("INSERT INTO children", then="COMMIT")
            with pytest.raises(errors.StoreError):
                await h.start("q1", lease_id="lease-1")
            assert proxy.cuts == 1
            if replayed:
                again = await asyncio.wait_for(h.start("q1", lease_id="lease-1"), 20)
                cid = again.conversation_id
            else:
                (cid,) = rows.rows(postgres_db, "SELECT conversation_id FROM children")[0]
            record = await wait_terminal(engine, cid, timeout=20)
    assert (record.state, record.error) == ("done", "")
    assert runner.started == 1


async def test_a_queue_admission_whose_commit_answer_was_lost_runs(
    postgres_db: str, workspace: Path
) -> None:
    """The pump admitted a queued child and the answer to its COMMIT was lost: the
    child, admitted here in the database, is run here once the database answers
    (design §19 said it waited for the next boot or a takeover)."""
    gate = asyncio.Event()

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        if ctx.request.message == "hold":
            await gate.wait()
        ctx.emit(Event(kind="result", text=ctx.request.message))

    runner = ScriptRunner(script=run)
    one_at_a_time = {"runner:runner-1": AdmissionPolicy(concurrency=1)}
    config = EngineConfig(admission=one_at_a_time, start_wait_s=0.2)
    with proxied(postgres_db) as (url, proxy):
        async with Engine(url, runner=runner, config=config) as engine:
            h = await open_harness(engine, runner, workspace)
            first = await h.start("q1", message="hold")
            second = await h.start("q2", message="next")
            assert second.queued
            proxy.cut_answer("state IN ('queued') AND cancel_requested_at IS NULL", then="COMMIT")
            gate.set()
            records = [
                await wait_terminal(engine, started.conversation_id, timeout=20)
                for started in (first, second)
            ]
            assert proxy.cuts == 1
            assert [(r.state, r.error, r.output) for r in records] == [
                ("done", "", "hold"),
                ("done", "", "next"),
            ]
    assert runner.started == 2


async def test_a_wake_whose_commit_answer_was_lost_resumes(
    postgres_db: str, workspace: Path
) -> None:
    """A wake-up set the answered child running here and the answer to its COMMIT was
    lost: the host resumes the child once the database answers, once."""

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        answer = await ctx.ask("q", "go on?")
        ctx.emit(Event(kind="result", text=answer))

    runner = ScriptRunner(script=run)
    with proxied(postgres_db) as (url, proxy):
        async with Engine(url, runner=runner, config=EngineConfig(hold_s=0.1)) as engine:
            h = await open_harness(engine, runner, workspace)
            started = await h.start("q1")
            cid = started.conversation_id
            for _ in range(500):
                if rows.rows(postgres_db, "SELECT state FROM children") == [("waiting",)]:
                    break
                await asyncio.sleep(0.02)
            proxy.cut_answer("state IN ('waiting')", then="COMMIT")
            await engine.answer_input(cid, "q", text="yes")
            record = await wait_terminal(engine, cid, timeout=20)
            assert proxy.cuts == 1
    assert (record.state, record.error, record.output) == ("done", "", "yes")
    assert runner.started == 2  # its first run, then once resumed with the answer


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
