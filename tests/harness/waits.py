"""What other tests use of run/test_waiting.py, kept here so that no test module imports
another: HOLD_S, Script, hosted, state_is, until."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from delegation import ChildContext, Engine, EngineConfig
from tests.harness.support import Harness, ScriptRunner, open_harness

HOLD_S = 0.2
Script = Callable[[ChildContext], Awaitable[None]]


@contextlib.asynccontextmanager
async def hosted(
    db_url: str, workspace: Path, script: Script, **config: Any
) -> AsyncIterator[Harness]:
    """An engine on the system clock (timeouts and sleeps are real) with a short hold."""
    runner = ScriptRunner(script=script)
    settings = EngineConfig(**{"release_drain_s": 2.0, "hold_s": HOLD_S, **config})
    async with Engine(db_url, runner=runner, config=settings) as engine:
        yield await open_harness(engine, runner, workspace)


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await check():
        if loop.time() > deadline:
            raise AssertionError("never came")
        await asyncio.sleep(0.02)


async def state_is(h: Harness, conversation_id: str, state: str) -> None:
    async def check() -> bool:
        record = await h.engine.get_child(conversation_id)
        return record is not None and record.state == state

    await until(check)
