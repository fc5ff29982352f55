"""What event streams whose clients never read cost ``delegation web`` (design §18).

``python -m tools.web_flood [--streams 64] [--events 512] [--runs 3]`` fills a
fresh SQLite database in a temporary directory with one finished child whose events
have every text field at the engine's cap (32 KiB each: about 128 KiB of JSON an
event), starts ``delegation web --no-token --port 0`` on it, and then, each run:
opens ``--streams`` event streams of that child on connections that never read (a
small receive buffer, so the kernel holds little for them), waits until the server's
memory settles, checks that a bystander is still answered, hangs the streams up and
waits again. It prints the server's resident memory before, with the streams open,
at its peak and after, each the median of the runs.

Operations tooling: nothing in the library imports it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

from delegation import Engine, Event
from delegation.run.context import ChildContext, Run
from tools.bench_base import CONFIG, Starter, machine, median
from tools.serve_flood import memory_mb, stop_process

FIELD = "x" * CONFIG.max_event_field_bytes  # every text field at the engine's cap
RECEIVE_BUFFER = 4096  # what each never-reading client lets its kernel take
SETTLE_S = 2.0  # the server's memory counts as settled once unchanged this long
WAIT_S = 120.0  # and stops being waited for after this long


class Filler:
    """A runner whose one child emits ``events`` events at the caps and finishes."""

    def __init__(self, events: int) -> None:
        self.events = events

    async def prepare(self, *args: object) -> Run:
        async def run(ctx: ChildContext) -> None:
            await ctx.admit()
            event = Event(kind="tool", text=FIELD, input=FIELD, tool_output=FIELD, error=FIELD)
            for n in range(self.events):
                ctx.emit(event)
                if n % 32 == 31:
                    await ctx.flush()

        return run


async def fill(path: Path, events: int) -> str:
    """A new database at ``path`` with one finished child of ``events`` events; its id."""
    engine = Engine(f"sqlite:///{path}", runner=Filler(events), config=CONFIG)
    await engine.open()
    try:
        starter = Starter(engine, await engine.connect("flood-runner", "flood-host"))
        child = (await starter.start("q1")).conversation_id
        while (found := await engine.get_child(child)) is None or not found.terminal:
            await asyncio.sleep(0.05)
        return child
    finally:
        await engine.close()


@contextlib.contextmanager
def web(path: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``delegation web`` on ``path``: its process and its address."""
    command = [sys.executable, "-m", "delegation.cli", "web", "--db", str(path)]
    proc = subprocess.Popen(
        [*command, "--port", "0", "--no-token"],
        stdout=subprocess.PIPE,
        stderr=(path.parent / "web.log").open("w"),
        text=True,
    )
    try:
        assert proc.stdout is not None
        said = proc.stdout.readline()
        if not said.startswith("delegation web: http"):
            raise RuntimeError(f"delegation web did not start: {said!r}")
        yield proc, said.split()[2]
    finally:
        stop_process(proc)


def silent_stream(url: str, path: str) -> socket.socket:
    """A connection that asks for the stream at ``path`` and never reads a byte."""
    where = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
    sock.connect((where.hostname or "127.0.0.1", where.port or 80))
    sock.sendall(f"GET /{path} HTTP/1.1\r\nHost: {where.netloc}\r\n\r\n".encode())
    return sock


def settled(pid: int) -> float:
    """The process's resident memory once it stopped changing (MB)."""
    deadline = time.monotonic() + WAIT_S
    last, since = memory_mb(pid), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = memory_mb(pid)
        if abs(now - last) > 1.0:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= SETTLE_S:
            break
    return memory_mb(pid)


def answered(url: str) -> bool:
    with urllib.request.urlopen(url + "api/children", timeout=30) as answer:
        return bool(answer.status == 200)


def measure(streams: int, events: int, runs: int) -> dict[str, object]:
    """Median figures of ``runs`` floods of ``streams`` never-reading streams."""
    figures: dict[str, list[float]] = {"before": [], "streams_open": [], "after": []}
    bystander = True
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "flood.db"
        child = asyncio.run(fill(path, events))
        with web(path) as (proc, url):
            answered(url)  # warm: the first read of the list is done
            for _ in range(runs):
                figures["before"].append(settled(proc.pid))
                socks = [silent_stream(url, f"api/children/{child}/events") for _ in range(streams)]
                figures["streams_open"].append(settled(proc.pid))
                bystander = bystander and answered(url)
                for sock in socks:
                    sock.close()
                figures["after"].append(settled(proc.pid))
            peak = memory_mb(proc.pid, "VmHWM")
        log = (Path(tmp) / "web.log").read_text()
    return {
        "streams": streams,
        "events": events,
        "event_json_kib": round(len(FIELD) * 4 / 1024),
        "runs": runs,
        **{f"rss_{name}_mb": round(median(values), 1) for name, values in figures.items()},
        "rss_peak_mb": round(peak, 1),
        "bystander_answered": bystander,
        "log_tracebacks": log.count("Traceback"),
        "cores": machine()["cores"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--events", type=int, default=512)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    for key, value in measure(args.streams, args.events, args.runs).items():
        print(f"{key:>20}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
