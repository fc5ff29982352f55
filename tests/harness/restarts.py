"""What other tests use of engine/test_recovery.py, kept here so that no test module imports
another: LEASE, restarted, route, rows, until_event."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from delegation import (
    ChildContext,
    Engine,
    EngineConfig,
)
from delegation.clock import ManualClock
from tests.harness.rows import scalar
from tests.harness.support import Harness, Script, ScriptRunner

LEASE = "lease-1"


def route(**scripts: Script) -> Script:
    """One runner script per child, chosen by the request's message."""

    async def run(ctx: ChildContext) -> None:
        await scripts[ctx.request.message](ctx)

    return run


@contextlib.asynccontextmanager
async def restarted(
    h: Harness,
    db_url: str,
    runner: ScriptRunner,
    config: EngineConfig,
    clock: ManualClock | None,
) -> AsyncIterator[Harness]:
    """A new engine on the same database; the runner reconnects with the same hostInstanceId.

    The returned harness keeps the old tool handle only for its ids (run, extension):
    the tool call itself ended with the old host, so calls go through the lease.
    """
    async with Engine(db_url, runner=runner, config=config, clock=clock) as engine:
        conn = await engine.connect(h.conn.runner_id, h.conn.host_instance_id)
        yield Harness(engine, runner, conn, h.tool, h.workspace)


async def until_event(engine: Engine, conversation_id: str, text: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while text not in [e.text for e in await engine.events(conversation_id)]:
        if loop.time() > deadline:
            raise AssertionError(f"event {text!r} never committed")
        await asyncio.sleep(0.01)


def rows(db_url: str, table: str, child_id: int) -> int:
    sql = f"SELECT COUNT(*) FROM {table} WHERE child_id = :child_id"
    return int(scalar(db_url, sql, {"child_id": child_id}))
