"""What other tests use of runners/test_child_reach.py, kept here so that no test module
imports another: ended, first_text, hosted, script."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

from delegation import Engine, EngineConfig
from delegation.runners.command import CommandRunner
from tests.harness.support import PRESET, Harness, open_harness


def script(source: str, *args: str) -> list[str]:
    literal = textwrap.dedent(source).replace("{", "{{").replace("}", "}}")
    return [sys.executable, "-c", literal, *args]


@contextlib.asynccontextmanager
async def hosted(tmp: Path, runner: CommandRunner) -> AsyncIterator[Harness]:
    (tmp / "ws").mkdir(exist_ok=True)
    config = EngineConfig(release_drain_s=2.0)
    async with Engine(f"sqlite:///{tmp / 'x.db'}", runner=runner, config=config) as engine:
        yield await open_harness(engine, runner, tmp / "ws", [PRESET])


async def first_text(h: Harness, conversation_id: str) -> str:
    for _ in range(1000):
        events = await h.engine.events(conversation_id)
        if events:
            return events[0].text
        await asyncio.sleep(0.01)
    raise AssertionError("no event")


async def ended(h: Harness, conversation_id: str) -> str:
    """Wait until the child is terminal; its error ("" for none)."""
    record = await h.wait_done(conversation_id, timeout=20)
    return str(record.error)
