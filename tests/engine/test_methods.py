"""The five child methods through a real Engine on both stores (design §3.6-3.8, §4-§6, §12).

Replay and idempotency, admission outcomes, fork and resume authority, child handles,
steering, every cap at its number, the event log's paging, truncation and commit
order, and the module-level ``admit()``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

import delegation
from delegation import ChildContext, DelegationError, EngineConfig, Event, Preset, errors
from delegation.clock import ManualClock
from delegation.options import ExecutionOptions
from tests.harness.support import PRESET, Harness
from tests.harness.tool_calls import open_tool, release, steer

FIELD_LIMIT = 32 * 1024
OTHER_PRESET = Preset(name="other", extension_id=PRESET.extension_id, generation=PRESET.generation)


# --- helpers -------------------------------------------------------------------------


async def within(awaitable: Awaitable[Any], timeout: float = 60.0) -> Any:
    return await asyncio.wait_for(awaitable, timeout)


async def cancel(h: Harness, child_id: str, **changes: Any) -> Any:
    return await h.engine.call(h.conn, "child.cancel", h.params(child_id=child_id, **changes))


def gate_before_admit(entered: asyncio.Event, gate: asyncio.Event) -> Any:
    """A run that signals ``entered``, waits for ``gate``, then admits and finishes."""

    async def run(ctx: ChildContext) -> None:
        entered.set()
        await gate.wait()
        await ctx.admit()
        ctx.emit(Event(kind="result", text=f"done: {ctx.request.message}"))

    return run


def hold_after_admit(gate: asyncio.Event) -> Any:
    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        await gate.wait()
        ctx.emit(Event(kind="result", text=f"done: {ctx.request.message}"))

    return run


async def read_all(h: Harness, child_id: str, **changes: Any) -> list[Event]:
    """Every committed event of a child, page by page."""
    seen: list[Event] = []
    while True:
        page = await h.read(child_id, after=seen[-1].sequence if seen else 0, **changes)
        if not page.events:
            return seen
        seen.extend(page.events)


def utf8_prefix(text: str, limit: int) -> str:
    """The longest prefix of ``text`` whose UTF-8 form fits in ``limit`` bytes."""
    used = 0
    for index, char in enumerate(text):
        used += len(char.encode("utf-8"))
        if used > limit:
            return text[:index]
    return text


# --- idempotent replay ---------------------------------------------------------------


async def test_replay_returns_same_child_and_runs_it_once(harness: Harness) -> None:
    first = await harness.start("q1")
    await harness.wait_done(first.conversation_id)
    again = await harness.start("q1")
    third = await harness.start("q1")
    for replay in (again, third):
        assert replay.conversation_id == first.conversation_id
        assert replay.run_id == first.run_id
        assert replay.parent_run_id == first.parent_run_id == "parent-run"
        assert replay.parent_conversation_id == "parent-conv"
        assert replay.extension_id == first.extension_id
        assert replay.profile == first.profile
        assert replay.runner_id == first.runner_id == "runner-1"
        assert replay.host_instance_id == first.host_instance_id == "host-a"
    assert len(harness.runner.prepared) == 1
    assert harness.runner.started == 1
    children = await harness.engine.list_children(parent_run_id="parent-run")
    assert [c.run_id for c in children] == [first.run_id]
    assert third.done and third.output == "done: do the task"


async def test_replay_while_running_waits_for_the_same_child(harness: Harness) -> None:
    gate = asyncio.Event()
    harness.runner.script = hold_after_admit(gate)
    first = await harness.start("q1")
    assert not first.done
    again = await harness.start("q1")
    assert (again.conversation_id, again.run_id) == (first.conversation_id, first.run_id)
    assert not again.done
    gate.set()
    await harness.wait_done(first.conversation_id)
    assert len(harness.runner.prepared) == 1
    assert harness.runner.started == 1


async def test_ten_concurrent_identical_starts_prepare_and_run_once(harness: Harness) -> None:
    entered = asyncio.Event()
    gate = asyncio.Event()
    harness.runner.script = gate_before_admit(entered, gate)
    starts = [asyncio.create_task(harness.start("same")) for _ in range(10)]
    await within(entered.wait())
    await asyncio.sleep(0.05)
    assert not any(t.done() for t in starts), "start must wait for admission"
    gate.set()
    results = await within(asyncio.gather(*starts))
    assert len({(r.conversation_id, r.run_id) for r in results}) == 1
    assert len(harness.runner.prepared) == 1
    assert harness.runner.started == 1
    await harness.wait_done(results[0].conversation_id)
    assert len(await harness.engine.list_children()) == 1
    assert harness.runner.started == 1


@pytest.mark.parametrize(
    "changes",
    [
        {"message": "another task"},
        {"options": ExecutionOptions(max_turns=3)},
        {"cwd": "sub"},
        {"system_prompt": "be brief"},
    ],
    ids=["message", "options", "cwd", "system_prompt"],
)
async def test_same_request_id_with_other_input_is_refused(
    harness: Harness, changes: dict[str, Any]
) -> None:
    first = await harness.start("q1")
    with pytest.raises(errors.RequestIdReused) as caught:
        await harness.start("q1", **changes)
    assert str(caught.value) == "requestId was already used with different child input"
    assert len(harness.runner.prepared) == 1
    assert len(await harness.engine.list_children()) == 1
    again = await harness.start("q1")
    assert again.run_id == first.run_id


async def test_caller_going_away_does_not_cancel_the_child(harness: Harness) -> None:
    entered = asyncio.Event()
    gate = asyncio.Event()
    harness.runner.script = gate_before_admit(entered, gate)
    caller = asyncio.create_task(harness.start("q1"))
    await within(entered.wait())
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    gate.set()
    child = harness.runner.prepared[0].identity
    record = await harness.wait_done(child.conversation_id)
    assert record.state == "done"
    assert record.admitted_at is not None
    assert record.error == ""
    replay = await harness.start("q1")
    assert (replay.conversation_id, replay.run_id) == (child.conversation_id, child.run_id)
    assert replay.done and not replay.cancelled
    assert replay.output == "done: do the task"
    assert len(harness.runner.prepared) == 1


async def test_caller_going_away_before_the_reservation_commits(harness: Harness) -> None:
    """The caller is cancelled while its reservation is in flight: the reservation still
    commits, so the child must still run (or not exist at all); a replay reconciles."""
    caller = asyncio.create_task(harness.start("q1"))
    await asyncio.sleep(0)  # the reservation is queued for the writer
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    replay = await within(harness.start("q1"))
    record = await harness.wait_done(replay.conversation_id, timeout=3.0)
    assert record.state == "done"
    assert record.output == "done: do the task"
    assert len(harness.runner.prepared) == 1
    assert len(await harness.engine.list_children()) == 1


# --- admission outcomes ----------------------------------------------------------------


async def assert_admission_failed(h: Harness, request_id: str, message: str) -> None:
    """Start, a replay, read and cancel all answer the same AdmissionFailed."""
    expected = f"child admission failed: {message}"
    with pytest.raises(errors.AdmissionFailed) as caught:
        await h.start(request_id)
    assert str(caught.value) == expected
    assert caught.value.reason == "admission_failed"
    (record,) = await h.engine.list_children()
    for call in (
        lambda: h.start(request_id),
        lambda: h.start(request_id),
        lambda: h.read(record.conversation_id),
        lambda: h.read(record.conversation_id, child_run_id=record.run_id),
        lambda: cancel(h, record.conversation_id),
        lambda: h.read(record.conversation_id),
    ):
        with pytest.raises(errors.AdmissionFailed) as again:
            await call()
        assert str(again.value) == expected


@pytest.mark.parametrize("early", [0, 1, 3])
async def test_the_first_page_holds_what_the_run_emitted_before_admitting(
    harness: Harness, early: int
) -> None:
    """The admission's page is read only if the run emitted: then it holds those events."""
    gate = asyncio.Event()

    async def script(ctx: ChildContext) -> None:
        for n in range(early):
            ctx.emit(Event(kind="text", text=f"early {n}"))
        await ctx.admit()
        ctx.emit(Event(kind="text", text="after admission"))
        await gate.wait()

    harness.runner.script = script
    started = await harness.start("q1")
    assert [(e.sequence, e.text) for e in started.events] == [
        (n + 1, f"early {n}") for n in range(early)
    ]
    assert not started.done
    gate.set()
    record = await harness.wait_done(started.conversation_id)
    assert record.state == "done"


async def test_prepare_failure_is_sticky(harness: Harness) -> None:
    harness.runner.prepare_error = RuntimeError("model unavailable")
    await assert_admission_failed(harness, "q1", "model unavailable")
    assert len(harness.runner.prepared) == 1
    assert harness.runner.started == 0
    (record,) = await harness.engine.list_children()
    assert record.state == "done"
    assert record.admitted_at is None
    assert record.error == "model unavailable"


async def test_run_raising_before_admit_is_sticky(harness: Harness) -> None:
    async def script(ctx: ChildContext) -> None:
        raise ValueError("bad configuration")

    harness.runner.script = script
    await assert_admission_failed(harness, "q1", "bad configuration")
    assert harness.runner.started == 1
    assert len(harness.runner.prepared) == 1
    (record,) = await harness.engine.list_children()
    assert record.state == "done"
    assert record.error == "bad configuration"


async def test_child_cancelled_before_admission_is_sticky(harness: Harness) -> None:
    entered = asyncio.Event()
    gate = asyncio.Event()
    harness.runner.script = gate_before_admit(entered, gate)
    caller = asyncio.create_task(harness.start("q1"))
    await within(entered.wait())
    child = harness.runner.prepared[0].identity
    # The run may already have stopped: then cancel answers the sticky failure too.
    answer: Any
    try:
        answer = await cancel(harness, child.conversation_id)
    except errors.AdmissionFailed as exc:
        answer = exc
    if isinstance(answer, errors.AdmissionFailed):
        assert str(answer) == "child admission failed: cancelled: cancel requested"
    else:
        assert answer.run_id == child.run_id
        assert not answer.done
    with pytest.raises(errors.AdmissionFailed) as caught:
        await within(caller)
    assert str(caught.value) == "child admission failed: cancelled: cancel requested"
    gate.set()
    record = await harness.wait_done(child.conversation_id)
    assert record.state == "cancelled"
    assert record.admitted_at is None
    await assert_admission_failed(harness, "q1", "cancelled: cancel requested")
    assert len(harness.runner.prepared) == 1


async def test_run_ended_without_admit_fails_admission(harness: Harness) -> None:
    async def script(ctx: ChildContext) -> None:
        return None

    harness.runner.script = script
    with pytest.raises(errors.AdmissionFailed) as caught:
        await harness.start("q1")
    assert str(caught.value).startswith("child admission failed")
    (record,) = await harness.engine.list_children()
    assert record.state == "done" and record.admitted_at is None


async def test_run_raising_after_admit_ends_done_with_its_message(harness: Harness) -> None:
    async def script(ctx: ChildContext) -> None:
        await ctx.admit()
        ctx.emit(Event(kind="text", text="partial"))
        raise RuntimeError("tool crashed")

    harness.runner.script = script
    started = await harness.start("q1")
    record = await harness.wait_done(started.conversation_id)
    assert record.state == "done"
    assert record.error == "tool crashed"
    final = await harness.read(started.conversation_id)
    assert final.done and not final.cancelled
    assert final.error == "tool crashed"
    assert [e.text for e in final.events] == ["partial"]
    replay = await harness.start("q1")
    assert replay.run_id == started.run_id and replay.error == "tool crashed"


# --- fork ----------------------------------------------------------------------------


async def test_fork_with_the_live_tool_works(harness: Harness) -> None:
    started = await harness.start("q1", context_mode="fork")
    record = await harness.wait_done(started.conversation_id)
    assert record.state == "done"
    assert harness.runner.prepared[0].request.context_mode == "fork"


async def test_fork_through_a_lease_with_the_live_tool_works(harness: Harness) -> None:
    await harness.start("q1", lease_id="L1")
    forked = await harness.start("q2", lease_id="L1", context_mode="fork")
    assert (await harness.wait_done(forked.conversation_id)).state == "done"


async def test_fork_through_a_lease_after_the_tool_ended_is_refused(harness: Harness) -> None:
    gate = asyncio.Event()
    harness.runner.script = hold_after_admit(gate)
    leased = await harness.start("q1", lease_id="L1")
    await harness.engine.close_tool(harness.tool)
    with pytest.raises(errors.ForkRequiresTool) as caught:
        await harness.start("q2", lease_id="L1", context_mode="fork")
    assert str(caught.value) == "child fork requires the current active parent tool"
    assert len(harness.runner.prepared) == 1
    # The lease itself still works for a fresh child: the refusal is about fork.
    fresh = await harness.start("q3", lease_id="L1")
    assert fresh.conversation_id != leased.conversation_id
    assert len(harness.runner.prepared) == 2
    gate.set()
    await harness.wait_done(fresh.conversation_id)


# --- resume and child handles -------------------------------------------------------


async def test_resume_is_a_new_execution_of_the_same_conversation(harness: Harness) -> None:
    first = await harness.start("q1", cwd="sub")
    await harness.wait_done(first.conversation_id)
    second = await harness.start("q2", resume=first.conversation_id, message="continue")
    assert second.conversation_id == first.conversation_id
    assert second.run_id != first.run_id
    record = await harness.wait_done(first.conversation_id, child_run_id=second.run_id)
    assert record.state == "done"
    assert record.followup
    assert record.cwd == os.path.realpath(Path(harness.workspace) / "sub")
    assert harness.runner.prepared[1].identity.conversation_id == first.conversation_id
    assert harness.runner.prepared[1].identity.run_id == second.run_id
    newest = await harness.engine.get_child(first.conversation_id)
    assert newest is not None and newest.run_id == second.run_id
    # Events are numbered per execution.
    events = await read_all(harness, first.conversation_id, child_run_id=second.run_id)
    assert [e.sequence for e in events] == [1]
    assert events[0].text == "done: continue"


async def test_resume_uses_the_saved_cwd(harness: Harness) -> None:
    seen: list[str] = []

    async def script(ctx: ChildContext) -> None:
        seen.append(ctx.cwd)
        await ctx.admit()

    harness.runner.script = script
    first = await harness.start("q1", cwd="sub")
    await harness.wait_done(first.conversation_id)
    second = await harness.start("q2", resume=first.conversation_id)
    await harness.wait_done(first.conversation_id, child_run_id=second.run_id)
    sub = os.path.realpath(Path(harness.workspace) / "sub")
    assert seen == [sub, sub]


async def test_resume_while_an_execution_is_unfinished_is_refused(harness: Harness) -> None:
    gate = asyncio.Event()
    harness.runner.script = hold_after_admit(gate)
    first = await harness.start("q1")
    with pytest.raises(errors.ActiveSubmission) as caught:
        await harness.start("q2", resume=first.conversation_id)
    assert str(caught.value) == "child conversation already has an active submission"
    assert len(harness.runner.prepared) == 1
    gate.set()
    await harness.wait_done(first.conversation_id)
    resumed = await harness.start("q3", resume=first.conversation_id)
    assert resumed.conversation_id == first.conversation_id
    gate.set()


RESUME_MISMATCH = "the child task cannot resume with a different parent, host or execution preset"


async def _resume_from(h: Harness, other: Harness, conversation_id: str, **changes: Any) -> None:
    before = len(h.runner.prepared)
    with pytest.raises(errors.ResumeMismatch) as caught:
        await other.start("resume-1", resume=conversation_id, **changes)
    assert str(caught.value) == RESUME_MISMATCH
    assert len(h.runner.prepared) == before


async def test_resume_from_another_parent_conversation_is_refused(harness: Harness) -> None:
    first = await harness.start("q1")
    await harness.wait_done(first.conversation_id)
    other = await open_tool(
        harness, "call-x", run_id="parent-run-2", conversation_id="parent-conv-2"
    )
    await _resume_from(harness, other, first.conversation_id)


async def test_resume_from_another_parent_in_another_workspace_is_refused(
    harness: Harness, tmp_path: Path
) -> None:
    first = await harness.start("q1")
    await harness.wait_done(first.conversation_id)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    other = await open_tool(
        harness,
        "call-x",
        run_id="parent-run-2",
        conversation_id="parent-conv-2",
        workspace=str(elsewhere),
    )
    await _resume_from(harness, other, first.conversation_id)


async def test_resume_from_another_extension_is_refused(harness: Harness) -> None:
    first = await harness.start("q1")
    await harness.wait_done(first.conversation_id)
    preset = Preset(name=PRESET.name, extension_id="ext-2", generation=PRESET.generation)
    other = await open_tool(harness, "call-e", extension_id="ext-2", presets=(preset,))
    await _resume_from(harness, other, first.conversation_id)


async def test_resume_with_another_preset_is_refused(harness: Harness) -> None:
    both = await open_tool(harness, "call-p", presets=(PRESET, OTHER_PRESET))
    first = await both.start("q1")
    await harness.wait_done(first.conversation_id)
    await _resume_from(harness, both, first.conversation_id, profile=OTHER_PRESET.name)
    resumed = await both.start("q2", resume=first.conversation_id)  # same preset: allowed
    assert resumed.conversation_id == first.conversation_id


async def test_resume_from_another_runner_is_refused(harness: Harness) -> None:
    first = await harness.start("q1")
    await harness.wait_done(first.conversation_id)
    conn2 = await harness.engine.connect("runner-2", "host-b")
    other = await open_tool(harness, "call-1", conn=conn2)
    await _resume_from(harness, other, first.conversation_id)


async def test_resume_of_an_unknown_conversation_is_refused(harness: Harness) -> None:
    await _resume_from(harness, harness, "c-unknown")
    assert await harness.engine.list_children() == []


async def test_child_handles_after_a_followup(harness: Harness) -> None:
    first = await harness.start("q1")
    await harness.wait_done(first.conversation_id)
    second = await harness.start("q2", resume=first.conversation_id, message="again")
    await harness.wait_done(first.conversation_id, child_run_id=second.run_id)
    conv = first.conversation_id

    with pytest.raises(errors.AmbiguousChild) as caught:
        await harness.read(conv)
    assert str(caught.value) == "childRunId is required for an ambiguous child handle"
    with pytest.raises(errors.AmbiguousChild):
        await cancel(harness, conv)

    one = await harness.read(conv, child_run_id=first.run_id)
    two = await harness.read(conv, child_run_id=second.run_id)
    assert (one.run_id, one.output) == (first.run_id, "done: do the task")
    assert (two.run_id, two.output) == (second.run_id, "done: again")

    with pytest.raises(errors.ChildNotOwned) as unknown:
        await harness.read("c-unknown")
    assert str(unknown.value) == "child run is not owned by this capability"
    with pytest.raises(errors.ChildNotOwned):
        await harness.read(conv, child_run_id="r-unknown")


async def test_a_followup_alone_in_its_grant_needs_its_run_id(harness: Harness) -> None:
    first = await harness.start("q1")
    await harness.wait_done(first.conversation_id)
    later = await open_tool(harness, "call-2")
    second = await later.start("q2", resume=first.conversation_id, message="again")
    await harness.wait_done(first.conversation_id, child_run_id=second.run_id)
    with pytest.raises(errors.FollowupRequiresRunId) as caught:
        await later.read(first.conversation_id)
    assert str(caught.value) == "childRunId is required after a child followup"
    exact = await later.read(first.conversation_id, child_run_id=second.run_id)
    assert exact.run_id == second.run_id and exact.output == "done: again"
    # The first execution belongs to the first tool call's grant only.
    with pytest.raises(errors.ChildNotOwned):
        await later.read(first.conversation_id, child_run_id=first.run_id)
    original = await harness.read(first.conversation_id)
    assert original.run_id == first.run_id


# --- steer ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_id", "message"),
    [
        ("", "go left"),
        (".", "go left"),
        ("..", "go left"),
        ("a/b", "go left"),
        ("a\\b", "go left"),
        ("a b", "go left"),
        ("a\x7fb", "go left"),
        ("x" * 129, "go left"),
        ("s1", ""),
        ("s1", "  \n\t "),
        ("s1", "x" * 10_001),
        ("s1", "é" * 10_001),
    ],
    ids=[
        "empty-id",
        "dot",
        "dotdot",
        "slash",
        "backslash",
        "space",
        "del",
        "long-id",
        "empty-message",
        "blank-message",
        "10001-chars",
        "10001-multibyte-chars",
    ],
)
async def test_steer_input_is_validated(harness: Harness, request_id: str, message: str) -> None:
    gate = asyncio.Event()
    harness.runner.script = hold_after_admit(gate)
    started = await harness.start("q1")
    with pytest.raises(errors.BadSteer) as caught:
        await steer(harness, started.conversation_id, request_id, message)
    assert str(caught.value) == "child steer requires requestId and a nonempty bounded message"
    # A refused steer leaves no receipt behind.
    ok = await steer(harness, started.conversation_id, "s1", "go right")
    assert ok.outcome == "injected"
    gate.set()


@pytest.mark.parametrize("char", ["x", "é", "😀"])
async def test_steer_of_exactly_10000_characters_is_accepted(harness: Harness, char: str) -> None:
    got: list[str] = []

    async def script(ctx: ChildContext) -> None:
        await ctx.admit()
        message = await ctx.wait_steer(5)
        got.append(message or "")

    harness.runner.script = script
    started = await harness.start("q1")
    answer = await steer(harness, started.conversation_id, "s1", char * 10_000)
    assert answer.outcome == "injected"
    await harness.wait_done(started.conversation_id)
    assert got == [char * 10_000]


async def test_steer_is_idempotent_and_delivered_once(harness: Harness) -> None:
    gate = asyncio.Event()
    first_seen = asyncio.Event()
    received: list[str] = []

    async def script(ctx: ChildContext) -> None:
        await ctx.admit()
        message = await ctx.wait_steer(5)
        assert message is not None
        received.append(message)
        first_seen.set()
        await gate.wait()
        received.extend(ctx.take_steers())
        extra = await ctx.wait_steer(0.05)
        if extra is not None:
            received.append(extra)

    harness.runner.script = script
    started = await harness.start("q1")
    conv = started.conversation_id
    answer = await steer(harness, conv, "s1", "go left")
    assert answer.outcome == "injected" and answer.reason == ""
    await within(first_seen.wait())
    for _ in range(3):
        again = await steer(harness, conv, "s1", "go left")
        assert again == answer
    with pytest.raises(errors.SteerRequestIdReused) as caught:
        await steer(harness, conv, "s1", "go right")
    assert str(caught.value) == "steer requestId already used with different input"
    gate.set()
    await harness.wait_done(conv)
    assert received == ["go left"]
    # The stored receipt keeps answering after the child finished.
    assert await steer(harness, conv, "s1", "go left") == answer


async def test_steer_of_a_finished_child_requires_a_prompt(harness: Harness) -> None:
    started = await harness.start("q1")
    await harness.wait_done(started.conversation_id)
    answer = await steer(harness, started.conversation_id, "s1", "one more thing")
    assert answer.outcome == "promptRequired"
    assert answer.reason == "noRunningTurn"
    assert delegation.encode(answer) == b'{"outcome":"promptRequired","reason":"noRunningTurn"}'
    again = await steer(harness, started.conversation_id, "s1", "one more thing")
    assert again == answer
    record = await harness.engine.get_child(started.conversation_id)
    assert record is not None and record.state == "done"
    assert len(harness.runner.prepared) == 1  # steering never starts a turn


async def test_steers_arrive_oldest_first(harness: Harness) -> None:
    gate = asyncio.Event()
    received: list[str] = []

    async def script(ctx: ChildContext) -> None:
        await ctx.admit()
        await gate.wait()
        first = await ctx.wait_steer(1)
        assert first is not None
        received.append(first)
        received.extend(ctx.take_steers())

    harness.runner.script = script
    started = await harness.start("q1")
    messages = [f"message {i}" for i in range(8)]
    for i, message in enumerate(messages):
        answer = await steer(harness, started.conversation_id, f"s{i}", message)
        assert answer.outcome == "injected"
    gate.set()
    await harness.wait_done(started.conversation_id)
    assert received == messages


# --- caps ----------------------------------------------------------------------------


def fail_some(prefix: str = "fail") -> Any:
    async def run(ctx: ChildContext) -> None:
        if ctx.request.message.startswith(prefix):
            raise RuntimeError("refused by host")
        await ctx.admit()
        ctx.emit(Event(kind="result", text="ok"))

    return run


async def _fill_grant(h: Harness, cap: int, failing: int) -> None:
    h.runner.script = fail_some()
    starts = [
        h.start(f"q{i}", message=("fail now" if i < failing else f"task {i}")) for i in range(cap)
    ]
    outcomes = await within(asyncio.gather(*starts, return_exceptions=True), 20)
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(failed) == failing
    assert all(isinstance(o, errors.AdmissionFailed) for o in failed)
    assert len(h.runner.prepared) == cap


async def _check_submission_cap(h: Harness, cap: int, failing: int) -> None:
    await _fill_grant(h, cap, failing)
    with pytest.raises(errors.SubmissionLimit) as caught:
        await h.start("one-too-many", message="task")
    assert str(caught.value) == "child submission limit exceeded"
    assert len(h.runner.prepared) == cap
    assert len(await h.engine.list_children(limit=1000)) == cap
    # A replay is not a new submission.
    (last,) = [c for c in await h.engine.list_children(limit=1000) if c.request_id == f"q{cap - 1}"]
    await h.wait_done(last.conversation_id)
    replay = await h.start(f"q{cap - 1}", message=f"task {cap - 1}")
    assert (replay.run_id, replay.done, replay.output) == (last.run_id, True, "ok")
    # The cap is per grant: another tool call may still start children.
    other = await open_tool(h, "call-2")
    fresh = await other.start("q-other", message="task")
    await h.wait_done(fresh.conversation_id)


async def test_default_cap_64_children_per_grant_counts_failed_ones(harness: Harness) -> None:
    assert harness.engine.config.max_children_per_grant == 64
    await _check_submission_cap(harness, 64, failing=8)


@pytest.mark.parametrize("config", [EngineConfig(max_children_per_grant=3)], ids=["cap3"])
async def test_small_children_cap_counts_failed_ones(harness: Harness) -> None:
    await _check_submission_cap(harness, 3, failing=2)


async def _check_steer_cap(h: Harness, cap: int) -> None:
    gate = asyncio.Event()
    received: list[str] = []

    async def script(ctx: ChildContext) -> None:
        await ctx.admit()
        await gate.wait()
        received.extend(ctx.take_steers())

    h.runner.script = script
    started = await h.start("q1")
    conv = started.conversation_id
    for i in range(cap):
        answer = await steer(h, conv, f"s{i}", f"message {i}")
        assert answer.outcome == "injected", i
    with pytest.raises(errors.SteerLimit) as caught:
        await steer(h, conv, f"s{cap}", f"message {cap}")
    assert str(caught.value) == "child steer request limit exceeded"
    # Stored receipts still answer at the cap.
    assert (await steer(h, conv, "s0", "message 0")).outcome == "injected"
    gate.set()
    await h.wait_done(conv)
    assert received == [f"message {i}" for i in range(cap)]


async def test_default_cap_128_steer_receipts_per_child(harness: Harness) -> None:
    assert harness.engine.config.max_steers_per_child == 128
    await _check_steer_cap(harness, 128)


@pytest.mark.parametrize("config", [EngineConfig(max_steers_per_child=2)], ids=["cap2"])
async def test_small_steer_cap(harness: Harness) -> None:
    await _check_steer_cap(harness, 2)


async def _check_preset_cap(h: Harness, cap: int) -> None:
    presets = tuple(
        Preset(name=f"p{i}", extension_id=PRESET.extension_id, generation=PRESET.generation)
        for i in range(cap + 1)
    )
    full = await open_tool(h, "call-full", presets=presets[:cap])
    started = await full.start("q1", profile=f"p{cap - 1}")
    await h.wait_done(started.conversation_id)
    with pytest.raises(errors.PresetLimit):
        await open_tool(h, "call-over", presets=presets)
    refused = dataclasses.replace(
        full, tool=dataclasses.replace(full.tool, tool_call_id="call-over")
    )
    with pytest.raises(errors.NotOwned):
        await refused.start("q2", profile="p0")
    assert len(h.runner.prepared) == 1


async def test_default_cap_32_presets_per_extension(harness: Harness) -> None:
    assert harness.engine.config.max_presets_per_extension == 32
    await _check_preset_cap(harness, 32)


@pytest.mark.parametrize("config", [EngineConfig(max_presets_per_extension=2)], ids=["cap2"])
async def test_small_preset_cap(harness: Harness) -> None:
    await _check_preset_cap(harness, 2)


async def test_default_nesting_depth_8(harness: Harness) -> None:
    assert harness.engine.config.max_depth == 8
    gate = asyncio.Event()
    harness.runner.script = hold_after_admit(gate)
    level = harness
    chain = []
    for depth in range(1, 9):
        child = await level.start(f"q{depth}")
        chain.append(child)
        record = await harness.engine.get_child(child.conversation_id)
        assert record is not None and record.depth == depth
        # The child's own tool call is one level deeper.
        level = await open_tool(
            harness,
            f"call-{depth + 1}",
            run_id=child.run_id,
            conversation_id=child.conversation_id,
        )
        assert level.tool.run_id == child.run_id
    with pytest.raises(errors.NestingLimit) as caught:
        await level.start("q9")
    assert str(caught.value) == "child nesting limit exceeded"
    assert len(harness.runner.prepared) == 8
    assert len(await harness.engine.list_children()) == 8
    # Nested children have their parent child as parent.
    for parent, child in itertools.pairwise(chain):
        assert child.parent_run_id == parent.run_id
        assert child.parent_conversation_id == parent.conversation_id
    gate.set()


@pytest.mark.parametrize("config", [EngineConfig(max_depth=2)], ids=["depth2"])
async def test_small_nesting_depth(harness: Harness) -> None:
    first = await harness.start("q1")
    level2 = await open_tool(
        harness, "call-2", run_id=first.run_id, conversation_id=first.conversation_id
    )
    second = await level2.start("q2")
    level3 = await open_tool(
        harness, "call-3", run_id=second.run_id, conversation_id=second.conversation_id
    )
    with pytest.raises(errors.NestingLimit):
        await level3.start("q3")
    assert len(harness.runner.prepared) == 2


@pytest.mark.parametrize("config", [EngineConfig(max_leases_per_runner=3)], ids=["cap3"])
async def test_lease_capacity_per_runner(harness: Harness) -> None:
    for i in range(3):
        await harness.start(f"q{i}", lease_id=f"L{i}")
    with pytest.raises(errors.LeaseCapacity) as caught:
        await harness.start("q3", lease_id="L3")
    assert str(caught.value) == "child lease capacity exceeded"
    # Tombstones are outside the cap (design §9): an unknown lease is still released.
    assert (await release(harness, "T-unknown")).done
    assert len(harness.runner.prepared) == 3
    assert len(await harness.engine.leases("runner-1")) == 4
    with pytest.raises(errors.LeaseCapacity):
        await harness.start("q4", lease_id="L4")
    # Releasing an existing lease turns it into a tombstone, which frees its place.
    assert (await release(harness, "L0")).done
    freed = await harness.start("q4", lease_id="L4")
    await harness.wait_done(freed.conversation_id)
    with pytest.raises(errors.LeaseCapacity):
        await harness.start("q6", lease_id="L6")
    # Existing leases keep working at capacity.
    more = await harness.start("q5", lease_id="L1")
    await harness.wait_done(more.conversation_id)
    # Another runner has its own capacity.
    conn2 = await harness.engine.connect("runner-2", "host-b")
    other = await open_tool(harness, "call-1", conn=conn2)
    await other.start("q1", lease_id="L3")


@pytest.mark.parametrize(
    "config",
    [EngineConfig(max_leases_per_runner=2, max_tombstones_per_extension=3)],
    ids=["cap2-keep3"],
)
async def test_tombstones_are_outside_the_lease_cap_and_trimmed(
    harness: Harness, clock: ManualClock
) -> None:
    for i in range(5):
        assert (await release(harness, f"T{i}")).done
        clock.advance(0.001)  # "newest" is by the time of the release
    await harness.start("q1", lease_id="L1")
    await harness.start("q2", lease_id="L2")
    with pytest.raises(errors.LeaseCapacity):
        await harness.start("q3", lease_id="L3")
    clock.advance(0.001)
    assert (await release(harness, "T5")).done  # at capacity, a release still works
    kept = {lease.lease_id for lease in await harness.engine.leases("runner-1")}
    assert kept == {"L1", "L2", "T3", "T4", "T5"}, "the newest three tombstones are kept"
    # A kept tombstone still fences its leaseId; a dropped one no longer exists.
    with pytest.raises(errors.NotOwned):
        await harness.start("q-fenced", lease_id="T5")
    assert len(harness.runner.prepared) == 2


# --- events --------------------------------------------------------------------------


def emitter(count: int, *, burst: int = 0) -> Any:
    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        for i in range(1, count + 1):
            ctx.emit(Event(kind="text", text=f"event {i}"))
            if burst and i % burst == 0:
                await asyncio.sleep(0.001)

    return run


@pytest.mark.parametrize(
    ("config", "count"),
    [(EngineConfig(), 300), (EngineConfig(events_per_read=5), 23)],
    ids=["default-128", "small-5"],
)
async def test_events_page_gap_free_from_one(
    harness: Harness, config: EngineConfig, count: int
) -> None:
    limit = config.events_per_read
    harness.runner.script = emitter(count)
    started = await harness.start("q1")
    assert len(started.events) <= limit
    await harness.wait_done(started.conversation_id)
    seen: list[Event] = []
    sizes: list[int] = []
    while True:
        page = await harness.read(started.conversation_id, after=seen[-1].sequence if seen else 0)
        sizes.append(len(page.events))
        assert page.done
        if not page.events:
            break
        seen.extend(page.events)
    assert [e.sequence for e in seen] == list(range(1, count + 1))
    assert [e.text for e in seen] == [f"event {i}" for i in range(1, count + 1)]
    full, rest = divmod(count, limit)
    assert sizes == [limit] * full + ([rest] if rest else []) + [0]
    # Reading from the middle returns exactly what follows.
    middle = await harness.read(started.conversation_id, after=count - 2)
    assert [e.sequence for e in middle.events] == [count - 1, count]
    past = await harness.read(started.conversation_id, after=count + 10)
    assert past.events == []


@pytest.mark.parametrize(
    "config", [EngineConfig(), EngineConfig(events_per_read=7)], ids=["default-128", "small-7"]
)
async def test_a_concurrent_reader_sees_every_event_once(
    harness: Harness, config: EngineConfig
) -> None:
    count = 400
    harness.runner.script = emitter(count, burst=13)
    started = await harness.start("q1")
    seen: list[int] = [e.sequence for e in started.events]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while True:
        page = await harness.read(started.conversation_id, after=seen[-1] if seen else 0)
        assert len(page.events) <= config.events_per_read
        seen.extend(e.sequence for e in page.events)
        if page.done and not page.events:
            break
        assert loop.time() < deadline
        await asyncio.sleep(0)
    assert seen == list(range(1, count + 1))


CUT_CASES = {
    "ascii-over": "a" * (FIELD_LIMIT + 1),
    "ascii-exact": "a" * FIELD_LIMIT,
    "e-acute": "a" + "é" * (FIELD_LIMIT // 2),
    "e-acute-even": "é" * (FIELD_LIMIT // 2 + 1),
    "cjk": "ab" + "中" * (FIELD_LIMIT // 3),
    "emoji": "ab" + "😀" * (FIELD_LIMIT // 4),
    "emoji-odd": "abc" + "😀" * (FIELD_LIMIT // 4),
    "mixed-long": ("x😀é中" * 5000),
}


@pytest.mark.parametrize("value", list(CUT_CASES.values()), ids=list(CUT_CASES))
async def test_event_fields_are_cut_at_a_character_boundary(harness: Harness, value: str) -> None:
    async def script(ctx: ChildContext) -> None:
        await ctx.admit()
        ctx.emit(
            Event(
                kind="tool",
                text=value,
                tool_name="grep",
                input=value,
                tool_output=value,
                error=value,
            )
        )
        ctx.emit(Event(kind="error", error=value))

    harness.runner.script = script
    started = await harness.start("q1")
    await harness.wait_done(started.conversation_id)
    events = await read_all(harness, started.conversation_id)
    assert [e.sequence for e in events] == [1, 2]
    expected = utf8_prefix(value, FIELD_LIMIT)
    tool, error = events
    for cut in (tool.text, tool.input, tool.tool_output, tool.error, error.error):
        encoded = cut.encode("utf-8")  # valid UTF-8: no lone surrogate survives
        assert len(encoded) <= FIELD_LIMIT
        assert cut == expected
    assert tool.tool_name == "grep"
    # The stored log agrees with the wire answer.
    stored = await harness.engine.events(started.conversation_id)
    assert stored[0].text == expected


async def test_output_is_the_last_result_text_untruncated(harness: Harness) -> None:
    big = "😀" * 12_000 + "end"  # 48,003 bytes

    async def script(ctx: ChildContext) -> None:
        await ctx.admit()
        ctx.emit(Event(kind="result", text="first answer"))
        await ctx.flush()
        ctx.emit(Event(kind="text", text="thinking again"))
        ctx.emit(Event(kind="result", text=big))
        ctx.emit(Event(kind="text", text="epilogue"))

    harness.runner.script = script
    started = await harness.start("q1")
    await harness.wait_done(started.conversation_id)
    final = await harness.read(started.conversation_id)
    assert final.output == big
    result_events = [e for e in final.events if e.kind == "result"]
    assert result_events[0].text == "first answer"
    assert result_events[1].text == utf8_prefix(big, FIELD_LIMIT)
    record = await harness.engine.get_child(started.conversation_id)
    assert record is not None and record.output == big


async def test_output_follows_the_last_result_in_one_batch(harness: Harness) -> None:
    async def script(ctx: ChildContext) -> None:
        await ctx.admit()
        for i in range(5):
            ctx.emit(Event(kind="result", text=f"answer {i}"))

    harness.runner.script = script
    started = await harness.start("q1")
    await harness.wait_done(started.conversation_id)
    assert (await harness.read(started.conversation_id)).output == "answer 4"


async def test_flushed_events_are_visible_to_read(harness: Harness) -> None:
    flushed = asyncio.Event()
    gate = asyncio.Event()

    count = 3000
    filler = "f" * 1000

    async def script(ctx: ChildContext) -> None:
        await ctx.admit()
        for i in range(1, count + 1):
            ctx.emit(Event(kind="text", text=f"event {i}", input=filler))
        await ctx.flush()
        flushed.set()
        await gate.wait()
        ctx.emit(Event(kind="text", text="unflushed"))
        await gate.wait()

    harness.runner.script = script
    started = await harness.start("q1")
    # Before the flush a read may or may not show events, but never a gap.
    assert [e.sequence for e in started.events] == list(range(1, len(started.events) + 1))
    await within(flushed.wait())
    last = await harness.read(started.conversation_id, after=count - 1)
    assert [e.sequence for e in last.events] == [count]
    assert not last.done
    page = await harness.read(started.conversation_id)
    assert [e.sequence for e in page.events] == list(range(1, 129))
    gate.set()
    await harness.wait_done(started.conversation_id)
    final = await harness.read(started.conversation_id, after=count)
    assert [e.text for e in final.events] == ["unflushed"]


async def test_terminal_state_is_committed_after_every_event(harness: Harness) -> None:
    count = 700
    gate = asyncio.Event()

    async def script(ctx: ChildContext) -> None:
        await ctx.admit()
        await gate.wait()
        for i in range(1, count + 1):
            ctx.emit(Event(kind="text", text=f"event {i}"))
            if i % 50 == 0:
                await asyncio.sleep(0)
        ctx.emit(Event(kind="result", text="finished"))

    harness.runner.script = script
    started = await harness.start("q1")
    conv = started.conversation_id
    gate.set()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while True:
        record = await harness.engine.get_child(conv)
        assert record is not None
        if record.terminal:
            stored = await harness.engine.events(conv, limit=10_000)
            assert len(stored) == count + 1
            break
        page = await harness.read(conv, after=count)
        if page.done:
            assert [e.text for e in page.events] == ["finished"]
            assert page.output == "finished"
            break
        assert loop.time() < deadline
    events = await read_all(harness, conv)
    assert [e.sequence for e in events] == list(range(1, count + 2))


# --- module-level admit ----------------------------------------------------------------


async def _deep(depth: int, action: Callable[[], Awaitable[None]]) -> None:
    if depth == 0:
        await action()
    else:
        await _deep(depth - 1, action)


async def test_module_admit_works_deep_in_the_call_stack(harness: Harness) -> None:
    states: list[str] = []

    async def script(ctx: ChildContext) -> None:
        await _deep(10, delegation.admit)
        record = await harness.engine.get_child(ctx.identity.conversation_id)
        assert record is not None
        states.append(record.state)
        await delegation.admit()  # a no-op once admitted
        ctx.emit(Event(kind="result", text="admitted deep down"))

    harness.runner.script = script
    started = await harness.start("q1")
    final = await harness.wait_done(started.conversation_id)
    assert states == ["running"]
    assert final.state == "done" and final.admitted_at is not None
    assert final.output == "admitted deep down"


async def test_module_admit_raises_outside_a_run(harness: Harness) -> None:
    with pytest.raises((RuntimeError, DelegationError)):
        await delegation.admit()
    started = await harness.start("q1")  # a run in another task does not leak into ours
    await harness.wait_done(started.conversation_id)
    with pytest.raises((RuntimeError, DelegationError)):
        await delegation.admit()


async def test_module_admit_raises_without_any_engine() -> None:
    with pytest.raises((RuntimeError, DelegationError)):
        await _deep(3, delegation.admit)


async def test_a_preset_generation_no_store_can_hold_is_refused_at_tool_open(
    harness: Harness,
) -> None:
    """Generations are wire uint64; one above int64 (what SQLite's INTEGER and
    PostgreSQL's BIGINT hold) is refused up front, never an internal error at a later
    start."""
    top = msgspec.structs.replace(PRESET, generation=2**63 - 1)
    ok = await open_tool(harness, "call-top", presets=(top,))
    started = await ok.start("q-top", generation=2**63 - 1)
    assert started.run_id
    beyond = msgspec.structs.replace(PRESET, generation=2**63)
    with pytest.raises(errors.PresetStale, match="above 2\\^63-1"):
        await open_tool(harness, "call-beyond", presets=(beyond,))
