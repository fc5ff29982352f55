"""``delegation serve`` end to end: a real host subprocess over stdio and a Unix socket,
on either store (``--db`` is the test's database URL: a SQLite file or PostgreSQL)."""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness.serving import OWNER, PRESET, Client, host, socket_client, start_params
from tests.harness.support import until_exists


@pytest.fixture
async def stdio(db_url: str) -> AsyncIterator[tuple[Client, asyncio.subprocess.Process]]:
    proc = await host("--stdio", "--db", db_url)
    assert proc.stdin is not None
    assert proc.stdout is not None
    client = Client(proc.stdout, proc.stdin)
    yield client, proc
    if proc.returncode is None:
        proc.stdin.close()
        await asyncio.wait_for(proc.wait(), 20)
    await client.close()


async def test_a_whole_session_over_stdio(
    stdio: tuple[Client, asyncio.subprocess.Process], workspace: Path
) -> None:
    client, proc = stdio
    await client.setup(workspace)
    started = await client.ok("child.start", start_params("q1"))
    assert started["parentRunId"] == "run-1"
    assert started["done"] is False
    child = {**OWNER, "childId": started["conversationId"]}
    steer = {**child, "requestId": "s1", "message": "look left"}
    assert await client.ok("child.steer", steer) == {"outcome": "injected"}
    result, events = await client.read_until_done(child)
    assert result["output"].startswith("finished 3 steps")
    assert [e["sequence"] for e in events] == list(range(1, len(events) + 1))
    assert any(e.get("text") == "steered: look left" for e in events)

    leased = await client.ok("child.start", start_params("q2", "work in 40 steps", leaseId="L1"))
    assert await client.ok("tool.end", {"runId": "run-1", "toolCallId": "call-1"}) == {}
    through_lease = {"runId": "run-1", "extensionId": "ext", "generation": 3, "leaseId": "L1"}
    still = await client.ok("child.read", {**through_lease, "childId": leased["conversationId"]})
    assert still["done"] is False, "a leased child outlives its tool call"
    released = await client.ok("child.lease.release", through_lease)
    assert released["done"] is True
    after = await client.call("child.read", {**through_lease, "childId": leased["conversationId"]})
    assert after["error"]["data"] == {"reason": "not_owned"}, "a released lease grants nothing"
    assert await client.ok("run.finish", {"runId": "run-1", "succeeded": True}) == {}
    assert proc.stdin is not None
    proc.stdin.close()
    assert await asyncio.wait_for(proc.wait(), 20) == 0, "end of input closes gracefully"


async def test_bad_frames_get_their_codes_and_the_stream_goes_on(
    stdio: tuple[Client, asyncio.subprocess.Process], workspace: Path
) -> None:
    client, _ = stdio
    cases: list[tuple[bytes, int]] = [
        (b"not json\n", -32700),
        (b'{"jsonrpc": "2.0", "id": 1, "method": \n', -32700),
        (b"[1, 2]\n", -32600),
        (b'"text"\n', -32600),
        (b'{"jsonrpc": "1.0", "id": 7, "method": "child.read"}\n', -32600),
        (b'{"jsonrpc": "2.0", "id": 8}\n', -32600),
        (b'{"jsonrpc": "2.0", "id": 9, "method": "child.read", "extra": 1}\n', -32600),
        (b'{"jsonrpc": "2.0", "id": 10, "method": "no.such.method"}\n', -32601),
        (b"\xff\xfe\n", -32700),
    ]
    for frame, code in cases:
        await client.send_raw(frame)
        answer = await client.receive()
        assert answer["error"]["code"] == code, (frame, answer)
        assert "Traceback" not in answer["error"]["message"]
    await client.setup(workspace)
    bad = await client.call("child.start", {**OWNER, "apiKey": "sk-123"})
    assert bad["error"]["code"] == -32602
    assert bad["error"]["data"] == {"reason": "malformed_input"}
    refused = await client.call("child.read", {**OWNER, "childId": "nope"})
    assert refused["error"]["data"]["reason"] == "child_not_owned"
    assert refused["error"]["message"] == "child run is not owned by this capability"


async def test_a_line_over_4_mib_is_refused_and_the_stream_goes_on(
    stdio: tuple[Client, asyncio.subprocess.Process], workspace: Path
) -> None:
    client, _ = stdio
    huge = (
        b'{"jsonrpc":"2.0","id":99,"method":"child.read","params":{"childId":"'
        + (b"x" * (4 * 1024 * 1024))
        + b'"}}\n'
    )
    await client.send_raw(huge)
    answer = await client.receive()
    assert answer["error"]["code"] == -32600
    assert "4 MiB" in answer["error"]["message"]
    await client.setup(workspace)  # still serving


async def test_notifications_get_no_answer(
    stdio: tuple[Client, asyncio.subprocess.Process], workspace: Path
) -> None:
    client, _ = stdio
    await client.send_raw(b'{"jsonrpc": "2.0", "method": "no.such.method"}\n')
    await client.setup(workspace)
    await asyncio.sleep(0.2)
    assert client.unmatched == []


async def test_a_start_waiting_for_admission_does_not_hold_up_a_read(
    stdio: tuple[Client, asyncio.subprocess.Process], workspace: Path
) -> None:
    client, _ = stdio
    await client.setup(workspace)
    first = await client.ok("child.start", start_params("q1", "work in 2 steps"))
    slow = asyncio.create_task(client.call("child.start", start_params("q2", "work in 2 steps")))
    await asyncio.sleep(0)  # the start's line is written first, before the read's
    read = await client.ok("child.read", {**OWNER, "childId": first["conversationId"]})
    assert read["conversationId"] == first["conversationId"]
    assert "error" not in await slow


async def test_socket_serves_each_connection_as_a_runner(
    db_url: str, tmp_path: Path, workspace: Path
) -> None:
    path = tmp_path / "host.sock"
    proc = await host("--socket", str(path), "--db", db_url)
    try:
        await until_exists(path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        client = await socket_client(path)
        await client.setup(workspace)
        started = await client.ok("child.start", start_params("q1", "work in 2 steps"))
        result, _ = await client.read_until_done({**OWNER, "childId": started["conversationId"]})
        assert result["done"] is True
        other = await socket_client(path)
        registered = await other.ok("runner.register", {"runnerId": "r2", "hostInstanceId": "h9"})
        assert registered["generation"] == 1
        await client.close()
        await other.close()
    finally:
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 20) == 0, "SIGTERM closes gracefully"
    assert not path.exists()


async def test_socket_refuses_a_peer_with_another_uid(db_url: str, tmp_path: Path) -> None:
    path = tmp_path / "host.sock"
    proc = await host("--socket", str(path), "--db", db_url, "--allow-uid",
                      str(os.getuid() + 4242))  # fmt: skip
    try:
        await until_exists(path)
        client = await socket_client(path)
        refused = await client.receive()
        assert refused["error"]["data"]["reason"] == "not_authorized"
        assert await client.closed(), "the connection is closed"
        await client.close()
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 20)


async def test_run_finish_of_another_runner_touches_nothing_of_it(
    db_url: str, tmp_path: Path, workspace: Path
) -> None:
    """Issue 12, finding 2: a second runner that knows a runId sent run.finish with
    succeeded false, and the first runner's tools closed and its children were cancelled."""
    path = tmp_path / "host.sock"
    proc = await host("--socket", str(path), "--db", db_url)
    try:
        await until_exists(path)
        victim = await socket_client(path)
        await victim.setup(workspace)
        started = start_params("q1", "work in 40 steps", leaseId="L1")
        leased = await victim.ok("child.start", started)
        attacker = await socket_client(path)
        await attacker.ok("runner.register", {"runnerId": "r2", "hostInstanceId": "h2"})
        assert await attacker.ok("run.finish", {"runId": "run-1", "succeeded": False}) == {}
        handle = {**OWNER, "childId": leased["conversationId"], "leaseId": "L1"}
        read = await victim.ok("child.read", handle)
        assert (read["done"], read.get("cancelled", False)) == (False, False)
        assert "conversationId" in await victim.ok("child.start", start_params("q2"))
        # The runner's own run.finish does end its run: the lease is revoked.
        assert await victim.ok("run.finish", {"runId": "run-1", "succeeded": False}) == {}
        refused = await victim.call("child.read", handle)
        assert refused["error"]["data"]["reason"] == "not_owned"
        await victim.close()
        await attacker.close()
    finally:
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 20) == 0


async def test_tool_begin_takes_the_parent_runs_policy(stdio: Any, workspace: Path) -> None:
    client, _ = stdio
    await client.ok("runner.register", {"runnerId": "r1", "hostInstanceId": "h1"})
    wide = {**PRESET, "options": {"allowedTools": ["read", "bash"]}}
    tool = {
        "runId": "run-1", "conversationId": "conv-1", "toolCallId": "call-1",
        "extensionId": "ext", "presets": [wide], "workspace": str(workspace),
        "policy": {"allowedTools": ["read"]},
    }  # fmt: skip
    assert await client.ok("tool.begin", tool) == {}
    refused = await client.call("child.start", start_params("q1"))
    assert refused["error"]["data"]["reason"] == "tools_widened"
    bad = {**tool, "toolCallId": "call-2", "policy": {"maxTokens": None}}
    assert (await client.call("tool.begin", bad))["error"]["code"] == -32602
