"""``delegation serve`` is bounded in everything a peer controls (design §9).

A real host subprocess each time: a peer that sends and never reads is parked (the
host stops reading it) instead of growing the host without limit, on a socket and on
stdio alike; other connections are answered meanwhile; ``--max-inflight`` caps the
requests of one stream served at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec

from tests.harness.serving import PRESET, Client, start_params
from tests.harness.serving import host as serve_host
from tools.serve_flood import Flood, flood_socket, hang_up, host, memory_mb, round_trip

ROOT = Path(__file__).resolve().parents[2]
FLOOD = 200_000  # requests: about 12 MB of them, 22 MB of answers, none read
CEILING_MB = 300  # the whole flood held in memory costs the host ~470 MB


def test_a_socket_peer_that_reads_nothing_is_parked_and_others_are_served(
    tmp_path: Path,
) -> None:
    with host(tmp_path) as (proc, path):
        assert "result" in round_trip(path, 20)
        before = memory_mb(proc.pid)
        flood, sock = flood_socket(path, FLOOD)
        try:
            assert "result" in round_trip(path, 20), "answered while the flood arrives"
            flood.wait(60)
            assert "result" in round_trip(path, 20), "answered while the flood sits unread"
            growth = memory_mb(proc.pid, "VmHWM") - before
        finally:
            hang_up(sock)
    assert growth < CEILING_MB, f"the host grew by {growth:.0f} MB"


def test_stdio_answers_nobody_reads_are_bounded_and_sigterm_still_stops(
    tmp_path: Path, db_path: Path
) -> None:
    log = (tmp_path / "host.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "delegation.cli", "serve", "--stdio", "--db", str(db_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=ROOT,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    try:
        register = {"runnerId": "r1", "hostInstanceId": "h1"}
        frame = {"jsonrpc": "2.0", "id": 1, "method": "runner.register", "params": register}
        proc.stdin.write(msgspec.json.encode(frame) + b"\n")
        proc.stdin.flush()
        assert "result" in msgspec.json.decode(proc.stdout.readline())  # the engine is open
        before = memory_mb(proc.pid)

        def send(batch: bytes) -> None:
            proc.stdin.write(batch)  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]

        flood = Flood(send, FLOOD)
        flood.wait(60)
        growth = memory_mb(proc.pid, "VmHWM") - before
        proc.terminate()
        # A writer blocked on the unread pipe must not keep the host from exiting.
        code = proc.wait(20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        with contextlib.suppress(OSError):  # what the flood left buffered has nowhere to go
            proc.stdin.close()
        proc.stdout.close()
        log.close()
    assert growth < CEILING_MB, f"the host grew by {growth:.0f} MB"
    assert code == 0
    assert b"Traceback" not in (tmp_path / "host.log").read_bytes()


async def test_max_inflight_holds_back_the_next_request(db_path: Path, workspace: Path) -> None:
    """With two slots held by starts waiting for admission, a third request is only
    read once one of them is answered; the one still in flight at SIGTERM is answered
    ``host_closing``."""
    proc = await serve_host(
        "--stdio", "--db", str(db_path), "--max-inflight", "2",
        "--runner", "tests.harness.serve_runners:SlowAdmit",
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    client = Client(proc.stdout, proc.stdin)
    try:
        await client.setup(workspace)
        slow = start_params("q-slow", "admit after 30")
        quick = start_params("q-quick", "admit after 0.5")
        await client.send_raw(
            _frame("slow", "child.start", slow)
            + _frame("quick", "child.start", quick)
            + _frame("third", "no.such.method", {})
        )
        first, second = await client.receive(), await client.receive()
        assert (first["id"], second["id"]) == ("quick", "third")
        assert first["result"]["profile"] == PRESET["name"]
        assert second["error"]["code"] == -32601
        proc.terminate()
        closing = await client.receive()
        assert closing["id"] == "slow"
        assert closing["error"]["data"] == {"reason": "host_closing"}
        assert await asyncio.wait_for(proc.wait(), 20) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await client.close()


def _frame(request_id: str, method: str, params: Any) -> bytes:
    frame = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}
    return msgspec.json.encode(frame) + b"\n"
