"""One host per database file (design §9): a file that is not a delegation database keeps
its mode; a refused second engine keeps the first engine's SQLite locks; a URI URL is
refused; an open cancelled midway gives the file back and leaves no open engine."""

from __future__ import annotations

import asyncio
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from delegation import Engine, errors
from delegation.store import database
from delegation.store.sqlite.files import upgrade_file
from tests.harness.support import ScriptRunner

# A POSIX write lock over SQLite's SHARED range: refused while any connection of
# another process has the database open (WAL keeps that SHARED lock for its life).
_PROBE = r"""
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
try:
    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 510, 1073741826)
    print("free")
except OSError:
    print("held")
"""


def _shared_lock(path: Path) -> str:
    probe = subprocess.run([sys.executable, "-c", _PROBE, str(path)], capture_output=True)
    return probe.stdout.decode().strip()


@pytest.mark.parametrize("how", ["engine", "upgrade"])
async def test_a_file_that_is_not_ours_keeps_its_mode(tmp_path: Path, how: str) -> None:
    """A mistyped --db (another application's file) is refused having changed nothing:
    today its mode (and that of its -wal/-shm/-journal) is set to 0600 first."""
    other = tmp_path / "notes.txt"
    other.write_text("not a database\n")
    other.chmod(0o644)
    if how == "engine":
        with pytest.raises(errors.StoreError):
            await Engine(f"sqlite:///{other}", runner=ScriptRunner()).open()
    else:
        with pytest.raises(errors.StoreError):
            upgrade_file(f"sqlite:///{other}", apply=True)
    assert stat.S_IMODE(other.stat().st_mode) == 0o644


async def test_a_refused_second_engine_keeps_the_first_engines_sqlite_locks(
    engine: Engine, db_path: Path
) -> None:
    """Closing any descriptor of a file drops every POSIX lock the process holds on
    it: the refused open must not close one while this process's engine uses SQLite
    (else an operator's ``sqlite3`` closing last checkpoints and unlinks the live WAL)."""
    await engine.connect("r", "h")
    assert _shared_lock(db_path) == "held"
    with pytest.raises(errors.HostConflict):
        await Engine(f"sqlite:///{db_path}", runner=ScriptRunner()).open()
    assert _shared_lock(db_path) == "held"


async def test_a_uri_url_of_a_live_file_is_not_a_second_host(
    engine: Engine, db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(db_path.parent)
    with pytest.raises(ValueError, match="plain SQLite file URL"):
        Engine(f"sqlite:///file:{db_path.name}?uri=true", runner=ScriptRunner())


async def test_an_open_cancelled_while_the_file_opens_gives_the_file_back(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = Engine(db_url, runner=ScriptRunner())
    # The store's own class: PostgresDatabase overrides ``open``, so patching
    # ``database.Database`` left the [postgres] open fast enough to race the timeout.
    store = type(first._db)
    slow_open = store.open
    opened = threading.Event()

    def open_slowly(self: database.Database, loop: asyncio.AbstractEventLoop) -> None:
        try:
            slow_open(self, loop)
            time.sleep(0.3)  # a long migration, say
        finally:
            opened.set()

    monkeypatch.setattr(store, "open", open_slowly)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(first.open(), 0.05)
    assert not opened.is_set(), "the open was cancelled while the file opens"
    await asyncio.to_thread(opened.wait, 30)
    await asyncio.sleep(0.3)  # the open's done callback runs on this loop
    with pytest.raises(errors.StoreError, match="closed"):  # given back, on any store
        await first._db.read(lambda conn: None)
    monkeypatch.setattr(store, "open", slow_open)
    # A second host on the file (or on PostgreSQL with one host per database) would be
    # refused with HostConflict, had the first open kept it.
    async with Engine(db_url, runner=ScriptRunner()) as again:
        assert again.is_open


async def test_an_open_cancelled_at_its_last_step_leaves_no_open_engine(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cancellation lands after ``_open = True`` (at the ``sleep(0)`` that lets the
    resumed runs step): the caller sees it cancelled, yet it holds the database."""
    first = Engine(db_url, runner=ScriptRunner())
    opening = asyncio.ensure_future(first.open())
    arm = first.timers.start

    def start_then_cancel(loop: asyncio.AbstractEventLoop) -> None:
        arm(loop)
        opening.cancel()

    monkeypatch.setattr(first.timers, "start", start_then_cancel)
    with pytest.raises(asyncio.CancelledError):
        await opening
    try:
        assert not first.is_open, "a cancelled open left the engine open"
    finally:
        await first.close()
