"""What peers that read nothing cost a host when every answer is a worst-case page
(design §18).

``python -m tools.serve_pages [--connections N] [--reads M] [--runs R]``
starts ``delegation serve --socket --runner tools.serve_pages:WorstPages``
on a fresh database, opens N connections (each its own runner with one child whose
events have every field at its cap of control characters: each escaped to six bytes,
so every page is cut at ``max_page_bytes``), sends M reads of the whole child on each
without reading a single answer, and prints the host's resident memory before and at
its peak, then checks that one more connection past ``--max-connections`` is refused
and that each connection, once it reads, gets all M answers. With ``--runs`` it does
it R times and prints the medians.

Operations tooling: nothing in the library imports it (the tests do).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from delegation.run.context import ChildContext, Recovery, Run
from delegation.wire import Event, Identity, Preset, Request
from tools.serve_flood import Flood, host, memory_mb

RUNNER = "tools.serve_pages:WorstPages"
FIELD = "\x01" * 64 * 1024  # over the 32 KiB cap: cut to 32 KiB once escaped
NAME = "\x01" * 2048  # over the 1 KiB cap of names
EVENTS = 40  # about 5.2 MB of events: more than one 4 MiB page
OWNER = {"runId": "run-1", "toolCallId": "call-1", "extensionId": "ext", "generation": 1}


class WorstPages:
    """A runner whose children emit :data:`EVENTS` events with every field over its
    cap of control characters, then end."""

    async def prepare(
        self, request: Request, preset: Preset, identity: Identity, recovery: Recovery | None
    ) -> Run:
        async def run(ctx: ChildContext) -> None:
            await ctx.admit()
            for _ in range(EVENTS):
                ctx.emit(
                    Event(kind=NAME, text=FIELD, tool_name=NAME, tool_call_id=NAME,
                          input=FIELD, tool_output=FIELD, error=FIELD)
                )  # fmt: skip

        return run


class Peer:
    """One connection that speaks JSON-RPC line by line, blocking."""

    def __init__(self, path: Path, timeout: float = 600.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(str(path))
        self.lines = self.sock.makefile("rb")

    def line(self) -> dict[str, Any]:
        """The next answer (raises if the host closed the connection)."""
        raw = self.lines.readline()
        if not raw:
            raise ConnectionError("the host closed the connection")
        answer: dict[str, Any] = json.loads(raw)
        return answer

    def call(self, method: str, params: dict[str, Any], request_id: int = 1) -> Any:
        self.sock.sendall(request(method, params, request_id))
        answer = self.line()
        if "result" not in answer:
            raise RuntimeError(f"{method} refused: {answer}")
        return answer["result"]

    def close(self) -> None:
        self.lines.close()
        self.sock.close()


def request(method: str, params: dict[str, Any], request_id: int) -> bytes:
    frame = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}
    return json.dumps(frame).encode() + b"\n"


def worst_child(path: Path, runner_id: str, workspace: Path) -> tuple[Peer, dict[str, Any]]:
    """A connection of runner ``runner_id`` with one finished child of
    :class:`WorstPages`; the params that read it from the start."""
    peer = Peer(path)
    peer.call("runner.register", {"runnerId": runner_id, "hostInstanceId": "h1"})
    preset = {"name": "worst", "extensionId": "ext", "generation": 1}
    peer.call("tool.begin", {"runId": "run-1", "conversationId": "conv-1",
                             "toolCallId": "call-1", "extensionId": "ext",
                             "presets": [preset], "workspace": str(workspace)})  # fmt: skip
    start = {"requestId": "q1", "profile": "worst", "message": "pages"}
    child = peer.call("child.start", {**OWNER, "request": start})["conversationId"]
    read = {**OWNER, "childId": child}
    deadline = time.monotonic() + 60
    while not peer.call("child.read", {**read, "after": 10**9})["done"]:
        if time.monotonic() > deadline:
            raise TimeoutError("the worst-case child did not finish")
        time.sleep(0.05)
    return peer, read


def unread_reads(peer: Peer, params: dict[str, Any], count: int) -> Flood:
    """``count`` reads of ``params`` sent on ``peer`` from a thread, none read."""
    return Flood(peer.sock.sendall, count, frame=lambda n: request("child.read", params, n))


def answer_sizes(peer: Peer, count: int) -> list[int]:
    """Read ``count`` answers, each a page of events; their sizes in bytes."""
    sizes = []
    for _ in range(count):
        raw = peer.lines.readline()
        if not json.loads(raw).get("result", {}).get("events"):
            raise RuntimeError(f"not a page: {raw[:200]!r}")
        sizes.append(len(raw))
    return sizes


def settle(pid: int, quiet_s: float = 2.0, timeout: float = 120.0) -> None:
    """Until the process's resident memory has not grown for ``quiet_s`` seconds."""
    deadline = time.monotonic() + timeout
    peak, since = memory_mb(pid), time.monotonic()
    while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
        time.sleep(0.1)
        if (now := memory_mb(pid)) > peak + 0.5:
            peak, since = now, time.monotonic()


def reset_peak(pid: int) -> None:
    """Start the process's peak resident memory (VmHWM) again from now (Linux)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def refused_past_the_limit(path: Path) -> dict[str, Any]:
    """The one line a connection past ``--max-connections`` gets."""
    peer = Peer(path, timeout=30)
    try:
        return peer.line()
    finally:
        peer.close()


def measure(connections: int, reads: int) -> dict[str, Any]:
    """One run: a fresh host, ``connections`` peers sending ``reads`` unread reads."""
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        workspace = directory / "ws"
        workspace.mkdir()
        limit = ("--max-connections", str(connections), "--runner", RUNNER)
        with host(directory, *limit) as (proc, path):
            children = [worst_child(path, f"r{n}", workspace) for n in range(connections)]
            reset_peak(proc.pid)  # the children's own writes are not what is measured
            before = memory_mb(proc.pid)
            floods = [unread_reads(peer, read, reads) for peer, read in children]
            for flood in floods:
                flood.wait(120)
            settle(proc.pid)  # the host computes and holds what it will of the answers
            peak = memory_mb(proc.pid, "VmHWM")
            refusal = refused_past_the_limit(path)
            sizes = [size for peer, _ in children for size in answer_sizes(peer, reads)]
            for peer, _ in children:
                peer.close()
        return {
            "connections": connections,
            "reads_each": reads,
            "sent_before_stall": min(flood.sent for flood in floods),
            "answers_read": len(sizes),
            "largest_answer_mb": round(max(sizes) / 1e6, 2),
            "refused_reason": refusal.get("error", {}).get("data", {}).get("reason"),
            "rss_before_mb": round(before, 1),
            "rss_peak_mb": round(peak, 1),
            "growth_mb": round(peak - before, 1),
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--connections", type=int, default=1)
    parser.add_argument("--reads", type=int, default=64)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args(argv)
    runs = [measure(args.connections, args.reads) for _ in range(args.runs)]
    for key in runs[0]:
        values = [run[key] for run in runs]
        varied = len(set(values)) > 1
        shown = statistics.median(values) if varied else values[0]  # only numbers vary
        print(f"{key:>18}: {shown}" + (f"  (runs: {values})" if varied else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
