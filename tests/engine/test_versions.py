"""A child knows which code ran it (design §34): the runner version of each execution,
and the host's policy on a resume by another version — resume, refuse, pin — at every
wake-up and restart, on SQLite and PostgreSQL. The same across real processes killed
with SIGKILL is in ``test_versions_crash.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from delegation import AdmissionPolicy, ChildContext, Engine, EngineConfig, Operator, errors
from delegation.codec import encode
from delegation.usecases.queries import result_of
from tests.harness.support import PRESET, open_harness
from tests.harness.versioned import Versioned, answered_on, asks, engine, until_done, waiting_on
from tests.harness.waits import HOLD_S, until


async def test_resume_tells_prepare_the_version_changed(db_url: str, workspace: Path) -> None:
    cid = await waiting_on(db_url, workspace, "v1")
    runner = Versioned("v2", script=asks)
    done = await answered_on(db_url, workspace, cid, runner)
    assert (done.state, done.output) == ("done", "heard hello")
    assert (done.version, done.attempt_version) == ("v1", "v2")
    recovery = runner.prepared[-1].recovery
    assert recovery is not None
    assert (recovery.runner_version, recovery.version_changed, recovery.reason) == (
        "v2", True, "input",
    )  # fmt: skip
    assert recovery.previous_version == "v1"
    with Operator(db_url) as op:
        texts = [e.text for e in op.events(cid) if e.kind == "recovery"]
    assert texts and texts[-1].endswith("runner version v1 -> v2"), texts


async def test_refuse_ends_the_child_without_preparing_it(db_url: str, workspace: Path) -> None:
    cid = await waiting_on(db_url, workspace, "v1")
    runner = Versioned("v2", script=asks)
    done = await answered_on(db_url, workspace, cid, runner, on_version_change="refuse")
    assert done.state == "done"
    assert done.error == "runner_version_changed: ran v1, this host runs v2"
    assert runner.prepared == []  # nothing of v2 ran


async def test_pin_waits_for_its_version_and_unpin_lets_the_current_code_resume(
    db_url: str, workspace: Path
) -> None:
    cid = await waiting_on(db_url, workspace, "v1")
    v2 = Versioned("v2", script=asks)
    pinned = await answered_on(db_url, workspace, cid, v2, on_version_change="pin")
    assert (pinned.state, pinned.pinned_version) == ("waiting", "v1")
    assert v2.prepared == []
    result = result_of(pinned, [])
    assert result.pinned_version == "v1" and b'"pinnedVersion":"v1"' in encode(result)
    assert b"pinnedVersion" not in encode(
        result_of(dataclasses.replace(pinned, pinned_version=None), [])
    )
    # A host of the same version still does not run it: it stays pinned.
    again = Versioned("v2", script=asks)
    async with engine(db_url, again, on_version_change="pin") as e:
        await e.expire_due()
        await asyncio.sleep(3 * HOLD_S)
        still = await e.get_child(cid)
    assert still is not None and (still.state, still.pinned_version) == ("waiting", "v1")
    assert again.prepared == []


async def test_a_host_of_the_pinned_version_takes_it(db_url: str, workspace: Path) -> None:
    cid = await waiting_on(db_url, workspace, "v1")
    v2 = Versioned("v2", script=asks)
    await answered_on(db_url, workspace, cid, v2, on_version_change="pin")
    v1 = Versioned("v1", script=asks)
    async with engine(db_url, v1, on_version_change="pin") as e:
        done = await until_done(e, cid)
    assert (done.state, done.output, done.pinned_version) == ("done", "heard hello", None)
    recovery = v1.prepared[-1].recovery
    assert recovery is not None and not recovery.version_changed


async def test_unpin_from_another_process(db_url: str, workspace: Path) -> None:
    cid = await waiting_on(db_url, workspace, "v1")
    v2 = Versioned("v2", script=asks)
    async with engine(db_url, v2, on_version_change="pin") as e:
        await e.answer_input(cid, "word", text="hello")

        async def pinned() -> bool:
            found = await e.get_child(cid)
            return found is not None and found.pinned_version == "v1"

        await until(pinned)

        def unpin() -> Any:
            with Operator(db_url) as op:
                return op.unpin(cid)

        outcome = await asyncio.to_thread(unpin)
        assert outcome.status == "applied", outcome
        done = await until_done(e, cid)
    assert (done.state, done.output, done.attempt_version) == ("done", "heard hello", "v2")
    recovery = v2.prepared[-1].recovery
    assert recovery is not None and (recovery.version_changed, recovery.reason) == (True, "unpin")
    with Operator(db_url) as op, pytest.raises(errors.ChildEnded):
        op.unpin(cid)


async def test_unversioned_and_resumed_versions_run_as_before(db_url: str, workspace: Path) -> None:
    cid = await waiting_on(db_url, workspace, None)
    with Operator(db_url) as op, pytest.raises(errors.NotPinned):
        op.unpin(cid)
    runner = Versioned("v2", script=asks)
    done = await answered_on(db_url, workspace, cid, runner, on_version_change="refuse")
    assert (done.state, done.output) == ("done", "heard hello")
    cid = await waiting_on(db_url, workspace, "v1", "q2")
    runner = Versioned("v2", resumes=("v1",), script=asks)
    done = await answered_on(db_url, workspace, cid, runner, on_version_change="refuse")
    assert (done.state, done.output) == ("done", "heard hello")


def test_a_version_is_bounded_printable_text(monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in ("", " v1", "v\n1", "x" * 129):
        with pytest.raises(ValueError, match="runner version"):
            EngineConfig(runner_version=bad)
    with pytest.raises(ValueError, match="on_version_change"):
        EngineConfig(on_version_change="ignore")


async def runs_forever(ctx: ChildContext) -> None:
    await ctx.admit()
    await ctx.step("one", lambda: 1)
    await asyncio.Event().wait()  # until its host closes


async def running_on(db_url: str, workspace: Path, version: str) -> str:
    """A child of ``version`` left running when its host closed (resumed at the next
    boot: the takeover's path)."""
    runner = Versioned(version, script=runs_forever)
    async with engine(db_url, runner) as e:
        h = await open_harness(e, runner, workspace)
        started = await h.start(lease_id="lease-1")
        await until(lambda: step_recorded(e, db_url, started.conversation_id))
    return started.conversation_id


async def step_recorded(e: Engine, db_url: str, cid: str) -> bool:
    found = await e.get_child(cid)
    if found is None or found.state != "running":
        return False

    def recorded() -> bool:
        with Operator(db_url) as op:
            return op.inspector.steps(cid).steps != []

    return await asyncio.to_thread(recorded)


@pytest.mark.parametrize("policy", ["resume", "refuse", "pin"])
async def test_a_restart_on_another_version_follows_the_policy(
    db_url: str, workspace: Path, policy: str
) -> None:
    cid = await running_on(db_url, workspace, "v1")
    runner = Versioned("v2", script=runs_forever)
    async with engine(db_url, runner, on_version_change=policy) as e:
        if policy == "resume":
            await until(lambda: step_recorded(e, db_url, cid))
            (prepared,) = runner.prepared
            recovery = prepared.recovery
            assert recovery is not None
            assert (recovery.version_changed, recovery.reason, recovery.runner_version) == (
                True, "restart", "v2",
            )  # fmt: skip
        child = await e.get_child(cid)
    assert child is not None
    if policy == "refuse":
        assert (child.state, child.error) == (
            "done", "runner_version_changed: ran v1, this host runs v2",
        )  # fmt: skip
        assert runner.prepared == []
    elif policy == "pin":
        assert (child.state, child.pinned_version) == ("waiting", "v1")
        assert runner.prepared == []
    else:
        assert child.attempt_version == "v2" and child.version == "v1"


async def test_a_woken_child_that_waited_its_turn_is_judged_when_its_turn_comes(
    db_url: str, workspace: Path
) -> None:
    """Woken on v1 under a full concurrency policy, it waits its turn; the v2 host's
    pump that gives it its turn judges its version (refuse: nothing of v2 runs it)."""
    gate = asyncio.Event()

    async def script(ctx: ChildContext) -> None:
        await ctx.admit()
        if ctx.request.message == "block":
            await gate.wait()
            return
        await asks(ctx)

    scope = f"preset:runner-1/{PRESET.extension_id}/{PRESET.name}"
    v1 = Versioned("v1", script=script)
    async with engine(db_url, v1, admission={scope: AdmissionPolicy(concurrency=1)}) as e:
        h = await open_harness(e, v1, workspace)
        asked = (await h.start("q1", message="ask", lease_id="lease-1")).conversation_id
        await until(lambda: state_of(e, asked, "waiting"))
        blocker = (await h.start("q2", message="block", lease_id="lease-1")).conversation_id
        await until(lambda: state_of(e, blocker, "running"))
        await e.answer_input(asked, "word", text="hello")
        await until(lambda: state_of(e, asked, "queued"))
    v2 = Versioned("v2", script=script)
    async with engine(db_url, v2, on_version_change="refuse") as e:
        done = await until_done(e, asked)
    assert done.error == "runner_version_changed: ran v1, this host runs v2"
    assert [p.request.message for p in v2.prepared] == []


async def test_a_child_queued_fresh_is_the_version_of_the_host_that_prepares_it(
    db_url: str, workspace: Path
) -> None:
    scope = f"preset:runner-1/{PRESET.extension_id}/{PRESET.name}"
    v1 = Versioned("v1", script=runs_forever)
    async with engine(db_url, v1, admission={scope: AdmissionPolicy(concurrency=1)}) as e:
        h = await open_harness(e, v1, workspace)
        await h.start("q1", lease_id="lease-1")
        queued = await h.start("q2", lease_id="lease-1")
        await until(lambda: state_of(e, queued.conversation_id, "queued"))
    v2 = Versioned("v2", script=runs_forever)
    async with engine(db_url, v2, admission={scope: AdmissionPolicy(concurrency=2)}) as e:
        await until(lambda: step_recorded(e, db_url, queued.conversation_id))
        child = await e.get_child(queued.conversation_id)
    assert child is not None and (child.version, child.attempt_version) == ("v2", "v2")
    fresh = [p for p in v2.prepared if p.recovery is None]
    assert len(fresh) == 1  # prepared fresh by v2: v2 is its version


async def test_a_pinned_child_that_ends_is_no_longer_pinned_and_resumes_honours_a_pin(
    db_url: str, workspace: Path
) -> None:
    cid = await waiting_on(db_url, workspace, "v1")
    await answered_on(db_url, workspace, cid, Versioned("v2", script=asks), on_version_change="pin")
    # A v3 that resumes v1 takes a child pinned to v1.
    v3 = Versioned("v3", resumes=("v1",), script=asks)
    async with engine(db_url, v3, on_version_change="pin") as e:
        done = await until_done(e, cid)
    assert (done.output, done.attempt_version) == ("heard hello", "v3")
    cid = await waiting_on(db_url, workspace, "v1", "q2")
    v2 = Versioned("v2", script=asks)
    pinned = await answered_on(db_url, workspace, cid, v2, on_version_change="pin")
    assert pinned.pinned_version == "v1"
    async with engine(db_url, v2, on_version_change="pin") as e:
        await e.cancel_child(cid)
        ended = await e.get_child(cid)
    assert ended is not None and ended.state == "cancelled"
    assert result_of(ended, [], strict=False).pinned_version == ""


async def state_of(e: Engine, cid: str, state: str) -> bool:
    found = await e.get_child(cid)
    return found is not None and found.state == state
