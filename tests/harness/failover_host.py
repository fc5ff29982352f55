"""A host process doing work while its database fails over (design §19), and the parent's
view of it.

    python -m tests.harness.failover_host NAME STREAMERS EVENTS HEARTBEAT_S TIMEOUT_S
    (the database URL in $DELEGATION_FAILOVER_URL)

One ``Engine``, one runner connection (``runner-NAME``). It starts ``STREAMERS`` leased
children that emit and flush an event every 50 ms until stopped, then, every 0.2 s
until it reads ``QUIET`` on its stdin, another leased child that emits ``EVENTS``
events (each flushed) and returns. A call or flush the engine refuses is said, and
tried again: a refused start with the next request, a refused flush with the same
events (the engine keeps them). Each line has the host's ``time.time()`` second:

    INSTANCE t id          READY t
    STARTED t conv lease   a start the engine acknowledged
    REFUSED t what reason  a start or a tool call refused (the error's ``reason``)
    RAN t conv             a run began (a new child); RESUMED t conv attempt: recovered
    ACK t conv seq text    an event committed: printed only after its flush returned
    UNFLUSHED t conv reason   a flush refused (the events are flushed again)
    ENDED t conv           a run returned, everything it emitted flushed
    STOPPED t conv why     a run stopped (cancelled, or fenced: its host was taken over)

``Host`` (the parent's side) starts one and keeps its lines as they come.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from delegation import (
    ChildContext,
    DelegationError,
    Engine,
    EngineConfig,
    Event,
    Identity,
    Params,
    Preset,
    Recovery,
    Request,
    Result,
    Run,
    RunnerConnection,
)

URL_ENV = "DELEGATION_FAILOVER_URL"
ROOT = Path(__file__).resolve().parents[2]
RETRY_S = 0.05  # between a refused flush and the next try
START_EVERY_S = 0.2
STREAM_EVERY_S = 0.05
CHILDREN_PER_TOOL = 50  # below the engine's max_children_per_grant (64)


# --- the host process --------------------------------------------------------------------


def say(word: str, *rest: object) -> None:
    print(" ".join([word, f"{time.time():.6f}", *map(str, rest)]), flush=True)


def reason_of(exc: BaseException) -> str:
    """The refusal's reason; what it says goes to stderr (shown when a check fails)
    unless it is the expected ``store_unavailable``."""
    reason = str(getattr(exc, "reason", type(exc).__name__))
    if reason != "store_unavailable":
        print(f"refused with {reason}: {exc!r}", file=sys.stderr, flush=True)
    return reason


async def flushed(ctx: ChildContext, pending: list[tuple[int, str]]) -> None:
    """Flush until the engine says it is committed; then acknowledge ``pending``."""
    conversation = ctx.identity.conversation_id
    while True:
        try:
            await ctx.flush()
            break
        except DelegationError as exc:
            if reason_of(exc) not in ("store_unavailable", "store_error", "database_busy"):
                raise
            say("UNFLUSHED", conversation, reason_of(exc))
            await asyncio.sleep(RETRY_S)
    for sequence, text in pending:
        say("ACK", conversation, sequence, text)
    pending.clear()


class WorkRunner:
    """Streamers (``events`` 0) stream until stopped; the others emit ``events`` and end."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.events: dict[str, int] = {}  # request id -> events to emit; 0: stream

    async def prepare(
        self, request: Request, preset: Preset, identity: Identity, recovery: Recovery | None
    ) -> Run:
        count = self.events.get(request.request_id, 0)

        async def run(ctx: ChildContext) -> None:
            await self.run(ctx, count)

        return run

    async def run(self, ctx: ChildContext, count: int) -> None:
        await ctx.admit()
        conversation = ctx.identity.conversation_id
        if ctx.recovery is None:
            say("RAN", conversation)
        else:
            say("RESUMED", conversation, ctx.recovery.attempt)
        pending: list[tuple[int, str]] = []
        n = 0
        try:
            while count == 0 or n < count:
                n += 1
                text = f"{self.name}:{n}"
                pending.append((ctx.emit(Event(kind="text", text=text)), text))
                await flushed(ctx, pending)
                await asyncio.sleep(STREAM_EVERY_S)
        except BaseException as exc:  # cancelled, or its writes refused for good (fenced)
            say("STOPPED", conversation, reason_of(exc))
            raise
        say("ENDED", conversation)


class Starter:
    """Leased starts under this host's parent run: a new tool call every 50 children."""

    def __init__(self, engine: Engine, conn: RunnerConnection, runner: WorkRunner) -> None:
        self.engine, self.conn, self.runner = engine, conn, runner
        self.name, self.count, self.tools = runner.name, 0, set[int]()

    async def start(self, events: int) -> None:
        n, tool = self.count, self.count // CHILDREN_PER_TOOL
        self.count += 1
        call, lease, request_id = f"call-{tool}", f"lease-{self.name}-{n}", f"q-{n}"
        self.runner.events[request_id] = events
        try:
            if tool not in self.tools:
                preset = Preset(name="worker", extension_id="ext", generation=7)
                await self.engine.open_tool(
                    self.conn, run_id=f"parent-{self.name}", conversation_id=f"pc-{self.name}",
                    tool_call_id=call, extension_id="ext", presets=[preset],
                    workspace=tempfile.gettempdir(),
                )  # fmt: skip
                self.tools.add(tool)
            request = Request(request_id=request_id, profile="worker", message="go",
                              lease_id=lease)  # fmt: skip
            params = Params(run_id=f"parent-{self.name}", tool_call_id=call, extension_id="ext",
                            generation=7, lease_id=lease, request=request)  # fmt: skip
            result = await self.engine.call(self.conn, "child.start", params)
        except DelegationError as exc:
            say("REFUSED", "start", reason_of(exc))
            return
        assert isinstance(result, Result)
        say("STARTED", result.conversation_id, lease)


async def host(name: str, streamers: int, events: int, heartbeat: float, timeout: float) -> None:
    config = EngineConfig(host_heartbeat_s=heartbeat, host_timeout_s=timeout,
                          lease_lifetime_s=3600.0, release_drain_s=5.0)  # fmt: skip
    runner = WorkRunner(name)
    engine = Engine(os.environ[URL_ENV], runner=runner, config=config)
    await engine.open()
    say("INSTANCE", engine.instance_id)
    conn = await engine.connect(f"runner-{name}", f"hi-{name}")
    starter = Starter(engine, conn, runner)
    for _ in range(streamers):
        await starter.start(0)
    say("READY")
    told = asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    while events and not told.done():
        await starter.start(events)
        await asyncio.sleep(START_EVERY_S)
    await asyncio.Event().wait()


# --- the parent's side -------------------------------------------------------------------


class Host:
    """One host process and the lines it printed (each split into words)."""

    def __init__(self, url: str, name: str, streamers: int, events: int,
                 heartbeat: float = 2.0, timeout: float = 10.0) -> None:  # fmt: skip
        self.name = name
        self.lines: list[list[str]] = []
        self.stderr: list[str] = []
        self._changed = threading.Condition()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.harness.failover_host", name, str(streamers), str(events),
             str(heartbeat), str(timeout)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            cwd=ROOT,
            env={**os.environ, URL_ENV: url, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        self._readers = [threading.Thread(target=self._read, daemon=True),
                         threading.Thread(target=self._read_errors, daemon=True)]  # fmt: skip
        for reader in self._readers:
            reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line.split())
                self._changed.notify_all()

    def _read_errors(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    def wait(self, found: Callable[[], bool], timeout: float, what: str) -> None:
        """Wait until ``found()`` holds (raises AssertionError after ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not found():
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    tail = "".join(self.stderr[-30:])
                    raise AssertionError(f"host {self.name}: no {what} in {timeout} s\n{tail}")
                self._changed.wait(min(left, 0.1))

    def words(self, first: str, since: float = 0.0) -> list[list[str]]:
        """Lines starting with ``first`` printed at ``since`` or later (``time.time()``)."""
        with self._changed:
            return [w for w in self.lines if w[0] == first and float(w[1]) >= since]

    def ready(self, timeout: float = 60.0) -> None:
        self.wait(lambda: bool(self.words("READY")), timeout, "READY")

    @property
    def instance(self) -> str:
        return self.words("INSTANCE")[0][2]

    def first_write(self, since: float) -> float | None:
        """When the host first had a write acknowledged (a start or a flush) at
        ``since`` or later."""
        times = [float(w[1]) for first in ("STARTED", "ACK") for w in self.words(first, since)]
        return min(times, default=None)

    def started(self) -> dict[str, str]:
        """conversation -> lease of every acknowledged start."""
        return {w[2]: w[3] for w in self.words("STARTED")}

    def acked(self) -> set[tuple[str, int, str]]:
        return {(w[2], int(w[3]), w[4]) for w in self.words("ACK")}

    def conversations(self, first: str) -> list[str]:
        return [w[2] for w in self.words(first)]

    def refusals(self) -> dict[str, int]:
        """How many calls and flushes were refused, by reason."""
        found: dict[str, int] = {}
        for w in [*self.words("REFUSED"), *self.words("UNFLUSHED")]:
            found[w[3]] = found.get(w[3], 0) + 1
        return found

    def quiet(self) -> None:
        """No more new children (the streamers stream on)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("QUIET\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for reader in self._readers:
            reader.join(10)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


if __name__ == "__main__":
    name, streamers, events, heartbeat, timeout = sys.argv[1:6]
    asyncio.run(host(name, int(streamers), int(events), float(heartbeat), float(timeout)))
