"""``delegation serve --socket`` beside another host and a peer (SPEC §9): a refused
second serve leaves the live host's socket; a peer that reads nothing costs the host
little (strict xfail: not fixed yet)."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from delegation.serve_io import listening_socket
from delegation.tools.serve_flood import memory_mb

ROOT = Path(__file__).resolve().parent.parent


def _wait_for(path: Path, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the host did not start"
        time.sleep(0.02)


def _register(path: Path) -> dict[str, object]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        frame = {"jsonrpc": "2.0", "id": 1, "method": "runner.register",
                 "params": {"runnerId": "r", "hostInstanceId": "h"}}  # fmt: skip
        sock.sendall(json.dumps(frame).encode() + b"\n")
        answer = b""
        while not answer.endswith(b"\n"):
            answer += sock.recv(65536)
    result: dict[str, object] = json.loads(answer)
    return result


def test_a_refused_second_serve_leaves_the_live_hosts_socket(tmp_path: Path) -> None:
    sock, db = tmp_path / "host.sock", tmp_path / "d.db"
    command = [sys.executable, "-m", "delegation.cli", "serve", "--socket", str(sock),
               "--db", str(db)]  # fmt: skip
    first = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        _wait_for(sock, first)
        second = subprocess.run(command, cwd=ROOT, capture_output=True, timeout=30)
        assert b"host_conflict" in second.stderr
        assert sock.exists(), "the live host's socket was unlinked"
        assert "result" in _register(sock)
    finally:
        first.terminate()
        first.wait(20)


@pytest.mark.xfail(strict=True, reason="not fixed here: see the review (answer bytes in flight)")
def test_a_peer_reading_nothing_costs_little_even_when_answers_are_large(
    tmp_path: Path,
) -> None:
    """The default scripted runner echoes the peer's message into its events: a page is
    a few MiB, and 64 reads in flight hold 64 of them (twice: the frame and the
    transport's copy)."""
    sock_path, workspace = tmp_path / "h.sock", tmp_path / "ws"
    workspace.mkdir()
    env = {**os.environ, "DELEGATION_SCRIPTED_DELAY": "0"}
    command = [sys.executable, "-m", "delegation.cli", "serve", "--socket", str(sock_path),
               "--db", str(tmp_path / "d.db")]  # fmt: skip
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
    try:
        _wait_for(sock_path, proc)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(sock_path))
            reader = sock.makefile("rb")

            def call(method: str, params: dict[str, object]) -> dict[str, object]:
                frame = {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}
                sock.sendall(json.dumps(frame).encode() + b"\n")
                answer: dict[str, object] = json.loads(reader.readline())
                assert "result" in answer, answer
                return answer["result"]  # type: ignore[return-value]

            call("runner.register", {"runnerId": "r1", "hostInstanceId": "h1"})
            preset = {"name": "scripted", "extensionId": "ext", "generation": 3}
            call("tool.begin", {"runId": "run-1", "conversationId": "conv-1",
                                "toolCallId": "call-1", "extensionId": "ext",
                                "presets": [preset], "workspace": str(workspace)})  # fmt: skip
            owner = {"runId": "run-1", "toolCallId": "call-1", "extensionId": "ext",
                     "generation": 3}  # fmt: skip
            request = {"requestId": "q", "profile": "scripted",
                       "message": "16 " + "\x01" * 40_000}  # fmt: skip
            child = call("child.start", {**owner, "request": request})["conversationId"]
            read = {**owner, "childId": child}
            while not call("child.read", {**read, "after": 10_000})["done"]:
                time.sleep(0.05)
            before = memory_mb(proc.pid)
            line = json.dumps({"jsonrpc": "2.0", "id": 2, "method": "child.read",
                               "params": read}).encode() + b"\n"  # fmt: skip
            sock.setblocking(False)
            deadline = time.monotonic() + 8
            while time.monotonic() < deadline:  # never read an answer
                try:
                    sock.send(line)
                except BlockingIOError:
                    time.sleep(0.1)
            growth = memory_mb(proc.pid, "VmHWM") - before
    finally:
        proc.terminate()
        proc.wait(20)
    assert growth < 100, f"the host grew by {growth:.0f} MB"


def test_the_socket_appears_listening_and_never_over_a_file(tmp_path: Path) -> None:
    """A peer that waits for the socket file finds it accepting at once (it is linked
    into place after listen), mode 0600; and it never replaces what is at the path."""
    path = tmp_path / "host.sock"
    server = listening_socket(str(path))
    try:
        assert stat.S_ISSOCK(path.stat().st_mode)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        with socket.socket(socket.AF_UNIX) as peer:
            peer.connect(str(path))  # accepted by the backlog: it listens already
        assert sorted(p.name for p in tmp_path.iterdir()) == ["host.sock"]
    finally:
        server.close()
    taken = tmp_path / "taken"
    taken.write_text("not a socket")
    with pytest.raises(FileExistsError):
        listening_socket(str(taken))
    assert taken.read_text() == "not a socket"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["host.sock", "taken"]
