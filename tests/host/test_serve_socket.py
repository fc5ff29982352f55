"""``delegation serve --socket`` beside another host and its peers (design §9, §18): a
refused second serve leaves the live host's socket; a peer that reads nothing costs
the host little even when its answers are pages of megabytes, and reads them all once
it reads; past ``--max-connections`` a peer gets one error line and is closed."""

from __future__ import annotations

import asyncio
import json
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from delegation import errors
from delegation.client.api import Client
from delegation.host.serve_io import listening_socket
from tools import serve_pages
from tools.serve_flood import host, memory_mb
from tools.serve_pages import Peer

ROOT = Path(__file__).resolve().parents[2]


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


def test_a_peer_reading_nothing_costs_little_even_when_answers_are_large(
    tmp_path: Path,
) -> None:
    """Every answer is a 4 MiB page (max_page_bytes) of events at their caps of control
    characters: 64 reads in flight held 64 of them (twice: the frame and the transport's
    copy) before answers counted in bytes against the stream's 16 MiB backlog, room for
    a page included. Once the peer reads, every answer comes."""
    workspace = tmp_path / "ws"
    workspace.mkdir()
    with host(tmp_path, "--runner", serve_pages.RUNNER) as (proc, path):
        peer, read = serve_pages.worst_child(path, "r1", workspace)
        try:
            serve_pages.reset_peak(proc.pid)
            before = memory_mb(proc.pid)
            flood = serve_pages.unread_reads(peer, read, 100)
            flood.wait(60)
            serve_pages.settle(proc.pid)
            growth = memory_mb(proc.pid, "VmHWM") - before
            sizes = serve_pages.answer_sizes(peer, 100)
        finally:
            peer.close()
    assert growth < 100, f"the host grew by {growth:.0f} MB"
    assert len(sizes) == 100 and max(sizes) <= 4 * 1024 * 1024 + 100


def test_past_max_connections_a_peer_gets_one_error_line_and_is_closed(tmp_path: Path) -> None:
    with host(tmp_path, "--max-connections", "2") as (_proc, path):
        served = [Peer(path), Peer(path)]
        try:
            for n, peer in enumerate(served):
                peer.call("runner.register", {"runnerId": f"r{n}", "hostInstanceId": "h1"})
            _past_the_limit(path)
            served[1].call("runner.register", {"runnerId": "r1", "hostInstanceId": "h1"})
            served.pop(0).close()
            deadline = time.monotonic() + 60
            while True:  # the host notices the hang-up, and the next connection is served
                try:
                    asyncio.run(_register_with_a_client(path))
                    break
                except errors.ConnectionLimit:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
        finally:
            for peer in served:
                peer.close()


def test_idle_connections_are_closed_and_free_their_slots(tmp_path: Path) -> None:
    """Issue 35, finding 6: 64 connections that sent nothing held every slot for as long
    as they stayed open. ``--idle-timeout`` closes one that sends nothing while nothing
    of it is in flight or unread; a peer that keeps talking stays."""
    idle_host = ("--max-connections", "2", "--idle-timeout", "1", "--log-level", "info")
    with host(tmp_path, *idle_host) as (_proc, path):
        idle, talking = Peer(path, timeout=30), Peer(path, timeout=30)
        try:
            talking.call("runner.register", {"runnerId": "r1", "hostInstanceId": "h1"})
            _past_the_limit(path)  # both slots are held
            began = time.monotonic()
            for n in range(8):  # 2.4 s of a request every 0.3 s: never idle for 1 s
                time.sleep(0.3)
                talking.call("run.finish", {"runId": f"run-{n}", "succeeded": True}, n + 2)
            with pytest.raises(ConnectionError):  # the idle one was closed meanwhile
                idle.line()
            assert time.monotonic() - began >= 0.9, "not before its idle timeout"
            asyncio.run(_register_with_a_client(path))  # its slot is free again
        finally:
            idle.close()
            talking.close()
    log = (tmp_path / "host.log").read_text()
    assert log.count("action=idle_connection_closed") >= 1, log


def test_a_connection_with_an_open_tool_call_or_a_slow_request_is_not_idle(
    tmp_path: Path,
) -> None:
    """The review of issue 35: a runner waiting quietly between its tool's calls was
    closed, which ended its tool call and cancelled its foreground children; and a
    request arriving slowly, a few bytes at a time, was cut off."""
    workspace = tmp_path / "ws"
    workspace.mkdir()
    with host(tmp_path, "--idle-timeout", "1") as (_proc, path):
        quiet, slow = Peer(path, timeout=30), Peer(path, timeout=30)
        try:
            quiet.call("runner.register", {"runnerId": "r1", "hostInstanceId": "h1"})
            begin = {"runId": "run", "conversationId": "conv", "toolCallId": "call",
                     "extensionId": "ext", "presets": [], "workspace": str(workspace)}  # fmt: skip
            quiet.call("tool.begin", begin, 2)
            frame = b'{"jsonrpc":"2.0","id":9,"method":"runner.register","params":'
            frame += b'{"runnerId":"r2","hostInstanceId":"h1"}}\n'
            for at in range(0, len(frame), 4):  # 2.5 s for one request
                slow.sock.sendall(frame[at : at + 4])
                time.sleep(2.5 / (len(frame) / 4))
            assert "result" in slow.line(), "answered, though it took longer than 1 s"
            quiet.call("tool.end", {"runId": "run", "toolCallId": "call"}, 3)  # still open
        finally:
            quiet.close()
            slow.close()


@pytest.mark.parametrize("value", ["0", "-1", "nan", "1e300"])
def test_an_idle_timeout_is_a_positive_number_of_seconds(tmp_path: Path, value: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "delegation.cli", "serve", "--socket", str(tmp_path / "s"),
         "--db", str(tmp_path / "d.db"), "--idle-timeout", value],
        cwd=ROOT, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "--idle-timeout" in done.stderr, done.stderr
    assert not (tmp_path / "d.db").exists()


def _past_the_limit(path: Path) -> None:
    """A peer past the limit reads one JSON-RPC error, then the end; a Client's call
    raises ConnectionLimit."""
    third = Peer(path)
    try:
        answer = third.line()
        assert answer["id"] is None and answer["error"]["code"] == -32602, answer
        assert answer["error"]["data"] == {"reason": "connection_limit"}
        with pytest.raises(ConnectionError):
            third.line()
    finally:
        third.close()
    with pytest.raises(errors.ConnectionLimit, match="too many connections"):
        asyncio.run(_register_with_a_client(path))


async def _register_with_a_client(path: Path) -> None:
    async with await Client.connect(path) as client:
        await client.register("r9", "h1")


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


# --- slow peers and one runner's many connections (SPEC §31) -----------------------------


def test_a_request_line_must_arrive_whole_within_the_request_timeout(tmp_path: Path) -> None:
    """The fifth attack: 64 connections that each sent one byte of a never-finished line
    every 2 s kept every slot (a slow line is no idler), and the real runner was
    refused. A line must now arrive whole within ``--request-timeout``, from its first
    byte; a new connection's first request, from its opening. A registered runner's
    line too (the review: its wait looked at the idle bound alone, 60 s)."""
    slow_host = ("--max-connections", "2", "--request-timeout", "3", "--log-level", "info")
    with host(tmp_path, *slow_host) as (_proc, path):
        dribbling, silent = Peer(path, timeout=30), Peer(path, timeout=30)
        try:
            dribbling.call("runner.register", {"runnerId": "r1", "hostInstanceId": "h1"})
            _past_the_limit(path)  # both slots are held
            began = time.monotonic()
            for byte in b'{"jsonrpc":"2.0","id":2,"method":"run.finish"':
                try:
                    dribbling.sock.sendall(bytes([byte]))
                except OSError:  # closed under it
                    break
                time.sleep(0.2)
                if time.monotonic() - began > 10:
                    break
            for peer in (dribbling, silent):  # the silent one never sent a request
                answer = peer.line()
                assert answer["error"]["message"] == (
                    "invalid request: a request line must arrive whole within 3 s"
                ), answer
                with pytest.raises(ConnectionError):
                    peer.line()  # and closed: by this bound (an idle close sends no line)
            asyncio.run(_register_with_a_client(path))  # their slots are free again
        finally:
            dribbling.close()
            silent.close()
    log = (tmp_path / "host.log").read_text()
    assert log.count("action=request_timeout") == 2, log


def test_one_runners_connections_cannot_lock_out_anothers(tmp_path: Path) -> None:
    """The fifth attack's other way: connections that register and open a tool call,
    then go silent, are not idle (closing them would cancel their children) and kept
    every slot. One runner holds at most ``--max-runner-connections`` at once (a
    registration past it is refused and its connection closed), and each registration
    fences the runner's older connection, which then ends (see the next test)."""
    workspace = tmp_path / "ws"
    workspace.mkdir()
    limits = ("--max-connections", "3", "--max-runner-connections", "1")
    with host(tmp_path, *limits) as (_proc, path):
        held = Peer(path, timeout=30)
        try:
            held.call("runner.register", {"runnerId": "greedy", "hostInstanceId": "h1"})
            begin = {"runId": "run-0", "conversationId": "conv-0", "toolCallId": "call",
                     "extensionId": "ext", "presets": [], "workspace": str(workspace)}  # fmt: skip
            held.call("tool.begin", begin, 2)
            second = Peer(path, timeout=30)
            try:
                second.sock.sendall(
                    serve_pages.request(
                        "runner.register", {"runnerId": "greedy", "hostInstanceId": "h1"}, 1
                    )
                )
                answer = second.line()
                assert answer["error"]["data"] == {"reason": "connection_limit"}, answer
                assert answer["error"]["message"] == (
                    "too many connections: runner 'greedy' holds 1 already; try again later"
                )
                with pytest.raises(ConnectionError):
                    second.line()  # and closed: it holds no slot
            finally:
                second.close()
            asyncio.run(_register_with_a_client(path))  # another runner is served
            held.call("tool.end", {"runId": "run-0", "toolCallId": "call"}, 3)  # still its
        finally:
            held.close()


@pytest.mark.parametrize("flag", ["--request-timeout", "--max-runner-connections"])
def test_the_slot_bounds_are_checked(tmp_path: Path, flag: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "delegation.cli", "serve", "--socket", str(tmp_path / "s"),
         "--db", str(tmp_path / "d.db"), flag, "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and flag in done.stderr, done.stderr
    assert not (tmp_path / "d.db").exists()


def test_a_registration_fences_the_runners_older_connection_and_frees_its_slot(
    tmp_path: Path,
) -> None:
    """The review of SPEC §31: a runner's newer registration fences its older connection
    (the engine ends its tool calls), yet the older stream still counted as having a
    tool call open (never idle) and held one of its runner's slots, so a runner that
    reconnected locked itself out. The fenced stream now ends, holding no slot."""
    workspace = tmp_path / "ws"
    workspace.mkdir()
    limits = ("--max-connections", "4", "--max-runner-connections", "2", "--log-level", "info")
    with host(tmp_path, *limits) as (_proc, path):
        peers = [Peer(path, timeout=30) for _ in range(3)]
        try:
            for n, peer in enumerate(peers):
                peer.call("runner.register", {"runnerId": "r", "hostInstanceId": "h1"})
                begin = {"runId": f"run-{n}", "conversationId": f"conv-{n}",
                         "toolCallId": "call", "extensionId": "ext", "presets": [],
                         "workspace": str(workspace)}  # fmt: skip
                peer.call("tool.begin", begin, 2)
            for fenced in peers[:2]:  # each fenced by the next: ended, not counted
                with pytest.raises(ConnectionError):
                    fenced.line()
        finally:
            for peer in peers:
                peer.close()
    log = (tmp_path / "host.log").read_text()
    assert log.count("action=superseded_connection_closed") == 2, log
