"""PostgreSQL behind PgBouncer (design §25): in session mode the engine works as on the
server itself (a child starts, streams, survives the host's restart, waits its turn);
in transaction mode it is refused at open with one clear line, before anything is
written: its advisory locks and ``LISTEN`` need a session of their own."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from delegation import AdmissionPolicy, ChildContext, Engine, EngineConfig, Event, errors
from delegation.store.postgres.connect import POOLED_TRANSACTIONS
from tests.harness import rows
from tests.harness.pgbouncer import bouncer, through
from tests.harness.support import PRESET, ScriptRunner, open_harness


@pytest.fixture
def session_url(postgres_server: str, postgres_db: str) -> Iterator[str]:
    with bouncer(postgres_server, "session") as port:
        yield through(postgres_db, port)


@pytest.mark.parametrize("mode", ["transaction", "statement"])
async def test_a_pooler_in_transaction_mode_is_refused_at_open(
    postgres_server: str, postgres_db: str, mode: str
) -> None:
    before = rows.rows(postgres_db, "SELECT id FROM engine_instances")
    with bouncer(postgres_server, mode) as port:
        engine = Engine(through(postgres_db, port), runner=ScriptRunner())
        with pytest.raises(errors.StoreError) as refused:
            await engine.open()
    assert str(refused.value) == POOLED_TRANSACTIONS
    assert "\n" not in str(refused.value) and "pool_mode=session" in str(refused.value)
    assert rows.rows(postgres_db, "SELECT id FROM engine_instances") == before  # nothing


async def test_in_session_mode_a_child_runs_and_resumes_after_a_restart(
    session_url: str, workspace: Path
) -> None:
    go_on = asyncio.Event()

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        if ctx.recovery is None:
            ctx.emit(Event(kind="text", text="before"))
            await ctx.flush()
            await go_on.wait()
        ctx.emit(Event(kind="result", text="after"))

    runner = ScriptRunner(script=run)
    async with Engine(session_url, runner=runner) as engine:
        h = await open_harness(engine, runner, workspace)
        started = await h.start("q1", lease_id="lease-1")
        conversation = started.conversation_id
        async for event in engine.follow(conversation):
            assert event.text == "before"
            break
    async with Engine(session_url, runner=runner) as engine:  # a new host instance
        events = [event.text async for event in engine.follow(conversation)]
        record = await engine.get_child(conversation)
    assert events[0] == "before" and events[-1] == "after"
    assert record is not None and (record.state, record.recovery_attempts) == ("done", 1)


async def test_in_session_mode_admission_holds_its_limit(session_url: str, workspace: Path) -> None:
    gate = asyncio.Event()

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        await gate.wait()

    scope = f"preset:runner-1/{PRESET.extension_id}/{PRESET.name}"
    config = EngineConfig(admission={scope: AdmissionPolicy(concurrency=1)}, start_wait_s=0)
    runner = ScriptRunner(script=run)
    async with Engine(session_url, runner=runner, config=config) as engine:
        h = await open_harness(engine, runner, workspace)
        first = await h.start("q1", lease_id="lease-1")
        second = await h.start("q2", lease_id="lease-1")
        assert not first.queued and second.queued
        gate.set()
        done = await h.wait_done(second.conversation_id, lease_id="lease-1", tool_call_id="")
        assert done.state == "done"
