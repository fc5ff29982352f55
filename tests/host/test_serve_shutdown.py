"""A runner hanging up and a host shutting down are quiet and answer what they can.

A real ``delegation serve --socket`` subprocess logging at info: a runner that
closes its socket with answers pending leaves one ``peer_hung_up`` line, no
traceback; SIGTERM with another runner's call in flight answers that call
``host_closing`` before the connection closes, and logs one line for the shutdown.
"""

from __future__ import annotations

import asyncio
import os
import select
import socket
import sys
import time
from pathlib import Path

import msgspec

from tests.harness.serving import PRESET, socket_client, start_params
from tests.harness.support import until_exists

ROOT = Path(__file__).resolve().parents[2]
REGISTER = {"runnerId": "r-gone", "hostInstanceId": "h1"}
NOISE = (
    "Traceback",
    "Unhandled exception",
    "CancelledError",
    "BrokenPipeError",
    "ConnectionResetError",
    "socket.send() raised exception",
    "Task was destroyed",
)


async def test_hang_up_and_shutdown_are_quiet_and_calls_in_flight_get_host_closing(
    db_path: Path, tmp_path: Path, workspace: Path
) -> None:
    path = tmp_path / "host.sock"
    log_path = tmp_path / "host.log"
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "delegation.cli", "serve", "--socket", str(path),
            "--db", str(db_path), "--runner", "tests.harness.serve_runners:SlowAdmit",
            stderr=log, cwd=ROOT, env={**os.environ, "DELEGATION_LOG": "info"},
        )  # fmt: skip
    staying = None
    try:
        await until_exists(path, timeout_s=10, pause_s=0.025)
        await asyncio.to_thread(_hang_up_with_answers_pending, path, workspace)
        staying = await socket_client(path)
        await staying.setup(workspace)
        leased = start_params("q-leased", "admit after 30", leaseId="L1")
        caught = [
            asyncio.create_task(staying.call("child.start", start_params("q-fg", "admit 30"))),
            asyncio.create_task(staying.call("child.start", leased)),
        ]
        # Each call registers its id before it writes its line: wait until both starts
        # are written, then send a later line. The host reads lines in order, so once
        # that one is answered, both starts are in flight.
        for _ in range(100):
            if len(staying.waiting) == 2:
                break
            await asyncio.sleep(0.01)
        assert (await staying.call("no.such.method"))["error"]["code"] == -32601
        proc.terminate()
        answers = await asyncio.gather(*caught)
        assert [a["error"]["data"]["reason"] for a in answers] == ["host_closing"] * 2
        assert await staying.closed(), "the host closes the connection after answering"
        assert await asyncio.wait_for(proc.wait(), 20) == 0
    finally:
        if staying is not None:
            await staying.close()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    logged = log_path.read_text()
    for noise in NOISE:
        assert noise not in logged, logged
    assert logged.count("action=peer_hung_up") == 1, logged
    assert logged.count("action=serve_stopped") == 1, logged


def _hang_up_with_answers_pending(path: Path, workspace: Path) -> None:
    """A runner that starts slow children, sends reads it never collects, and closes
    its socket with answers unread (the host's next read of it fails: a reset)."""
    tool = {
        "runId": "run-1", "conversationId": "conv-1", "toolCallId": "call-1",
        "extensionId": "ext", "presets": [PRESET], "workspace": str(workspace),
    }  # fmt: skip
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(20)
        sock.connect(str(path))
        answers = sock.makefile("rb")
        for method, params in (("runner.register", REGISTER), ("tool.begin", tool)):
            sock.sendall(_frame(method, method, params))
            assert b'"result"' in answers.readline()
        starts = [_frame(f"s{n}", "child.start", start_params(f"q{n}", "admit after 0.3"))
                  for n in range(3)]  # fmt: skip
        reads = _frame("r", "child.read", {}) * 2000
        sock.sendall(b"".join(starts) + reads)
        select.select([sock], [], [], 20)  # answers arrive, and stay unread
        answers.close()
    time.sleep(0.5)  # the slow starts are answered: to a closed socket


def _frame(request_id: str, method: str, params: object) -> bytes:
    frame = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}
    return msgspec.json.encode(frame) + b"\n"
