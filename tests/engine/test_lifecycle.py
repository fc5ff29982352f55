"""The lifetime matrix of design §4, §5 and §7 inside one running engine.

Which trigger ends which child: the end of a tool call, the end of a parent run,
a runner reconnecting or disconnecting, ``child.lease.release``, ``child.cancel``
and a graceful ``engine.close()``. Each test keeps runs alive with asyncio gates
and checks the stored state and the error the child ends with.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from delegation import (
    ChildContext,
    ChildRecord,
    Engine,
    EngineConfig,
    Event,
    Params,
    Result,
    ToolHandle,
    errors,
)
from delegation.clock import ManualClock
from tests.harness.rows import rows
from tests.harness.support import PRESET, Harness, Script, ScriptRunner, finish_after_admit, hold

LEASE = "lease-1"
ACTIVE = ("admitted", "running")


@pytest.fixture
async def gates(engine: Engine) -> AsyncIterator[Callable[[], asyncio.Event]]:
    """A factory of gates, every one released before the engine closes."""
    made: list[asyncio.Event] = []

    def make() -> asyncio.Event:
        made.append(asyncio.Event())
        return made[-1]

    yield make
    for gate in made:
        gate.set()
    await asyncio.sleep(0.05)


def route(**scripts: Script) -> Script:
    """One runner script per child, chosen by the request's message."""

    async def run(ctx: ChildContext) -> None:
        await scripts[ctx.request.message](ctx)

    return run


def stubborn(release: asyncio.Event, *, finish: bool = False) -> Script:
    """Admits, and when cancelled keeps waiting on ``release`` (then returns normally)."""

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        ctx.emit(Event(kind="text", text="working"))
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            if finish:
                ctx.emit(Event(kind="result", text="finished anyway"))
                return
            await release.wait()
            ctx.emit(Event(kind="result", text="finished anyway"))

    return run


def lease_params(h: Harness, lease_id: str = LEASE, **changes: object) -> Params:
    """Params that reach a child through its lease, with no live tool call."""
    return h.params(lease_id=lease_id, tool_call_id="", **changes)


async def state_of(engine: Engine, conversation_id: str) -> ChildRecord:
    record = await engine.get_child(conversation_id)
    assert record is not None
    return record


async def wait_for(event: asyncio.Event, timeout: float = 60.0) -> None:
    await asyncio.wait_for(event.wait(), timeout)


async def assert_cancelled(h: Harness, conversation_id: str, error: str) -> ChildRecord:
    record = await h.wait_done(conversation_id)
    assert record.state == "cancelled"
    assert record.error == error
    assert record.cancel_requested_at is not None
    return record


# --- the end of a tool call ----------------------------------------------------------


async def test_tool_end_cancels_foreground_children(
    harness: Harness, gates: Callable[[], asyncio.Event]
) -> None:
    gate = gates()
    harness.runner.script = hold(gate)
    first = await harness.start("q1")
    second = await harness.start("q2", message="another task")
    assert (await state_of(harness.engine, first.conversation_id)).state == "running"

    await harness.engine.close_tool(harness.tool)

    for started in (first, second):
        record = await assert_cancelled(
            harness, started.conversation_id, "cancelled: tool call ended"
        )
        assert record.error.startswith("cancelled:")
        assert record.output == ""  # the gate never opened: the run did not finish
    # The tool's authority ended with it: its children are no longer reachable.
    with pytest.raises(errors.NotOwned):
        await harness.read(first.conversation_id)


async def test_tool_end_spares_a_child_admitted_under_a_lease(
    harness: Harness, gates: Callable[[], asyncio.Event]
) -> None:
    gate = gates()

    async def leased(ctx: ChildContext) -> None:
        await ctx.admit()
        ctx.emit(Event(kind="text", text="waiting"))
        steer = await ctx.wait_steer(5)
        await gate.wait()
        ctx.emit(Event(kind="result", text=f"steered: {steer}"))

    harness.runner.script = route(fg=hold(gate), bg=leased)
    foreground = await harness.start("q1", message="fg")
    background = await harness.start("q2", message="bg", lease_id=LEASE)
    assert not background.done

    await harness.engine.close_tool(harness.tool)

    await assert_cancelled(harness, foreground.conversation_id, "cancelled: tool call ended")
    await asyncio.sleep(0.05)
    record = await state_of(harness.engine, background.conversation_id)
    assert record.state == "running"
    assert record.cancel_requested_at is None
    # Still readable and steerable through the lease, with no live tool call.
    read = await harness.engine.call(
        harness.conn, "child.read", lease_params(harness, child_id=background.conversation_id)
    )
    assert not read.done and not read.cancelled
    assert [e.text for e in read.events] == ["waiting"]
    steered = await harness.engine.call(
        harness.conn,
        "child.steer",
        lease_params(
            harness, child_id=background.conversation_id, request_id="s1", message="go left"
        ),
    )
    assert steered.outcome == "injected"
    gate.set()
    record = await harness.wait_done(background.conversation_id)
    assert (record.state, record.error, record.output) == ("done", "", "steered: go left")
    final = await harness.engine.call(
        harness.conn, "child.read", lease_params(harness, child_id=background.conversation_id)
    )
    assert final.done and not final.cancelled and final.output == "steered: go left"


async def test_first_lease_admission_cannot_outlive_its_originating_tool(
    harness: Harness, gates: Callable[[], asyncio.Event]
) -> None:
    gate = gates()
    preparing = asyncio.Event()
    admitted: list[str] = []

    async def slow_to_admit(ctx: ChildContext) -> None:
        preparing.set()
        await gate.wait()
        await ctx.admit()
        admitted.append(ctx.identity.conversation_id)

    harness.runner.script = slow_to_admit
    start = asyncio.create_task(harness.start("q1", lease_id=LEASE))
    await wait_for(preparing)
    assert not start.done()

    await harness.engine.close_tool(harness.tool)

    expected = "child admission failed: cancelled: originating tool ended before admission"
    with pytest.raises(errors.AdmissionFailed) as refused:
        await asyncio.wait_for(start, 5)
    assert str(refused.value) == expected
    (record,) = await harness.engine.list_children(lease_id=LEASE)
    assert record.state == "cancelled"
    assert record.admitted_at is None
    assert admitted == []
    # Every replay of the requestId, and every read, answers the same failure.
    with pytest.raises(errors.AdmissionFailed) as replayed:
        await harness.start("q1", lease_id=LEASE, tool_call_id="")
    assert str(replayed.value) == expected
    with pytest.raises(errors.AdmissionFailed) as read:
        await harness.engine.call(
            harness.conn, "child.read", lease_params(harness, child_id=record.conversation_id)
        )
    assert str(read.value) == expected
    assert len(harness.runner.prepared) == 1


async def test_a_run_ignoring_cancellation_still_cannot_admit_after_its_origin_tool_ended(
    harness: Harness, gates: Callable[[], asyncio.Event]
) -> None:
    gate = gates()
    preparing = asyncio.Event()
    effects: list[str] = []

    async def ignores_cancel(ctx: ChildContext) -> None:
        preparing.set()
        with contextlib.suppress(asyncio.CancelledError):  # a careless run: it admits anyway
            await gate.wait()
        await ctx.admit()
        effects.append("effect")

    harness.runner.script = ignores_cancel
    start = asyncio.create_task(harness.start("q1", lease_id=LEASE))
    await wait_for(preparing)
    await harness.engine.close_tool(harness.tool)

    with pytest.raises(errors.AdmissionFailed, match="originating tool ended before admission"):
        await asyncio.wait_for(start, 5)
    assert effects == []
    (record,) = await harness.engine.list_children(lease_id=LEASE)
    assert (record.state, record.admitted_at) == ("cancelled", None)
    # The lease never activated: it cannot be used without a live tool.
    with pytest.raises(errors.LeaseNotActivated):
        await harness.start("q2", lease_id=LEASE, tool_call_id="")


async def _lease_orphaned_by_its_creating_tool(
    harness: Harness, workspace: Path, gate: asyncio.Event
) -> tuple[ToolHandle, asyncio.Task[Result], asyncio.Event]:
    """Create ``LEASE`` from the harness tool, end that tool before any admission,
    then start a second child on the never-activated lease from a new live tool
    (allowed by design §3.5). Returns the new tool, the pending start, and the event
    the second run sets once it waits before admission."""
    preparing = asyncio.Event()

    async def slow_to_admit(ctx: ChildContext) -> None:
        preparing.set()
        await gate.wait()
        await ctx.admit()
        ctx.emit(Event(kind="text", text="admitted"))
        await asyncio.Event().wait()

    harness.runner.script = slow_to_admit
    first = asyncio.create_task(harness.start("q1", lease_id=LEASE))
    await wait_for(preparing)
    await harness.engine.close_tool(harness.tool)
    with pytest.raises(errors.AdmissionFailed):
        await asyncio.wait_for(first, 5)
    tool = await harness.engine.open_tool(
        harness.conn,
        run_id="parent-run",
        conversation_id="parent-conv",
        tool_call_id="call-2",
        extension_id=PRESET.extension_id,
        presets=[PRESET],
        workspace=str(workspace),
    )
    preparing.clear()
    second = asyncio.create_task(harness.start("q2", lease_id=LEASE, tool_call_id="call-2"))
    await wait_for(preparing)
    return tool, second, preparing


async def test_first_lease_admission_under_a_new_live_tool_succeeds(
    harness: Harness, gates: Callable[[], asyncio.Event], workspace: Path
) -> None:
    """design §3.5: a never-activated lease may be used with a live owned tool grant.
    Once such a start passed authority (prepare was called, a row written), its
    admission re-checks the tool that originated *this* admission, which is live."""
    gate = gates()
    _, second, _ = await _lease_orphaned_by_its_creating_tool(harness, workspace, gate)

    gate.set()
    started = await asyncio.wait_for(second, 5)

    assert not started.done
    record = await state_of(harness.engine, started.conversation_id)
    assert record.state == "running" and record.admitted_at is not None
    (lease,) = await harness.engine.leases()
    assert lease.activated_at is not None


async def test_first_lease_admission_is_cancelled_when_its_new_origin_tool_ends(
    harness: Harness, gates: Callable[[], asyncio.Event], workspace: Path
) -> None:
    gate = gates()
    tool, second, _ = await _lease_orphaned_by_its_creating_tool(harness, workspace, gate)

    await harness.engine.close_tool(tool)
    await asyncio.sleep(0.05)
    gate.set()

    expected = "child admission failed: cancelled: originating tool ended before admission"
    with pytest.raises(errors.AdmissionFailed) as refused:
        await asyncio.wait_for(second, 5)
    assert str(refused.value) == expected
    (record,) = [c for c in await harness.engine.list_children() if c.request_id == "q2"]
    assert record.admitted_at is None
    assert (record.state, record.error) == (
        "cancelled",
        "cancelled: originating tool ended before admission",
    )


# --- the end of the parent run -------------------------------------------------------


async def test_parent_run_success_keeps_leases_and_leased_children(
    harness: Harness, gates: Callable[[], asyncio.Event]
) -> None:
    gate = gates()
    harness.runner.script = hold(gate)
    leased = await harness.start("q1", lease_id=LEASE)

    await harness.engine.finish_run("parent-run", succeeded=True)
    await asyncio.sleep(0.05)

    record = await state_of(harness.engine, leased.conversation_id)
    assert record.state == "running"
    assert record.cancel_requested_at is None
    (lease,) = await harness.engine.leases()
    assert lease.lease_id == LEASE and lease.revoked_at is None
    # The lease still grants: a new child starts and runs with no tool call at all.
    later = await harness.engine.call(
        harness.conn, "child.start", harness.start_params("q2", lease_id=LEASE, tool_call_id="")
    )
    assert not later.done
    assert (await state_of(harness.engine, later.conversation_id)).state == "running"
    gate.set()
    for started in (leased, later):
        done = await harness.wait_done(started.conversation_id)
        assert (done.state, done.error, done.output) == ("done", "", "finished")


async def test_parent_run_failure_drops_its_leases_and_cancels_their_children(
    harness: Harness, gates: Callable[[], asyncio.Event], workspace: Path
) -> None:
    gate = gates()
    harness.runner.script = hold(gate)
    leased = await harness.start("q1", lease_id=LEASE)
    # A lease of another parent run is not touched.
    await harness.engine.open_tool(
        harness.conn,
        run_id="other-run",
        conversation_id="other-conv",
        tool_call_id="call-x",
        extension_id=PRESET.extension_id,
        presets=[PRESET],
        workspace=str(workspace),
    )
    other = await harness.start("q1", lease_id="lease-2", run_id="other-run", tool_call_id="call-x")

    await harness.engine.finish_run("parent-run", succeeded=False)

    await assert_cancelled(harness, leased.conversation_id, "cancelled: parent run failed")
    leases = {lease.lease_id: lease for lease in await harness.engine.leases()}
    assert leases[LEASE].revoked_at is not None
    assert leases["lease-2"].revoked_at is None
    assert (await state_of(harness.engine, other.conversation_id)).state == "running"
    # Later starts on the dropped lease are refused, with or without a live tool.
    prepared = len(harness.runner.prepared)
    await harness.engine.open_tool(
        harness.conn,
        run_id="parent-run",
        conversation_id="parent-conv",
        tool_call_id="call-2",
        extension_id=PRESET.extension_id,
        presets=[PRESET],
        workspace=str(workspace),
    )
    with pytest.raises(errors.NotOwned):
        await harness.start("q2", lease_id=LEASE, tool_call_id="call-2")
    with pytest.raises(errors.NotOwned):
        await harness.start("q3", lease_id=LEASE, tool_call_id="")
    with pytest.raises(errors.NotOwned):
        await harness.engine.call(
            harness.conn, "child.read", lease_params(harness, child_id=leased.conversation_id)
        )
    assert len(harness.runner.prepared) == prepared
    assert len(await harness.engine.list_children(lease_id=LEASE)) == 1


# --- runner reconnects and disconnects -----------------------------------------------


async def test_reconnect_with_same_host_instance_keeps_leases(
    harness: Harness, gates: Callable[[], asyncio.Event]
) -> None:
    gate = gates()
    harness.runner.script = hold(gate)
    foreground = await harness.start("q1")
    leased = await harness.start("q2", lease_id=LEASE)
    old = harness.conn

    new = await harness.engine.connect("runner-1", "host-a")
    assert new.generation == old.generation + 1

    # The old connection's tool grants ended with it; its leases did not.
    await assert_cancelled(harness, foreground.conversation_id, "cancelled: runner reconnected")
    await asyncio.sleep(0.05)
    record = await state_of(harness.engine, leased.conversation_id)
    assert record.state == "running" and record.cancel_requested_at is None
    read = await harness.engine.call(
        new, "child.read", lease_params(harness, child_id=leased.conversation_id)
    )
    assert not read.done and read.conversation_id == leased.conversation_id
    steered = await harness.engine.call(
        new,
        "child.steer",
        lease_params(harness, child_id=leased.conversation_id, request_id="s1", message="hi"),
    )
    assert steered.outcome == "injected"
    # The old connection is stale.
    with pytest.raises(errors.StaleConnection, match="runner connection generation is stale"):
        await harness.engine.call(
            old, "child.read", lease_params(harness, child_id=leased.conversation_id)
        )
    with pytest.raises(errors.StaleConnection):
        await harness.engine.call(old, "child.lease.release", lease_params(harness))
    assert (await state_of(harness.engine, leased.conversation_id)).state == "running"
    gate.set()
    done = await harness.wait_done(leased.conversation_id)
    assert (done.state, done.output) == ("done", "finished")


async def test_reconnect_with_another_host_instance_revokes_leases(
    harness: Harness, gates: Callable[[], asyncio.Event]
) -> None:
    gate = gates()
    harness.runner.script = hold(gate)
    foreground = await harness.start("q1")
    leased = await harness.start("q2", lease_id=LEASE)
    old = harness.conn

    new = await harness.engine.connect("runner-1", "host-b")

    await assert_cancelled(harness, leased.conversation_id, "cancelled: runner restarted")
    record = await harness.wait_done(foreground.conversation_id)
    assert record.state == "cancelled" and record.error.startswith("cancelled:")
    (lease,) = await harness.engine.leases("runner-1")
    assert lease.revoked_at is not None
    with pytest.raises(errors.NotOwned):
        await harness.engine.call(
            new, "child.read", lease_params(harness, child_id=leased.conversation_id)
        )
    with pytest.raises(errors.StaleConnection):
        await harness.engine.call(
            old, "child.read", lease_params(harness, child_id=leased.conversation_id)
        )


async def test_disconnect_ends_tool_grants_and_keeps_leases_for_a_reconnect(
    harness: Harness, gates: Callable[[], asyncio.Event], workspace: Path
) -> None:
    gate = gates()
    harness.runner.script = hold(gate)
    foreground = await harness.start("q1")
    leased = await harness.start("q2", lease_id=LEASE)
    # Another runner's tool call is not touched.
    conn2 = await harness.engine.connect("runner-2", "host-z")
    await harness.engine.open_tool(
        conn2,
        run_id="run-2",
        conversation_id="conv-2",
        tool_call_id="call-2",
        extension_id=PRESET.extension_id,
        presets=[PRESET],
        workspace=str(workspace),
    )
    other = await harness.engine.call(
        conn2, "child.start", harness.start_params("q1", run_id="run-2", tool_call_id="call-2")
    )

    await harness.engine.disconnect(harness.conn)

    await assert_cancelled(harness, foreground.conversation_id, "cancelled: runner disconnected")
    await asyncio.sleep(0.05)
    assert (await state_of(harness.engine, leased.conversation_id)).state == "running"
    assert (await state_of(harness.engine, other.conversation_id)).state == "running"
    (lease,) = await harness.engine.leases("runner-1")
    assert lease.revoked_at is None
    with pytest.raises((errors.RunnerNotFound, errors.StaleConnection)):
        await harness.engine.call(
            harness.conn, "child.read", lease_params(harness, child_id=leased.conversation_id)
        )

    new = await harness.engine.connect("runner-1", "host-a")
    read = await harness.engine.call(
        new, "child.read", lease_params(harness, child_id=leased.conversation_id)
    )
    assert not read.done and not read.cancelled
    with pytest.raises(errors.StaleConnection):
        await harness.engine.call(
            harness.conn, "child.read", lease_params(harness, child_id=leased.conversation_id)
        )
    gate.set()
    assert (await harness.wait_done(leased.conversation_id)).state == "done"
    assert (await harness.wait_done(other.conversation_id)).state == "done"


# --- child.lease.release -------------------------------------------------------------


async def test_release_cancels_every_child_of_the_lease_and_only_those(
    harness: Harness, gates: Callable[[], asyncio.Event]
) -> None:
    gate = gates()
    harness.runner.script = hold(gate)
    first = await harness.start("q1", lease_id=LEASE)
    second = await harness.start("q2", lease_id=LEASE)
    elsewhere = await harness.start("q3", lease_id="lease-2")
    foreground = await harness.start("q4")

    released = await harness.engine.call(harness.conn, "child.lease.release", lease_params(harness))

    assert released.done is True
    for started in (first, second):
        await assert_cancelled(harness, started.conversation_id, "cancelled: lease released")
    for started in (elsewhere, foreground):
        record = await state_of(harness.engine, started.conversation_id)
        assert record.state == "running" and record.cancel_requested_at is None
    leases = {lease.lease_id: lease for lease in await harness.engine.leases()}
    assert leases[LEASE].revoked_at is not None
    assert leases["lease-2"].revoked_at is None

    again = await harness.engine.call(harness.conn, "child.lease.release", lease_params(harness))
    assert again.done is True
    # A released lease grants nothing any more, even with a live tool.
    with pytest.raises(errors.NotOwned):
        await harness.start("q5", lease_id=LEASE)


async def test_release_before_any_start_leaves_a_tombstone_that_fences_starts(
    harness: Harness,
) -> None:
    released = await harness.engine.call(harness.conn, "child.lease.release", lease_params(harness))
    assert released.done is True
    (tombstone,) = await harness.engine.leases("runner-1")
    assert tombstone.lease_id == LEASE and tombstone.revoked_at is not None

    with pytest.raises(errors.NotOwned):
        await harness.start("q1", lease_id=LEASE)
    assert harness.runner.prepared == []
    assert await harness.engine.list_children() == []
    again = await harness.engine.call(harness.conn, "child.lease.release", lease_params(harness))
    assert again.done is True
    # The tool itself still works for children outside that lease.
    started = await harness.start("q2")
    assert (await harness.wait_done(started.conversation_id)).state == "done"


async def test_release_whose_children_do_not_stop_is_unconfirmed_until_retried(
    harness: Harness, gates: Callable[[], asyncio.Event], config: EngineConfig
) -> None:
    gate = gates()
    harness.runner.script = stubborn(gate)
    leased = await harness.start("q1", lease_id=LEASE)
    loop = asyncio.get_running_loop()

    began = loop.time()
    with pytest.raises(errors.ReleaseUnconfirmed) as refused:
        await harness.engine.call(harness.conn, "child.lease.release", lease_params(harness))
    elapsed = loop.time() - began

    assert str(refused.value) == (
        "child lease revoked but cleanup is not yet confirmed; retry release"
    )
    assert config.release_drain_s * 0.9 <= elapsed < config.release_drain_s + 30
    record = await state_of(harness.engine, leased.conversation_id)
    assert record.state == "running"
    assert record.cancel_requested_at is not None
    (lease,) = await harness.engine.leases()
    assert lease.revoked_at is not None  # the revocation itself is durable already

    gate.set()
    await assert_cancelled(harness, leased.conversation_id, "cancelled: lease released")
    retried = await harness.engine.call(harness.conn, "child.lease.release", lease_params(harness))
    assert retried.done is True


@pytest.mark.parametrize(
    "changes",
    [{"extension_id": "other-ext"}, {"generation": PRESET.generation + 1}],
    ids=["extension", "generation"],
)
async def test_release_by_another_owner_is_refused_and_changes_nothing(
    harness: Harness, gates: Callable[[], asyncio.Event], changes: dict[str, object]
) -> None:
    gate = gates()
    harness.runner.script = hold(gate)
    leased = await harness.start("q1", lease_id=LEASE)

    with pytest.raises(errors.LeaseOwnerMismatch) as refused:
        await harness.engine.call(
            harness.conn, "child.lease.release", lease_params(harness, **changes)
        )
    assert str(refused.value) == "child lease owner mismatch"

    await asyncio.sleep(0.05)
    record = await state_of(harness.engine, leased.conversation_id)
    assert record.state == "running" and record.cancel_requested_at is None
    (lease,) = await harness.engine.leases()
    assert lease.revoked_at is None


@pytest.mark.parametrize(
    "changes",
    [{"lease_id": ""}, {"generation": 0}, {"extension_id": ""}],
    ids=["no-lease", "zero-generation", "no-extension"],
)
async def test_release_without_its_exact_owner_is_refused(
    harness: Harness, gates: Callable[[], asyncio.Event], changes: dict[str, object]
) -> None:
    gate = gates()
    harness.runner.script = hold(gate)
    leased = await harness.start("q1", lease_id=LEASE)
    params = lease_params(harness)
    params = Params(
        run_id=params.run_id,
        extension_id=str(changes.get("extension_id", params.extension_id)),
        generation=int(str(changes.get("generation", params.generation))),
        lease_id=str(changes.get("lease_id", params.lease_id)),
    )

    with pytest.raises(errors.ReleaseOwnerRequired) as refused:
        await harness.engine.call(harness.conn, "child.lease.release", params)
    assert str(refused.value) == "child lease release requires its exact owner"

    await asyncio.sleep(0.05)
    record = await state_of(harness.engine, leased.conversation_id)
    assert record.state == "running" and record.cancel_requested_at is None
    leases = await harness.engine.leases()
    assert [(lease.lease_id, lease.revoked_at) for lease in leases] == [(LEASE, None)]


# --- child.cancel --------------------------------------------------------------------


async def test_cancel_is_exact_and_leaves_the_sibling_running(
    harness: Harness, gates: Callable[[], asyncio.Event]
) -> None:
    gate = gates()
    harness.runner.script = hold(gate)
    target = await harness.start("q1")
    sibling = await harness.start("q2")

    answered = await harness.engine.call(
        harness.conn, "child.cancel", harness.params(child_id=target.conversation_id)
    )
    assert answered.conversation_id == target.conversation_id

    await assert_cancelled(harness, target.conversation_id, "cancelled: cancel requested")
    final = await harness.read(target.conversation_id)
    assert final.done and final.cancelled
    assert final.error == "cancelled: cancel requested"
    await asyncio.sleep(0.05)
    record = await state_of(harness.engine, sibling.conversation_id)
    assert record.state == "running" and record.cancel_requested_at is None
    gate.set()
    done = await harness.wait_done(sibling.conversation_id)
    assert (done.state, done.output) == ("done", "finished")


async def test_cancelled_child_ends_cancelled_even_if_its_run_returns_normally(
    harness: Harness,
) -> None:
    harness.runner.script = stubborn(asyncio.Event(), finish=True)
    started = await harness.start("q1")

    await harness.engine.call(
        harness.conn, "child.cancel", harness.params(child_id=started.conversation_id)
    )

    record = await assert_cancelled(harness, started.conversation_id, "cancelled: cancel requested")
    assert record.admitted_at is not None
    final = await harness.read(started.conversation_id)
    assert final.done and final.cancelled
    assert final.error == "cancelled: cancel requested"
    assert [e.text for e in final.events] == ["working", "finished anyway"]


async def test_cancelling_a_finished_child_returns_its_result_unchanged(harness: Harness) -> None:
    harness.runner.script = finish_after_admit
    started = await harness.start("q1")
    await harness.wait_done(started.conversation_id)
    before = await harness.read(started.conversation_id)
    assert before.done and not before.cancelled and before.output == "done: do the task"

    answered = await harness.engine.call(
        harness.conn, "child.cancel", harness.params(child_id=started.conversation_id)
    )

    assert answered == before
    record = await state_of(harness.engine, started.conversation_id)
    assert (record.state, record.error, record.cancel_requested_at) == ("done", "", None)
    assert await harness.read(started.conversation_id) == before


# --- graceful close ------------------------------------------------------------------


async def test_graceful_close_cancels_foreground_but_not_leased_children(
    harness: Harness,
    gates: Callable[[], asyncio.Event],
    db_url: str,
    config: EngineConfig,
    clock: ManualClock,
) -> None:
    gate = gates()
    harness.runner.script = hold(gate)
    foreground = await harness.start("q1")
    leased = await harness.start("q2", lease_id=LEASE)

    await harness.engine.close()

    later = asyncio.Event()
    try:
        fresh = ScriptRunner(script=hold(later))
        async with Engine(db_url, runner=fresh, config=config, clock=clock) as reopened:
            record = await reopened.get_child(foreground.conversation_id)
            assert record is not None
            assert (record.state, record.error) == ("cancelled", "cancelled: host closed")
            record = await reopened.get_child(leased.conversation_id)
            assert record is not None
            assert record.state in ACTIVE
            assert record.cancel_requested_at is None
            assert record.error == ""
            (lease,) = await reopened.leases()
            assert lease.lease_id == LEASE and lease.revoked_at is None
    finally:
        later.set()


async def read_until_refused(engine: Engine, outcomes: list[BaseException]) -> None:
    while True:
        try:
            await engine.get_child("c-anything")
        except Exception as exc:
            outcomes.append(exc)
            return


async def test_reads_racing_a_graceful_close_are_refused_never_crash(
    db_url: str, runner: ScriptRunner, config: EngineConfig, clock: ManualClock
) -> None:
    """Found by the soak: the store closed the loop's read connection from a worker
    thread while reads still ran on it (a segfault, or SQLAlchemy errors escaping)."""
    for _ in range(10):
        engine = Engine(db_url, runner=runner, config=config, clock=clock)
        await engine.open()
        outcomes: list[BaseException] = []
        readers = [asyncio.create_task(read_until_refused(engine, outcomes)) for _ in range(20)]
        await asyncio.sleep(0.01)
        await engine.close()
        await asyncio.wait_for(asyncio.gather(*readers), 5)
        assert [type(exc) for exc in outcomes] == [errors.StoreError] * 20


async def test_registering_or_opening_a_tool_while_the_engine_closes_is_refused(
    harness: Harness, db_url: str
) -> None:
    """Found by the soak: a runner registering while the engine closed was committed
    after the close had ended this instance's connections, so that connection (and tool
    calls opened on it) stayed open in the database under a closed host instance."""
    closing = asyncio.create_task(harness.engine.close())
    await asyncio.sleep(0)  # the close has begun
    try:
        with pytest.raises(errors.StoreError):
            await harness.engine.connect("runner-2", "host-b")
        with pytest.raises(errors.StoreError):
            await harness.engine.open_tool(
                harness.conn,
                run_id="parent-run",
                conversation_id="parent-conv",
                tool_call_id="call-2",
                extension_id=PRESET.extension_id,
                presets=[PRESET],
                workspace=harness.workspace,
            )
    finally:
        await closing
    left = rows(
        db_url,
        "SELECT (SELECT COUNT(*) FROM connections WHERE closed_at IS NULL),"
        " (SELECT COUNT(*) FROM grants WHERE kind = 'tool' AND closed_at IS NULL)",
    )
    assert left == [(0, 0)]
