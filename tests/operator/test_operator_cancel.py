"""An operator's ``delegation cancel``: a slow child's cancel is applied, not reported as
no live host; one left while no host runs stops the child before it runs again; several
pending together are applied together, each with its own outcome."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from sqlalchemy import create_engine

from delegation import ChildContext, Engine, EngineConfig
from delegation.store import controls
from tests.harness.confinement import _ended
from tests.harness.operators import operator
from tests.harness.rows import rows, scalar
from tests.harness.support import ScriptRunner, hold, open_harness

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


async def test_cancels_pending_together_are_applied_together_each_with_its_own_outcome(
    db_url: str, workspace: Path
) -> None:
    """Cancels committed at once are applied in one transaction (maintenance.
    apply_cancels): each still gets what a cancel alone records, a child not found
    its failure, and the children stop."""
    gate = asyncio.Event()

    async def script(ctx: ChildContext) -> None:
        await ctx.admit()
        if ctx.request.message != "quick":
            await gate.wait()

    runner = ScriptRunner(script)
    async with Engine(db_url, runner=runner) as engine:
        h = await open_harness(engine, runner, workspace)
        first = await h.start("q1", lease_id="L1")
        second = await h.start("q2", lease_id="L2")
        quick = await h.start("q3", message="quick", lease_id="L3")
        done = await _ended(engine, quick.conversation_id)
        asked = [
            (first.conversation_id, None),
            (second.conversation_id, second.run_id),
            (first.conversation_id, None),  # twice: applied twice, it changes nothing
            (quick.conversation_id, None),
            ("conv-" + "0" * 32, None),  # no such child
            ("not an id", None),
        ]
        store = create_engine(db_url)
        try:
            with store.begin() as conn:  # one commit: the host sees them pending together
                for conversation, run_id in asked:
                    controls.submit(conn, conversation, run_id, "cancel", "", "", 1.0, notify=True)
        finally:
            store.dispose()
        for child in (first, second):
            record = await _ended(engine, child.conversation_id)
            assert (record.state, record.error) == ("cancelled", "cancelled by operator")
        assert await engine.get_child(quick.conversation_id) == done
        applied = "SELECT COUNT(*) FROM controls WHERE applied_at IS NOT NULL"
        for _ in range(200):
            if scalar(db_url, applied) == len(asked):
                break
            await asyncio.sleep(0.05)
    outcomes = [json.loads(o) for (o,) in rows(db_url, "SELECT outcome FROM controls ORDER BY id")]
    assert [o.get("runId") for o in outcomes[:4]] == [
        first.run_id, second.run_id, first.run_id, quick.run_id
    ]  # fmt: skip
    assert [o["state"] for o in outcomes[:4]] == ["cancelling", "cancelling", "cancelling", "done"]
    assert outcomes[4]["failureReason"] == "child_not_found"
    assert outcomes[5]["failureReason"] == "invalid_id"
    assert scalar(db_url, applied) == len(asked)
