"""An operator's control is judged when it is given (design §33), whether or not a host
runs: refused at once (one line, exit 1, nothing recorded) when it cannot apply; a
control refused later, when a host applies it, keeps its refusal; ``delegation
controls`` lists every control with its outcome. The Python door (``Operator``) is the
same, with typed errors; ``child.send`` lets the extension that holds a child send it
an event. On SQLite and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from delegation import ChildContext, Engine, EngineConfig, Event, Operator, errors
from delegation.store import controls
from delegation.store.controls import InputAnswer, decoded
from delegation.store.stores import write_once
from tests.harness.operators import operator
from tests.harness.support import ScriptRunner, open_harness
from tests.harness.waits import HOLD_S, hosted, state_is, until


async def asking(ctx: ChildContext) -> None:
    """A child that asks three things, then waits for an event, then ends."""
    await ctx.admit()
    pick = await ctx.ask("pick", "which?", options=["red", "blue"])
    ok = await ctx.ask("ok", "may I?", kind="approval", tool_name="rm")
    word = await ctx.ask("word", "say a word")
    sent = await ctx.wait_event("sig", "go")
    await ctx.wait_event("end", "stop")
    ctx.emit(Event(kind="result", text=f"{pick} {ok} {word} {json.dumps(sent)}"))


async def controls_of(db_url: str, cid: str | None = None) -> list[dict[str, Any]]:
    code, out, err = await operator("controls", *([cid] if cid else []), "--json", db=db_url)
    assert code == 0, err
    listed: list[dict[str, Any]] = json.loads(out)
    return listed


async def waiting_child(db_url: str, workspace: Any) -> str:
    """A child suspended on its first question, its host closed: no host runs."""
    async with hosted(db_url, workspace, asking) as h:
        started = await h.start(lease_id="lease-1")
        await state_is(h, started.conversation_id, "waiting")
    return started.conversation_id


async def test_with_no_host_every_wrong_control_is_refused_and_nothing_recorded(
    db_url: str, workspace: Any
) -> None:
    cid = await waiting_child(db_url, workspace)
    wrong = [
        (("pick", "--decision", "green"), "child input decision is not one of its options"),
        (("nope", "--decision", "red"), "child input request not found"),
        (("ok", "--approve"), "child input request not found"),  # not asked yet
        (("pick", "--text", "red"), "child input decision is not one of its options"),
    ]
    for given, said in wrong:
        code, out, err = await operator("input", cid, *given, db=db_url)
        assert (code, out, err) == (1, "", f"delegation: {said}\n"), given
    code, out, err = await operator("input", cid, "pick", "--decision", "x", "--json", db=db_url)
    assert (code, json.loads(out)["reason"]) == (1, "input_invalid")
    assert await controls_of(db_url) == []
    # A valid answer is recorded (queued: no host runs) ...
    code, out, err = await operator("input", cid, "pick", "--decision", "blue", "--wait", "0",
                                    db=db_url)  # fmt: skip
    assert code == 0 and "is recorded (control 1, not waited for)" in out, (out, err)
    # ... and a second answer to the same request is refused at once, not dropped later.
    code, out, err = await operator("input", cid, "pick", "--decision", "red", db=db_url)
    assert (code, err) == (1, "delegation: child input was already answered\n")
    code, out, err = await operator("steer", cid, " ", db=db_url)
    assert code == 1 and "nonempty" in err
    listed = await controls_of(db_url, cid)
    assert [(c["action"], c["status"]) for c in listed] == [("input", "pending")]

    # The next host applies it; the list says so.
    async with hosted(db_url, workspace, asking):

        async def applied() -> bool:
            return (await controls_of(db_url, cid))[0]["status"] == "applied"

        await until(applied)
    (control,) = await controls_of(db_url, cid)
    assert control["outcome"] == {"state": "running"} or control["outcome"]["state"] in (
        "running", "waiting",
    )  # fmt: skip


async def test_a_control_refused_when_applied_keeps_its_refusal(
    db_url: str, workspace: Any
) -> None:
    async def timed(ctx: ChildContext) -> None:
        await ctx.admit()
        try:
            await ctx.ask("pick", "which?", options=["red", "blue"], timeout=4.0)
        except errors.InputTimeout:
            ctx.emit(Event(kind="result", text="timed out"))

    async with hosted(db_url, workspace, timed) as h:
        started = await h.start(lease_id="lease-1")
        cid = started.conversation_id
        await state_is(h, cid, "waiting")
    # Given while the request is open: recorded. Applied after it timed out: refused.
    code, out, err = await operator("input", cid, "pick", "--decision", "red", "--wait", "0",
                                    db=db_url)  # fmt: skip
    assert code == 0 and "is recorded" in out, err
    await asyncio.sleep(4.0)  # past the request's timeout
    async with hosted(db_url, workspace, timed) as h:
        await h.wait_done(cid)
        code, out, err = await operator("controls", cid, "--wait", "10", "--json", db=db_url)
    (control,) = json.loads(out)
    assert (control["status"], control["reason"]) == ("refused", "input_closed"), control
    assert control["error"] == "child is not waiting for input"
    code, out, err = await operator("controls", cid, db=db_url)
    assert code == 0 and "input  " in out and "refused [input_closed]" in out, out


async def test_send_and_cancel_to_an_ended_child_are_refused(db_url: str, workspace: Any) -> None:
    async def quick(ctx: ChildContext) -> None:
        await ctx.admit()
        ctx.emit(Event(kind="result", text="done"))

    async with hosted(db_url, workspace, quick) as h:
        started = await h.start(lease_id="lease-1")
        cid = started.conversation_id
        await h.wait_done(cid)
        with pytest.raises(errors.EventClosed, match="child conversation has no live execution"):
            await h.engine.send_event(cid, "go", {"n": 1})
        for args in (("send", cid, "go"), ("cancel", cid), ("steer", cid, "go on")):
            code, out, err = await operator(*args, "--json", db=db_url)
            assert code == 1, (args, out, err)
            assert json.loads(out)["reason"] in ("event_closed", "child_ended"), out
        code, out, err = await operator("send", cid, "go", db=db_url)
        assert err == "delegation: child conversation has no live execution\n"
        code, out, err = await operator("cancel", cid, db=db_url)
        assert err == f"delegation: child {cid} has already ended (done)\n"
    assert await controls_of(db_url) == []
    with Operator(db_url) as op:
        with pytest.raises(errors.EventClosed):
            op.send_event(cid, "go")
        with pytest.raises(errors.ChildEnded):
            op.cancel(cid)
        with pytest.raises(errors.ChildNotFound):
            op.steer("c-" + "0" * 32, "hello")
        assert op.controls(cid) == []


async def test_the_python_door_answers_while_a_host_owns_the_database(
    db_url: str, workspace: Any
) -> None:
    async with hosted(db_url, workspace, asking) as h:
        started = await h.start(lease_id="lease-1")
        cid = started.conversation_id
        await state_is(h, cid, "waiting")

        def act() -> list[Any]:
            seen: list[Any] = []
            with Operator(db_url) as op:
                assert list(op.input_requests(cid)) == ["pick"]
                with pytest.raises(errors.InputInvalid):
                    op.answer_input(cid, "pick", decision="green")
                seen.append(op.answer_input(cid, "pick", decision="red"))
                with pytest.raises(errors.InputAnswered):
                    op.answer_input(cid, "pick", decision="blue")
            return seen

        (first,) = await asyncio.to_thread(act)
        assert (first.status, first.action, first.conversation_id) == ("applied", "input", cid)

        def requests() -> list[str]:
            with Operator(db_url) as op:
                return list(op.input_requests(cid))

        async def asked(name: str) -> bool:
            return name in await asyncio.to_thread(requests)

        await until(lambda: asked("ok"))

        def approve_and_send() -> list[Any]:
            with Operator(db_url) as op:
                approved = op.answer_input(cid, "ok", decision="approve", request_id="op-ok")
                again = op.answer_input(cid, "ok", decision="approve", request_id="op-ok")
                assert again.id == approved.id  # the same request id: the same control
                return [approved, [c.status for c in op.controls(cid)]]

        approved, statuses = await asyncio.to_thread(approve_and_send)
        assert approved.status == "applied" and statuses == ["applied", "applied"]
        await until(lambda: asked("word"))

        def answer_and_send() -> list[Any]:
            with Operator(db_url) as op:
                worded = op.answer_input(cid, "word", text="hello")
                sent = op.send_event(cid, "go", {"n": 1}, idempotency_key="s1")
                again = op.send_event(cid, "go", {"n": 2}, idempotency_key="s1")
                op.send_event(cid, "stop")
                return [worded.status, sent.fields, again.fields]

        assert await asyncio.to_thread(answer_and_send) == [
            "applied", {"accepted": True}, {"accepted": False},
        ]  # fmt: skip
        done = await h.wait_done(cid)
    assert done.output == 'red approve hello {"n": 1}'


async def test_child_send_from_the_extension_that_holds_the_child(
    db_url: str, workspace: Any
) -> None:
    async def waits(ctx: ChildContext) -> None:
        await ctx.admit()
        sent = await ctx.wait_event("sig", "go")
        ctx.emit(Event(kind="result", text=json.dumps(sent)))

    runner = ScriptRunner(script=waits)
    settings = EngineConfig(release_drain_s=2.0, hold_s=HOLD_S)
    async with Engine(db_url, runner=runner, config=settings) as engine:
        h = await open_harness(engine, runner, workspace)
        started = await h.start(lease_id="lease-1")
        cid = started.conversation_id
        handle = {"child_id": cid, "lease_id": "lease-1", "tool_call_id": ""}
        with pytest.raises(errors.BadSteer):  # a send needs its request id
            await engine.send(h.conn, h.params(**handle, key="go", data=1))
        sent = await engine.call(
            h.conn, "child.send", h.params(**handle, key="go", data={"n": 1}, request_id="s-1")
        )
        assert sent.conversation_id == cid
        again = await engine.send(h.conn, h.params(**handle, key="go", data=2, request_id="s-1"))
        assert again.conversation_id == cid  # idempotent: nothing changed
        done = await h.wait_done(cid)
        assert done.output == '{"n": 1}'
        # A retry whose answer was lost, after the event ended the child: nothing changes.
        retried = await engine.send(h.conn, h.params(**handle, key="go", data=1, request_id="s-1"))
        assert retried.done and retried.conversation_id == cid
        with pytest.raises(errors.EventClosed):
            await engine.send(h.conn, h.params(**handle, key="go", request_id="s-2"))
        # Another extension's connection may not send to it (authority as for a steer).
        other = await engine.connect("other-runner", "other-host")
        with pytest.raises(errors.AuthorityError):
            await engine.send(other, h.params(**handle, key="go", request_id="s-3"))


async def test_child_send_over_serve(db_url: str, workspace: Any) -> None:
    from delegation.client.api import Client
    from tests.harness.client_hosts import ENV, ROOT, setup, start_params

    runner = ("--runner", "tests.harness.serve_runners:Waiter")
    async with await Client.spawn(["--db", db_url, *runner], env=ENV, cwd=ROOT) as client:
        await setup(client, workspace)
        started = await client.start(start_params("q1", "wait for go"))
        child = {"runId": "run-1", "toolCallId": "call-1", "extensionId": "ext",
                 "generation": 3, "childId": started.conversation_id}  # fmt: skip
        sent = await client.send({**child, "key": "go", "data": {"n": 1}, "requestId": "s-1"})
        assert sent.conversation_id == started.conversation_id
        while not (result := await client.read(child)).done:
            await asyncio.sleep(0.02)
        assert result.output == '{"n": 1}'
        with pytest.raises(errors.EventClosed, match="child conversation has no live execution"):
            await client.send({**child, "key": "go", "requestId": "s-2"})


async def test_an_answer_queued_by_an_earlier_version_is_applied(
    db_url: str, workspace: Any
) -> None:
    """Rows of the version before the typed controls: the field not given was null."""
    cid = await waiting_child(db_url, workspace)
    with Operator(db_url) as op:
        run_id = op.show(cid).run_id  # type: ignore[union-attr]
    old = json.dumps({"inputId": "pick", "decision": "blue", "text": None})
    write_once(db_url, lambda c: controls.submit(c, cid, run_id, "input", old, "op-old", 1.0))
    assert decoded("input", old) == InputAnswer("pick", "blue", "")
    async with hosted(db_url, workspace, asking) as h:

        async def asked() -> bool:
            found = await h.engine.get_child(cid)
            return found is not None and found.inputs_open == 1 and found.state == "waiting"

        await until(lambda: asked())
        (control,) = await controls_of(db_url, cid)
        assert (control["status"], control["outcome"]) == ("applied", {"state": "running"})


async def test_a_python_answer_gets_a_request_id_so_applying_it_twice_changes_nothing(
    db_url: str, workspace: Any
) -> None:
    cid = await waiting_child(db_url, workspace)
    with Operator(db_url) as op:
        given = op.answer_input(cid, "pick", decision="red", wait=0)
        assert given.status == "pending" and given.request_id.startswith("op-")
        steer = op.steer(cid, "hurry", wait=0)
        assert steer.request_id.startswith("op-") and steer.request_id != given.request_id
