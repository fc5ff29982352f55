"""``delegation.client.api`` against a real ``delegation serve``: over a Unix socket
(``Client.connect``) and over the stdio of a host it spawns (``Client.spawn``), on
either store (the host's ``--db`` is the test's database URL)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from delegation import Params, Request, errors
from delegation.client.api import Client, SyncClient
from delegation.rpc import error_from_wire
from tests.harness import client_hosts
from tests.harness.client_hosts import (
    ENV,
    LEASE,
    OWNER,
    PRESET,
    ROOT,
    Opener,
    SocketHost,
    read_until_done,
    settled_threads,
    setup,
    start_params,
)
from tests.harness.serve_runners import OUTPUT_CHARS

opener = client_hosts.opener  # the fixture
socket_host = client_hosts.socket_host  # the fixture

SLOW = "tests.harness.serve_runners:SlowAdmit"
LARGE = "tests.harness.serve_runners:LargeAnswers"


@pytest.fixture
async def client(opener: Opener) -> AsyncIterator[Client]:
    async with await opener("--runner", "scripted") as client:
        yield client


async def test_a_whole_session(client: Client, workspace: Path) -> None:
    await setup(client, workspace)
    started = await client.start(start_params("q1", "work in 3 steps"))
    assert (started.parent_run_id, started.done) == ("run-1", False)
    child = {**OWNER, "childId": started.conversation_id}
    steered = await client.steer({**child, "requestId": "s1", "message": "look left"})
    assert steered.outcome == "injected"
    result, events = await read_until_done(client, child)
    assert result.output.startswith("finished 3 steps")
    assert [e.sequence for e in events] == list(range(1, len(events) + 1))
    assert any(e.text == "steered: look left" for e in events)

    # The same params as typed Params and as JSON text.
    long = Request(request_id="q2", profile="scripted", message="work in 500 steps")
    other = await client.start(Params(run_id="run-1", tool_call_id="call-1",
                                      extension_id="ext", generation=3, request=long))  # fmt: skip
    cancelled = await client.cancel(
        '{"runId": "run-1", "toolCallId": "call-1", "extensionId": "ext", "generation": 3,\n'
        f' "childId": "{other.conversation_id}"}}'
    )
    assert cancelled.conversation_id == other.conversation_id
    cancelled, _ = await read_until_done(client, {**OWNER, "childId": other.conversation_id})
    assert cancelled.cancelled

    leased = await client.start(start_params("q3", "work in 500 steps", leaseId="L1"))
    await client.end_tool("run-1", "call-1")
    through_lease = {**LEASE, "childId": leased.conversation_id}
    assert not (await client.read(through_lease)).done, "a leased child outlives its tool"
    assert (await client.release(LEASE)).done
    with pytest.raises(errors.NotOwned):
        await client.read(through_lease)
    await client.finish_run("run-1", succeeded=True)


async def test_refusals_raise_the_subclass_named_by_their_reason(
    client: Client, workspace: Path
) -> None:
    with pytest.raises(errors.RunnerNotFound, match=r"runner\.register must come first"):
        await client.read({**OWNER, "childId": "c1"})
    await setup(client, workspace)
    with pytest.raises(errors.MalformedInput, match="unknown field `apiKey`"):
        await client.start({**OWNER, "apiKey": "sk-123"})
    with pytest.raises(errors.ChildNotOwned) as refused:
        await client.read({**OWNER, "childId": "nope"})
    assert str(refused.value) == "child run is not owned by this capability", "the host's words"
    with pytest.raises(errors.NotOwned):
        await client.end_tool("run-1", "call-never-opened")
    with pytest.raises(errors.ToolAlreadyOpen):
        await client.begin_tool(
            run_id="run-1", conversation_id="conv-1", tool_call_id="call-1", extension_id="ext",
            presets=[PRESET], workspace=str(workspace),
        )  # fmt: skip
    with pytest.raises(errors.NotOwned):
        await client.start({**start_params("q1", "hi"), "generation": 4})
    with pytest.raises(errors.PresetStale):
        await client.start({**start_params("q1", "hi"), "request": {
            "requestId": "q1", "profile": "no-such-preset", "message": "hi"}})  # fmt: skip
    with pytest.raises(errors.MalformedInput):
        await client.read(b"[1, 2]")  # refused before it is sent
    with pytest.raises(errors.MethodNotFound):
        await client.call("no.such.method", {})
    with pytest.raises(errors.InvalidRpcRequest, match="4 MiB"):
        await client.read({**OWNER, "childId": "x" * (4 * 1024 * 1024)})  # refused before sent
    assert (await client.register("r1", "h1")).generation >= 1, "the stream goes on"


def test_an_unknown_reason_falls_back_to_the_class_of_its_code() -> None:
    assert type(error_from_wire(-32603, "gone", "some_new_store_reason")) is errors.StoreError
    assert type(error_from_wire(-32602, "no", "some_new_reason")) is errors.DelegationError
    assert type(error_from_wire(-32601, "what")) is errors.MethodNotFound
    admission = error_from_wire(-32602, "child admission failed: boom", "admission_failed")
    assert isinstance(admission, errors.AdmissionFailed)
    assert str(admission) == "child admission failed: boom", "no class prefixes it again"


async def test_twenty_calls_in_flight_are_matched_by_id(opener: Opener, workspace: Path) -> None:
    async with await opener("--runner", SLOW) as client:
        await setup(client, workspace)
        children = [
            (await client.start(start_params(f"q{n}", "admit after 0"))).conversation_id
            for n in range(3)
        ]
        done: list[str] = []

        async def call(name: str, answer: Awaitable[Any]) -> Any:
            result = await answer
            done.append(name)
            return result

        slow = call("slow", client.start(start_params("slow", "admit after 1.5")))
        reads = [
            call(f"read{n}", client.read({**OWNER, "childId": children[n % 3]})) for n in range(19)
        ]
        results = await asyncio.wait_for(asyncio.gather(slow, *reads), 20)
        assert done[-1] == "slow", "the slow start was answered after the fast reads"
        assert [r.conversation_id for r in results[1:]] == [children[n % 3] for n in range(19)]
        assert results[0].conversation_id not in children
        slow_child, _ = await read_until_done(
            client, {**OWNER, "childId": results[0].conversation_id}
        )
        assert slow_child.output == "admitted after 1.5"


async def wait_done(client: Client, child: dict[str, Any]) -> None:
    """Until the child is done, reading no events (small answers)."""
    while not (await client.read({**child, "after": 10**9})).done:
        await asyncio.sleep(0.05)


async def test_the_largest_answers_leave_the_connection_working(
    opener: Opener, workspace: Path
) -> None:
    """A page of capped control-character events (98 MiB once escaped before pages were
    bounded by bytes) and an answer past 32 MiB (a child's whole output) are read, and
    the next call on the same client is answered."""
    async with await opener("--runner", LARGE) as client:
        await setup(client, workspace)
        worst = {
            **OWNER,
            "childId": (await client.start(start_params("q1", "events"))).conversation_id,
        }
        await wait_done(client, worst)
        page = await client.read(worst)
        assert 0 < len(page.events) < 128
        assert len(msgspec.json.encode(page)) <= 4 * 1024 * 1024
        big = {
            **OWNER,
            "childId": (await client.start(start_params("q2", "output"))).conversation_id,
        }
        await wait_done(client, big)
        answer = await client.read({**big, "after": 1})
        assert answer.output == "\x01" * OUTPUT_CHARS
        assert len(msgspec.json.encode(answer)) > 32 * 1024 * 1024
        after = page.events[-1].sequence
        following = await client.read({**worst, "after": after})
        assert following.events[0].sequence == after + 1


def test_the_sync_client_does_a_whole_session(db_url: str, workspace: Path) -> None:
    before = set(threading.enumerate())
    with SyncClient.spawn(["--db", db_url, "--runner", "scripted"], env=ENV) as client:
        assert client.register("r1", "h1").generation >= 1
        client.begin_tool(
            run_id="run-1", conversation_id="conv-1", tool_call_id="call-1", extension_id="ext",
            presets=[PRESET], workspace=str(workspace),
        )  # fmt: skip
        started = client.start(start_params("q1", "work in 3 steps"))
        child = {**OWNER, "childId": started.conversation_id}
        assert client.steer({**child, "requestId": "s1", "message": "go"}).outcome == "injected"
        while not (result := client.read(child)).done:
            time.sleep(0.02)
        assert result.output.startswith("finished 3 steps")
        other = {**OWNER, "childId": client.start(start_params("q2", "500 steps")).conversation_id}
        client.cancel(other)
        while not (result := client.read(other)).done:
            time.sleep(0.02)
        assert result.cancelled
        client.start(start_params("q3", "work in 500 steps", leaseId="L1"))
        client.end_tool("run-1", "call-1")
        assert client.release(LEASE).done
        with pytest.raises(errors.NotOwned):
            client.end_tool("run-1", "call-1")
        client.finish_run("run-1")
        process = client.process
    assert process is not None
    assert process.returncode == 0, "end of input closed the host gracefully"
    assert settled_threads(before) == set(), "no loop thread left behind"


def test_the_sync_client_over_a_socket(socket_host: SocketHost) -> None:
    before = set(threading.enumerate())
    with SyncClient.connect(socket_host.start("--runner", "scripted")) as client:
        with pytest.raises(errors.RunnerNotFound):
            client.read(OWNER)
        assert client.register("r1", "h1").generation >= 1
        assert client.process is None
    assert settled_threads(before) == set()


async def test_closing_leaves_no_process_behind(db_url: str) -> None:
    before = set(threading.enumerate())
    client = await Client.spawn(["--db", db_url, "--runner", "scripted"], env=ENV)
    async with client:
        await client.register("r1", "h1")
    assert client.process is not None
    assert client.process.returncode == 0
    with pytest.raises(errors.HostClosing):
        await client.register("r1", "h1")
    assert settled_threads(before) == set()


def test_a_sync_client_that_cannot_connect_leaves_no_thread(tmp_path: Path) -> None:
    before = set(threading.enumerate())
    with pytest.raises(FileNotFoundError):
        SyncClient.connect(tmp_path / "no-host.sock")
    assert settled_threads(before) == set()


@pytest.mark.parametrize("transport", ["socket", "stdio"])
async def test_pending_calls_fail_when_the_host_dies(
    transport: str, db_url: str, socket_host: SocketHost, workspace: Path
) -> None:
    if transport == "socket":
        client = await Client.connect(socket_host.start("--runner", SLOW))
    else:
        client = await Client.spawn(["--db", db_url, "--runner", SLOW], env=ENV, cwd=ROOT)
    async with client:
        await setup(client, workspace)
        waiting = asyncio.create_task(client.start(start_params("q1", "admit after 60")))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        host = client.process or socket_host.procs[-1]
        os.kill(host.pid, signal.SIGKILL)
        with pytest.raises(errors.HostClosing):
            await asyncio.wait_for(waiting, 10)
        with pytest.raises(errors.HostClosing):
            await client.read({**OWNER, "childId": "c1"})


# --- an abandoned call -------------------------------------------------------------------


async def test_an_answer_to_an_abandoned_call_is_not_why_the_connection_ended(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "s.sock")
    got: asyncio.Queue[bytes] = asyncio.Queue()
    peer: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer.append(writer)
        while line := await reader.readline():
            await got.put(line)

    server = await asyncio.start_unix_server(serve, path)
    client = await Client.connect(path)
    try:
        first = asyncio.create_task(client.call("child.read", {}))
        await got.get()
        first.cancel()  # the caller gave up (a timeout)
        failure = {"code": -32602, "message": "child not found",
                   "data": {"reason": "child_not_found"}}  # fmt: skip
        peer[0].write(json.dumps({"jsonrpc": "2.0", "id": 1, "error": failure}).encode() + b"\n")
        await peer[0].drain()
        second = asyncio.create_task(client.call("child.read", {}))
        await got.get()
        peer[0].close()  # the host goes away
        with pytest.raises(errors.DelegationError) as raised:
            await asyncio.wait_for(second, 5)
        assert type(raised.value) is errors.HostClosing, repr(raised.value)
    finally:
        await client.close()
        server.close()
