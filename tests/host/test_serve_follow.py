"""``child.follow`` seen from the host's side: a real ``Session`` on a real engine in
this process, so that what only the host knows can be asserted (the bytes it holds for
a client that stops reading; the end of input ending a follow; the protocol's
refusals). End-to-end follows through a host subprocess are in test_client_follow.py."""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from delegation import ChildContext, Engine, Event, Params, Result
from delegation.backlog import MAX_BACKLOG, Backlog
from delegation.engine.following import owned_pages
from delegation.engine.notices import Notices
from delegation.host.serve import Session
from delegation.host.serve_io import SocketOutbox
from tests.harness.support import PRESET, ScriptRunner, hold

OWNER = {"runId": "run-1", "toolCallId": "call-1", "extensionId": "ext", "generation": 7}
START = {**OWNER, "request": {"requestId": "q1", "profile": PRESET.name, "message": "go"}}
BIG_EVENTS = 1000  # 32 KiB of text each: twice the 16 MiB bound, and more
PAGE_BOUND = 5 * 1024 * 1024  # a page of 128 such events is about 4.1 MiB


NO_ID = object()  # a notification's


def frame(request_id: Any, method: str, params: Any) -> bytes:
    message = {"jsonrpc": "2.0", "method": method, "params": params}
    if request_id is not NO_ID:
        message["id"] = request_id
    return json.dumps(message).encode() + b"\n"


class Taken:
    """An outbox whose frames are taken as they are sent: nothing waits in its backlog."""

    def __init__(self, frames: asyncio.Queue[dict[str, Any]]) -> None:
        self.backlog = Backlog()
        self._frames = frames

    def send(self, data: bytes) -> None:
        self._frames.put_nowait(json.loads(data))


class Stream:
    """One stream to an in-process Session: request lines in, frames out (in order)."""

    def __init__(self, engine: Engine, **options: Any) -> None:
        self.lines: asyncio.Queue[bytes] = asyncio.Queue()
        self.frames: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.ids = itertools.count(1)
        self.session = Session(engine, Taken(self.frames), **options)
        self.task = asyncio.create_task(self.session.run(lambda _size: self.lines.get()))

    def send(self, method: str, params: Any, request_id: Any = "next") -> Any:
        if request_id == "next":
            request_id = next(self.ids)
        self.lines.put_nowait(frame(request_id, method, params))
        return request_id

    def notify(self, method: str, params: Any) -> None:
        self.lines.put_nowait(frame(NO_ID, method, params))

    async def next(self) -> dict[str, Any]:
        return await asyncio.wait_for(self.frames.get(), 60)

    async def call(self, method: str, params: Any, request_id: Any = "next") -> dict[str, Any]:
        sent = self.send(method, params, request_id)
        answer = await self.next()
        assert answer.get("id") == sent, answer
        return answer

    async def ok(self, method: str, params: Any) -> Any:
        answer = await self.call(method, params)
        assert "result" in answer, answer
        return answer["result"]

    async def setup(self, workspace: Path) -> str:
        """Register, open the tool call, start one child; its conversation id."""
        await self.ok("runner.register", {"runnerId": "r1", "hostInstanceId": "h1"})
        tool = {
            "runId": "run-1", "conversationId": "conv-1", "toolCallId": "call-1",
            "extensionId": "ext", "workspace": str(workspace),
            "presets": [{"name": PRESET.name, "extensionId": "ext", "generation": 7}],
        }  # fmt: skip
        await self.ok("tool.begin", tool)
        return str((await self.ok("child.start", START))["conversationId"])

    async def end(self) -> None:
        self.lines.put_nowait(b"")
        await asyncio.wait_for(self.task, 60)


async def held(
    engine: Engine, runner: ScriptRunner, workspace: Path, **options: Any
) -> tuple[Stream, dict[str, Any], asyncio.Event]:
    """A stream whose child says "working", then waits for the gate returned."""
    gate = asyncio.Event()
    runner.script = hold(gate)
    stream = Stream(engine, **options)
    return stream, {**OWNER, "childId": await stream.setup(workspace)}, gate


async def test_the_end_of_input_ends_its_follows(
    engine: Engine, runner: ScriptRunner, workspace: Path
) -> None:
    stream, child, gate = await held(engine, runner, workspace)
    follow = stream.send("child.follow", child)
    events = await stream.next()
    assert events["method"] == "child.events"
    assert events["params"]["follow"] == follow
    assert [e["text"] for e in events["params"]["events"]] == ["working"]
    await stream.end()  # the peer can send no stop any more: the follow ends at once
    assert await stream.next() == {"jsonrpc": "2.0", "id": follow, "result": {"done": False}}
    gate.set()


async def test_a_closing_host_answers_its_follows_host_closing(
    engine: Engine, runner: ScriptRunner, workspace: Path
) -> None:
    stream, child, gate = await held(engine, runner, workspace)
    follow = stream.send("child.follow", child)
    assert (await stream.next())["params"]["follow"] == follow
    stream.session.stop()  # SIGTERM: a follow is not over, it is cut short (retry it)
    closing = await stream.next()
    assert (closing["id"], closing["error"]["data"]) == (follow, {"reason": "host_closing"})
    await asyncio.wait_for(stream.task, 60)
    gate.set()


async def test_the_protocol_s_refusals(
    engine: Engine, runner: ScriptRunner, workspace: Path
) -> None:
    stream, child, gate = await held(engine, runner, workspace, max_inflight=3)
    # (three slots: two follows at once, and one slot left for other calls)

    # Without an id a follow's events would name nothing: refused (and, a notification,
    # unanswered: the next frame is the read's answer).
    stream.notify("child.follow", child)
    assert "result" in await stream.call("child.read", child)
    null = await stream.call("child.follow", child, request_id=None)
    assert null["error"]["code"] == -32600 and null["id"] is None

    first = stream.send("child.follow", child, request_id="f")
    assert (await stream.next())["params"]["follow"] == "f"
    twice = await stream.call("child.follow", child, request_id="f")
    assert twice["error"]["code"] == -32600, "the id of a follow still running"
    second = stream.send("child.follow", {**child, "after": 1}, request_id=7)
    over = await stream.call("child.follow", child)
    assert over["error"]["data"] == {"reason": "follow_limit"}
    assert over["error"]["message"] == (
        "too many follows on this connection (at most 2; stop one first)"
    )

    assert (await stream.call("child.follow.stop", {"follow": "nobody"}))["result"] == {}
    bad = await stream.call("child.follow.stop", {"follow": 1.5})
    assert bad["error"]["data"] == {"reason": "malformed_input"}
    stream.notify("child.follow.stop", {"follow": first})
    assert await stream.next() == {"jsonrpc": "2.0", "id": "f", "result": {"done": False}}

    gate.set()  # the child ends: the follow still running gives its last event, then ends
    events = await stream.next()
    assert events["params"] == {
        "follow": second,
        "events": [{"sequence": 2, "kind": "result", "text": "finished"}],
    }
    assert await stream.next() == {"jsonrpc": "2.0", "id": second, "result": {"done": True}}
    await stream.end()


async def test_a_stream_with_one_slot_runs_no_follow(engine: Engine, workspace: Path) -> None:
    stream = Stream(engine, max_inflight=1)
    child = {**OWNER, "childId": await stream.setup(workspace)}
    refused = await stream.call("child.follow", child)
    assert refused["error"]["data"] == {"reason": "follow_limit"}
    await stream.end()


async def flood(ctx: ChildContext) -> None:
    await ctx.admit()
    for _ in range(BIG_EVENTS):
        ctx.emit(Event(kind="text", text="x" * 32 * 1024))


class Peer:
    """The client's end of a socket, read only when asked (a raw socket: nothing
    reads ahead for it)."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.buffer = b""

    async def send(self, data: bytes) -> None:
        await asyncio.get_running_loop().sock_sendall(self.sock, data)

    async def next(self) -> dict[str, Any]:
        while b"\n" not in self.buffer:
            chunk = await asyncio.wait_for(
                asyncio.get_running_loop().sock_recv(self.sock, 1 << 20), 60
            )
            assert chunk, "the host closed the stream"
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return dict(json.loads(line))


async def test_a_follow_whose_client_stops_reading_waits_within_the_bound(
    engine: Engine, runner: ScriptRunner, workspace: Path
) -> None:
    """The child commits 32 MiB of events while the client reads nothing: the host
    holds its answers up to the 16 MiB bound and one page, and the follow waits; once
    the client reads again, every event arrives once, in order."""
    runner.script = flood
    host_end, peer_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    reader, writer = await asyncio.open_unix_connection(sock=host_end)
    outbox = SocketOutbox(writer, Backlog())
    held: list[int] = []  # what the host holds for the peer, as each frame is written
    sent: list[int] = []  # the size of each frame

    class Measured:
        backlog = outbox.backlog

        def send(self, data: bytes) -> None:
            held.append(writer.transport.get_write_buffer_size() + len(data))
            sent.append(len(data))
            outbox.send(data)

    session = Session(engine, Measured())
    serving = asyncio.create_task(session.run(reader.read))
    peer = Peer(peer_end)
    try:
        await peer.send(frame(1, "runner.register", {"runnerId": "r1", "hostInstanceId": "h1"}))
        tool = {
            "runId": "run-1", "conversationId": "conv-1", "toolCallId": "call-1",
            "extensionId": "ext", "workspace": str(workspace),
            "presets": [{"name": PRESET.name, "extensionId": "ext", "generation": 7}],
        }  # fmt: skip
        await peer.send(frame(2, "tool.begin", tool) + frame(3, "child.start", START))
        answers = [await peer.next() for _ in range(3)]
        child_id = answers[2]["result"]["conversationId"]
        await peer.send(frame("f", "child.follow", {**OWNER, "childId": child_id}))

        # The peer reads nothing now; wait for the child's end and a full backlog: the
        # follow cannot reserve room for its next page.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while not (
            (record := await engine.get_child(child_id)) is not None
            and record.terminal
            and outbox.backlog.used + engine.config.max_page_bytes > MAX_BACKLOG
        ):
            assert loop.time() < deadline, "the child did not end or the outbox never filled"
            await asyncio.sleep(0.01)
        assert max(held) <= MAX_BACKLOG + PAGE_BOUND
        assert sum(sent) < BIG_EVENTS * 32 * 1024, "the follow waits: most events unsent"

        sequences: list[int] = []
        while "id" not in (message := await peer.next()):
            assert message["params"]["follow"] == "f"
            sequences += [event["sequence"] for event in message["params"]["events"]]
        assert message == {"jsonrpc": "2.0", "id": "f", "result": {"done": True}}
        assert sequences == list(range(1, BIG_EVENTS + 1)), "each event once, in order"
        assert max(held) <= MAX_BACKLOG + PAGE_BOUND
    finally:
        peer_end.close()
        await asyncio.wait_for(serving, 60)
        writer.close()


async def test_a_page_cut_before_its_count_is_not_taken_for_the_last() -> None:
    """A read may cut a page before ``events_per_read`` (by bytes, where reads are bounded
    so) and a Result does not say so: a follow of a terminal child whose reads give two
    events at a time still gives all of them."""
    committed = [Event(kind="text", text=str(n), sequence=n) for n in range(1, 8)]
    identity = {
        "conversation_id": "c1", "run_id": "r1", "parent_conversation_id": "p",
        "parent_run_id": "pr", "extension_id": "ext", "profile": "worker",
    }  # fmt: skip

    async def read(params: Params) -> Result:
        page = [event for event in committed if event.sequence > params.after][:2]
        return Result(**identity, done=True, events=page)

    async def locate(conversation_id: str, run_id: str) -> Any:
        return SimpleNamespace(id=1)  # the id its commits are announced by

    params = Params(run_id="pr", extension_id="ext", generation=7, child_id="c1")
    pages = owned_pages(read, locate, Notices(), params, limit=128)
    got = [event.sequence async for page in pages for event in page.events]
    assert got == list(range(1, 8))
