"""``follow`` ends on every terminal state whoever wrote it (design §18): the host's own
cancel, another host's, an operator's, a lease's expiry and a purge; in the process of
the host that runs the child (both stores), and on another host of the same PostgreSQL
database, which no event of the child wakes (a cancel writes none). The takeover's end
is in tests/crash/test_several_hosts.py (it needs a host process to pause)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from delegation import Engine, EngineConfig, errors
from delegation.clock import ManualClock
from tests.harness.operators import operator
from tests.harness.support import Harness, ScriptRunner, hold, open_harness

ENDINGS = ["cancel", "operator", "expiry", "purge"]


async def follow_to_end(engine: Engine, conversation: str, texts: list[str]) -> str:
    """Follow ``conversation`` on ``engine`` to its end: "ended", or "purged" when the
    record went before the follower saw its end (the read's own answer)."""
    try:
        async for event in engine.follow(conversation):
            texts.append(event.text)
    except errors.ChildPurged:
        return "purged"
    return "ended"


async def end_child(
    ending: str, host: Engine, other: Engine, clock: ManualClock, conversation: str, url: str
) -> None:
    """End ``conversation`` (run by ``host``) the way ``ending`` names."""
    if ending == "cancel":
        await host.cancel_child(conversation)
    elif ending == "cancel_elsewhere":  # asked of another host, stopped by its owner
        await other.cancel_child(conversation)
    elif ending == "operator":
        code, _, err = await operator("cancel", conversation, "--wait", db=url)
        assert code == 0, err
    elif ending == "expiry":
        clock.advance(host.config.lease_lifetime_s + 1)
        await host.expire_due()
    elif ending == "purge":
        await host.cancel_child(conversation)
        clock.advance(host.config.retention_s + 1)
        assert await host.purge() == 1
    else:
        raise AssertionError(ending)


async def until_following(texts: list[str], follower: asyncio.Task[str]) -> None:
    """Wait until the follower gave the child's first event (it then waits for more)."""
    for _ in range(6000):
        if texts or follower.done():
            break
        await asyncio.sleep(0.01)
    assert texts == ["working"] and not follower.done()


@pytest.mark.parametrize("ending", ENDINGS)
async def test_follow_in_the_hosts_process_ends_with_the_child(
    harness: Harness, clock: ManualClock, db_url: str, ending: str
) -> None:
    harness.runner.script = hold(asyncio.Event())
    child = await harness.start("q1", lease_id="L1")
    texts: list[str] = []
    engine = harness.engine
    follower = asyncio.create_task(follow_to_end(engine, child.conversation_id, texts))
    await until_following(texts, follower)
    await end_child(ending, engine, engine, clock, child.conversation_id, db_url)
    how = await asyncio.wait_for(follower, 60)
    assert how == "ended" or (ending == "purge" and how == "purged")
    assert texts == ["working"]


@pytest.mark.parametrize("ending", ["cancel_elsewhere", *ENDINGS])
async def test_follow_on_another_host_ends_with_the_child(
    postgres_db: str, workspace: Path, ending: str
) -> None:
    clock = ManualClock(start=time.time())
    runner = ScriptRunner(hold(asyncio.Event()))
    config = EngineConfig(release_drain_s=5.0, lease_lifetime_s=60.0)
    async with (
        Engine(postgres_db, runner=runner, config=config, clock=clock) as a,
        Engine(postgres_db, runner=ScriptRunner(), config=config, clock=clock) as b,
    ):
        h = await open_harness(a, runner, workspace)
        child = await h.start("q1", lease_id="L1")
        texts: list[str] = []
        follower = asyncio.create_task(follow_to_end(b, child.conversation_id, texts))
        await until_following(texts, follower)
        await end_child(ending, a, b, clock, child.conversation_id, postgres_db)
        how = await asyncio.wait_for(follower, 60)
        assert how in ("ended", "purged")
        assert texts == ["working"]
        record = await a.get_child(child.conversation_id)
        assert record is None or record.state == "cancelled"
