"""What other tests use of client/test_client.py, kept here so that no test module imports
another: ENV, LEASE, OWNER, Opener, PRESET, ROOT, SocketHost, _listening, opener,
read_until_done, serve_socket, settled_threads, setup, socket_host, start_params."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from delegation import Event, Preset, Result
from delegation.client.api import Client

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "DELEGATION_SCRIPTED_DELAY": "0.02"}
PRESET = Preset(name="scripted", extension_id="ext", generation=3)
OWNER = {"runId": "run-1", "toolCallId": "call-1", "extensionId": "ext", "generation": 3}
LEASE = {"runId": "run-1", "extensionId": "ext", "generation": 3, "leaseId": "L1"}
Opener = Callable[..., Awaitable[Client]]


def start_params(request_id: str, message: str, **extra: Any) -> dict[str, Any]:
    request = {"requestId": request_id, "profile": "scripted", "message": message}
    if "leaseId" in extra:
        request["leaseId"] = extra["leaseId"]
    return {**OWNER, **extra, "request": request}


def serve_socket(path: Path, db: str, *runner: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "delegation.cli", "serve", "--socket", str(path),
         "--db", db, *runner],
        cwd=ROOT, env=ENV, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 20
    while not _listening(path):  # the file appears at bind(), a moment before listen()
        assert proc.poll() is None and time.monotonic() < deadline, "the host did not start"
        time.sleep(0.02)
    return proc


def _listening(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


class SocketHost:
    """``serve --socket`` subprocesses on one database; ``start`` returns the socket path."""

    def __init__(self, db: str, tmp_path: Path) -> None:
        self.db = db
        self.path = tmp_path / "host.sock"
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, *runner: str) -> Path:
        self.procs.append(serve_socket(self.path, self.db, *runner))
        return self.path


@pytest.fixture
def socket_host(db_url: str, tmp_path: Path) -> Iterator[SocketHost]:
    host = SocketHost(db_url, tmp_path)
    yield host
    for proc in host.procs:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(20)


@pytest.fixture(params=["socket", "stdio"])
def opener(request: pytest.FixtureRequest, db_url: str, socket_host: SocketHost) -> Opener:
    """Opens a Client with the given runner args, over a socket or over a spawned stdio."""

    async def open_client(*runner: str) -> Client:
        if request.param == "socket":
            return await Client.connect(socket_host.start(*runner))
        return await Client.spawn(["--db", db_url, *runner], env=ENV, cwd=ROOT)

    return open_client


async def setup(client: Client, workspace: Path) -> None:
    registered = await client.register("r1", "h1")
    assert registered.generation >= 1
    assert registered.connection_id
    await client.begin_tool(
        run_id="run-1", conversation_id="conv-1", tool_call_id="call-1", extension_id="ext",
        presets=[PRESET], workspace=str(workspace),
    )  # fmt: skip


async def read_until_done(client: Client, child: dict[str, Any]) -> tuple[Result, list[Event]]:
    events: list[Event] = []
    while not (result := await client.read({**child, "after": len(events)})).done:
        events += result.events
        await asyncio.sleep(0.02)
    return result, events + result.events


def settled_threads(before: set[threading.Thread]) -> set[threading.Thread]:
    """Threads not in ``before`` that are still alive after a short grace (asyncio's
    waitpid threads end just after the exit they report)."""
    deadline = time.monotonic() + 60
    while (extra := set(threading.enumerate()) - before) and time.monotonic() < deadline:
        time.sleep(0.01)
    return extra
