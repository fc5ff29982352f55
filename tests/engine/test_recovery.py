"""Restart, lease expiry and retention (design §4, §5, §7), on the same database.

A "restart" here is graceful: the first engine is closed and a second ``Engine`` is
opened on the same database in the same process (crash restarts, with a killed
process, live in ``test_crash.py``). Lease boundaries and retention run on the
injected ``ManualClock``; the tests of real timers use the system clock with a lease
lifetime of a fraction of a second.
"""

from __future__ import annotations

import asyncio
import math
from datetime import UTC, datetime
from pathlib import Path

import pytest

from delegation import (
    ChildContext,
    ChildRecord,
    Engine,
    EngineConfig,
    Event,
    NotResumable,
    Params,
    Recovery,
    errors,
)
from delegation.clock import ManualClock
from tests.harness.restarts import LEASE, restarted, route, rows, until_event
from tests.harness.support import Harness, Script, ScriptRunner, finish_after_admit, open_harness

INTERRUPTED = "child interrupted by host restart"
ADMISSION_INTERRUPTED = "child admission interrupted by host restart"
LEASE_EXPIRED = "cancelled: lease expired"


# --- helpers -------------------------------------------------------------------------


def lease_params(h: Harness, lease_id: str = LEASE, **changes: object) -> Params:
    """Params that reach a child through its lease, with no live tool call."""
    return h.params(lease_id=lease_id, tool_call_id="", **changes)


async def forever(ctx: ChildContext) -> None:
    """Admits, says so, then runs until it is cancelled (or suspended by a close)."""
    await ctx.admit()
    ctx.emit(Event(kind="text", text="working"))
    await asyncio.Event().wait()


async def child(engine: Engine, conversation_id: str) -> ChildRecord:
    record = await engine.get_child(conversation_id)
    assert record is not None
    return record


async def until_state(engine: Engine, conversation_id: str, state: str) -> ChildRecord:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while True:
        record = await child(engine, conversation_id)
        if record.state == state:
            return record
        if loop.time() > deadline:
            raise AssertionError(f"child {conversation_id} never reached {state}: {record}")
        await asyncio.sleep(0.01)


def assert_gap_free(sequences: list[int]) -> None:
    assert sequences == list(range(1, len(sequences) + 1))


# --- graceful close, then resume -----------------------------------------------------


def steerable(listening: asyncio.Event) -> Script:
    """Loops on ``wait_steer``; "hold" makes it stop listening, "stop" makes it finish
    with every message it heard as its output."""

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        ctx.emit(Event(kind="text", text="resumed" if ctx.recovery else "started"))
        listening.set()
        heard: list[str] = []
        while True:
            message = await ctx.wait_steer(10)
            if message is None:
                raise RuntimeError("no steer arrived")
            if message == "stop":
                break
            heard.append(message)
            ctx.emit(Event(kind="text", text=f"heard: {message}"))
            if message == "hold":
                await asyncio.Event().wait()
        ctx.emit(Event(kind="result", text=" | ".join(heard)))

    return run


async def steer(h: Harness, conversation_id: str, request_id: str, message: str) -> str:
    result = await h.engine.call(
        h.conn,
        "child.steer",
        lease_params(h, child_id=conversation_id, request_id=request_id, message=message),
    )
    assert result.reason == ""
    return str(result.outcome)


async def test_graceful_close_resumes_a_leased_child_that_is_steered_to_completion(
    harness: Harness, db_url: str, config: EngineConfig, clock: ManualClock
) -> None:
    listening = asyncio.Event()
    harness.runner.script = steerable(listening)
    started = await harness.start("q1", lease_id=LEASE)
    conversation_id = started.conversation_id
    assert not started.done
    await asyncio.wait_for(listening.wait(), 5)
    # One steer is taken before the close; the next stays queued, undelivered.
    assert await steer(harness, conversation_id, "s1", "hold") == "injected"
    await until_event(harness.engine, conversation_id, "heard: hold")
    assert await steer(harness, conversation_id, "s2", "go left") == "injected"
    before = await child(harness.engine, conversation_id)
    assert before.state == "running"

    await harness.engine.close()

    resumed_listening = asyncio.Event()
    fresh = ScriptRunner(script=steerable(resumed_listening))
    async with restarted(harness, db_url, fresh, config, clock) as h:
        assert h.conn.generation == harness.conn.generation + 1
        await asyncio.wait_for(resumed_listening.wait(), 5)
        (prepared,) = fresh.prepared
        recovery_events = [
            e for e in await h.engine.events(conversation_id) if e.kind == "recovery"
        ]
        assert len(recovery_events) == 1
        # The steer taken before the close is history; the queued one is delivered anew.
        assert prepared.recovery == Recovery(
            attempt=1, last_sequence=recovery_events[0].sequence, delivered_steers=("hold",)
        )
        assert prepared.identity.conversation_id == conversation_id
        assert prepared.identity.run_id == started.run_id
        record = await until_state(h.engine, conversation_id, "running")
        assert record.recovery_attempts == 1
        assert record.engine_instance_id == h.engine.instance_id
        assert record.cancel_requested_at is None
        # The old connection is fenced; the new one steers the child through the lease.
        with pytest.raises(errors.StaleConnection):
            await h.engine.call(
                harness.conn, "child.read", lease_params(h, child_id=conversation_id)
            )
        # A replayed receipt is answered again but not queued twice.
        assert await steer(h, conversation_id, "s2", "go left") == "injected"
        await until_event(h.engine, conversation_id, "heard: go left")
        assert await steer(h, conversation_id, "s3", "stop") == "injected"

        done = await h.wait_done(conversation_id)
        assert (done.state, done.error, done.output) == ("done", "", "go left")
        assert done.run_id == started.run_id
        events = await h.engine.events(conversation_id)
        assert_gap_free([e.sequence for e in events])
        assert [(e.kind, e.text) for e in events] == [
            ("text", "started"),
            ("text", "heard: hold"),
            ("recovery", events[2].text),
            ("text", "resumed"),
            ("text", "heard: go left"),
            ("result", "go left"),
        ]
        assert recovery_events[0].sequence == 3
        final = await h.engine.call(h.conn, "child.read", lease_params(h, child_id=conversation_id))
        assert final.done and not final.cancelled and final.output == "go left"
        assert [e.sequence for e in final.events] == [1, 2, 3, 4, 5, 6]
        assert len(fresh.prepared) == 1


async def test_a_resumed_child_answers_read_and_replay_while_it_runs(
    harness: Harness, db_url: str, config: EngineConfig, clock: ManualClock
) -> None:
    """design §5: read (and a replayed start) waits for admission, then answers. A resumed
    child was admitted before the restart, so neither may wait for its run to end."""
    harness.runner.script = forever
    started = await harness.start("q1", lease_id=LEASE)
    await until_event(harness.engine, started.conversation_id, "working")
    await harness.engine.close()

    fresh = ScriptRunner(script=forever)
    async with restarted(harness, db_url, fresh, config, clock) as h:
        await until_state(h.engine, started.conversation_id, "running")
        await asyncio.sleep(0.05)
        read = await asyncio.wait_for(
            h.engine.call(h.conn, "child.read", lease_params(h, child_id=started.conversation_id)),
            2,
        )
        assert not read.done and read.run_id == started.run_id
        # Its "working" again is the one committed before the close (design §26).
        assert [e.kind for e in read.events] == ["text", "recovery"]
        replay = await asyncio.wait_for(
            h.engine.call(
                h.conn, "child.start", h.start_params("q1", lease_id=LEASE, tool_call_id="")
            ),
            2,
        )
        assert not replay.done and replay.run_id == started.run_id
        assert len(fresh.prepared) == 1


async def test_a_runner_refusing_to_resume_ends_the_child_interrupted(
    harness: Harness, db_url: str, config: EngineConfig, clock: ManualClock
) -> None:
    harness.runner.script = forever
    started = await harness.start("q1", lease_id=LEASE)
    await until_event(harness.engine, started.conversation_id, "working")
    await harness.engine.close()

    refusing = ScriptRunner(script=forever, prepare_error=NotResumable("state is gone"))
    async with restarted(harness, db_url, refusing, config, clock) as h:
        record = await h.wait_done(started.conversation_id)
        assert (record.state, record.error) == ("done", INTERRUPTED)
        assert record.admitted_at is not None
        assert record.recovery_attempts == 1
        (prepared,) = refusing.prepared
        assert prepared.recovery is not None and prepared.recovery.attempt == 1
        assert refusing.started == 0
        result = await h.engine.call(
            h.conn, "child.read", lease_params(h, child_id=started.conversation_id)
        )
        assert result.done and not result.cancelled and result.error == INTERRUPTED
        assert [e.kind for e in result.events] == ["text", "recovery"]
        assert_gap_free([e.sequence for e in result.events])
        # Ended for good: a further restart does not try again.
        await h.engine.close()
    again = ScriptRunner(script=forever)
    async with restarted(harness, db_url, again, config, clock) as h:
        await asyncio.sleep(0.05)
        assert again.prepared == []
        record = await child(h.engine, started.conversation_id)
        assert (record.state, record.error, record.recovery_attempts) == ("done", INTERRUPTED, 1)


@pytest.mark.parametrize(
    "config",
    [
        EngineConfig(release_drain_s=1.0, max_recovery_attempts=1),
        EngineConfig(release_drain_s=1.0, max_recovery_attempts=2),
    ],
    ids=["max-1", "max-2"],
)
async def test_a_child_restarted_past_the_attempt_limit_ends_interrupted(
    harness: Harness, db_url: str, config: EngineConfig, clock: ManualClock
) -> None:
    harness.runner.script = forever
    started = await harness.start("q1", lease_id=LEASE)
    await until_event(harness.engine, started.conversation_id, "working")
    await harness.engine.close()

    for attempt in range(1, config.max_recovery_attempts + 1):
        runner = ScriptRunner(script=forever)
        async with restarted(harness, db_url, runner, config, clock) as h:
            record = await until_state(h.engine, started.conversation_id, "running")
            assert record.recovery_attempts == attempt
            (prepared,) = runner.prepared
            assert prepared.recovery is not None
            assert prepared.recovery.attempt == attempt
            events = await h.engine.events(started.conversation_id)
            recoveries = [e.sequence for e in events if e.kind == "recovery"]
            assert len(recoveries) == attempt
            assert prepared.recovery.last_sequence == recoveries[-1]

    last = ScriptRunner(script=forever)
    async with restarted(harness, db_url, last, config, clock) as h:
        record = await h.wait_done(started.conversation_id)
        assert (record.state, record.error) == ("done", INTERRUPTED)
        assert record.recovery_attempts == config.max_recovery_attempts
        await asyncio.sleep(0.05)
        assert last.prepared == []
        events = await h.engine.events(started.conversation_id)
        assert_gap_free([e.sequence for e in events])
        kinds = [e.kind for e in events]
        assert kinds.count("recovery") == config.max_recovery_attempts
        result = await h.engine.call(
            h.conn, "child.read", lease_params(h, child_id=started.conversation_id)
        )
        assert result.done and result.error == INTERRUPTED


async def test_close_cancels_foreground_children_and_boot_ends_never_admitted_ones(
    harness: Harness, db_url: str, config: EngineConfig, clock: ManualClock
) -> None:
    """design §7: at a graceful close tool grants end, so foreground children are cancelled
    and so is a first admission under a lease its tool authorized (§4: "end of the
    originating tool before admission"); a never-admitted child of an already active
    lease is left alone by the close and ended at the next boot, ``done`` with "child
    admission interrupted by host restart"."""
    waiting = asyncio.Event()
    effects: list[str] = []

    async def slow_to_admit(ctx: ChildContext) -> None:
        waiting.set()
        await asyncio.Event().wait()
        await ctx.admit()
        effects.append(ctx.request.request_id)

    harness.runner.script = route(fg=forever, bg=forever, slow=slow_to_admit)
    leased = await harness.start("q1", message="bg", lease_id=LEASE)
    foreground = await harness.start("q2", message="fg")
    # A start through the (active) lease alone, not admitted yet at the close.
    pending_lease = asyncio.create_task(
        harness.engine.call(
            harness.conn,
            "child.start",
            harness.start_params("q3", message="slow", lease_id=LEASE, tool_call_id=""),
        )
    )
    await asyncio.wait_for(waiting.wait(), 5)
    waiting.clear()
    # A first start on a new lease, authorized by the tool, not admitted at the close.
    pending_first = asyncio.create_task(harness.start("q4", message="slow", lease_id="lease-2"))
    await asyncio.wait_for(waiting.wait(), 5)
    by_request = {c.request_id: c for c in await harness.engine.list_children()}
    assert by_request["q3"].state == by_request["q4"].state == "prepared"

    await harness.engine.close()

    with pytest.raises(errors.AdmissionFailed):
        await asyncio.wait_for(pending_first, 5)
    # What the caller of the lease start sees is checked by the next test.
    await asyncio.wait_for(asyncio.gather(pending_lease, return_exceptions=True), 5)

    fresh = ScriptRunner(script=route(fg=forever, bg=forever, slow=slow_to_admit))
    async with restarted(harness, db_url, fresh, config, clock) as h:
        record = await child(h.engine, foreground.conversation_id)
        assert (record.state, record.error) == ("cancelled", "cancelled: host closed")
        first = by_request["q4"]
        record = await child(h.engine, first.conversation_id)
        assert (record.state, record.error, record.admitted_at) == (
            "cancelled",
            "cancelled: originating tool ended before admission",
            None,
        )
        never = by_request["q3"]
        record = await child(h.engine, never.conversation_id)
        assert (record.state, record.error, record.admitted_at) == (
            "done",
            ADMISSION_INTERRUPTED,
            None,
        )
        with pytest.raises(errors.AdmissionFailed) as refused:
            await h.engine.call(
                h.conn, "child.read", lease_params(h, child_id=never.conversation_id)
            )
        assert str(refused.value) == f"child admission failed: {ADMISSION_INTERRUPTED}"
        with pytest.raises(errors.AdmissionFailed) as replayed:
            await h.engine.call(
                h.conn,
                "child.start",
                h.start_params("q3", message="slow", lease_id=LEASE, tool_call_id=""),
            )
        assert str(replayed.value) == f"child admission failed: {ADMISSION_INTERRUPTED}"
        # Only the admitted leased child is resumed.
        record = await until_state(h.engine, leased.conversation_id, "running")
        assert record.recovery_attempts == 1
        await asyncio.sleep(0.05)
        assert [p.identity.conversation_id for p in fresh.prepared] == [leased.conversation_id]
        assert effects == []


async def test_a_start_awaiting_admission_at_close_does_not_answer_a_live_child(
    harness: Harness,
) -> None:
    """design §4: admission commits the state, "and only then does child.start return to
    its caller". A start whose run has not admitted when the host closes must not
    answer a Result as if the child were admitted and running."""
    waiting = asyncio.Event()

    async def slow_to_admit(ctx: ChildContext) -> None:
        waiting.set()
        await asyncio.Event().wait()
        await ctx.admit()

    harness.runner.script = route(bg=forever, slow=slow_to_admit)
    await harness.start("q1", message="bg", lease_id=LEASE)  # activates the lease
    pending = asyncio.create_task(
        harness.engine.call(
            harness.conn,
            "child.start",
            harness.start_params("q2", message="slow", lease_id=LEASE, tool_call_id=""),
        )
    )
    await asyncio.wait_for(waiting.wait(), 5)

    await harness.engine.close()

    (outcome,) = await asyncio.wait_for(asyncio.gather(pending, return_exceptions=True), 5)
    assert isinstance(outcome, errors.DelegationError), (
        f"child.start answered {outcome!r} for a child that was never admitted"
    )


# --- lease expiry --------------------------------------------------------------------


async def test_a_lease_is_live_at_its_deadline_and_expired_one_tick_after(
    harness: Harness, config: EngineConfig, clock: ManualClock
) -> None:
    engine = harness.engine
    harness.runner.script = route(hold=forever, quick=finish_after_admit)
    created = clock.now()
    running = await harness.start("q1", message="hold", lease_id=LEASE)
    finished = await harness.start("q2", message="quick", lease_id=LEASE)
    await harness.wait_done(finished.conversation_id)
    clock.advance(10)
    other = await harness.start("q3", message="hold", lease_id="lease-2")
    leases = {lease.lease_id: lease for lease in await engine.leases()}
    deadline = created + config.lease_lifetime_s
    assert leases[LEASE].created_at == created
    assert leases[LEASE].expires_at == deadline
    assert leases["lease-2"].expires_at == created + 10 + config.lease_lifetime_s

    clock.set(deadline)
    await engine.expire_due()
    await asyncio.sleep(0.05)

    record = await child(engine, running.conversation_id)
    assert record.state == "running" and record.cancel_requested_at is None
    assert {lease.lease_id for lease in await engine.leases()} == {LEASE, "lease-2"}
    read = await engine.call(
        harness.conn, "child.read", lease_params(harness, child_id=running.conversation_id)
    )
    assert not read.done

    clock.set(math.nextafter(deadline, math.inf))
    await engine.expire_due()

    record = await harness.wait_done(running.conversation_id)
    assert (record.state, record.error) == ("cancelled", LEASE_EXPIRED)
    assert record.lease_id == LEASE  # the record stays, the lease goes
    record = await child(engine, finished.conversation_id)
    assert (record.state, record.error, record.output) == ("done", "", "done: quick")
    assert [lease.lease_id for lease in await engine.leases()] == ["lease-2"]
    assert {c.conversation_id for c in await engine.list_children(lease_id=LEASE)} == {
        running.conversation_id,
        finished.conversation_id,
    }
    record = await child(engine, other.conversation_id)
    assert record.state == "running" and record.cancel_requested_at is None
    with pytest.raises(errors.NotOwned):
        await engine.call(
            harness.conn, "child.read", lease_params(harness, child_id=running.conversation_id)
        )
    # Re-armed at the next deadline, about ten (clock) seconds away.
    armed = engine.timers.armed_at()
    assert armed is not None
    assert 8 < (armed - datetime.now(UTC)).total_seconds() < 11


async def test_the_scheduler_expires_a_lease_without_anyone_asking(
    db_url: str, workspace: Path
) -> None:
    runner = ScriptRunner(script=forever)
    config = EngineConfig(lease_lifetime_s=0.3, release_drain_s=1.0)
    async with Engine(db_url, runner=runner, config=config) as engine:
        h = await open_harness(engine, runner, workspace)
        started = await h.start("q1", lease_id=LEASE)
        foreground = await h.start("q2")
        (lease,) = await engine.leases()
        assert engine.timers.armed_at() is not None

        record = await h.wait_done(started.conversation_id, timeout=2.0)

        assert (record.state, record.error) == ("cancelled", LEASE_EXPIRED)
        assert record.cancel_requested_at is not None
        assert lease.expires_at is not None
        assert record.cancel_requested_at > lease.expires_at
        assert await engine.leases() == []
        assert (await child(engine, foreground.conversation_id)).state == "running"


@pytest.mark.parametrize("wake", ["another-lease-timer", "expire-due-call"])
async def test_a_lost_timer_delays_expiry_until_the_next_wake_up(
    db_url: str, workspace: Path, wake: str
) -> None:
    runner = ScriptRunner(script=forever)
    config = EngineConfig(lease_lifetime_s=0.3, release_drain_s=1.0)
    async with Engine(db_url, runner=runner, config=config) as engine:
        h = await open_harness(engine, runner, workspace)
        started = await h.start("q1", lease_id=LEASE)
        (lease,) = await engine.leases()
        assert lease.expires_at is not None

        engine.timers.arm(None)  # the scheduler job is lost
        assert engine.timers.armed_at() is None
        await asyncio.sleep(max(0.0, lease.expires_at - engine.clock.now()) + 0.4)

        # Nothing expired by itself: the row is still there and the child runs ...
        record = await child(engine, started.conversation_id)
        assert record.state == "running" and record.cancel_requested_at is None
        assert [x.lease_id for x in await engine.leases()] == [LEASE]
        # ... but the database is the truth: the lease no longer grants anything.
        with pytest.raises(errors.NotOwned):
            await engine.call(
                h.conn, "child.read", lease_params(h, child_id=started.conversation_id)
            )

        if wake == "expire-due-call":
            await engine.expire_due()
            record = await h.wait_done(started.conversation_id, timeout=1.0)
        else:
            other = await h.start("q2", lease_id="lease-2")
            (lease2,) = [x for x in await engine.leases() if x.lease_id == "lease-2"]
            assert lease2.expires_at is not None
            assert engine.timers.armed_at() is not None
            record = await h.wait_done(started.conversation_id, timeout=2.0)
            assert record.cancel_requested_at is not None
            assert record.cancel_requested_at > lease2.expires_at  # at lease-2's wake-up
            other_record = await h.wait_done(other.conversation_id, timeout=2.0)
            assert (other_record.state, other_record.error) == ("cancelled", LEASE_EXPIRED)

        assert (record.state, record.error) == ("cancelled", LEASE_EXPIRED)
        assert await engine.leases() == []


async def test_a_lease_overdue_at_boot_is_expired_and_its_child_not_resumed(
    harness: Harness, db_url: str, config: EngineConfig, clock: ManualClock
) -> None:
    harness.runner.script = forever
    started = await harness.start("q1", lease_id=LEASE)
    await until_event(harness.engine, started.conversation_id, "working")
    (lease,) = await harness.engine.leases()
    assert lease.expires_at is not None
    harness.engine.timers.arm(None)
    clock.set(lease.expires_at + 1)
    await asyncio.sleep(0.05)
    assert (await child(harness.engine, started.conversation_id)).state == "running"
    assert [x.lease_id for x in await harness.engine.leases()] == [LEASE]

    await harness.engine.close()

    fresh = ScriptRunner(script=forever)
    async with restarted(harness, db_url, fresh, config, clock) as h:
        record = await h.wait_done(started.conversation_id)
        assert (record.state, record.error) == ("cancelled", LEASE_EXPIRED)
        assert record.admitted_at is not None
        assert record.recovery_attempts == 0
        assert await h.engine.leases() == []
        await asyncio.sleep(0.05)
        assert fresh.prepared == []
        events = await h.engine.events(started.conversation_id)
        assert [e.kind for e in events] == ["text"]


# --- retention -----------------------------------------------------------------------


@pytest.mark.parametrize("config", [EngineConfig(release_drain_s=1.0, retention_s=100)])
async def test_retention_purges_exactly_what_is_due(
    harness: Harness, config: EngineConfig, clock: ManualClock, db_url: str
) -> None:
    engine = harness.engine

    async def steered(ctx: ChildContext) -> None:
        await ctx.admit()
        message = await ctx.wait_steer(5)
        ctx.emit(Event(kind="result", text=f"steered: {message}"))

    async def fails(ctx: ChildContext) -> None:
        await ctx.admit()
        ctx.emit(Event(kind="text", text="trying"))
        raise RuntimeError("it broke")

    harness.runner.script = route(
        quick=finish_after_admit, fails=fails, hold=forever, steered=steered
    )
    t0 = clock.now()
    # Finished at t0: a foreground child, a failed one, a steered leased one (under a
    # lease that stays live), a cancelled one, and one under a lease released at t0.
    old_fg = await harness.start("q1", message="quick")
    old_failed = await harness.start("q2", message="fails")
    old_leased = await harness.start("q3", message="steered", lease_id=LEASE)
    assert await steer(harness, old_leased.conversation_id, "s1", "hi") == "injected"
    old_cancelled = await harness.start("q4", message="hold")
    await engine.call(
        harness.conn, "child.cancel", harness.params(child_id=old_cancelled.conversation_id)
    )
    old_released = await harness.start("q5", message="hold", lease_id="lease-old")
    released = await engine.call(
        harness.conn, "child.lease.release", lease_params(harness, lease_id="lease-old")
    )
    assert released.done
    await engine.call(
        harness.conn, "child.lease.release", lease_params(harness, lease_id="ghost-old")
    )
    olds = [old_fg, old_failed, old_leased, old_cancelled, old_released]
    old_records = [await harness.wait_done(s.conversation_id) for s in olds]
    assert {r.finished_at for r in old_records} == {t0}
    for record in old_records:
        assert rows(db_url, "events", record.id) > 0
    assert rows(db_url, "steers", old_records[2].id) == 1

    clock.advance(50)
    new_fg = await harness.start("q6", message="quick")
    new_record = await harness.wait_done(new_fg.conversation_id)
    await engine.call(
        harness.conn, "child.lease.release", lease_params(harness, lease_id="ghost-new")
    )
    active = await harness.start("q7", message="hold", lease_id=LEASE)
    assert await steer(harness, active.conversation_id, "s1", "keep") == "injected"
    active_record = await until_state(engine, active.conversation_id, "running")
    assert len(await engine.list_children()) == 7
    assert {x.lease_id for x in await engine.leases()} == {
        LEASE,
        "lease-old",
        "ghost-old",
        "ghost-new",
    }

    # Exactly at the end of the retention period nothing is due yet.
    clock.set(t0 + config.retention_s)
    assert await engine.purge() == 0
    assert len(await engine.list_children()) == 7
    assert len(await engine.leases()) == 4

    clock.set(math.nextafter(t0 + config.retention_s, math.inf))
    assert await engine.purge() == len(olds)

    kept = await engine.list_children()
    assert {c.conversation_id for c in kept} == {new_fg.conversation_id, active.conversation_id}
    for started, record in zip(olds, old_records, strict=True):
        assert await engine.get_child(started.conversation_id) is None
        assert await engine.events(started.conversation_id) == []
        assert rows(db_url, "events", record.id) == 0
        assert rows(db_url, "steers", record.id) == 0
    assert rows(db_url, "events", new_record.id) == 1
    assert rows(db_url, "steers", active_record.id) == 1
    assert (await child(engine, new_fg.conversation_id)).output == "done: quick"
    assert (await child(engine, active.conversation_id)).state == "running"
    assert {x.lease_id for x in await engine.leases()} == {LEASE, "ghost-new"}
    # The still-live lease knows the purged child went, and still serves the active one.
    with pytest.raises(errors.ChildPurged):
        await engine.call(
            harness.conn, "child.read", lease_params(harness, child_id=old_leased.conversation_id)
        )
    read = await engine.call(
        harness.conn, "child.read", lease_params(harness, child_id=active.conversation_id)
    )
    assert not read.done
    assert await engine.purge() == 0
