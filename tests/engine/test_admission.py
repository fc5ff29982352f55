"""Admission waits its turn (design §22): policies by scope, the ``queued`` state, its
order, its answers, deadlines. On both stores, one host process; several PostgreSQL
hosts and a host killed while holding slots are in ``test_admission_hosts.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from delegation import AdmissionPolicy, ChildContext, Engine, EngineConfig, Event, errors
from delegation.codec import encode
from delegation.engine.runtime import Use
from delegation.options import ExecutionOptions
from delegation.usecases.service import cancel_exact
from tests.harness.support import PRESET, Harness, ScriptRunner, open_harness
from tests.harness.waits import until

SCOPE = f"preset:runner-1/{PRESET.extension_id}/{PRESET.name}"
Script = Callable[[ChildContext], Awaitable[None]]


class Gates:
    """Each child's run waits for its own gate; the runs in flight are counted."""

    def __init__(self) -> None:
        self.gates: dict[str, asyncio.Event] = {}
        self.running: set[str] = set()
        self.most = 0
        self.order: list[str] = []

    def gate(self, message: str) -> asyncio.Event:
        return self.gates.setdefault(message, asyncio.Event())

    async def run(self, ctx: ChildContext) -> None:
        await ctx.admit()
        name = ctx.request.message
        self.order.append(name)
        self.running.add(name)
        self.most = max(self.most, len(self.running))
        try:
            await self.gate(name).wait()
        finally:
            self.running.discard(name)
        ctx.emit(Event(kind="result", text=name))


@contextlib.asynccontextmanager
async def hosted(
    db_url: str, workspace: Path, script: Script, **config: Any
) -> AsyncIterator[Harness]:
    runner = ScriptRunner(script=script)
    settings = EngineConfig(**{"release_drain_s": 2.0, "start_wait_s": 0.2, **config})
    async with Engine(db_url, runner=runner, config=settings) as engine:
        yield await open_harness(engine, runner, workspace)


async def state_of(h: Harness, conversation_id: str) -> str:
    record = await h.engine.get_child(conversation_id)
    assert record is not None
    return record.state


async def test_a_start_past_the_concurrency_waits_its_turn_unprepared(
    db_url: str, workspace: Path
) -> None:
    gates = Gates()
    policy = {SCOPE: AdmissionPolicy(concurrency=1)}
    async with hosted(db_url, workspace, gates.run, admission=policy) as h:
        first = await h.start("q1", message="a", lease_id="lease-1")
        assert not first.done and not first.queued
        second = await h.start("q2", message="b", lease_id="lease-1")
        assert (second.done, second.queued, second.queue_position) == (False, True, 1)
        wire = json.loads(encode(second))
        assert wire["queued"] is True and wire["queuePosition"] == 1
        assert await state_of(h, second.conversation_id) == "queued"
        assert [p.request.message for p in h.runner.prepared] == ["a"]  # b: never prepared
        read = await h.read(second.conversation_id, lease_id="lease-1", tool_call_id="")
        assert read.queued and read.queue_position == 1
        gates.gate("a").set()
        await h.wait_done(first.conversation_id, lease_id="lease-1", tool_call_id="")
        await until(lambda: _is(h, second.conversation_id, "running"))
        read = await h.read(second.conversation_id, lease_id="lease-1", tool_call_id="")
        assert not read.queued and "queued" not in json.loads(encode(read))
        gates.gate("b").set()
        done = await h.wait_done(second.conversation_id, lease_id="lease-1", tool_call_id="")
        assert done.state == "done" and not done.error
        assert gates.most == 1


async def _is(h: Harness, conversation_id: str, state: str) -> bool:
    return await state_of(h, conversation_id) == state


async def test_no_policy_changes_nothing_on_the_wire(db_url: str, workspace: Path) -> None:
    gates = Gates()
    async with hosted(db_url, workspace, gates.run) as h:
        started = await h.start("q1", message="a", lease_id="lease-1")
        wire = json.loads(encode(started))
        assert "queued" not in wire and "queuePosition" not in wire
        gates.gate("a").set()
        await h.wait_done(started.conversation_id, lease_id="lease-1", tool_call_id="")
        record = await h.engine.get_child(started.conversation_id)
        assert record is not None and record.queued_at is None


LEASE = {"lease_id": "lease-1", "tool_call_id": ""}


@pytest.mark.parametrize("lease", ["lease-1", ""])
async def test_a_full_queue_refuses_and_writes_nothing(
    db_url: str, workspace: Path, lease: str
) -> None:
    """Under a lease or the tool call's own grant (on PostgreSQL a start without a
    leaseId is otherwise one lone statement: here it must be one transaction)."""
    gates = Gates()
    policy = {SCOPE: AdmissionPolicy(concurrency=1, max_queued=1)}
    async with hosted(db_url, workspace, gates.run, admission=policy) as h:
        first = await h.start("q1", message="a", lease_id=lease)
        second = await h.start("q2", message="b", lease_id=lease)
        assert second.queued
        with pytest.raises(errors.QueueFull, match=r"^child admission queue is full$") as refused:
            await h.start("q3", message="c", lease_id=lease)
        assert refused.value.reason == "queue_full"
        listed = await h.engine.list_children()
        assert sorted(c.conversation_id for c in listed) == sorted(
            [first.conversation_id, second.conversation_id]
        )
        gates.gate("a").set()
        gates.gate("b").set()
        done = await h.wait_done(second.conversation_id, **(LEASE if lease else {}))
        assert done.state == "done"


async def test_a_queue_timeout_cancels_the_child_unprepared(db_url: str, workspace: Path) -> None:
    gates = Gates()
    policy = {SCOPE: AdmissionPolicy(concurrency=1, queue_timeout_s=0.3)}
    # Answered queued at once: a busy machine cannot make the start outwait the timeout.
    async with hosted(db_url, workspace, gates.run, admission=policy, start_wait_s=0) as h:
        first = await h.start("q1", message="a", lease_id="lease-1")
        second = await h.start("q2", message="b", lease_id="lease-1")
        assert second.queued
        ended = await h.wait_done(second.conversation_id, **LEASE)
        assert (ended.state, ended.error) == ("cancelled", "cancelled: admission wait timed out")
        read = await h.read(second.conversation_id, **LEASE)
        assert read.done and read.cancelled and read.error == "cancelled: admission wait timed out"
        assert [p.request.message for p in h.runner.prepared] == ["a"]
        gates.gate("a").set()
        await h.wait_done(first.conversation_id, **LEASE)


async def test_a_cancelled_queued_child_ends_without_prepare(db_url: str, workspace: Path) -> None:
    gates = Gates()
    policy = {SCOPE: AdmissionPolicy(concurrency=1)}
    async with hosted(db_url, workspace, gates.run, admission=policy) as h:
        first = await h.start("q1", message="a", lease_id="lease-1")
        second = await h.start("q2", message="b", lease_id="lease-1")
        cancelled = await h.engine.call(
            h.conn, "child.cancel", h.params(child_id=second.conversation_id, **LEASE)
        )
        assert cancelled.done and cancelled.cancelled
        assert cancelled.error == "cancelled: cancel requested"
        gates.gate("a").set()
        await h.wait_done(first.conversation_id, **LEASE)
        await asyncio.sleep(0.3)  # a pump after the slot freed admits nothing
        assert [p.request.message for p in h.runner.prepared] == ["a"]


async def test_priority_then_first_prepared_orders_the_queue(db_url: str, workspace: Path) -> None:
    gates = Gates()
    policy = {SCOPE: AdmissionPolicy(concurrency=1)}
    async with hosted(db_url, workspace, gates.run, admission=policy) as h:
        first = await h.start("q0", message="first", lease_id="lease-1")
        for n, (name, priority) in enumerate([("low", 1), ("high", 9), ("mid", 5), ("mid2", 5)]):
            params = h.start_params(f"q{n + 1}", message=name, lease_id="lease-1")
            request = params.request
            assert request is not msgspec_unset()
            params = replace(params, request=replace(request, priority=priority))
            queued = await h.engine.call(h.conn, "child.start", params)
            assert queued.queued
        await release_in_turn(gates, 5)
        assert gates.order == ["first", "high", "mid", "mid2", "low"]
        await h.wait_done(first.conversation_id, **LEASE)


async def test_parents_are_served_round_robin(db_url: str, workspace: Path) -> None:
    gates = Gates()
    policy = {SCOPE: AdmissionPolicy(concurrency=1)}
    async with hosted(db_url, workspace, gates.run, admission=policy) as h:
        other = await h.engine.open_tool(
            h.conn, run_id="parent-run-2", conversation_id="parent-conv-2",
            tool_call_id="call-2", extension_id=PRESET.extension_id, presets=[PRESET],
            workspace=h.workspace,
        )  # fmt: skip
        await h.start("q0", message="first")
        for n in range(3):
            await h.start(f"a{n}", message=f"a{n}")
        for n in range(2):
            params = h.start_params(f"b{n}", message=f"b{n}")
            params = replace(params, run_id=other.run_id, tool_call_id=other.tool_call_id)
            assert (await h.engine.call(h.conn, "child.start", params)).queued
        await release_in_turn(gates, 6)
        assert gates.order == ["first", "a0", "b0", "a1", "b1", "a2"]


async def release_in_turn(gates: Gates, count: int) -> None:
    """Let each run end once it runs, in the order they are admitted."""
    for n in range(count):
        await until(lambda n=n: _ran(gates, n))
        gates.gate(gates.order[n]).set()


async def _ran(gates: Gates, n: int) -> bool:
    return len(gates.order) > n


def msgspec_unset() -> Any:
    import msgspec

    return msgspec.UNSET


def replace(struct: Any, **changes: Any) -> Any:
    import msgspec

    return msgspec.structs.replace(struct, **changes)


async def test_a_rate_admits_at_most_n_per_period(db_url: str, workspace: Path) -> None:
    async def quick(ctx: ChildContext) -> None:
        await ctx.admit()

    policy = {SCOPE: AdmissionPolicy(rate=(5, 1.0))}
    async with hosted(db_url, workspace, quick, admission=policy) as h:
        started = [await h.start(f"q{n}", message=f"m{n}", lease_id="lease-1") for n in range(20)]
        for child in started:
            await h.wait_done(child.conversation_id, **LEASE)
        records = [await h.engine.get_child(c.conversation_id) for c in started]
        admitted = sorted(r.admitted_at for r in records if r is not None and r.admitted_at)
        assert len(admitted) == 20
        # A bucket of 5, refilled at 5 a second: in any window of w seconds, 5 + 5w at most.
        for i, at in enumerate(admitted):
            for j in range(i + 1, len(admitted)):
                window = admitted[j] - at
                assert j - i + 1 <= 5 + 5 * window + 1e-6, (i, j, window)
        spread = admitted[-1] - admitted[0]
        assert spread >= (20 - 5) / 5 - 0.05  # 15 tokens refilled: 3 s at least


async def test_a_waiting_child_frees_its_slot_and_queues_again_when_woken(
    db_url: str, workspace: Path
) -> None:
    gates = Gates()

    async def run(ctx: ChildContext) -> None:
        if ctx.request.message == "asks":
            await ctx.admit()
            answer = await ctx.ask("go", "go on?")
            ctx.emit(Event(kind="result", text=str(answer)))
            return
        await gates.run(ctx)

    policy = {SCOPE: AdmissionPolicy(concurrency=1)}
    async with hosted(db_url, workspace, run, admission=policy, hold_s=0.1) as h:
        asks = await h.start("q1", message="asks", lease_id="lease-1")
        other = await h.start("q2", message="b", lease_id="lease-1")  # queued, then admitted
        await until(lambda: _is(h, asks.conversation_id, "waiting"))
        await until(lambda: _is(h, other.conversation_id, "running"))  # took the slot
        await h.engine.answer_input(asks.conversation_id, "go", text="yes")
        await until(lambda: _is(h, asks.conversation_id, "queued"))  # the slot is b's
        read = await h.read(asks.conversation_id, **LEASE)
        assert read.queued and read.queue_position == 1
        gates.gate("b").set()
        done = await h.wait_done(asks.conversation_id, **LEASE)
        assert done.state == "done" and not done.error


async def test_a_restart_mid_queue_keeps_the_order(tmp_path: Path, workspace: Path) -> None:
    url = f"sqlite:///{tmp_path / 'queue.db'}"
    gates = Gates()
    policy = {SCOPE: AdmissionPolicy(concurrency=1)}
    async with hosted(url, workspace, gates.run, admission=policy) as h:
        await h.start("q0", message="first", lease_id="lease-1")
        for n in range(4):
            assert (await h.start(f"q{n + 1}", message=f"m{n}", lease_id="lease-1")).queued
    again = Gates()
    async with hosted(url, workspace, again.run, admission=policy):
        await release_in_turn(again, 5)
        assert again.order == ["first", "m0", "m1", "m2", "m3"]


async def test_set_admission_applies_at_once_and_from_another_process(
    db_url: str, workspace: Path
) -> None:
    gates = Gates()
    async with hosted(db_url, workspace, gates.run) as h:
        await h.engine.set_admission(SCOPE, AdmissionPolicy(concurrency=1))
        await h.start("q1", message="a", lease_id="lease-1")
        assert (await h.start("q2", message="b", lease_id="lease-1")).queued
        (use,) = await h.engine.admission()
        assert (use.scope, use.in_use, use.queued) == (SCOPE, 1, 1)
        # Another process raises it: this host admits b within a second.
        done = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "delegation.cli", "admission", SCOPE, "--concurrency", "2",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "DELEGATION_DB": db_url},
        )  # fmt: skip
        out, err = await done.communicate()
        assert done.returncode == 0, err
        assert SCOPE in out.decode()
        await until(lambda: _ran(gates, 1), timeout=5.0)
        assert gates.order == ["a", "b"]
        await h.engine.set_admission(SCOPE, None)
        assert await h.engine.admission() == []
        gates.gate("a").set()
        gates.gate("b").set()


def test_scopes_and_policies_are_checked() -> None:
    for bad in ("preset:r/e", "runner:", "runner:a/b", "tool:x", "parent:a/b", "preset"):
        with pytest.raises(ValueError, match="admission scope"):
            EngineConfig(admission={bad: AdmissionPolicy()})
    for values in ({"concurrency": 0}, {"rate": (0, 1.0)}, {"rate": (1, 0)}, {"max_queued": -1},
                   {"queue_timeout_s": 0}):  # fmt: skip
        with pytest.raises(ValueError, match="admission"):
            AdmissionPolicy(**values)  # type: ignore[arg-type]
    with pytest.raises(errors.MalformedInput, match=r"admission policy: .* at `\$\.rate`"):
        AdmissionPolicy(rate="5/s")  # type: ignore[arg-type]  # a type: tests/contract/test_typed_inputs.py


async def test_a_cancel_recorded_before_its_turn_ends_the_child_unprepared(
    db_url: str, workspace: Path
) -> None:
    """A cancel is recorded, then its child stopped: a turn of the pump in between (or a
    stop that never came: a crash) must not admit it."""
    gates = Gates()
    policy = {SCOPE: AdmissionPolicy(concurrency=1)}
    async with hosted(db_url, workspace, gates.run, admission=policy) as h:
        first = await h.start("q1", message="a", lease_id="lease-1")
        second = await h.start("q2", message="b", lease_id="lease-1")
        use = Use(cancel_exact, second.conversation_id, None, "cancelled: by the test")
        await h.engine._rt.write(use)  # recorded only: nothing stopped it
        gates.gate("a").set()
        await h.wait_done(first.conversation_id, **LEASE)
        ended = await h.wait_done(second.conversation_id, **LEASE)
        assert (ended.state, ended.error) == ("cancelled", "cancelled: by the test")
        assert [p.request.message for p in h.runner.prepared] == ["a"]


async def test_a_tool_call_ending_cancels_a_queued_first_child_of_its_lease(
    db_url: str, workspace: Path
) -> None:
    gates = Gates()
    policy = {SCOPE: AdmissionPolicy(concurrency=1)}
    async with hosted(db_url, workspace, gates.run, admission=policy) as h:
        await h.start("q1", message="a")  # the tool call's own child holds the slot
        queued = await h.start("q2", message="b", lease_id="lease-9")  # a new lease
        assert queued.queued
        await h.engine.close_tool(h.tool)
        ended = await until_ended(h, queued.conversation_id)
        assert ended.state == "cancelled" and ended.admitted_at is None
        await asyncio.sleep(0.3)
        assert [p.request.message for p in h.runner.prepared] == ["a"]


async def until_ended(h: Harness, conversation_id: str) -> Any:
    found: list[Any] = []

    async def ended() -> bool:
        found[:] = [await h.engine.get_child(conversation_id)]
        return found[0] is not None and found[0].terminal

    await until(ended)
    return found[0]


async def test_a_policy_set_later_counts_the_children_already_running(
    db_url: str, workspace: Path
) -> None:
    gates = Gates()
    policy = {"runner:someone-else": AdmissionPolicy(concurrency=1)}
    async with hosted(db_url, workspace, gates.run, admission=policy) as h:
        await h.start("q1", message="a", lease_id="lease-1")  # admitted by its run
        await h.engine.set_admission(SCOPE, AdmissionPolicy(concurrency=1))
        later = await h.start("q2", message="b", lease_id="lease-1")
        assert later.queued
        uses = {u.scope: (u.in_use, u.queued) for u in await h.engine.admission()}
        assert uses[SCOPE] == (1, 1)
        gates.gate("a").set()
        gates.gate("b").set()
        await h.wait_done(later.conversation_id, **LEASE)


async def test_removing_a_policy_admits_what_no_policy_holds_any_more(
    db_url: str, workspace: Path
) -> None:
    gates = Gates()
    other = "runner:someone-else"  # a policy remains, but none applies to these children
    policy = {SCOPE: AdmissionPolicy(concurrency=1), other: AdmissionPolicy(concurrency=1)}
    async with hosted(db_url, workspace, gates.run, admission=policy) as h:
        await h.start("q1", message="a", lease_id="lease-1")
        waiting = [await h.start(f"q{n}", message=f"m{n}", lease_id="lease-1") for n in (2, 3)]
        assert all(w.queued for w in waiting)
        await h.engine.set_admission(SCOPE, None)  # the runner's policy still applies
        await until(lambda: _ran(gates, 2))  # both at once: no slot of the preset held them
        assert sorted(gates.order) == ["a", "m2", "m3"]
        for name in gates.order:
            gates.gate(name).set()


# --- deadlines ------------------------------------------------------------------------


async def test_a_deadline_counts_from_admission_and_outlives_a_restart(
    tmp_path: Path, workspace: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'deadline.db'}"

    async def forever(ctx: ChildContext) -> None:
        await ctx.admit()
        await asyncio.sleep(3600)

    options = ExecutionOptions(deadline_seconds=1.5)
    async with hosted(url, workspace, forever) as h:
        started = await h.start("q1", lease_id="lease-1", options=options)
        record = await h.engine.get_child(started.conversation_id)
        assert record is not None and record.admitted_at is not None
        assert record.deadline_at == pytest.approx(record.admitted_at + 1.5)
        await asyncio.sleep(0.5)
    async with hosted(url, workspace, forever) as h:
        ended = await h.wait_done(started.conversation_id, **LEASE)
        assert (ended.state, ended.error) == ("cancelled", "cancelled: child deadline exceeded")
        assert ended.deadline_at == record.deadline_at  # never reset by the restart
        assert ended.finished_at is not None and ended.finished_at >= record.deadline_at


async def test_a_deadline_ends_a_waiting_child_that_holds_no_task(
    db_url: str, workspace: Path
) -> None:
    async def asks(ctx: ChildContext) -> None:
        await ctx.admit()
        await ctx.ask("go", "go on?")

    options = ExecutionOptions(deadline_seconds=0.8)
    async with hosted(db_url, workspace, asks, hold_s=0.05) as h:
        started = await h.start("q1", lease_id="lease-1", options=options)
        await until(lambda: _is(h, started.conversation_id, "waiting"))
        ended = await h.wait_done(started.conversation_id, **LEASE)
        assert (ended.state, ended.error) == ("cancelled", "cancelled: child deadline exceeded")


async def test_a_nested_childs_deadline_is_at_most_its_parents(
    db_url: str, workspace: Path
) -> None:
    async def forever(ctx: ChildContext) -> None:
        await ctx.admit()
        await asyncio.sleep(3600)

    async with hosted(db_url, workspace, forever) as h:
        parent = await h.start("q1", options=ExecutionOptions(deadline_seconds=30))
        tool = await h.engine.open_tool(
            h.conn, run_id=parent.run_id, conversation_id=parent.conversation_id,
            tool_call_id="inner", extension_id=PRESET.extension_id, presets=[PRESET],
            workspace=h.workspace,
        )  # fmt: skip
        params = h.start_params("n1", options=ExecutionOptions(deadline_seconds=3000))
        params = replace(params, run_id=tool.run_id, tool_call_id=tool.tool_call_id)
        nested = await h.engine.call(h.conn, "child.start", params)
        outer = await h.engine.get_child(parent.conversation_id)
        inner = await h.engine.get_child(nested.conversation_id)
        assert outer is not None and inner is not None and outer.deadline_at is not None
        assert inner.deadline_at == outer.deadline_at  # its own 3000 s: cut to what is left


async def test_deadline_seconds_narrows_like_the_other_options(
    db_url: str, workspace: Path
) -> None:
    async with hosted(db_url, workspace, Gates().run) as h:
        tool = await h.engine.open_tool(
            h.conn, run_id="limited", conversation_id="limited-conv", tool_call_id="t",
            extension_id=PRESET.extension_id, presets=[PRESET], workspace=h.workspace,
            policy=ExecutionOptions(deadline_seconds=10),
        )  # fmt: skip
        params = h.start_params("w1", options=ExecutionOptions(deadline_seconds=20))
        params = replace(params, run_id=tool.run_id, tool_call_id=tool.tool_call_id)
        with pytest.raises(errors.DeadlineWidened, match="deadlineSeconds"):
            await h.engine.call(h.conn, "child.start", params)
        with pytest.raises(errors.InvalidOptions, match="deadlineSeconds"):
            await h.start("w2", options=ExecutionOptions(deadline_seconds=-1))


async def test_a_step_timeout_raises_step_timeout_and_records_nothing(
    db_url: str, workspace: Path
) -> None:
    seen: list[str] = []

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        try:
            await ctx.step("slow", asyncio.sleep, 5, timeout=0.1)
        except errors.StepTimeout as exc:
            seen.append(str(exc))
        assert await ctx.recorded("slow") is None
        seen.append(await ctx.step("quick", lambda: "ok", timeout=1))

    async with hosted(db_url, workspace, run) as h:
        started = await h.start("q1", lease_id="lease-1")
        done = await h.wait_done(started.conversation_id, **LEASE)
        assert done.state == "done" and not done.error
    assert seen == ["child step 'slow' timed out after 0.1 s", "ok"]


def test_a_priority_outside_0_to_9_is_refused() -> None:
    from delegation.wire import Request

    for bad in (-1, 10):
        with pytest.raises(errors.BadPriority):
            Request(request_id="r", profile="p", message="m", priority=bad).validate()
    Request(request_id="r", profile="p", message="m", priority=0).validate()


async def _other_parent(h: Harness) -> Any:
    """A second parent conversation's tool call, to start children under."""
    return await h.engine.open_tool(
        h.conn, run_id="parent-run-2", conversation_id="parent-conv-2",
        tool_call_id="call-2", extension_id=PRESET.extension_id, presets=[PRESET],
        workspace=h.workspace,
    )  # fmt: skip


async def _start_at(h: Harness, key: str, priority: int, tool: Any = None) -> Any:
    params = h.start_params(key, message=key)
    params = replace(params, request=replace(params.request, priority=priority))
    if tool is not None:
        params = replace(params, run_id=tool.run_id, tool_call_id=tool.tool_call_id)
    return await h.engine.call(h.conn, "child.start", params)


async def test_a_parent_flooding_at_priority_9_cannot_starve_another(
    db_url: str, workspace: Path
) -> None:
    """The fifth attack (SPEC §31): bands were strict, and a parent submitting at 9 kept
    another parent's earlier child (priority 5) waiting behind all of its work. Now a
    priority is a head start of 8 turns a level: the other parent's child waits behind
    at most 4 * 8 + 1 of the flooding parent's children (the +1: the turn they share),
    however many it queues."""
    gates = Gates()
    policy = {SCOPE: AdmissionPolicy(concurrency=1)}
    async with hosted(db_url, workspace, gates.run, admission=policy) as h:
        other = await _other_parent(h)
        await _start_at(h, "first", 9)
        for n in range(60):
            assert (await _start_at(h, f"a{n}", 9)).queued
        assert (await _start_at(h, "b", 5, other)).queued
        await release_in_turn(gates, 40)
        before = gates.order.index("b") - 1  # "first" ran before either
        assert before == (9 - 5) * 8 + 1, gates.order
        assert gates.order[1:4] == ["a0", "a1", "a2"], "priority still goes first"


async def test_a_parent_trickling_at_priority_9_cannot_starve_another(
    db_url: str, workspace: Path
) -> None:
    """The same with one child queued at a time: a parent's turns never go back, so
    keeping the queue short buys it no new head start."""
    gates = Gates()
    policy = {SCOPE: AdmissionPolicy(concurrency=1)}
    async with hosted(db_url, workspace, gates.run, admission=policy) as h:
        other = await _other_parent(h)
        await _start_at(h, "a0", 9)
        assert (await _start_at(h, "a1", 9)).queued
        assert (await _start_at(h, "b", 5, other)).queued
        for n in range(2, 60):
            await until(lambda n=n: _ran(gates, n - 2))
            gates.gate(gates.order[n - 2]).set()
            if "b" in gates.order:
                break
            assert (await _start_at(h, f"a{n}", 9)).queued
        assert "b" in gates.order, gates.order
        assert gates.order.index("b") - 1 <= (9 - 5) * 8 + 1, gates.order
        for name in gates.order:
            gates.gate(name).set()


async def test_a_scope_caps_the_priority_its_children_ask(db_url: str, workspace: Path) -> None:
    gates = Gates()
    policy = {SCOPE: AdmissionPolicy(concurrency=1, max_priority=5)}
    async with hosted(db_url, workspace, gates.run, admission=policy) as h:
        before = await h.engine.list_children()
        with pytest.raises(errors.PriorityAboveCap) as refused:
            await _start_at(h, "greedy", 9)
        assert str(refused.value) == (
            f"child priority 9 is above max_priority 5 of admission scope {SCOPE}"
        )
        assert refused.value.reason == "priority_above_cap"
        assert await h.engine.list_children() == before, "a refusal writes nothing"
        fair = await _start_at(h, "fair", 5)
        gates.gate("fair").set()
        await h.wait_done(fair.conversation_id, **LEASE)
    with pytest.raises(ValueError, match="max_priority"):
        AdmissionPolicy(max_priority=10)
    with pytest.raises(errors.MalformedInput, match="max_priority"):
        AdmissionPolicy(max_priority="9")  # type: ignore[arg-type]


async def test_the_cli_sets_and_lists_a_priority_cap(
    db_url: str, workspace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from delegation.cli import main

    async with hosted(db_url, workspace, Gates().run) as h:
        await h.start("q0", message="seen")  # the scope is one the database knows
        assert main(["admission", SCOPE, "--max-priority", "3", "--db", db_url]) == 0
        capsys.readouterr()
        assert main(["admission", "--json", "--db", db_url]) == 0
        listed = json.loads(capsys.readouterr().out)
        mine = [scope for scope in listed if scope["scope"] == SCOPE]
        assert [(s["maxPriority"], s["concurrency"]) for s in mine] == [(3, None)]
        (use,) = [use for use in await h.engine.admission() if use.scope == SCOPE]
        assert use.row.policy.max_priority == 3


async def test_children_that_sleep_and_wake_in_a_loop_cannot_starve_another_parent(
    db_url: str, workspace: Path
) -> None:
    """The review of SPEC §31: a woken child whose slot was taken queued at the newest
    turn served, and won the tie with its older id, so a parent whose children slept and
    woke in a loop kept another parent's child queued for ever. A wake now takes a turn
    of its parent's, and a free slot only when nobody is queued in its scopes."""
    runs = {"f": 0}
    seen: dict[str, int] = {}
    gates = Gates()

    async def run(ctx: ChildContext) -> None:
        name = ctx.request.message
        if name == "g":
            await gates.run(ctx)  # holds the slot until let go
            return
        await ctx.admit()
        if name.startswith("f"):
            runs["f"] += 1  # once per run: its first, then one per wake
            for n in range(30):
                await asyncio.sleep(0.02)  # the slot held a moment
                await ctx.sleep(f"nap-{n}", 0.01)
        else:
            seen["v"] = runs["f"]
        ctx.emit(Event(kind="result", text=name))

    policy = {SCOPE: AdmissionPolicy(concurrency=1)}
    async with hosted(db_url, workspace, run, admission=policy, hold_s=0.0) as h:
        other = await _other_parent(h)
        sleepers = [await _start_at(h, name, 5) for name in ("f1", "f2", "f3")]
        holder = await _start_at(h, "g", 5)
        await until(lambda: _is(h, holder.conversation_id, "running"), timeout=30)
        assert (await _start_at(h, "v", 5, other)).queued

        async def all_queued() -> bool:
            states = [await state_of(h, s.conversation_id) for s in sleepers]
            return states == ["queued"] * 3  # each woke, and waits behind the holder

        await until(all_queued, timeout=30)
        before = runs["f"]
        gates.gate("g").set()

        async def ran() -> bool:
            return "v" in seen

        await until(ran, timeout=60)
    assert seen["v"] - before <= 3, f"{seen['v'] - before} wakes of the sleepers came first"
