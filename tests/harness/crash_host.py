"""A host process for crash tests: it runs one scenario on a database and dies at a
named fault point with ``os._exit`` (no cleanup, no flush: like a crash).

    python tests/harness/crash_host.py DB_URL WORKSPACE FAULT

The fault points live here, in the test's host, never in the library. The process
prints ``READY`` lines as it goes, so the test can see how far it got.
"""

from __future__ import annotations

import asyncio
import os
import sys

from delegation import (
    ChildContext,
    Engine,
    EngineConfig,
    Event,
    Params,
    Preset,
    Request,
    RunnerConnection,
)

CRASH = 77
OWNER = {"run_id": "parent-run", "tool_call_id": "call-1", "extension_id": "ext"}
PRESET = Preset(name="worker", extension_id="ext", generation=7)
LEASE = "lease-1"
REQUEST = Request(request_id="q-crash", profile="worker", message="count to ten", lease_id=LEASE)


def say(line: str) -> None:
    print(line, flush=True)


def die() -> None:
    os._exit(CRASH)


class CrashRunner:
    def __init__(self, fault: str) -> None:
        self.fault = fault

    async def prepare(self, request: Request, preset: Preset, identity: object, recovery: object):  # type: ignore[no-untyped-def]
        if self.fault == "after_prepared_commit":
            die()
        if self.fault == "inside_prepare":
            await asyncio.sleep(0.01)
            die()
        return self.run

    async def run(self, ctx: ChildContext) -> None:
        await ctx.admit()
        if self.fault == "after_admission_commit":
            die()
        for step in range(1, 6):
            ctx.emit(Event(kind="text", text=f"step {step}"))
        await ctx.flush()
        say("FLUSHED 5")
        if self.fault == "mid_stream":
            ctx.emit(Event(kind="text", text="not flushed"))
            die()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if self.fault == "during_release_drain":
                die()
            raise


async def begin(engine: Engine, workspace: str) -> RunnerConnection:
    """Open ``engine``, connect the runner and open the tool call these hosts start under
    (its ids are ``OWNER``)."""
    await engine.open()
    conn = await engine.connect("runner-1", "host-a")
    await engine.open_tool(
        conn,
        conversation_id="parent-conv",
        presets=[PRESET],
        workspace=workspace,
        **OWNER,
    )
    return conn


async def main(url: str, workspace: str, fault: str) -> None:
    lifetime = 1.0 if fault == "lease_expires_while_down" else 3600.0
    config = EngineConfig(lease_lifetime_s=lifetime, release_drain_s=30.0)
    engine = Engine(url, runner=CrashRunner(fault), config=config)
    conn = await begin(engine, workspace)
    params = Params(**OWNER, generation=7, lease_id=LEASE, request=REQUEST)
    result = await engine.call(conn, "child.start", params)
    say(f"STARTED {result.conversation_id}")
    if fault == "during_release_drain":
        await asyncio.sleep(0.2)
        release = Params(**OWNER, generation=7, lease_id=LEASE)
        await engine.call(conn, "child.lease.release", release)
    await asyncio.sleep(3600 if fault != "lease_expires_while_down" else 0.3)
    die()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
