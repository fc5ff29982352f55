"""The runs executing in this process and their lifecycle (delegation.engine.local_run)."""

from __future__ import annotations

import asyncio

from delegation import ChildContext, Event
from delegation.engine.local_run import Phase
from tests.harness.rows import rows
from tests.harness.support import Harness


async def test_a_run_goes_preparing_admitted_finishing_ended(harness: Harness) -> None:
    entered, gate, finishing = asyncio.Event(), asyncio.Event(), asyncio.Event()
    seen: list[Phase] = []

    async def script(ctx: ChildContext) -> None:
        seen.extend(run.phase for run in harness.engine._supervisor.runs)
        await ctx.admit()
        entered.set()
        await gate.wait()
        ctx.emit(Event(kind="result", text="done"))

    harness.runner.script = script
    started = await harness.start("q1")
    record = await harness.engine.get_child(started.conversation_id)
    assert record is not None
    child_id = record.id
    await entered.wait()
    run = harness.engine._supervisor.runs.get(child_id)
    assert run is not None and seen == [Phase.PREPARING] and run.phase is Phase.ADMITTED
    assert run.decided.is_set() and not run.ended.is_set()
    run.finishing()  # as the engine marks it once the run returned: a cancel spares it
    run.cancel()
    assert run.task is not None and not run.task.cancelling()
    finishing.set()
    gate.set()
    await asyncio.wait_for(run.ended.wait(), 10)
    assert run.phase is Phase.ENDED and harness.engine._supervisor.runs.get(child_id) is None
    done = await harness.wait_done(started.conversation_id)
    assert done.state == "done"


async def test_close_suspends_a_leased_run_without_recording_an_end(
    harness: Harness, db_url: str
) -> None:
    entered = asyncio.Event()

    async def script(ctx: ChildContext) -> None:
        await ctx.admit()
        entered.set()
        await asyncio.Event().wait()  # runs until it is stopped

    harness.runner.script = script
    started = await harness.start("q1", lease_id="L1")  # leased: it outlives the close
    await entered.wait()
    (run,) = list(harness.engine._supervisor.runs)
    assert run.phase is Phase.ADMITTED and not run.suspended
    await harness.engine.close()
    assert run.suspended and run.phase is Phase.ENDED and run.task is not None
    assert run.task.done()  # stopped (the engine's task swallows the cancellation)
    assert rows(db_url, "SELECT state FROM children") == [("running",)], "resumed at next boot"
    assert started.conversation_id
