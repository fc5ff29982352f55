"""The A2A face (design §29), driven by the official SDK's own client (``a2a.client``:
nothing of ours on the client side) against the real ``delegation web --a2a`` process on
loopback, beside a real host in this process. On SQLite and PostgreSQL (``db_url``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from a2a.client import A2ACardResolver, Client, ClientConfig, ClientFactory
from a2a.server.context import ServerCallContext
from a2a.types.a2a_pb2 import (
    AgentCard,
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
    InvalidParamsError,
    PushNotificationNotSupportedError,
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)
from a2a.utils.proto_utils import to_stream_response
from google.protobuf.json_format import MessageToDict

from delegation import ChildContext, Event, Operator, errors
from delegation.records import ChildSummary
from delegation.usecases.inspector import PAGE, Inspector
from delegation.web import a2a as face_module
from delegation.web import a2a_routes
from delegation.web.app import Routes, address, allowed_hosts, bind
from delegation.web.stream import StreamCount
from delegation.web.token import Token
from tests.harness import browser
from tests.harness.waits import hosted, state_is, until
from tests.harness.web_serving import serving

LEASE = "lease-1"


async def approving(ctx: ChildContext) -> None:
    """A child that plans (more than a page of lines when asked "chatty"), asks for an
    approval, and reports what it did."""
    await ctx.admit()
    for _ in range(PAGE + 72 if ctx.request.message == "chatty" else 1):
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


@dataclass
class Site:
    """The page and its face served by uvicorn on the test's loop."""

    url: str
    token: Token
    page: Routes
    face: a2a_routes.Served

    @property
    def bearer(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token.value}"}


@contextlib.asynccontextmanager
async def served(db_url: str) -> AsyncIterator[Site]:
    """``delegation web --a2a`` of ``db_url`` in this process (on this loop), as
    :func:`delegation.web.app.serve` builds it."""
    with Inspector(db_url) as inspector:
        page = Routes(inspector)
        listener = bind("127.0.0.1", 0)
        token = Token.new(listener.getsockname()[1])
        face = a2a_routes.Served(inspector, page.commits, address(listener), page.streams)
        app = page.app(
            allowed_hosts("127.0.0.1"), token, face.routes, face.public, face.bearer_only
        )
        try:
            async with serving(page, app, listener):
                yield Site(address(listener), token, page, face)
        finally:
            face.close()


def rpc(method: str, params: dict[str, Any], n: int = 1) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": n, "method": method, "params": params}


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
                with Inspector(db_url) as inspector:
                    stored = [e.sequence for e in inspector.all_events(cid, run_id)]
                assert numbers == stored and len(numbers) >= 3  # each event once, none lost

                done = await a2a.get_task(GetTaskRequest(id=run_id))
                assert done.status.state == TaskState.TASK_STATE_COMPLETED
                assert done.artifacts[0].parts[0].text == "deploy: approve"
                async with client(web, streaming=False) as plain:  # once more, now it ended
                    (late,) = [r async for r in plain.send_message(answer)]
                assert late.task.status.state == TaskState.TASK_STATE_COMPLETED  # not refused
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
                stopped: list[int] = []
                with contextlib.suppress(Exception):  # the server goes away mid-stream
                    async for response in a2a.subscribe(SubscribeToTaskRequest(id=run_id)):
                        before.append(response)
                        if len(sequences(before)) >= 20 and not stopped:
                            stopped.append(web.stop())  # Ctrl-C: the stream ends, the child runs on
                assert stopped == [130]  # as a Ctrl-C'd command (not swallowed with the stream)
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
                stream = {**new, "method": "SubscribeToTask"}
                refused = await http.post(endpoint, json=stream, headers={"A2A-Version": "1.0"})
                assert refused.status_code == 401  # a stream too, before anything is read
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


async def test_the_endpoint_takes_the_bearer_alone_json_alone_and_no_foreign_origin(
    db_url: str, workspace: Path
) -> None:
    """A page of another port of 127.0.0.1 (the same site: its POSTs carry the cookie)
    cannot cancel: the endpoint takes no cookie (the bearer, or a script's query token),
    no text/plain body (a
    form's, or a fetch's without a preflight) and no foreign Origin."""
    async with hosted(db_url, workspace, ticking) as h:
        cid, run_id = await child(h, "running", message="forever")
        async with served(db_url) as site:
            endpoint = site.url + "a2a"
            cancel = json.dumps(rpc("tasks/cancel", {"id": run_id}))
            cookie = {"Cookie": f"{site.token.cookie}={site.token.value}"}
            as_json = {"Content-Type": "application/json"}
            async with httpx.AsyncClient(timeout=30) as http:
                page = await http.get(site.url + "api/children", headers=cookie)
                assert page.status_code == 200  # the page keeps its cookie
                page = await http.get(site.url + f"api/children?token={site.token.value}")
                assert page.status_code == 200  # and its query token
                refusals = [
                    (endpoint, {**cookie, **as_json}, 401),
                    (endpoint, {**site.bearer, "Content-Type": "text/plain"}, 415),
                    (endpoint, site.bearer, 415),  # no Content-Type
                    (endpoint, {**site.bearer, **as_json, "Origin": "http://127.0.0.1:1"}, 403),
                    (endpoint, {**site.bearer, **as_json, "Origin": "null"}, 403),
                ]
                for url, headers, status in refusals:
                    answer = await http.post(url, content=cancel, headers=headers)
                    assert answer.status_code == status, (headers, answer.text)
                own = {**site.bearer, **as_json, "Origin": site.url.rstrip("/")}
                get = json.dumps(rpc("tasks/get", {"id": run_id}))
                answer = await http.post(endpoint, content=get, headers=own)
                assert answer.json()["result"]["id"] == run_id  # its own page's origin
                # A script may show the token in the query instead (it sets no cookie).
                answer = await http.post(
                    f"{endpoint}?token={site.token.value}", content=get, headers=as_json
                )
                assert answer.json()["result"]["id"] == run_id
                assert "set-cookie" not in answer.headers
            with Operator(db_url) as op:
                assert op.controls(cid) == []
            record = await h.engine.get_child(cid)
            assert record is not None and record.state == "running"


async def test_a_body_over_the_cap_is_refused_before_the_sdk_reads_it(
    db_url: str, workspace: Path
) -> None:
    big = json.dumps(rpc("tasks/get", {"id": "r-" + "x" * a2a_routes.MAX_BODY}))
    async with served(db_url) as site:
        headers = {**site.bearer, "Content-Type": "application/json"}
        async with httpx.AsyncClient(timeout=30) as http:
            answer = await http.post(site.url + "a2a", content=big, headers=headers)
            assert answer.status_code == 413
            assert answer.json()["error"]["code"] == -32600  # InvalidRequest
            small = json.dumps(rpc("tasks/get", {"id": "r-nobody"}))
            answer = await http.post(site.url + "a2a", content=small, headers=headers)
            assert answer.json()["error"]["code"] == -32001  # read, and answered


async def test_the_guard_reads_no_more_than_its_cap_with_or_without_a_length() -> None:
    reached: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    guard = a2a_routes.Guard(app, StreamCount(), max_body=1000)

    async def call(length: int | None, chunks: int) -> tuple[int, int]:
        """The status answered to a body of ``chunks`` chunks of 100 bytes, and how many
        chunks the guard took."""
        taken, sent = 0, []

        async def receive() -> dict[str, Any]:
            nonlocal taken
            taken += 1
            return {"type": "http.request", "body": b"x" * 100, "more_body": taken < chunks}

        async def send(message: Any) -> None:
            sent.append(message)

        headers = [(b"content-type", b"application/json"), (b"host", b"127.0.0.1")]
        if length is not None:
            headers.append((b"content-length", str(length).encode()))
        scope = {"type": "http", "method": "POST", "path": "/a2a", "headers": headers}
        scope |= {"scheme": "http", "query_string": b"", "server": ("127.0.0.1", 1)}
        await guard(scope, receive, send)
        return sent[0]["status"], taken

    assert await call(5000, 50) == (413, 0)  # its length says: nothing read
    assert await call(None, 50) == (413, 11)  # streamed: the cap and one chunk
    assert not reached
    assert await call(None, 10) == (200, 10)  # at the cap: handed on whole
    assert reached == [b"x" * 1000]


async def test_streams_count_with_the_pages_and_controls_have_threads_of_their_own(
    db_url: str, workspace: Path
) -> None:
    async with hosted(db_url, workspace, ticking) as h:
        cid, run_id = await child(h, "running", message="forever")
        async with served(db_url) as site:
            site.page.streams.limit = 1
            headers = {**site.bearer, "Content-Type": "application/json"}
            subscribe = rpc("SubscribeToTask", {"id": run_id})
            v1 = {**headers, "A2A-Version": "1.0", "Accept": "text/event-stream"}
            async with httpx.AsyncClient(timeout=30) as http:
                first = http.stream("POST", site.url + "a2a", json=subscribe, headers=v1)
                async with first as open_stream:
                    assert open_stream.status_code == 200
                    assert site.page.streams.open == 1
                    again = await http.post(site.url + "a2a", json=subscribe, headers=v1)
                    assert "too many open streams" in again.text
                    events = await http.get(
                        site.url + f"api/children/{cid}/events?token={site.token.value}"
                    )
                    assert events.status_code == 503  # the page's streams are the same ones
                await until(lambda: _true(site.page.streams.open == 0))
            thread = await site.face.face._control(threading.current_thread)
            assert thread.name.startswith("a2a-control")
            assert site.face.face._controls._max_workers == face_module.CONTROL_THREADS


class Flaky:
    """An inspector whose second and third reads of a page fail as a busy, then an away,
    database's do."""

    def __init__(self, inspector: Inspector) -> None:
        self.inspector, self.reads = inspector, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inspector, name)

    def page(self, *args: Any) -> Any:
        self.reads += 1
        if self.reads == 2:
            raise errors.DatabaseBusy("busy")
        if self.reads == 3:
            raise errors.StoreUnavailable("away")
        return self.inspector.page(*args)


class Ticks:
    """A wake that says to read again every 50 ms."""

    def version(self) -> int:
        return 0

    async def moved(self, since: int) -> bool:
        await asyncio.sleep(0.05)
        return True


@contextlib.contextmanager
def direct(db_url: str, wrap: Any = None) -> Iterator[face_module.Face]:
    """A face over ``db_url`` called directly, its inspector wrapped in ``wrap``."""
    with Inspector(db_url) as inspector, Operator(db_url) as operator:
        reads = cast(Inspector, wrap(inspector) if wrap else inspector)
        made = face_module.Face(reads, operator, Ticks(), AgentCard())
        try:
            yield made
        finally:
            made.close()


async def test_a_busy_or_away_database_delays_a_subscription_and_ends_none(
    db_url: str, workspace: Path
) -> None:
    async with hosted(db_url, workspace, ticking) as h:
        _, run_id = await child(h, "running")
        with direct(db_url, Flaky) as face:
            request = SubscribeToTaskRequest(id=run_id)
            streamed = face.on_subscribe_to_task(request, ServerCallContext())
            seen = [to_stream_response(e) async for e in streamed]
            assert cast(Flaky, face.inspector).reads > 3
    numbers = sequences(seen)
    assert numbers == list(range(1, 152))  # 150 ticks and the result, none lost
    assert seen[-1].status_update.status.state == TaskState.TASK_STATE_COMPLETED


async def test_a_subscription_catches_up_working_then_says_the_state_now(
    db_url: str, workspace: Path
) -> None:
    async with hosted(db_url, workspace, approving) as h:
        _, run_id = await child(h, "waiting", message="chatty")
        with direct(db_url) as face:
            streamed = face.on_subscribe_to_task(
                SubscribeToTaskRequest(id=run_id), ServerCallContext()
            )
            seen: list[StreamResponse] = []
            async with asyncio.timeout(20):
                async for item in streamed:
                    seen.append(to_stream_response(item))
                    update = seen[-1].status_update.status
                    if update.state == TaskState.TASK_STATE_INPUT_REQUIRED:
                        break
            await streamed.aclose()
    first, *updates, now = seen
    assert first.task.status.state == TaskState.TASK_STATE_INPUT_REQUIRED
    assert len(first.task.history) == PAGE
    states = {u.status_update.status.state for u in updates}
    assert states == {TaskState.TASK_STATE_WORKING}  # past events: not the state now
    assert now.status_update.status.state == TaskState.TASK_STATE_INPUT_REQUIRED  # then it
    assert "inputRequests" in MessageToDict(now.status_update.status.message)["metadata"]


async def test_a_message_id_is_needed_and_names_one_task(db_url: str, workspace: Path) -> None:
    async with hosted(db_url, workspace, ticking) as h:
        cid, run_id = await child(h, "running", message="forever")
        with direct(db_url) as face:
            context = ServerCallContext()
            with pytest.raises(InvalidParamsError, match="message_id"):
                await face.on_message_send(said("", "go on", run_id), context)
            given = await face.on_message_send(said("m-1", "go on", run_id), context)
            assert given.status.state == TaskState.TASK_STATE_WORKING  # a steer of it
            first = face.inspector.control_by_request(cid, ["steer"], "m-1")
            assert first is not None and first.run_id == run_id
            other = dataclasses.replace(first, run_id="r-another-execution")
            face.inspector = cast(Inspector, Found(face.inspector, other))
            with pytest.raises(InvalidParamsError, match="already used") as refused:
                await face.on_message_send(said("m-1", "go on", run_id), context)
            assert refused.value.data == {"reason": "steer_request_id_reused"}
            with pytest.raises(InvalidParamsError, match="page_token"):  # -32602, not -32603
                await face.on_list_tasks(ListTasksRequest(page_token="²"), context)
            with pytest.raises(InvalidParamsError, match="page_token"):
                await face.on_list_tasks(ListTasksRequest(page_token="9" * 20), context)
        with Operator(db_url) as op:
            steers = [c.request_id for c in op.controls(cid) if c.action == "steer"]
        assert steers == ["m-1"]


class Found:
    """An inspector that finds ``control`` for every request id."""

    def __init__(self, inspector: Inspector, control: Any) -> None:
        self.inspector, self.control = inspector, control

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inspector, name)

    def control_by_request(self, *args: Any) -> Any:
        return self.control


async def bulky(ctx: ChildContext) -> None:
    """A child whose 20 events of 30,000 characters pass a page's 256 KiB."""
    await ctx.admit()
    for n in range(20):
        ctx.emit(Event(kind="text", text=f"{n:02} " + "x" * 30_000))
    ctx.emit(Event(kind="result", text="said"))


async def test_a_task_with_large_events_gives_its_newest(db_url: str, workspace: Path) -> None:
    async with hosted(db_url, workspace, bulky) as h:
        _, run_id = await child(h, "done")
        with direct(db_url) as face:
            task = await face.on_get_task(GetTaskRequest(id=run_id), ServerCallContext())
    numbers = [int(m.metadata["sequence"]) for m in task.history]
    assert numbers[-1] == 21 == task.metadata["sequence"]  # the result, the newest
    assert 1 < len(numbers) < 21 and numbers == list(range(22 - len(numbers), 22))
    assert sum(len(m.parts[0].text) for m in task.history) <= 256 * 1024


class Counted:
    """An inspector that counts its listings and refuses to read a child again."""

    def __init__(self, inspector: Inspector) -> None:
        self.inspector, self.listings = inspector, 0

    def __getattr__(self, name: str) -> Any:
        if name in ("tail", "summary", "by_run", "page"):
            raise AssertionError(f"a listed child read again ({name})")
        return getattr(self.inspector, name)

    def listing(self, *args: Any) -> Any:
        self.listings += 1
        return self.inspector.listing(*args)


async def test_list_tasks_scans_in_batches_and_builds_tasks_from_the_rows(
    db_url: str, workspace: Path
) -> None:
    async with hosted(db_url, workspace, approving) as h:
        for n in range(3):
            await child(h, "waiting", request_id=f"q{n}")
        with direct(db_url, Counted) as face:
            context = ServerCallContext()
            by_state = ListTasksRequest(page_size=1, status=TaskState.TASK_STATE_COMPLETED)
            assert list((await face.on_list_tasks(by_state, context)).tasks) == []
            counted = cast(Counted, face.inspector)
            assert counted.listings == 1  # one batch, not a read a row
            asking = ListTasksRequest(
                page_size=2, status=TaskState.TASK_STATE_INPUT_REQUIRED, history_length=1
            )
            page = await face.on_list_tasks(asking, context)
            assert len(page.tasks) == 2 and page.next_page_token
            assert all(len(t.history) == 1 for t in page.tasks)  # the newest event each
            asking.page_token = page.next_page_token
            rest = await face.on_list_tasks(asking, context)
            assert len(rest.tasks) == 1 and counted.listings == 3


SUMMARY = ChildSummary(
    *(1, "c-1", "r-1", "running", "ops", None, "c-0", "r-0", "ext", "runner", 1.0, None),
    *(None, 0, None, 2.0, 0, "", ""),
)


@pytest.mark.parametrize(
    ("changes", "state"),
    [
        ({"state": "prepared", "admitted_at": None}, TaskState.TASK_STATE_SUBMITTED),
        ({"state": "queued", "admitted_at": None}, TaskState.TASK_STATE_SUBMITTED),
        ({"state": "admitted"}, TaskState.TASK_STATE_WORKING),
        ({"state": "running"}, TaskState.TASK_STATE_WORKING),
        ({"state": "waiting", "inputs_open": 1}, TaskState.TASK_STATE_INPUT_REQUIRED),
        ({"state": "waiting"}, TaskState.TASK_STATE_WORKING),  # on a sleep or an event
        ({"state": "done", "output": "ok"}, TaskState.TASK_STATE_COMPLETED),
        ({"state": "done", "error": "it broke"}, TaskState.TASK_STATE_FAILED),
        ({"state": "done", "admitted_at": None, "error": "no"}, TaskState.TASK_STATE_REJECTED),
        ({"state": "cancelled", "cancel_reason": "asked"}, TaskState.TASK_STATE_CANCELED),
    ],
)
def test_each_state_of_the_table(changes: dict[str, Any], state: TaskState) -> None:
    summary = dataclasses.replace(SUMMARY, **changes)
    assert face_module.task_state(summary) == state
    status = face_module.status_of(summary, {})
    assert status.state == state != TaskState.TASK_STATE_AUTH_REQUIRED
    why = changes.get("error") or changes.get("cancel_reason")
    assert [p.text for p in status.message.parts] == ([why] if why else [])
