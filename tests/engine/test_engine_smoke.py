"""The happy path end to end: start, events, steer, read to completion, replay."""

from __future__ import annotations

import asyncio
import gc

from delegation import ChildContext, Engine, Event
from tests.harness.support import Harness, ScriptRunner


async def test_start_read_steer_and_replay(harness: Harness) -> None:
    async def script(ctx: ChildContext) -> None:
        await ctx.admit()
        ctx.emit(Event(kind="text", text="thinking"))
        steer = await ctx.wait_steer(5)
        ctx.emit(Event(kind="result", text=f"done with {steer}"))

    harness.runner.script = script
    started = await harness.start()
    assert not started.done
    assert started.parent_run_id == "parent-run"
    steered = await harness.engine.call(
        harness.conn,
        "child.steer",
        harness.params(child_id=started.conversation_id, request_id="s1", message="left"),
    )
    assert steered.outcome == "injected"
    await harness.wait_done(started.conversation_id)
    final = await harness.read(started.conversation_id)
    assert final.done and not final.cancelled
    assert final.output == "done with left"
    assert [e.sequence for e in final.events] == [1, 2]
    again = await harness.start()
    assert again.run_id == started.run_id
    assert len(harness.runner.prepared) == 1
    await asyncio.sleep(0)


async def test_opening_leaves_the_garbage_collector_as_it_found_it(db_url: str) -> None:
    """A boot pauses the cyclic collector while it resumes children, and only then."""
    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        engine = Engine(db_url, runner=ScriptRunner())
        try:
            await engine.open()
            assert gc.isenabled() is enabled
        finally:
            await engine.close()
            gc.enable()
