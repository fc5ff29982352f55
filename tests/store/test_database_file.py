"""The SQLite file underneath a host (design §18, issue 28 point 7).

A file replaced while a host runs (a backup restored with ``mv backup.db live.db``) is
noticed: the host stops its runs, writes nothing more and exits with "database file
was replaced while in use", and no second host takes its children over while it
lives. A read-only file is refused ("database file is read-only"), never made
writable. A refused file (newer schema, read-only, not a database, held by another
host) is left as it was: no -wal, -shm or lock file beside it, not a byte changed.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from delegation import ChildContext, Engine, EngineConfig, errors
from tests.harness.serve_runners import streaming
from tests.harness.serving import socket_client, start_params
from tests.harness.support import ScriptRunner, open_harness, until_exists

pytestmark = pytest.mark.sqlite_only  # a SQLite file is what is replaced

ROOT = Path(__file__).resolve().parents[2]
LOCK_HOST = Path(__file__).resolve().parents[1] / "harness" / "lock_host.py"
REPLACED = "database file was replaced while in use"
READ_ONLY = "database file is read-only"
NOISE = ("Traceback", "Unhandled exception", "Task was destroyed", "never retrieved")


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def fingerprint(path: Path) -> tuple[str, int, int]:
    """The file's bytes (a digest), its mtime and its mode."""
    info = path.stat()
    return hashlib.sha256(path.read_bytes()).hexdigest(), info.st_mtime_ns, info.st_mode


def backup(live: Path, to: Path) -> None:
    """A consistent copy of a live database, as an operator takes one (SQLite's online
    backup, the WAL's commits included)."""
    source, target = sqlite3.connect(live), sqlite3.connect(to)
    try:
        source.backup(target)
    finally:
        target.close()
        source.close()


async def resumed_by_the_next_host(live: Path) -> list[tuple[str, int]]:
    """The children a host opening ``live`` resumes (as after a crash), with their
    attempt: what the restored file holds, readable and whole."""
    runner = ScriptRunner()
    async with Engine(f"sqlite:///{live}", runner=runner):
        for _ in range(2400):
            if runner.prepared:
                break
            await asyncio.sleep(0.025)
    return [
        (p.identity.conversation_id, p.recovery.attempt if p.recovery else 0)
        for p in runner.prepared
    ]


@pytest.fixture
def folder(tmp_path: Path, template_db: Path) -> Path:
    """A folder holding only ``live.db`` (migrated) and, in ``backup/``, nothing yet."""
    place = tmp_path / "db"
    place.mkdir()
    shutil.copyfile(template_db, place / "live.db")
    (tmp_path / "backup").mkdir()
    return place


# --- a replaced file is noticed ---------------------------------------------------------


async def test_serve_exits_with_one_line_when_its_file_is_replaced(
    folder: Path, tmp_path: Path, workspace: Path
) -> None:
    """`mv backup.db live.db` under a serving host: it stops its runs and exits 1 with
    the one line, having written nothing to the restored file and left nothing of its
    own beside it; the next host opens the restored file and resumes its child."""
    live, saved = folder / "live.db", tmp_path / "backup" / "live.db"
    sock, log_path = tmp_path / "host.sock", tmp_path / "host.log"
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "delegation.cli", "serve", "--socket", str(sock),
            "--db", str(live), "--runner", "tests.harness.serve_runners:Streaming",
            stderr=log, cwd=ROOT,
        )  # fmt: skip
    try:
        await until_exists(sock, timeout_s=60, pause_s=0.025)
        client = await socket_client(sock)
        await client.setup(workspace)
        started = await client.ok("child.start", start_params("q1", "stream", leaseId="L1"))
        await asyncio.sleep(0.2)  # it streams
        backup(live, saved)
        restored = fingerprint(saved)
        os.replace(saved, live)
        assert await asyncio.wait_for(proc.wait(), 60) == 1
        await client.close()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    logged = log_path.read_text()
    assert logged.splitlines()[-1] == f"delegation: {REPLACED} (database_replaced)", logged
    assert logged.count("action=database_replaced") == 1, logged
    for noise in NOISE:
        assert noise not in logged, logged
    assert fingerprint(live) == restored, "not a byte written to the restored file"
    assert listing(folder) == ["live.db"], "its own -wal and -shm are not left beside it"
    assert await resumed_by_the_next_host(live) == [(started["conversationId"], 1)]


def test_a_second_host_takes_over_only_once_the_first_has_stopped(
    folder: Path, tmp_path: Path, workspace: Path
) -> None:
    """Today the second host opened the restored file at once and resumed the child
    the first still ran: two runners of one child. Its -wal, still the first host's,
    keeps the second out until the first has stopped its run and given the path up.
    Both hosts write their lines to one file: its order is the order of events."""
    live, saved = folder / "live.db", tmp_path / "backup" / "live.db"
    url, out = f"sqlite:///{live}", tmp_path / "hosts.out"
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(*args: str) -> None:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            procs.append(
                subprocess.Popen([sys.executable, str(LOCK_HOST), *args], stdout=fd, cwd=ROOT)
            )
        finally:
            os.close(fd)

    def lines() -> list[str]:
        return out.read_text().splitlines() if out.exists() else []

    def wait_for(prefix: str) -> str:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            found = [line for line in lines() if line.startswith(prefix)]
            if found:
                return found[0]
            time.sleep(0.02)
        raise AssertionError(f"no {prefix!r} line: {lines()}")

    try:
        spawn("first", url, str(workspace))
        conversation = wait_for("STARTED").split()[1]
        backup(live, saved)
        spawn("second", url)
        refused = wait_for("REFUSED")
        assert refused == "REFUSED host_conflict database is in use by another live host"
        os.replace(saved, live)
        assert [proc.wait(60) for proc in procs] == [0, 0], lines()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    said = lines()
    assert said.index("RUN STOPPED") < said.index("OPENED"), said
    assert said.index("RUN STOPPED") < said.index(f"RESUMED {conversation} 1"), said
    assert f"FAILED database_replaced {REPLACED}" in said
    assert "CLOSED database_replaced" in said


@pytest.mark.parametrize("noticed", ["at_its_check", "at_close"])
async def test_an_idle_host_notices(folder: Path, tmp_path: Path, noticed: str) -> None:
    """No run writes: the host looks every host_heartbeat_s, or it closes first (a
    SIGTERM right after the restore). Every write is refused from then on, close says
    why, and nothing of the restored file changed. Its own -wal and -shm do not stay
    beside it: SQLite's connections, seeing their file moved, leave them at close,
    and the next host would read that log into the restored file."""
    live, saved = folder / "live.db", tmp_path / "backup" / "live.db"
    config = EngineConfig(host_heartbeat_s=0.2, host_timeout_s=1.0)
    if noticed == "at_close":
        config = EngineConfig(host_heartbeat_s=600.0, host_timeout_s=1800.0)
    engine = Engine(f"sqlite:///{live}", runner=ScriptRunner(), config=config)
    await engine.open()
    try:
        await engine.connect("runner-1", "host-a")  # its -wal holds a commit
        backup(live, saved)
        restored = fingerprint(saved)
        os.replace(saved, live)
        if noticed == "at_its_check":
            failure = await asyncio.wait_for(engine.failed(), 60)
            assert (type(failure), str(failure)) == (errors.DatabaseReplaced, REPLACED)
            assert (failure.reason, failure.rpc_code) == ("database_replaced", -32603)
            with pytest.raises(errors.DatabaseReplaced, match=f"^{REPLACED}$"):
                await engine.connect("runner-1", "host-a")
    finally:
        with pytest.raises(errors.DatabaseReplaced, match=f"^{REPLACED}$"):
            await engine.close()
    assert not engine.is_open
    assert fingerprint(live) == restored
    assert listing(folder) == ["live.db"]


async def test_a_writing_host_notices_at_its_next_commit(
    folder: Path, tmp_path: Path, workspace: Path
) -> None:
    """The periodic check is far off: the run's own next flush finds the file replaced.
    The run is stopped (cancelled, its end not recorded), the events it emitted after
    the replacement are dropped, and the restored file gets none of them."""
    live, saved = folder / "live.db", tmp_path / "backup" / "live.db"
    config = EngineConfig(host_heartbeat_s=600.0, host_timeout_s=1800.0)
    stopped: list[BaseException] = []

    async def stream_until_stopped(ctx: ChildContext) -> None:
        try:
            await streaming(ctx)
        except BaseException as exc:
            stopped.append(exc)
            raise

    runner = ScriptRunner(stream_until_stopped)
    engine = Engine(f"sqlite:///{live}", runner=runner, config=config)
    await engine.open()
    try:
        harness = await open_harness(engine, runner, workspace)
        child = await harness.start(lease_id="L1")
        backup(live, saved)
        restored = fingerprint(saved)
        os.replace(saved, live)
        assert str(await asyncio.wait_for(engine.failed(), 60)) == REPLACED
        assert [type(exc) for exc in stopped] == [asyncio.CancelledError]
    finally:
        with pytest.raises(errors.DatabaseReplaced):
            await engine.close()
    assert fingerprint(live) == restored
    assert listing(folder) == ["live.db"]
    assert await resumed_by_the_next_host(live) == [(child.conversation_id, 1)]


@pytest.mark.parametrize("noticed", ["by_a_write", "at_close"])
async def test_a_host_whose_side_files_went_too_leaves_the_new_hosts_alone(
    folder: Path, tmp_path: Path, noticed: str
) -> None:
    """A restore that also removed the -wal and -shm (as SQLite's docs ask of a copy):
    a second host opens the restored file before the first notices. The first, closing,
    leaves the -wal and -shm that are now the second host's alone, whether it noticed
    before its close or only as it closes (SIGTERM right after the restore): it removes
    only its own, and SQLite's connections, seeing their file moved, neither checkpoint
    nor remove by name at close."""
    live, saved = folder / "live.db", tmp_path / "backup" / "live.db"
    config = EngineConfig(host_heartbeat_s=600.0, host_timeout_s=1800.0)
    first = Engine(f"sqlite:///{live}", runner=ScriptRunner(), config=config)
    await first.open()
    second: Engine | None = None
    try:
        backup(live, saved)
        for suffix in ("-wal", "-shm"):
            Path(f"{live}{suffix}").unlink()
        os.replace(saved, live)
        second = Engine(f"sqlite:///{live}", runner=ScriptRunner())
        await second.open()
        theirs = {s: os.stat(f"{live}{s}").st_ino for s in ("-wal", "-shm")}
        if noticed == "by_a_write":
            with pytest.raises(errors.DatabaseReplaced):
                await first.connect("runner-1", "host-a")  # a write finds the file replaced
            await asyncio.wait_for(first.failed(), 60)
        with pytest.raises(errors.DatabaseReplaced):
            await first.close()
        assert {s: os.stat(f"{live}{s}").st_ino for s in ("-wal", "-shm")} == theirs
        assert (await second.connect("runner-2", "host-b")).generation == 1
    finally:
        if first.is_open:
            with pytest.raises(errors.DatabaseReplaced):
                await first.close()
        if second is not None:
            await second.close()


# --- a read-only file is refused ---------------------------------------------------------


async def test_a_read_only_file_is_refused_never_made_writable(folder: Path) -> None:
    """Root writes a 0444 file all the same: today it was made 0600 and written."""
    live = folder / "live.db"
    live.chmod(0o444)
    before = listing(folder), fingerprint(live)
    with pytest.raises(errors.DatabaseReadOnly) as caught:
        await Engine(f"sqlite:///{live}", runner=ScriptRunner()).open()
    assert str(caught.value) == READ_ONLY
    assert (caught.value.reason, caught.value.rpc_code) == ("database_read_only", -32603)
    assert (listing(folder), fingerprint(live)) == before
    assert stat.S_IMODE(live.stat().st_mode) == 0o444


@pytest.mark.parametrize("command", ["serve", "upgrade"])
def test_serve_and_upgrade_refuse_a_read_only_file_in_one_line(
    folder: Path, tmp_path: Path, command: str
) -> None:
    live = folder / "live.db"
    live.chmod(0o444)
    before = listing(folder), fingerprint(live)
    args = (
        ["serve", "--socket", str(tmp_path / "host.sock")]
        if command == "serve"
        else ["db", "upgrade"]
    )
    proc = subprocess.run(
        [sys.executable, "-m", "delegation.cli", *args, "--db", str(live)],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=False,
    )  # fmt: skip
    assert (proc.returncode, proc.stderr) == (1, f"delegation: {READ_ONLY} (database_read_only)\n")
    assert (listing(folder), fingerprint(live)) == before


def _read_only_mount(folder: Path) -> Iterator[str]:
    """The shell lines that remount ``folder`` read-only in a mount namespace of its own."""
    yield f"mount --bind {folder} {folder}"
    yield f"mount -o remount,bind,ro {folder}"


@pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux's unshare")
def test_a_file_on_a_read_only_mount_is_refused(folder: Path, tmp_path: Path) -> None:
    """EROFS: even root cannot write it (today SQLite's own error came later)."""
    live = folder / "live.db"
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "; ".join(_read_only_mount(folder))],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if probe.returncode != 0:
        pytest.skip(f"no mount namespace here: {probe.stderr.strip()}")
    before = listing(folder), fingerprint(live)
    serve = f"{sys.executable} -m delegation.cli serve --socket {tmp_path}/h.sock --db {live}"
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", "; ".join([*_read_only_mount(folder), f"exec {serve}"])],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=False,
    )  # fmt: skip
    assert (proc.returncode, proc.stderr) == (1, f"delegation: {READ_ONLY} (database_read_only)\n")
    assert (listing(folder), fingerprint(live)) == before


# --- nothing is created beside a refused file ----------------------------------------------


def _newer_schema(live: Path) -> None:
    with sqlite3.connect(live) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '9999_from_the_future'")
    conn.close()


def _read_only(live: Path) -> None:
    live.chmod(0o444)


def _not_a_database(live: Path) -> None:
    live.write_text("my notes, not a database\n")


REFUSALS = {
    "newer_schema": (_newer_schema, errors.SchemaMismatch),
    "read_only": (_read_only, errors.DatabaseReadOnly),
    "not_a_database": (_not_a_database, errors.StoreError),
    "held_by_another_host": (None, errors.HostConflict),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_nothing_is_created_beside_a_refused_file(folder: Path, case: str) -> None:
    """Today a newer-schema file that was refused still got a -wal and a -shm."""
    live = folder / "live.db"
    prepare, refusal = REFUSALS[case]
    holder: subprocess.Popen[str] | None = None
    if prepare is not None:
        prepare(live)
    else:
        holder = subprocess.Popen(
            [sys.executable, str(LOCK_HOST), "hold", f"sqlite:///{live}"],
            stdout=subprocess.PIPE, text=True, cwd=ROOT,
        )  # fmt: skip
        assert holder.stdout is not None and holder.stdout.readline() == "HOLDING\n"
    try:
        before = listing(folder), fingerprint(live)
        for opener in ("engine", "serve"):
            if opener == "engine":
                with pytest.raises(refusal):
                    asyncio.run(Engine(f"sqlite:///{live}", runner=ScriptRunner()).open())
            else:
                proc = subprocess.run(
                    [sys.executable, "-m", "delegation.cli", "serve", "--socket",
                     str(folder.parent / "h.sock"), "--db", str(live)],
                    capture_output=True, text=True, timeout=60, cwd=ROOT, check=False,
                )  # fmt: skip
                assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
                assert f"({refusal.reason})" in proc.stderr
            assert (listing(folder), fingerprint(live)) == before, opener
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
            assert holder.stdout is not None
            holder.stdout.close()


@pytest.mark.parametrize("case", ["newer_schema", "not_a_database"])
def test_a_reader_refusing_a_file_creates_nothing_beside_it(folder: Path, case: str) -> None:
    """`delegation children` read a newer file through a WAL reader, which left a -wal
    and a -shm beside the file it then refused."""
    live = folder / "live.db"
    prepare, refusal = REFUSALS[case]
    assert prepare is not None
    prepare(live)
    before = listing(folder), fingerprint(live)
    proc = subprocess.run(
        [sys.executable, "-m", "delegation.cli", "children", "--db", str(live)],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=False,
    )  # fmt: skip
    assert proc.returncode == 1 and f"({refusal.reason})" in proc.stderr, proc.stderr
    assert (listing(folder), fingerprint(live)) == before
