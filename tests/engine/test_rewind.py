"""Rewind (design §35): a follow-up may carry ``rewind: {runId, step?}`` and run as a new
execution seeded from a recorded step of an ended one: the steps before the point run
zero times, those after it once, the new execution's events 1..E are the source's, then
a ``rewind`` event and new events gap-free. Every refusal writes nothing. On both
stores, in this process; a host killed mid-rewind is in ``test_rewind_crash.py``.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest

from delegation import (
    ChildContext,
    Engine,
    EngineConfig,
    Event,
    ExecutionOptions,
    Request,
    Rewind,
    errors,
)
from tests.harness import rows
from tests.harness.rewinds import LEASE, NAMES, Steps, counts, events_of
from tests.harness.support import Harness, ScriptRunner, open_harness
from tests.harness.waits import hosted, state_is


def rewind(conversation_id: str, run_id: str, step: str | None = None) -> dict[str, Any]:
    """The request fields of a follow-up that rewinds."""
    point = Rewind(run_id=run_id) if step is None else Rewind(run_id=run_id, step=step)
    return {"resume": conversation_id, "rewind": point}


async def first_run(h: Harness, steps: Steps) -> Any:
    h.runner.script = steps.run
    started = await h.start("q1", lease_id=LEASE)
    done = await h.wait_done(started.conversation_id)
    assert (done.state, done.error) == ("done", "")
    return done


async def test_a_rewind_to_a_step_runs_those_before_it_zero_times_and_the_rest_once(
    harness: Harness, db_url: str
) -> None:
    steps = Steps()
    source = await first_run(harness, steps)
    assert steps.calls == Counter(NAMES)
    cid = source.conversation_id
    started = await harness.start("q2", lease_id=LEASE, **rewind(cid, source.run_id, "c"))
    # Its first answer already holds what it was seeded with.
    assert [e.kind for e in started.events[:2]] == ["text", "rewind"]
    done = await harness.wait_done(cid, child_run_id=started.run_id)
    assert (done.state, done.error, done.output) == ("done", "", "ok")
    # a and b replayed (their recorded values), c..e ran once more.
    assert steps.calls == Counter({"a": 1, "b": 1, "c": 2, "d": 2, "e": 2})
    recovery = steps.recoveries[-1]
    assert (recovery.reason, recovery.attempt, recovery.steps) == ("rewind", 0, 2)
    before, after = events_of(db_url, source.run_id), events_of(db_url, started.run_id)
    # Events 1..E are the source's (E: the last one committed with b, the last step
    # copied: "b=b1" was emitted after b, so the new run emits it again), then `rewind`.
    assert [e.text for e in before] == ["a=a1", "b=b1", "c=c1", "d=d1", "e=e1", "ok"]
    assert after[:1] == before[:1]
    assert after[1].kind == "rewind" and after[1].sequence == 2
    assert source.run_id in after[1].text and "'c'" in after[1].text
    assert [e.text for e in after[2:]] == ["b=b1", "c=c2", "d=d2", "e=e2", "ok"]
    assert [e.sequence for e in after] == list(range(1, len(after) + 1))  # gap-free
    lineage = rows.rows(
        db_url, "SELECT rewound_from, rewound_step FROM children WHERE run_id = :r",
        {"r": started.run_id},
    )  # fmt: skip
    assert lineage == [(source.run_id, "c")]
    # The source's rows never change.
    assert [e.text for e in events_of(db_url, source.run_id)] == [e.text for e in before]


async def test_a_rewind_without_a_step_replays_every_step(harness: Harness, db_url: str) -> None:
    steps = Steps()
    source = await first_run(harness, steps)
    cid = source.conversation_id
    started = await harness.start("q2", lease_id=LEASE, **rewind(cid, source.run_id))
    await harness.wait_done(cid, child_run_id=started.run_id)
    assert steps.calls == Counter(NAMES)  # not one step ran again
    assert steps.recoveries[-1].steps == 5
    after = events_of(db_url, started.run_id)
    # The events committed with the steps are the source's; what followed e is new.
    assert after[:4] == events_of(db_url, source.run_id)[:4]
    assert [e.kind for e in after[4:]] == ["rewind", "text", "result"]
    assert "after its last step" in after[4].text and after[5].text == "e=e1"


async def test_each_refusal_of_a_rewind_writes_nothing(harness: Harness, db_url: str) -> None:
    steps = Steps()
    harness.runner.script = steps.run
    narrow = ExecutionOptions(no_tools=True)
    started = await harness.start("q1", lease_id=LEASE, options=narrow)
    source = await harness.wait_done(started.conversation_id)
    cid = source.conversation_id
    before = counts(db_url)
    cases: list[tuple[type[errors.DelegationError], dict[str, Any]]] = [
        (errors.RewindRequiresResume, {"rewind": Rewind(run_id=source.run_id)}),
        (errors.RewindRunUnknown, rewind(cid, "r-nobody")),
        (errors.RewindRunUnknown, rewind(cid, "bad/id")),
        (errors.RewindRunUnknown, rewind(cid, "r-nobody", "")),  # the source first
        (errors.RewindStepUnknown, rewind(cid, source.run_id, "nope")),
        (errors.RewindStepUnknown, rewind(cid, source.run_id, "\x1fpatch:x")),
        (errors.RewindStepUnknown, rewind(cid, source.run_id, "")),
        (
            errors.OptionsWidened,
            {**rewind(cid, source.run_id, "c"), "options": ExecutionOptions(no_tools=False)},
        ),
        (
            errors.ResumeMismatch,
            {**rewind(cid, source.run_id, "c"), "options": ExecutionOptions(model="other")},
        ),
    ]
    for i, (refusal, fields) in enumerate(cases):
        with pytest.raises(refusal):
            await harness.start(f"bad-{i}", lease_id=LEASE, **fields)
        assert counts(db_url) == before, refusal
    # A rewind whose run is of another conversation is unknown here.
    other = await harness.start("q-other", lease_id=LEASE)
    await harness.wait_done(other.conversation_id)
    before = counts(db_url)
    with pytest.raises(errors.RewindRunUnknown):
        await harness.start("bad-x", lease_id=LEASE, **rewind(cid, other.run_id))
    # A stale owner: another host instance of the runner may not continue it.
    conn = await harness.engine.connect("runner-1", "host-b")
    stale = Harness(harness.engine, harness.runner, conn, harness.tool, harness.workspace)
    with pytest.raises(errors.AuthorityError):
        await stale.start("bad-y", lease_id=LEASE, **rewind(cid, source.run_id, "c"))
    assert counts(db_url) == before


async def test_a_live_source_is_refused_and_a_rewind_is_idempotent_by_request_id(
    harness: Harness, db_url: str
) -> None:
    gate = asyncio.Event()
    steps = Steps()

    async def run(ctx: ChildContext) -> None:
        await steps.run(ctx)
        await gate.wait()

    harness.runner.script = run
    started = await harness.start("q1", lease_id=LEASE)
    cid = started.conversation_id
    await asyncio.sleep(0.2)
    before = counts(db_url)
    with pytest.raises(errors.ActiveSubmission):
        await harness.start("q2", lease_id=LEASE, **rewind(cid, started.run_id, "b"))
    assert counts(db_url) == before
    gate.set()
    await harness.wait_done(cid)
    harness.runner.script = steps.run
    fields = rewind(cid, started.run_id, "b")
    first = await harness.start("q2", lease_id=LEASE, **fields)
    again = await harness.start("q2", lease_id=LEASE, **fields)
    assert again.run_id == first.run_id
    with pytest.raises(errors.RequestIdReused):
        await harness.start("q2", lease_id=LEASE, **rewind(cid, started.run_id, "c"))
    await harness.wait_done(cid, child_run_id=first.run_id)
    assert steps.calls["a"] == 1 and steps.calls["b"] == 2


async def test_answered_inputs_before_the_point_are_kept_and_events_after_it_offered_again(
    db_url: str, workspace: Path
) -> None:
    seen: list[Any] = []

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        answer = await ctx.ask("approve", "go on?", kind="approval")
        seen.append(("answer", answer))
        await ctx.step("middle", lambda: "m")
        payload = await ctx.wait_event("wait-go", "go")
        seen.append(("event", payload))
        await ctx.step("last", lambda: "l")
        ctx.emit(Event(kind="result", text=f"{answer} {json.dumps(payload)}"))

    async with hosted(db_url, workspace, run) as h:
        started = await h.start(lease_id=LEASE)
        cid = started.conversation_id
        await state_is(h, cid, "waiting")
        await h.engine.answer_input(cid, "approve", decision="approve")
        await h.engine.send_event(cid, "go", {"n": 1})
        source = await h.wait_done(cid)
        assert source.output == 'approve {"n": 1}'
        seen.clear()
        # Rewound to `last`: the answer and the event are recorded steps before it.
        one = await h.start("q2", lease_id=LEASE, **rewind(cid, source.run_id, "last"))
        done = await h.wait_done(cid, child_run_id=one.run_id)
        assert done.output == 'approve {"n": 1}' and seen == [
            ("answer", "approve"), ("event", {"n": 1}),
        ]  # fmt: skip
        inputs = rows.rows(
            db_url, "SELECT w.name, w.answer FROM waits w JOIN children c ON c.id = w.child_id"
            " WHERE c.run_id = :r ORDER BY w.name", {"r": one.run_id},
        )  # fmt: skip
        assert [name for name, _ in inputs] == ["approve", "wait-go"]
        seen.clear()
        # Rewound to `wait-go`: the event the source's wait took is offered again.
        two = await h.start("q3", lease_id=LEASE, **rewind(cid, one.run_id, "wait-go"))
        done = await h.wait_done(cid, child_run_id=two.run_id)
        assert done.output == 'approve {"n": 1}'
        assert seen == [("answer", "approve"), ("event", {"n": 1})]
        # Rewound to `approve`: the person is asked again; the event is offered again
        # (kept untaken, it is the one a wait for "go" gets: another is not kept).
        three = await h.start("q4", lease_id=LEASE, **rewind(cid, two.run_id, "approve"))
        await state_is(h, cid, "waiting")
        await h.engine.answer_input(cid, "approve", decision="deny")
        assert not await h.engine.send_event(cid, "go", {"n": 2})
        done = await h.wait_done(cid, child_run_id=three.run_id)
        assert done.output == 'deny {"n": 1}'


async def test_a_patch_after_the_point_is_at_the_frontier_and_one_before_it_is_not(
    harness: Harness, db_url: str
) -> None:
    steps = Steps()
    source = await first_run(harness, steps)
    cid = source.conversation_id
    seen: list[tuple[str, bool]] = []

    async def fixed(ctx: ChildContext) -> None:
        await ctx.admit()
        seen.append(("early", await ctx.patched("early")))  # a and b lie ahead: replaying
        await ctx.step("a", steps._fn("a"))
        await ctx.step("b", steps._fn("b"))
        seen.append(("fix", await ctx.patched("fix")))  # past the copied steps
        await ctx.step("c", steps._fn("c"))
        ctx.emit(Event(kind="result", text="fixed"))

    harness.runner.script = fixed
    started = await harness.start("q2", lease_id=LEASE, **rewind(cid, source.run_id, "c"))
    done = await harness.wait_done(cid, child_run_id=started.run_id)
    assert done.output == "fixed"
    assert seen == [("early", False), ("fix", True)]
    assert steps.calls == Counter({"a": 1, "b": 1, "c": 2, "d": 1, "e": 1})


async def test_the_host_rewinds_under_the_conversations_live_lease_only(
    db_url: str, workspace: Path
) -> None:
    steps = Steps()
    runner = ScriptRunner(script=steps.run)
    config = EngineConfig(release_drain_s=1.0)
    async with Engine(db_url, runner=runner, config=config) as engine:
        h = await open_harness(engine, runner, workspace)
        leased = await first_run(h, steps)
        result = await engine.rewind_child(
            leased.conversation_id, run_id=leased.run_id, step="d", request_id="op-1"
        )
        assert result.run_id != leased.run_id
        await h.wait_done(leased.conversation_id, child_run_id=result.run_id)
        assert steps.calls == Counter({"a": 1, "b": 1, "c": 1, "d": 2, "e": 2})
        again = await engine.rewind_child(
            leased.conversation_id, run_id=leased.run_id, step="d", request_id="op-1"
        )
        assert again.run_id == result.run_id  # idempotent by request id
        # A child with no lease: nothing to run a new execution under.
        foreground = await h.start("q-fg")
        await h.wait_done(foreground.conversation_id)
        before = counts(db_url)
        with pytest.raises(errors.RewindNoAuthority):
            await engine.rewind_child(foreground.conversation_id, run_id=foreground.run_id)
        # A released lease no longer authorizes one either; one made before is still
        # the same execution when asked again (its request id), another point is not.
        await engine.release(h.conn, h.params(lease_id=LEASE, run_id="parent-run"))
        with pytest.raises(errors.RewindNoAuthority):
            await engine.rewind_child(leased.conversation_id, run_id=leased.run_id)
        made = await engine.rewind_child(
            leased.conversation_id, run_id=leased.run_id, step="d", request_id="op-1"
        )
        assert made.run_id == result.run_id
        with pytest.raises(errors.RequestIdReused):
            await engine.rewind_child(
                leased.conversation_id, run_id=leased.run_id, step="c", request_id="op-1"
            )
        with pytest.raises(errors.ChildNotFound):
            await engine.rewind_child("c-nobody", run_id=leased.run_id)
        assert counts(db_url) == {**before, "grants": counts(db_url)["grants"]}


def test_request_rewind_is_omitted_unless_given() -> None:
    plain = Request(request_id="q", profile="p", message="m")
    assert b"rewind" not in msgspec.json.encode(plain)
    given = Request(request_id="q", profile="p", message="m", resume="c", rewind=Rewind(run_id="r"))
    assert json.loads(msgspec.json.encode(given))["rewind"] == {"runId": "r"}


async def test_a_rewind_records_the_current_runner_version_and_is_told_the_sources(
    db_url: str, workspace: Path
) -> None:
    steps = Steps()
    runner = ScriptRunner(script=steps.run)
    old = EngineConfig(release_drain_s=1.0, runner_version="v1")
    async with Engine(db_url, runner=runner, config=old) as engine:
        source = await first_run(await open_harness(engine, runner, workspace), steps)
    new = EngineConfig(release_drain_s=1.0, runner_version="v2")
    async with Engine(db_url, runner=runner, config=new) as engine:
        h = await open_harness(engine, runner, workspace)
        fields = rewind(source.conversation_id, source.run_id, "d")
        started = await h.start("q2", lease_id=LEASE, **fields)
        done = await h.wait_done(source.conversation_id, child_run_id=started.run_id)
    assert (done.version, done.attempt_version) == ("v2", "v2")
    recovery = steps.recoveries[-1]
    assert (recovery.runner_version, recovery.version_changed, recovery.previous_version) == (
        "v2", True, "v1",
    )  # fmt: skip
    versions = rows.rows(
        db_url, "SELECT s.name, s.version FROM steps s JOIN children c ON c.id = s.child_id"
        " WHERE c.run_id = :r ORDER BY s.ordinal", {"r": started.run_id},
    )  # fmt: skip
    # The copied steps keep the version that recorded them; the rest are v2's.
    assert versions == [("a", "v1"), ("b", "v1"), ("c", "v1"), ("d", "v2"), ("e", "v2")]


async def test_what_a_copied_step_emitted_and_a_copied_result_are_not_written_again(
    harness: Harness, db_url: str
) -> None:
    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        ctx.emit(Event(kind="text", text="start"))
        for name in ("a", "b", "c"):

            def fn(name: str = name) -> str:
                ctx.emit(Event(kind="text", text=f"inside {name}"))  # the step's own
                return name

            await ctx.step(name, fn)
            ctx.emit(Event(kind="text", text=f"after {name}"))
        ctx.emit(Event(kind="result", text="the answer"))
        await ctx.step("notify", lambda: "sent")

    harness.runner.script = run
    started = await harness.start("q1", lease_id=LEASE)
    source = await harness.wait_done(started.conversation_id)
    cid = source.conversation_id
    one = await harness.start("q2", lease_id=LEASE, **rewind(cid, source.run_id, "c"))
    await harness.wait_done(cid, child_run_id=one.run_id)
    texts = [e.text for e in events_of(db_url, one.run_id) if e.kind == "text"]
    assert texts == ["start", "inside a", "after a", "inside b", "after b", "inside c",
                     "after c"]  # fmt: skip
    # Rewound after its last step: its result was copied, and is the new one's output.
    two = await harness.start("q3", lease_id=LEASE, **rewind(cid, source.run_id))
    done = await harness.wait_done(cid, child_run_id=two.run_id)
    assert done.output == "the answer"
    kinds = [e.kind for e in events_of(db_url, two.run_id)]
    assert kinds.count("result") == 1 and kinds[-1] == "rewind"
