"""A child past EngineConfig.max_run_s is cancelled with "cancelled: child deadline exceeded"
(issue 29): there was no time limit on a child at all."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from delegation import ChildContext, Engine, EngineConfig, Event
from delegation.runners.command import CommandRunner
from tests.harness.support import PRESET, ScriptRunner, open_harness


async def forever(ctx: ChildContext) -> None:
    await ctx.admit()
    ctx.emit(Event(kind="text", text="working"))
    await asyncio.Event().wait()


async def test_a_child_past_max_run_s_is_cancelled_with_child_deadline_exceeded(
    db_url: str, workspace: Path
) -> None:
    runner = ScriptRunner(script=forever)
    config = EngineConfig(max_run_s=0.3, release_drain_s=5.0)
    async with Engine(db_url, runner=runner, config=config) as engine:
        h = await open_harness(engine, runner, workspace)
        started = await h.start()
        record = await h.wait_done(started.conversation_id)
        assert (record.state, record.error) == ("cancelled", "cancelled: child deadline exceeded")


async def test_a_real_command_child_is_ended_by_the_deadline(db_url: str, workspace: Path) -> None:
    argv = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"]
    runner = CommandRunner(profiles={PRESET.name: argv})
    config = EngineConfig(max_run_s=1.0, release_drain_s=5.0)
    async with Engine(db_url, runner=runner, config=config) as engine:
        h = await open_harness(engine, runner, workspace)
        started = await h.start()
        record = await h.wait_done(started.conversation_id)
        assert (record.state, record.error) == ("cancelled", "cancelled: child deadline exceeded")


async def test_a_child_within_max_run_s_finishes_as_usual(db_url: str, workspace: Path) -> None:
    runner = ScriptRunner()
    async with Engine(db_url, runner=runner, config=EngineConfig(max_run_s=60.0)) as engine:
        h = await open_harness(engine, runner, workspace)
        started = await h.start()
        record = await h.wait_done(started.conversation_id)
        assert (record.state, record.error) == ("done", "")


@pytest.mark.parametrize("bad", [0.0, -1.0, 1e300])
def test_max_run_s_must_be_a_positive_number_of_seconds(bad: float) -> None:
    with pytest.raises(ValueError, match="max_run_s"):
        EngineConfig(max_run_s=bad)
