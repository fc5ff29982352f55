"""What every benchmark of :mod:`tools.bench` shares: the engine's settings,
a runner, :class:`Bench` (new SQLite files, each raw baseline with the stdlib
``sqlite3``; :class:`~tools.bench_postgres.PostgresBench` derives from it for a
PostgreSQL server), the raw ``sqlite3`` baselines, and the machine's description."""

from __future__ import annotations

import asyncio
import os
import platform
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from delegation import Engine, EngineConfig, Event, Params, Preset, Request, Result
from delegation.run.context import ChildContext, Recovery, Run
from delegation.wire import Identity

PRESET = Preset(name="bench", extension_id="ext", generation=1)
# Production settings, but for the lease cap: thousands of leases share one runner here.
CONFIG = EngineConfig(max_leases_per_runner=10**9)


class Runner:
    """Admits, emits what the scenario asks, and returns (or holds until cancelled)."""

    def __init__(self) -> None:
        self.hold = False
        self.emit = 0

    async def prepare(
        self, request: Request, preset: Preset, identity: Identity, recovery: Recovery | None
    ) -> Run:
        async def run(ctx: ChildContext) -> None:
            await ctx.admit()
            if self.emit:
                for n in range(self.emit):
                    ctx.emit(Event(kind="text", text=f"event {n}"))
                await ctx.flush()
            if self.hold:
                await asyncio.Event().wait()

        return run


class Starter:
    """Starts children as a runner would: a new tool call every 60 children (the default
    cap is 64 per grant), each start one ``child.start`` call."""

    def __init__(self, engine: Engine, conn: Any) -> None:
        self.engine = engine
        self.conn = conn
        self.count = 0
        self.tools: dict[int, asyncio.Future[Any]] = {}

    async def params(self, request_id: str, lease: str = "") -> Params:
        index = self.count // 60
        self.count += 1
        if index not in self.tools:
            self.tools[index] = asyncio.ensure_future(
                self.engine.open_tool(
                    self.conn,
                    run_id="run-1",
                    conversation_id="conv-1",
                    tool_call_id=f"call-{index}",
                    extension_id="ext",
                    presets=[PRESET],
                    workspace=tempfile.gettempdir(),
                )
            )
        await self.tools[index]
        request = Request(request_id=request_id, profile="bench", message="go", lease_id=lease)
        return Params(
            run_id="run-1",
            tool_call_id=f"call-{index}",
            extension_id="ext",
            generation=1,
            lease_id=lease,
            request=request,
        )

    async def start(self, request_id: str, lease: str = "") -> Result:
        result = await self.engine.call(
            self.conn, "child.start", await self.params(request_id, lease)
        )
        assert isinstance(result, Result)
        return result


async def starter_of(engine: Engine) -> Starter:
    return Starter(engine, await engine.connect("bench-runner", "bench-host"))


def rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@dataclass
class PageReader:
    """The raw baseline's read of a page: ``read(child_id, after)`` returns its rows."""

    read: Callable[[int, int], list[Any]]
    close: Callable[[], None] = field(default=lambda: None)


class Bench:
    """Where the scenarios run: new SQLite files in ``folder``, each raw baseline with
    the stdlib ``sqlite3`` (``bench_postgres.PostgresBench``: a PostgreSQL server)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.count = 0
        self.engines: list[Engine] = []  # to close those a failed scenario left open

    def path(self) -> Path:
        self.count += 1
        return self.folder / f"bench-{self.count}.db"

    def new(self) -> Path | str:
        """A new, empty database for one engine or one baseline."""
        return self.path()

    def url(self, target: Path | str) -> str:
        return f"sqlite:///{target}"

    async def engine(self, path: Path | str, runner: Runner, **config: Any) -> Engine:
        settings = msgspec.structs.asdict(_Settings(**config)) if config else {}
        engine = Engine(self.url(path), runner=runner, config=_config(**settings))
        await engine.open()
        self.engines.append(engine)
        return engine

    async def close_engines(self) -> None:
        """Close every engine still open (a scenario failed): their writer threads
        would keep the process alive. Closing an engine twice does nothing."""
        engines, self.engines = self.engines, []
        for engine in engines:
            try:
                await asyncio.wait_for(engine.close(), 30)
            except Exception as exc:  # the scenario's own failure is the one to report
                print(f"  an engine did not close: {exc!r}", file=sys.stderr)

    def raw_commits(self, n: int) -> float:
        return raw_commits(self.path(), n)

    def raw_batches(self, n: int, children: int) -> float:
        return raw_batches(self.path(), n)

    def fill_events(self, target: Path | str, child_id: int, count: int, body: bytes) -> None:
        filler = sqlite3.connect(target)
        filler.executemany(
            "INSERT INTO events (child_id, sequence, body) VALUES (?, ?, ?)",
            ((child_id, n, body) for n in range(1, count + 1)),
        )
        filler.commit()
        filler.close()

    def page_reader(self, target: Path | str) -> PageReader:
        baseline = sqlite3.connect(target)

        def read(child_id: int, after: int) -> list[Any]:
            return baseline.execute(
                "SELECT body FROM events WHERE child_id = ? AND sequence > ?"
                " ORDER BY sequence LIMIT 128",
                (child_id, after),
            ).fetchall()

        return PageReader(read, baseline.close)

    def cleanup(self) -> None:
        """After each scenario (SQLite: the folder goes at the end)."""

    def close(self) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        """What the report's ``machine`` says of the store, besides :func:`machine`."""
        return {}


class _Settings(msgspec.Struct):
    lease_lifetime_s: float = 3600.0
    hold_s: float = 30.0
    start_wait_s: float = 5.0


def _config(**changes: Any) -> EngineConfig:
    from dataclasses import replace

    return replace(CONFIG, **changes)


# --- raw sqlite3 baselines ------------------------------------------------------------


def raw(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute(
        "CREATE TABLE IF NOT EXISTS rows (id INTEGER PRIMARY KEY, child INTEGER, seq INTEGER,"
        " body BLOB)"
    )
    return conn


def raw_commits(path: Path, n: int) -> float:
    """Single-row INSERT transactions per second."""
    conn = raw(path)
    body = b'{"requestId":"q","profile":"bench","message":"go"}'
    started = time.perf_counter()
    for i in range(n):
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO rows (child, seq, body) VALUES (?, ?, ?)", (i, 0, body))
        conn.execute("COMMIT")
    elapsed = time.perf_counter() - started
    conn.close()
    return n / elapsed


def raw_batches(path: Path, n: int, batch: int = 100) -> float:
    """Rows per second inserted in committed batches of ``batch`` rows."""
    conn = raw(path)
    rows = [(i, i, b'{"sequence":1,"kind":"text","text":"event 1"}') for i in range(batch)]
    started = time.perf_counter()
    for _ in range(max(1, n // batch)):
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany("INSERT INTO rows (child, seq, body) VALUES (?, ?, ?)", rows)
        conn.execute("COMMIT")
    elapsed = time.perf_counter() - started
    conn.close()
    return max(1, n // batch) * batch / elapsed


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def machine() -> dict[str, Any]:
    return {
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "platform": platform.platform(),
    }
