"""An operator's ``delegation cancel``: a slow child's cancel is applied, not reported as
no live host; one left while no host runs stops the child before it runs again."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from delegation import ChildContext, Engine, EngineConfig
from tests.support import ScriptRunner, hold, open_harness
from tests.test_command_confinement import _ended
from tests.test_push_control import operator

# --- operator cancel ---------------------------------------------------------------------


async def test_an_operator_cancel_of_a_slow_child_is_not_reported_as_no_live_host(
    db_url: str, workspace: Path
) -> None:
    async def slow(ctx: ChildContext) -> None:
        await ctx.admit()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.shield(asyncio.sleep(4))  # a CLI agent saving its work
            raise

    runner = ScriptRunner(slow)
    async with Engine(db_url, runner=runner, config=EngineConfig(release_drain_s=10)) as engine:
        h = await open_harness(engine, runner, workspace)
        child = await h.start("q1", lease_id="L1")
        code, out, err = await operator("cancel", child.conversation_id, "--json", db=db_url)
        assert code == 0, err
        assert json.loads(out)["applied"] is True, out
        assert (await _ended(engine, child.conversation_id)).state == "cancelled"


async def test_a_cancel_left_while_down_stops_the_child_before_it_runs_again(
    db_url: str, workspace: Path
) -> None:
    runner = ScriptRunner(hold(asyncio.Event()))
    async with Engine(db_url, runner=runner) as engine:
        h = await open_harness(engine, runner, workspace)
        child = await h.start("q1", lease_id="L1")
    code, out, err = await operator("cancel", child.conversation_id, db=db_url)
    assert code == 0 and "queued" in out, err
    resumed = ScriptRunner(hold(asyncio.Event()))
    async with Engine(db_url, runner=resumed) as engine:
        record = await _ended(engine, child.conversation_id)
        assert (record.state, record.error) == ("cancelled", "cancelled by operator")
    assert resumed.started == 0, "the cancelled command ran again from its start"
