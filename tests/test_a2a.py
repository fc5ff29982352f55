"""The A2A face (design §29), driven by the official SDK's own client (``a2a.client``:
nothing of ours on the client side) against the real ``delegation web --a2a`` process on
loopback, beside a real host in this process. On SQLite and PostgreSQL (``db_url``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from a2a.client import A2ACardResolver, Client, ClientConfig, ClientFactory
from a2a.types.a2a_pb2 import (
    CancelTaskRequest,
    GetTaskRequest,
    ListTasksRequest,
    Message,
    Part,
    Role,
    SendMessageRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    TaskPushNotificationConfig,
    TaskState,
)
from a2a.utils.errors import (
    PushNotificationNotSupportedError,
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)
from google.protobuf.json_format import MessageToDict

from delegation import ChildContext, Event, Operator
from tests import browser
from tests.test_waiting import hosted, state_is, until

LEASE = "lease-1"


async def approving(ctx: ChildContext) -> None:
    """A child that plans, asks for an approval, and reports what it did."""
    await ctx.admit()
    ctx.emit(Event(kind="text", text="planning"))
    ok = await ctx.ask("deploy", "deploy to production?", kind="approval", tool_name="deploy")
    ctx.emit(Event(kind="result", text=f"deploy: {ok}"))


async def ticking(ctx: ChildContext) -> None:
    """A child that says something every 20 ms, 150 times, then ends ("forever": until
    cancelled)."""
    await ctx.admit()
    count = 10**6 if ctx.request.message == "forever" else 150
    for n in range(count):
        ctx.emit(Event(kind="text", text=f"tick {n}"))
        await asyncio.sleep(0.02)
    ctx.emit(Event(kind="result", text="ticked"))


@contextlib.contextmanager
def face(db_url: str) -> Iterator[browser.Web]:
    with browser.web(db_url, "--a2a") as web:
        yield web


@contextlib.asynccontextmanager
async def client(web: browser.Web, *, streaming: bool = True) -> AsyncIterator[Client]:
    """The SDK's client of the face, found from its agent card, showing the token."""
    headers = {"Authorization": f"Bearer {web.token}"}
    async with httpx.AsyncClient(headers=headers, timeout=30) as http:
        config = ClientConfig(streaming=streaming, httpx_client=http)
        made = await ClientFactory(config).create_from_url(web.url)
        try:
            yield made
        finally:
            await made.close()


def said(message_id: str, text: str, task_id: str, **metadata: Any) -> SendMessageRequest:
    message = Message(message_id=message_id, task_id=task_id, role=Role.ROLE_USER)
    message.parts.append(Part(text=text))
    message.metadata.update(metadata)
    return SendMessageRequest(message=message)


async def child(h: Any, state: str, **changes: Any) -> tuple[str, str]:
    """A leased child started and in ``state``: its conversation id and run id."""
    started = await h.start(lease_id=LEASE, **changes)
    await state_is(h, started.conversation_id, state)
    record = await h.engine.get_child(started.conversation_id)
    assert record is not None
    return started.conversation_id, record.run_id


def sequences(responses: list[StreamResponse]) -> list[int]:
    """The event sequences a stream gave: the Task's history, then its status updates'."""
    found: list[int] = []
    for response in responses:
        messages = []
        if response.HasField("task"):
            messages = list(response.task.history)
        elif response.HasField("status_update") and response.status_update.status.HasField(
            "message"
        ):
            messages = [response.status_update.status.message]
        for message in messages:
            _, _, n = message.message_id.rpartition(":")
            if n.isdigit():
                found.append(int(n))
    return found


async def test_an_sdk_client_lists_follows_answers_and_sees_the_artifact(
    db_url: str, workspace: Path
) -> None:
    async with hosted(db_url, workspace, approving) as h:
        cid, run_id = await child(h, "waiting")
        with face(db_url) as web:
            async with client(web) as a2a:
                async with httpx.AsyncClient() as anonymous:  # the card is public
                    card = await A2ACardResolver(anonymous, web.url).get_agent_card()
                assert card.capabilities.streaming and not card.capabilities.push_notifications
                assert [skill.id for skill in card.skills] == ["children"]
                assert card.supported_interfaces[0].url == web.url + "a2a"
                assert "bearer" in card.security_schemes

                listed = await a2a.list_tasks(ListTasksRequest(context_id=cid))
                assert [t.id for t in listed.tasks] == [run_id]
                (task,) = listed.tasks
                assert task.context_id == cid
                assert task.status.state == TaskState.TASK_STATE_INPUT_REQUIRED
                asks = MessageToDict(task.status.message)["metadata"]
                assert list(asks["inputRequests"]) == ["deploy"]
                assert task.status.message.parts[0].text == "deploy to production?"
                by_state = ListTasksRequest(status=TaskState.TASK_STATE_COMPLETED)
                assert list((await a2a.list_tasks(by_state)).tasks) == []

                seen: list[StreamResponse] = []

                async def follow() -> None:
                    async for response in a2a.subscribe(SubscribeToTaskRequest(id=run_id)):
                        seen.append(response)

                follower = asyncio.create_task(follow())
                await until(lambda: _true(bool(seen)))
                first = seen[0].task
                assert first.id == run_id and first.metadata["sequence"] == len(first.history)

                answer = said("approve-1", "approve", run_id)
                async with client(web, streaming=False) as plain:
                    (reply,) = [r async for r in plain.send_message(answer)]
                    (again,) = [r async for r in plain.send_message(answer)]
                assert reply.task.id == again.task.id == run_id
                await asyncio.wait_for(follower, 20)

                last = seen[-1].status_update.status
                assert last.state == TaskState.TASK_STATE_COMPLETED
                (artifact,) = [
                    r.artifact_update.artifact for r in seen if r.HasField("artifact_update")
                ]
                assert artifact.parts[0].text == "deploy: approve"
                numbers = sequences(seen)
                assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) >= 3

                done = await a2a.get_task(GetTaskRequest(id=run_id))
                assert done.status.state == TaskState.TASK_STATE_COMPLETED
                assert done.artifacts[0].parts[0].text == "deploy: approve"
        with Operator(db_url) as op:
            answers = [c for c in op.controls(cid) if c.action == "input"]
        assert [(c.request_id, c.status) for c in answers] == [("approve-1", "applied")]


async def _true(value: bool) -> bool:
    return value


async def test_cancel_ends_canceled_and_refusals_are_the_sdks_own_errors(
    db_url: str, workspace: Path
) -> None:
    async with hosted(db_url, workspace, ticking) as h:
        cid, run_id = await child(h, "running", message="forever")
        with face(db_url) as web:
            async with client(web, streaming=False) as a2a:
                working = await a2a.get_task(GetTaskRequest(id=run_id, history_length=3))
                while working.metadata["sequence"] < 5:  # five ticks committed
                    working = await a2a.get_task(GetTaskRequest(id=run_id, history_length=3))
                assert working.status.state == TaskState.TASK_STATE_WORKING
                assert len(working.history) == 3  # the newest three events
                cancelled = await a2a.cancel_task(CancelTaskRequest(id=run_id))
                assert cancelled.status.state == TaskState.TASK_STATE_CANCELED
                record = await h.engine.get_child(cid)
                assert record is not None and record.state == "cancelled"  # the database agrees

                with pytest.raises(TaskNotCancelableError):
                    await a2a.cancel_task(CancelTaskRequest(id=run_id))
                with pytest.raises(TaskNotFoundError):
                    await a2a.get_task(GetTaskRequest(id="r-nobody"))
                with pytest.raises(TaskNotFoundError):
                    await a2a.cancel_task(CancelTaskRequest(id="r-nobody"))
                with pytest.raises(UnsupportedOperationError):  # a finished task
                    _ = [r async for r in a2a.send_message(said("m-1", "go on", run_id))]
                with pytest.raises(UnsupportedOperationError):  # children are started elsewhere
                    _ = [r async for r in a2a.send_message(said("m-2", "start one", ""))]
                push = TaskPushNotificationConfig(task_id=run_id, url="http://127.0.0.1:9/")
                with pytest.raises(PushNotificationNotSupportedError):
                    await a2a.create_task_push_notification_config(push)
                listed = await a2a.list_tasks(
                    ListTasksRequest(status=TaskState.TASK_STATE_CANCELED)
                )
                assert [t.id for t in listed.tasks] == [run_id]


async def test_a_restart_mid_stream_and_a_resubscribe_lose_no_event(
    db_url: str, workspace: Path
) -> None:
    async with hosted(db_url, workspace, ticking) as h:
        _, run_id = await child(h, "running")
        before: list[StreamResponse] = []
        with face(db_url) as web:
            async with client(web) as a2a:
                with contextlib.suppress(Exception):  # the server goes away mid-stream
                    async for response in a2a.subscribe(SubscribeToTaskRequest(id=run_id)):
                        before.append(response)
                        if len(sequences(before)) >= 20:
                            assert web.stop() == 0  # Ctrl-C: the stream ends, the child runs on
        got = sequences(before)
        assert got == list(range(1, len(got) + 1)) and len(got) >= 20
        with face(db_url) as web:  # a new server: a new port and token, the same database
            async with client(web) as a2a:
                after = [r async for r in a2a.subscribe(SubscribeToTaskRequest(id=run_id))]
        again = sequences(after)
        assert again == list(range(1, len(again) + 1))  # the whole sequence, no gap
        assert set(got) < set(again) and len(again) == 151  # 150 ticks and the result
        assert after[-1].status_update.status.state == TaskState.TASK_STATE_COMPLETED


async def test_v0_3_names_a_raw_v1_call_and_401_without_the_token(
    db_url: str, workspace: Path
) -> None:
    async with hosted(db_url, workspace, approving) as h:
        cid, run_id = await child(h, "waiting")
        with face(db_url) as web:
            endpoint = web.url + "a2a"
            bearer = {"Authorization": f"Bearer {web.token}"}
            async with httpx.AsyncClient(timeout=30) as http:
                old = {"jsonrpc": "2.0", "id": 1, "method": "tasks/get", "params": {"id": run_id}}
                answer = (await http.post(endpoint, json=old, headers=bearer)).json()["result"]
                assert answer["kind"] == "task" and answer["contextId"] == cid
                assert answer["status"]["state"] == "input-required"
                new = {"jsonrpc": "2.0", "id": 2, "method": "GetTask", "params": {"id": run_id}}
                v1 = {**bearer, "A2A-Version": "1.0"}
                answer = (await http.post(endpoint, json=new, headers=v1)).json()["result"]
                assert answer["status"]["state"] == "TASK_STATE_INPUT_REQUIRED"
                refused = await http.post(endpoint, json=new, headers={"A2A-Version": "1.0"})
                assert refused.status_code == 401
                assert refused.headers["www-authenticate"] == "Bearer"
                wrong = {"Authorization": "Bearer nope", "A2A-Version": "1.0"}
                assert (await http.post(endpoint, json=new, headers=wrong)).status_code == 401
                assert (await http.get(web.url + ".well-known/agent-card.json")).status_code == 200
                assert (await http.get(web.url + "api/children")).status_code == 401
            v03 = ClientConfig(streaming=False)
            async with httpx.AsyncClient(headers=bearer, timeout=30) as http:
                v03.httpx_client = http
                card = await A2ACardResolver(http, web.url).get_agent_card()
                del card.supported_interfaces[0]  # the v0.3 interface only
                legacy = ClientFactory(v03).create(card)
                task = await legacy.get_task(GetTaskRequest(id=run_id))
                assert task.status.state == TaskState.TASK_STATE_INPUT_REQUIRED
                await legacy.close()
