"""The records a child method locates its child by (``grants.runner_tool_and_executions``),
on both stores: rows unchanged since the last read give the records made then, a row
that changed gives new ones, and a conversation's executions come oldest first."""

from __future__ import annotations

import asyncio
from typing import Any

from delegation.store import grants
from tests.harness.support import Harness, hold


async def _located(harness: Harness, conversation_id: str) -> Any:
    tool = harness.tool
    return await harness.engine._db.read_now(
        lambda c: grants.runner_tool_and_executions(
            c, harness.conn.runner_id, tool.run_id, tool.tool_call_id, conversation_id
        )
    )


async def test_unchanged_rows_give_the_same_records_and_a_changed_row_new_ones(
    harness: Harness,
) -> None:
    gate = asyncio.Event()
    harness.runner.script = hold(gate)
    first = await harness.start("q1")
    runner, tool, [child] = await _located(harness, first.conversation_id)
    again_runner, again_tool, [again] = await _located(harness, first.conversation_id)
    assert (again_runner, again_tool, again) == (runner, tool, child)
    assert again is child and again_tool is tool  # made once: records are frozen
    assert child.state == "running"

    gate.set()
    await harness.wait_done(first.conversation_id)
    _, _, [ended] = await _located(harness, first.conversation_id)
    assert ended is not child
    assert (ended.id, ended.state) == (child.id, "done")

    second = await harness.start("q2", resume=first.conversation_id)
    await harness.wait_done(first.conversation_id, child_run_id=second.run_id)
    _, _, executions = await _located(harness, first.conversation_id)
    assert [(e.run_id, e.followup) for e in executions] == [
        (first.run_id, False),
        (second.run_id, True),
    ]
    assert executions[0].id < executions[1].id
    executions.clear()  # each caller's own list: the kept records are not touched
    _, _, kept = await _located(harness, first.conversation_id)
    assert len(kept) == 2


async def test_a_call_naming_no_tool_finds_the_runner_alone(harness: Harness) -> None:
    started = await harness.start("q1")
    await harness.wait_done(started.conversation_id)
    found = await harness.engine._db.read_now(
        lambda c: grants.runner_tool_and_executions(
            c, harness.conn.runner_id, harness.tool.run_id, "", started.conversation_id
        )
    )
    runner, tool, [child] = found
    assert runner is not None and runner.runner_id == harness.conn.runner_id
    assert tool is None
    assert child.conversation_id == started.conversation_id
