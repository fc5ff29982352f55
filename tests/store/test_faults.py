"""Faults from outside and inside: each a clear error at open or at the call, never damage.

Outside: another process holding SQLite's write lock, a file that no longer grows (a
full disk, made real with ``RLIMIT_FSIZE`` in a host subprocess), a read-only file, a
corrupted or foreign file, a schema newer than the code. Inside: a runner whose
``prepare`` or run raises, or that misuses ``emit`` or cancellation. And after
``close``, nothing of the engine is left: no task, thread, timer or open file.

Every database here is real, through the real migrations: the faults of a SQLite file
run on SQLite only; the runner's faults and the close run on both stores (design §12),
where on PostgreSQL what a closed engine must not leave open is a session on the
server. The other process is a real process. Nothing of the library is mocked.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import make_url

from delegation import (
    ChildContext,
    DelegationError,
    Engine,
    EngineConfig,
    Event,
    Preset,
    errors,
)
from delegation.cli.commands import main
from delegation.clock import ManualClock
from tests.harness import rows as read
from tests.harness.support import Harness, Prepared, Script, ScriptRunner, hold

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "delegation"
BUSY_TIMEOUT_MS = 200
BOUND_S = 5.0  # generous: a busy call waits about two busy timeouts, not seconds
LEASE = "lease-1"


@pytest.fixture
def config() -> EngineConfig:
    return EngineConfig(release_drain_s=1.0, busy_timeout_ms=BUSY_TIMEOUT_MS)


# --- helpers -------------------------------------------------------------------------


def url(db: Path | str) -> str:
    """A SQLite file's URL, or the URL ``db`` already is."""
    return read.url_of(db) if isinstance(db, Path) else db


def rows(db: Path | str, sql: str) -> list[tuple[Any, ...]]:
    """A query through a separate read-only connection (a WAL reader: never blocked)."""
    return read.rows(url(db), sql)


def dump(db: Path | str) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table."""
    return read.snapshot(url(db))


# Every session on the test's own PostgreSQL database but the one asking: nothing else
# than the engine connects to it.
BACKENDS = """
SELECT pid, application_name FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid()
"""

# What a pooler's kept server sessions may not be once the engine closed: in use, or
# holding a lock (a host's advisory lock given back only with the session).
POOLED_IN_USE = """
SELECT pid, state FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid() AND state <> 'idle'
UNION ALL SELECT l.pid, l.locktype FROM pg_locks l JOIN pg_database d ON d.oid = l.database
WHERE d.datname = current_database() AND l.locktype = 'advisory'
"""


def fingerprint(db_path: Path) -> tuple[str, str]:
    """The bytes of a database and of its WAL (absent counts as empty): what it holds.

    A reader may create an empty WAL and the shared-memory index; neither holds data.
    """
    wal = db_path.with_name(db_path.name + "-wal")
    content = wal.read_bytes() if wal.exists() else b""
    return hashlib.sha256(db_path.read_bytes()).hexdigest(), hashlib.sha256(content).hexdigest()


def migrated(path: Path, template: Path) -> Path:
    shutil.copyfile(template, path)
    return path


Leftovers = Callable[[Path | str], list[str]]


@pytest.fixture(autouse=True)
def threads_before() -> set[threading.Thread]:
    """The threads alive before the test (and its engine) started."""
    return set(threading.enumerate())


@pytest.fixture
def leftovers(threads_before: set[threading.Thread]) -> Leftovers:
    """What an engine may have left running or open in this process since the test began:
    for a database given by a PostgreSQL URL, its sessions on the server instead of files."""

    def find(db: Path | str) -> list[str]:
        found = [
            f"thread {t.name}"
            for t in threading.enumerate()
            if t not in threads_before
            and (t.name.startswith("delegation") or "apscheduler" in t.name.lower())
        ]
        current = asyncio.current_task()
        for task in asyncio.all_tasks():
            code = getattr(task.get_coro(), "cr_code", None)
            where = code.co_filename if code is not None else ""
            ours = str(PACKAGE) in where or "apscheduler" in where
            if task is not current and (ours or task.get_name().startswith("delegation")):
                found.append(f"task {task.get_name()} in {where}")
        # APScheduler 3 waits with loop.call_later; a shut-down scheduler cancels its timer.
        for handle in getattr(asyncio.get_running_loop(), "_scheduled", []):
            if not handle.cancelled() and "Scheduler" in repr(handle):
                found.append(f"timer {handle!r}")
        if not read.is_sqlite(url(db)):
            for pid, name in rows(db, BACKENDS):
                found.append(f"connection {name!r} (server process {pid})")
            return found
        db_path = db if isinstance(db, Path) else Path(str(make_url(db).database))
        names = {os.path.realpath(f"{db_path}{end}") for end in ("", "-wal", "-shm", "-journal")}
        for fd in Path("/proc/self/fd").iterdir():
            with contextlib.suppress(OSError):
                if os.readlink(fd) in names:
                    found.append(f"file descriptor {fd.name} on {os.readlink(fd)}")
        return found

    return find


needs_proc = pytest.mark.skipif(
    not Path("/proc/self/fd").is_dir(), reason="open files are read from /proc/self/fd"
)


def route(**scripts: Script) -> Script:
    """One script per child, chosen by the request's message."""

    async def run(ctx: ChildContext) -> None:
        await scripts[ctx.request.message](ctx)

    return run


async def until(predicate: Callable[[], Awaitable[bool]], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


async def committed(harness: Harness, conversation_id: str, texts: list[str]) -> bool:
    return [e.text for e in await harness.engine.events(conversation_id)] == texts


async def state_of(harness: Harness, conversation_id: str) -> str:
    record = await harness.engine.get_child(conversation_id)
    assert record is not None
    return record.state


# --- another process holds the write lock ----------------------------------------------

HOLD_LOCK = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
print("LOCKED", flush=True)
sys.stdin.readline()
conn.execute("ROLLBACK")
conn.close()
"""


@contextlib.contextmanager
def write_lock_held(db_path: Path) -> Iterator[None]:
    """Another process holds the database's write lock until the block ends."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(db_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline() == "LOCKED\n"
        yield
    finally:
        proc.stdin.close()
        assert proc.wait(timeout=10) == 0
        proc.stdout.close()


async def busy(call: Awaitable[Any]) -> errors.DatabaseBusy:
    """The call fails as busy, within the bound."""
    started = time.monotonic()
    with pytest.raises(errors.DatabaseBusy) as info:
        await call
    assert time.monotonic() - started < BOUND_S
    error = info.value
    assert (error.reason, error.rpc_code) == ("database_busy", -32603)
    assert "busy; retry" in str(error)
    return error


@pytest.mark.sqlite_only  # another process holds SQLite's write lock
async def test_a_held_write_lock_fails_calls_as_busy_and_writes_nothing(
    harness: Harness, db_path: Path
) -> None:
    """child.start, steer, cancel and lease.release wait a bounded time, fail with the
    retryable DatabaseBusy and leave no row behind; reads go on. Once the lock is free
    the same calls succeed, and what the running child emitted meanwhile is all there."""
    emit_now, emitted, leased_gate = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def steered(ctx: ChildContext) -> None:
        await ctx.admit()
        ctx.emit(Event(kind="text", text="before"))
        await emit_now.wait()
        for n in (1, 2, 3):
            ctx.emit(Event(kind="text", text=f"during {n}"))
        emitted.set()
        message = await ctx.wait_steer(10)
        ctx.emit(Event(kind="result", text=f"steered: {message}"))

    async def quick(ctx: ChildContext) -> None:
        await ctx.admit()
        ctx.emit(Event(kind="result", text="quick"))

    harness.runner.script = route(steered=steered, leased=hold(leased_gate), quick=quick)
    a = await harness.start("q-a", message="steered")
    c = await harness.start("q-c", message="leased", lease_id=LEASE)
    await until(lambda: committed(harness, a.conversation_id, ["before"]))
    await until(lambda: committed(harness, c.conversation_id, ["working"]))
    steer = harness.params(child_id=a.conversation_id, request_id="s-1", message="go left")
    cancel = harness.params(child_id=c.conversation_id, lease_id=LEASE)
    release = harness.params(lease_id=LEASE)
    prepared = len(harness.runner.prepared)

    with write_lock_held(db_path):
        before = dump(db_path)
        emit_now.set()
        await emitted.wait()
        call = harness.engine.call
        await busy(harness.start("q-b", message="quick"))
        await busy(call(harness.conn, "child.steer", steer))
        await busy(call(harness.conn, "child.cancel", cancel))
        await busy(call(harness.conn, "child.lease.release", release))
        page = await harness.read(a.conversation_id)  # a WAL reader is not blocked
        assert [e.text for e in page.events] == ["before"], "only committed events are read"
        assert dump(db_path) == before, "a busy call wrote nothing"
        assert len(harness.runner.prepared) == prepared, "nothing was prepared"
        assert await state_of(harness, c.conversation_id) == "running", "c was not stopped"

    b = await harness.start("q-b", message="quick")
    assert (await harness.wait_done(b.conversation_id)).output == "quick"
    outcome = await harness.engine.call(harness.conn, "child.steer", steer)
    assert outcome.outcome == "injected"
    done = await harness.wait_done(a.conversation_id)
    assert (done.state, done.output) == ("done", "steered: go left")
    events = await harness.engine.events(a.conversation_id)
    assert [(e.sequence, e.text) for e in events] == [
        (1, "before"),
        (2, "during 1"),
        (3, "during 2"),
        (4, "during 3"),
        (5, "steered: go left"),
    ], "the events emitted while the lock was held are all there, in order"
    cancelled = await harness.engine.call(harness.conn, "child.cancel", cancel)
    assert cancelled.conversation_id == c.conversation_id
    assert (await harness.engine.call(harness.conn, "child.lease.release", release)).done
    record = await harness.wait_done(c.conversation_id)
    assert (record.state, record.error) == ("cancelled", "cancelled: cancel requested")
    assert rows(db_path, "SELECT COUNT(*) FROM children") == [(3,)]


@pytest.mark.sqlite_only  # another process holds SQLite's write lock
async def test_a_run_that_ends_while_the_lock_is_held_is_recorded_once_it_is_free(
    harness: Harness, db_path: Path
) -> None:
    """The engine's own write of a finished run is not a caller's call to retry: a busy
    database delays it, never loses it (else the child would stay running forever)."""
    finish = asyncio.Event()
    harness.runner.script = hold(finish)
    child = await harness.start()
    with write_lock_held(db_path):
        finish.set()
        await asyncio.sleep(5 * BUSY_TIMEOUT_MS / 1000)  # the run is over; its end waits
        assert rows(db_path, "SELECT state FROM children") == [("running",)]
    record = await harness.wait_done(child.conversation_id)
    assert (record.state, record.error, record.output) == ("done", "", "finished")
    events = await harness.engine.events(child.conversation_id)
    assert [(e.sequence, e.text) for e in events] == [(1, "working"), (2, "finished")]


@pytest.mark.sqlite_only  # another process holds SQLite's write lock
@needs_proc
async def test_close_while_the_lock_is_held_is_bounded_and_leaves_nothing_behind(
    harness: Harness, db_path: Path, db_url: str, clock: ManualClock, leftovers: Leftovers
) -> None:
    """A graceful close that cannot write still stops every run and releases the file;
    it says so, and the next boot recovers as after a crash."""
    gate = asyncio.Event()
    harness.runner.script = hold(gate)
    child = await harness.start(lease_id=LEASE)
    await until(lambda: committed(harness, child.conversation_id, ["working"]))
    with write_lock_held(db_path):
        gate.set()  # the run emits its result and ends while nothing can commit
        await asyncio.sleep(0.05)
        started = time.monotonic()
        with pytest.raises(errors.DatabaseBusy):
            await asyncio.wait_for(harness.engine.close(), timeout=3 * BOUND_S)
        assert time.monotonic() - started < 3 * BOUND_S
        assert not harness.engine.is_open
        assert leftovers(db_path) == []
    assert rows(db_path, "PRAGMA integrity_check") == [("ok",)]

    runner = ScriptRunner()
    async with Engine(db_url, runner=runner, clock=clock) as again:
        record = await again.get_child(child.conversation_id)
        assert record is not None
        await until(lambda: _terminal(again, child.conversation_id))
    assert [p.recovery.attempt for p in runner.prepared if p.recovery] == [1], "resumed"


async def _terminal(engine: Engine, conversation_id: str) -> bool:
    record = await engine.get_child(conversation_id)
    return record is not None and record.terminal


# --- the disk is full --------------------------------------------------------------------

DISK_HOST = """
import asyncio, json, os, resource, signal, sys
from delegation import Engine, EngineConfig, Event, Params, Preset, Request, errors

PRESET = Preset(name="worker", extension_id="ext", generation=7)
OWNER = {"run_id": "parent-run", "tool_call_id": "call-1", "extension_id": "ext"}


def say(**fields):
    print(json.dumps(fields), flush=True)


def file_size_limit(limit):
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


FULL, ROOM = asyncio.Event(), asyncio.Event()


class Runner:
    async def prepare(self, request, preset, identity, recovery):
        async def run(ctx):
            await ctx.admit()
            if request.message == "stream":  # emits while the disk is full
                await FULL.wait()
                for _ in range(20):
                    ctx.emit(Event(kind="text", text="y" * 20_000))
                try:
                    await ctx.flush()
                except errors.DelegationError as exc:
                    say(step="stream", flushed=False, error=type(exc).__name__)
                else:
                    say(step="stream", flushed=True, error=None)
                await ROOM.wait()
                await ctx.flush()
            ctx.emit(Event(kind="result", text=f"{len(request.message)} bytes read"))

        return run


async def main(path, workspace):
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails: EFBIG
    engine = Engine(f"sqlite:///{path}", runner=Runner(), config=EngineConfig())
    await engine.open()
    conn = await engine.connect("runner-1", "host-a")
    await engine.open_tool(
        conn, run_id="parent-run", conversation_id="parent-conv", tool_call_id="call-1",
        extension_id="ext", presets=[PRESET], workspace=workspace,
    )

    async def start(request_id, message):
        request = Request(request_id=request_id, profile="worker", message=message)
        params = Params(**OWNER, generation=7, request=request)
        return await engine.call(conn, "child.start", params)

    async def finished(child):
        for _ in range(500):
            record = await engine.get_child(child.conversation_id)
            if record.terminal:
                return record
            await asyncio.sleep(0.01)

    small = await start("q-small", "fits")
    await finished(small)
    say(step="small", child=small.conversation_id)
    stream = await start("q-stream", "stream")
    # From now on no file may grow more than a page past its size: the disk is full.
    files = [path + suffix for suffix in ("", "-wal") if os.path.exists(path + suffix)]
    file_size_limit(max(os.path.getsize(name) for name in files) + 4096)
    FULL.set()
    await asyncio.sleep(0.5)  # the stream's events fail to commit, again and again
    try:
        await start("q-big", "x" * 400_000)
    except errors.DelegationError as exc:
        say(step="full", error=type(exc).__name__, reason=exc.reason, message=str(exc),
            children=len(await engine.list_children()))
    else:
        say(step="full", error=None)
    file_size_limit(resource.RLIM_INFINITY)  # room again: the same call succeeds
    big = await start("q-big", "x" * 400_000)
    record = await finished(big)
    say(step="room", child=big.conversation_id, state=record.state, output=record.output)
    ROOM.set()
    record = await finished(stream)
    events = await engine.events(stream.conversation_id, after=0)
    say(step="streamed", child=stream.conversation_id, state=record.state,
        sequences=[e.sequence for e in events])
    await engine.close()


asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


@pytest.mark.sqlite_only  # a SQLite file that cannot grow; PRAGMA checks
async def test_a_full_disk_is_a_clear_error_at_the_call_and_no_damage(
    db_path: Path, workspace: Path
) -> None:
    """A host whose file cannot grow gets a StoreError for the call that needed room, has
    nothing of it half-written, and serves the same call once there is room; the file
    reopens intact."""
    proc = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", DISK_HOST, str(db_path), str(workspace)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    small, stream, full, room, streamed = (json.loads(line) for line in proc.stdout.splitlines())
    # Events emitted while the disk was full are kept for the next try, never dropped:
    # once there is room they commit, and the child's sequence has no gap.
    assert (stream["flushed"], stream["error"]) == (False, "StoreError"), stream
    assert streamed["state"] == "done"
    assert streamed["sequences"] == list(range(1, 22))
    assert full["error"] is not None, "the write past the file size limit did not fail"
    assert (full["error"], full["reason"]) == ("StoreError", "store_error"), full
    assert full["message"].startswith("child store failed: "), full
    assert full["children"] == 2, "nothing of the failed start was written"
    assert (room["state"], room["output"]) == ("done", "400000 bytes read")

    assert rows(db_path, "PRAGMA integrity_check") == [("ok",)]
    assert rows(db_path, "PRAGMA foreign_key_check") == []
    found = rows(db_path, "SELECT conversation_id, request_id, state, output FROM children")
    assert sorted(found) == sorted(
        [
            (small["child"], "q-small", "done", "4 bytes read"),
            (room["child"], "q-big", "done", "400000 bytes read"),
            (streamed["child"], "q-stream", "done", "6 bytes read"),
        ]
    )


# --- files the engine must not open ------------------------------------------------------


def _not_sqlite(path: Path, template: Path) -> Path:
    path.write_bytes(b"name,value\n" + b"a,1\n" * 4096)
    return path


def _corrupt_header(path: Path, template: Path) -> Path:
    migrated(path, template)
    data = bytearray(path.read_bytes())
    data[:100] = random.Random(1).randbytes(100)
    path.write_bytes(bytes(data))
    return path


def _corrupt_pages(path: Path, template: Path) -> Path:
    """A real database whose schema reads fine but whose children pages are garbage."""
    migrated(path, template)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        roots = [
            root
            for (root,) in conn.execute(
                "SELECT rootpage FROM sqlite_master WHERE tbl_name = 'children' AND rootpage > 0"
            )
        ]
        (page_size,) = conn.execute("PRAGMA page_size").fetchone()
    noise = random.Random(2)
    with path.open("r+b") as file:
        for root in roots:
            file.seek((root - 1) * page_size)
            file.write(noise.randbytes(page_size))
    return path


def _foreign(path: Path, template: Path) -> Path:
    """Another application's SQLite file (a rollback journal, tables of its own)."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT NOT NULL)")
        conn.executemany("INSERT INTO notes (body) VALUES (?)", [("keep me",), ("me too",)])
        conn.commit()
    return path


def _foreign_clash(path: Path, template: Path) -> Path:
    """Another application's file with a table named like one of ours."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("CREATE TABLE children (id INTEGER PRIMARY KEY, name TEXT)")
        conn.execute("INSERT INTO children (name) VALUES ('alice')")
        conn.commit()
    return path


def _foreign_alembic(path: Path, template: Path) -> Path:
    """Another application that uses Alembic too: a revision we have never heard of."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) PRIMARY KEY)")
        conn.execute("INSERT INTO alembic_version VALUES ('ae1027a6acf')")
        conn.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY)")
        conn.commit()
    return path


def _newer_schema(path: Path, template: Path) -> Path:
    migrated(path, template)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '0099_from_the_future'")
        conn.commit()
    return path


REFUSED: dict[str, tuple[Callable[[Path, Path], Path], type[DelegationError], str]] = {
    "not_sqlite": (_not_sqlite, errors.StoreError, "file is not a database"),
    "corrupt_header": (_corrupt_header, errors.StoreError, "file is not a database"),
    "corrupt_pages": (_corrupt_pages, errors.StoreError, "malformed"),
    "foreign": (_foreign, errors.SchemaMismatch, "not a delegation database"),
    "foreign_clash": (_foreign_clash, errors.SchemaMismatch, "not a delegation database"),
    "foreign_alembic": (_foreign_alembic, errors.SchemaMismatch, "ae1027a6acf"),
    "newer_schema": (_newer_schema, errors.SchemaMismatch, "0099_from_the_future"),
}


@pytest.mark.sqlite_only  # files built and corrupted through sqlite3
@needs_proc
@pytest.mark.parametrize("kind", REFUSED)
async def test_a_file_the_engine_cannot_use_is_refused_at_open_untouched(
    kind: str, tmp_path: Path, template_db: Path, leftovers: Leftovers
) -> None:
    make, error, says = REFUSED[kind]
    path = make(tmp_path / "delegation.db", template_db)
    before = fingerprint(path)
    runner = ScriptRunner()
    engine = Engine(f"sqlite:///{path}", runner=runner)
    with pytest.raises(DelegationError) as info:
        await engine.open()
    assert type(info.value) is error, info.value
    assert says in str(info.value)
    assert not engine.is_open
    assert fingerprint(path) == before, "the file was changed"
    assert leftovers(path) == []
    assert runner.prepared == []


@pytest.mark.sqlite_only  # the stdlib driver's SQLite version
async def test_an_sqlite_older_than_3_35_5_is_refused_at_open_untouched(
    tmp_path: Path, template_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Admission is one ``UPDATE ... RETURNING``, which SQLite has since 3.35 (with the
    fixes of 3.35.5)."""
    path = tmp_path / "delegation.db"
    shutil.copy(template_db, path)
    before = fingerprint(path)
    monkeypatch.setattr(sqlite3, "sqlite_version_info", (3, 35, 4))
    monkeypatch.setattr(sqlite3, "sqlite_version", "3.35.4")
    engine = Engine(f"sqlite:///{path}", runner=ScriptRunner())
    with pytest.raises(errors.StoreError) as info:
        await engine.open()
    assert str(info.value) == "delegation needs SQLite 3.35.5 or newer; this Python has 3.35.4"
    assert not engine.is_open
    assert fingerprint(path) == before


@pytest.mark.sqlite_only  # the file is changed through sqlite3
def test_a_newer_schema_is_explained_by_the_cli_and_left_alone(
    tmp_path: Path, template_db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _newer_schema(tmp_path / "delegation.db", template_db)
    before = fingerprint(path)
    for command in (["db", "upgrade"], ["children"], ["db", "current"]):
        assert main([*command, "--db", str(path)]) == 1, command
        err = capsys.readouterr().err
        assert "0099_from_the_future" in err and "newer" in err, err
        assert "(schema_mismatch)" in err
        assert "run `delegation db upgrade`" not in err
    assert fingerprint(path) == before


@pytest.mark.sqlite_only  # another application's SQLite file
def test_a_foreign_file_is_not_migrated_by_the_cli(
    tmp_path: Path, template_db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _foreign(tmp_path / "notes.db", template_db)
    before = fingerprint(path)
    assert main(["db", "upgrade", "--db", str(path)]) == 1
    err = capsys.readouterr().err
    assert "not a delegation database" in err and "(schema_mismatch)" in err
    assert fingerprint(path) == before
    assert rows(path, "SELECT body FROM notes") == [("keep me",), ("me too",)]


# The read-only probe runs in a process of its own. Root writes through permission bits
# by its CAP_DAC_OVERRIDE capability; as root, the probe gives that capability up first,
# so a 0444 file in a 0555 directory is as read-only to it as to any other user.
READ_ONLY_PROBE = """
import asyncio, ctypes, json, os, sys
from delegation import DelegationError, Engine
from tests.harness.support import ScriptRunner

CAP_DAC_OVERRIDE = 1


class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def drop_dac_override():
    libc = ctypes.CDLL(None, use_errno=True)
    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    for field in ("effective", "permitted", "inheritable"):
        setattr(data[0], field, getattr(data[0], field) & ~(1 << CAP_DAC_OVERRIDE))
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


async def main(url):
    engine = Engine(url, runner=ScriptRunner())
    try:
        await engine.open()
    except DelegationError as exc:
        print(json.dumps({"error": type(exc).__name__, "reason": exc.reason, "message": str(exc)}))
    else:
        await engine.close()
        print(json.dumps({"error": None}))


if os.geteuid() == 0:
    drop_dac_override()
asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.sqlite_only  # a read-only SQLite file
@pytest.mark.skipif(
    os.geteuid() == 0 and sys.platform != "linux",
    reason="as root, the probe gives up CAP_DAC_OVERRIDE, a Linux capability",
)
def test_a_read_only_database_is_refused_at_open_untouched(
    tmp_path: Path, template_db: Path
) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    path = migrated(folder / "delegation.db", template_db)
    path.chmod(0o444)
    folder.chmod(0o555)
    before = sorted(p.name for p in folder.iterdir()), fingerprint(path)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", READ_ONLY_PROBE, f"sqlite:///{path}"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            check=False,
        )
    finally:
        folder.chmod(0o755)  # so that pytest can clean up
    assert proc.returncode == 0, proc.stderr
    outcome = json.loads(proc.stdout)
    assert outcome == {  # design §18: refused as read-only, never written through
        "error": "DatabaseReadOnly",
        "reason": "database_read_only",
        "message": "database file is read-only",
    }
    assert (sorted(p.name for p in folder.iterdir()), fingerprint(path)) == before


# --- runner faults end only their child ------------------------------------------------------


class Boom(Exception):
    pass


class FaultRunner(ScriptRunner):
    """A ScriptRunner whose ``prepare`` fails for the message "prepare raises"."""

    async def prepare(self, request: Any, preset: Preset, identity: Any, recovery: Any) -> Script:
        if request.message == "prepare raises":
            self.prepared.append(Prepared(request, preset, identity, recovery))
            raise Boom("no such model: gpt-0")
        return await super().prepare(request, preset, identity, recovery)


@pytest.fixture
def runner() -> ScriptRunner:
    return FaultRunner()


async def _raise_before_admit(ctx: ChildContext) -> None:
    raise Boom("tool crashed early")


async def _cancelled_by_itself_before_admit(ctx: ChildContext) -> None:
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    future.cancel()
    await future  # a CancelledError nobody asked for


async def _raise_after_admit(ctx: ChildContext) -> None:
    await ctx.admit()
    ctx.emit(Event(kind="text", text="working"))
    raise Boom("tool crashed late")


async def _emit_not_an_event(ctx: ChildContext) -> None:
    await ctx.admit()
    ctx.emit(Event(kind="text", text="working"))
    ctx.emit({"kind": "text", "text": "a dict"})  # type: ignore[arg-type]


async def _cancelled_by_itself_after_admit(ctx: ChildContext) -> None:
    await ctx.admit()
    ctx.emit(Event(kind="text", text="working"))
    await _cancelled_by_itself_before_admit(ctx)


NEVER_ADMITTED = {
    "prepare raises": "no such model: gpt-0",
    "raises before admit": "tool crashed early",
    "cancelled by itself before admit": "CancelledError",
}
ADMITTED = {
    "raises after admit": "tool crashed late",
    "emits a dict": "emit() takes an Event, not dict",
    "cancelled by itself after admit": "CancelledError",
}
SCRIPTS = {
    "raises before admit": _raise_before_admit,
    "cancelled by itself before admit": _cancelled_by_itself_before_admit,
    "raises after admit": _raise_after_admit,
    "emits a dict": _emit_not_an_event,
    "cancelled by itself after admit": _cancelled_by_itself_after_admit,
}


@dataclass
class Sibling:
    """A leased child that keeps running beside the faulty one; ``check`` proves it
    untouched and the engine still serving: it finishes, and a new start works."""

    harness: Harness
    scripts: dict[str, Script]
    gate: asyncio.Event
    conversation_id: str = ""

    async def check(self) -> None:
        assert await state_of(self.harness, self.conversation_id) == "running"
        self.gate.set()
        record = await self.harness.wait_done(self.conversation_id)
        assert (record.state, record.error, record.output) == ("done", "", "finished")
        fresh = await self.harness.start("q-after", message="quick")
        assert (await self.harness.wait_done(fresh.conversation_id)).output == "quick"


@pytest.fixture
async def sibling(harness: Harness) -> AsyncIterator[Sibling]:
    async def quick(ctx: ChildContext) -> None:
        await ctx.admit()
        ctx.emit(Event(kind="result", text="quick"))

    gate = asyncio.Event()
    scripts: dict[str, Script] = {"sibling": hold(gate), "quick": quick, **SCRIPTS}

    async def run(ctx: ChildContext) -> None:
        await scripts[ctx.request.message](ctx)

    harness.runner.script = run
    found = Sibling(harness, scripts, gate)
    child = await harness.start("q-sibling", message="sibling", lease_id=LEASE)
    found.conversation_id = child.conversation_id
    yield found
    gate.set()


@pytest.mark.parametrize("fault", NEVER_ADMITTED)
async def test_a_fault_before_admission_fails_that_child_only(
    fault: str, harness: Harness, sibling: Sibling
) -> None:
    expected = f"child admission failed: {NEVER_ADMITTED[fault]}"
    with pytest.raises(errors.AdmissionFailed) as info:
        await harness.start("q-fault", message=fault)
    assert str(info.value) == expected
    with pytest.raises(errors.AdmissionFailed) as again:
        await harness.start("q-fault", message=fault)  # a replay runs nothing
    assert str(again.value) == expected
    (record,) = await harness.engine.list_children(state="done")
    assert (record.state, record.error) == ("done", NEVER_ADMITTED[fault])
    with pytest.raises(errors.AdmissionFailed) as read:
        await harness.read(record.conversation_id)
    assert str(read.value) == expected
    assert [p.request.message for p in harness.runner.prepared].count(fault) == 1
    await sibling.check()


@pytest.mark.parametrize("fault", ADMITTED)
async def test_a_fault_after_admission_ends_that_child_only(
    fault: str, harness: Harness, sibling: Sibling
) -> None:
    started = await harness.start("q-fault", message=fault)
    assert not started.cancelled
    record = await harness.wait_done(started.conversation_id)
    assert (record.state, record.error) == ("done", ADMITTED[fault])
    result = await harness.read(started.conversation_id)
    assert (result.done, result.cancelled, result.error) == (True, False, ADMITTED[fault])
    assert [(e.sequence, e.text) for e in result.events] == [(1, "working")]
    await sibling.check()


async def test_an_ill_typed_event_is_refused_at_emit_and_poisons_nothing(
    harness: Harness, sibling: Sibling
) -> None:
    """msgspec does not check types at construction: an Event with a number for a string
    must be refused by emit, not stored where every later read would choke on it, and
    a refused event takes no sequence number."""
    refused: list[str] = []

    async def sloppy(ctx: ChildContext) -> None:
        await ctx.admit()
        bad = (
            Event(kind=5),  # type: ignore[arg-type]
            Event(kind="text", text=5),  # type: ignore[arg-type]
            Event(kind="tool", tool_name="ls", success="yes"),  # type: ignore[arg-type]
            Event(kind="text", text="\udc80"),  # a lone surrogate is no UTF-8
        )
        for event in bad:
            try:
                ctx.emit(event)
            except TypeError as exc:
                refused.append(str(exc))
        ctx.emit(Event(kind="result", text="still fine"))

    sibling.scripts["sloppy"] = sloppy
    started = await harness.start("q-sloppy", message="sloppy")
    record = await harness.wait_done(started.conversation_id)
    assert (record.state, record.error, record.output) == ("done", "", "still fine")
    assert len(refused) == 4, refused
    assert all(r.startswith("emit() takes a well-formed Event: ") for r in refused), refused
    result = await harness.read(started.conversation_id)
    assert [(e.sequence, e.kind, e.text) for e in result.events] == [(1, "result", "still fine")]
    await sibling.check()


async def test_emit_after_the_run_ended_is_refused_and_changes_nothing(
    harness: Harness, sibling: Sibling
) -> None:
    kept: list[ChildContext] = []

    async def leaky(ctx: ChildContext) -> None:
        await ctx.admit()
        kept.append(ctx)
        ctx.emit(Event(kind="result", text="over"))

    sibling.scripts["leaky"] = leaky
    started = await harness.start("q-leaky", message="leaky")
    await harness.wait_done(started.conversation_id)
    with pytest.raises(RuntimeError, match="has ended"):
        kept[0].emit(Event(kind="text", text="too late"))
    await asyncio.sleep(0.05)
    result = await harness.read(started.conversation_id)
    assert [(e.sequence, e.text) for e in result.events] == [(1, "over")]
    assert (result.done, result.output) == (True, "over")
    await sibling.check()


async def test_a_run_that_swallows_cancellation_still_ends_cancelled(
    harness: Harness, sibling: Sibling
) -> None:
    async def stubborn(ctx: ChildContext) -> None:
        await ctx.admit()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            ctx.emit(Event(kind="text", text="cleaning up"))
            await asyncio.sleep(0.05)  # it goes on for a while, then returns normally
        ctx.emit(Event(kind="result", text="returned normally"))

    sibling.scripts["stubborn"] = stubborn
    started = await harness.start("q-stubborn", message="stubborn")
    await harness.engine.call(
        harness.conn, "child.cancel", harness.params(child_id=started.conversation_id)
    )
    record = await harness.wait_done(started.conversation_id)
    assert (record.state, record.error) == ("cancelled", "cancelled: cancel requested")
    events = await harness.engine.events(started.conversation_id)
    assert [e.text for e in events] == ["cleaning up", "returned normally"]
    await sibling.check()


# --- after close, nothing is left ------------------------------------------------------------


@needs_proc
async def test_close_leaves_no_task_thread_timer_or_open_file(
    harness: Harness, db_url: str, leftovers: Leftovers, request: pytest.FixtureRequest
) -> None:
    """On PostgreSQL the engine's open "files" are its sessions on the server. Through
    a session pooler the server sessions outlive the engine's connections (the pooler
    keeps them for its next client): there none may stay in use or hold a lock."""
    gate = asyncio.Event()

    async def stubborn(ctx: ChildContext) -> None:
        await ctx.admit()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            ctx.emit(Event(kind="text", text="interrupted"))

    harness.runner.script = route(held=hold(gate), stubborn=stubborn)
    await harness.start("q-fg", message="held")
    leased = await harness.start("q-leased", message="held", lease_id=LEASE)
    await harness.start("q-stubborn", message="stubborn", lease_id=LEASE)
    await harness.read(leased.conversation_id, lease_id=LEASE)
    assert harness.engine.timers.armed_at() is not None  # the lease's wake-up
    sqlite = read.is_sqlite(db_url)
    live = {found.split()[0] for found in leftovers(db_url)}
    held = "file" if sqlite else "connection"
    assert live == {"thread", "task", "timer", held}, "the probe sees a live engine"

    await harness.engine.close()
    left = leftovers(db_url)
    if not sqlite:  # a closed session's server process ends just after: wait for it
        left = [found for found in left if not found.startswith("connection ")]

        pooled = request.node.callspec.params.get("db_url") == "pgbouncer"

        async def no_session() -> bool:
            if pooled:
                return rows(db_url, POOLED_IN_USE) == []
            return rows(db_url, BACKENDS) == []

        await until(no_session)
    assert left == []
    if sqlite:
        assert rows(db_url, "PRAGMA integrity_check") == [("ok",)]
    states = dict(rows(db_url, "SELECT request_id, state FROM children"))
    assert states == {"q-fg": "cancelled", "q-leased": "running", "q-stubborn": "running"}
    with pytest.raises(errors.StoreError):
        await harness.start("q-late")


@pytest.mark.sqlite_only  # a SQLite file corrupted through sqlite3
@needs_proc
async def test_a_failed_open_leaves_nothing_behind_and_a_good_open_still_works(
    tmp_path: Path, template_db: Path, leftovers: Leftovers
) -> None:
    """The engine gives the file back on every way out of open, so the host can retry."""
    path = _corrupt_pages(tmp_path / "delegation.db", template_db)
    engine = Engine(f"sqlite:///{path}", runner=ScriptRunner())
    for _ in range(2):  # the same engine, retried
        with pytest.raises(errors.StoreError, match="malformed"):
            await engine.open()
        assert leftovers(path) == []
    good = migrated(tmp_path / "good.db", template_db)
    async with Engine(f"sqlite:///{good}", runner=ScriptRunner()) as engine:
        conn = await engine.connect("runner-1", "host-a")
        assert conn.generation == 1
    assert leftovers(good) == []


async def test_close_does_not_wait_forever_for_a_run_that_ignores_cancellation(
    harness: Harness,
) -> None:
    released = asyncio.Event()

    async def deaf(ctx: ChildContext) -> None:
        await ctx.admit()
        while not released.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await released.wait()

    harness.runner.script = deaf
    await harness.start("q-deaf", lease_id=LEASE)
    drain = harness.engine.config.release_drain_s
    begun = time.monotonic()
    await asyncio.wait_for(harness.engine.close(), drain + 10)
    assert time.monotonic() - begun < drain + 5
    assert not harness.engine.is_open
    stuck = [t for t in asyncio.all_tasks() if t.get_name().startswith("delegation-child-")]
    assert len(stuck) == 1 and not stuck[0].done()
    released.set()
    await asyncio.wait_for(stuck[0], 5)  # it ends on its own; its end is not recorded
