"""What other tests use of store/test_database_away.py, kept here so that no test module
imports another: own_harness."""

from __future__ import annotations

from delegation import Engine
from tests.harness.support import PRESET, Harness, ScriptRunner


async def own_harness(engine: Engine, runner: ScriptRunner, runner_id: str) -> Harness:
    """The usual harness, for one of several hosts: a runner of its own."""
    conn = await engine.connect(runner_id, f"{runner_id}-host")
    tool = await engine.open_tool(
        conn, run_id=f"{runner_id}-run", conversation_id=f"{runner_id}-conv",
        tool_call_id="call-1", extension_id=PRESET.extension_id, presets=[PRESET],
        workspace="/tmp",
    )  # fmt: skip
    return Harness(engine, runner, conn, tool, "/tmp")
