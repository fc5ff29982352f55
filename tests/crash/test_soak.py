"""The soak of the issue: ``python -m delegation.soak --seconds 20 --json`` runs hosts
that are closed gracefully and killed with SIGKILL on one database, and must report no
violation; with ``--url`` on a PostgreSQL server and ``--hosts 3`` it runs three hosts at
once and also pauses them past the host timeout, with ``--db-restart-command`` through
restarts of the server itself. The checker it relies on is a plain
function over a database: the last tests break one on purpose and expect each break to
be reported, and read either store."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from delegation import ChildContext, Event
from tests.harness import postgres, rows
from tests.harness.support import Harness
from tools.soak.check import Checker, check_file
from tools.soak.journal import Acks

# Hosts race heartbeat timeouts here: run alone, after the rest (see conftest).
pytestmark = pytest.mark.serial

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"ops", "violations", "restarts", "errors_by_reason", "p99_ms", "rss_mb"}


def hosts_left(folder: Path) -> list[int]:
    """Processes still running on the soak's files."""
    left = []
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if entry.name.isdigit() and str(folder).encode() in command:
            left.append(int(entry.name))
    return left


@pytest.mark.timeout(300)
def test_soak_for_twenty_seconds_reports_no_violation(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "delegation.soak",
            "--seconds",
            "20",
            "--json",
            "--keep",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout + proc.stderr
    report = json.loads(lines[0])
    assert report["violations"] == 0, report["violation_samples"]
    assert proc.returncode == 0, proc.stderr
    assert set(report) >= KEYS
    assert report["restarts"] >= 2
    assert report["kills"] >= 1 and report["graceful"] >= 1
    assert report["restarts"] == report["kills"] + report["graceful"]
    assert report["ops"] > 200
    assert report["acked"]["starts"] > 0 and report["acked"]["events"] > 0
    assert all(isinstance(n, int) and n > 0 for n in report["errors_by_reason"].values())
    assert report["p99_ms"] > 0 and report["rss_mb"] > 0
    assert report["checks"] > report["restarts"]
    assert hosts_left(tmp_path) == []


def soak_on_postgres(soak: list[str], tmp_path: Path, *, clean: bool = True) -> dict[str, Any]:
    """Run ``python -m delegation.soak *soak`` (its folder in ``tmp_path``, for
    hosts_left); its one-line report, once it found no violation (``clean``)."""
    proc = subprocess.run(
        [sys.executable, "-m", "delegation.soak", *soak],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout + proc.stderr
    report: dict[str, Any] = json.loads(lines[0])
    if clean:
        assert report["violations"] == 0, report["violation_samples"]
        assert proc.returncode == 0, proc.stderr
    return report


@pytest.mark.timeout(180)
def test_soak_of_three_hosts_on_postgres_kills_pauses_and_takes_over(
    postgres_db: str, tmp_path: Path
) -> None:
    """Three hosts at once on a new database of the server (dropped at the end): at
    least one is killed, one paused past the host timeout (then fenced), one taken
    over, and every invariant holds."""
    report = soak_on_postgres(
        ["--url", postgres_db, "--hosts", "3", "--seconds", "15", "--json"], tmp_path
    )
    assert (report["store"], report["hosts"]) == ("postgresql", 3)
    assert report["kills"] >= 1 and report["pauses"] >= 1 and report["graceful"] >= 1
    assert report["takeovers"] >= 1 and report["fenced"] >= 1
    assert report["ops"] > 200 and report["acked"]["events"] > 0
    assert report["checks"] > report["restarts"] + report["pauses"]
    assert hosts_left(tmp_path) == []
    soak_db = report["database"].rsplit("/", 1)[1]
    assert soak_db.startswith("delegation_soak_")
    found = rows.rows(postgres_db, "SELECT 1 FROM pg_database WHERE datname = :n", {"n": soak_db})
    assert found == [], "the soak's own database is dropped at the end"


@pytest.mark.timeout(180)
def test_soak_through_database_restarts_on_postgres(postgres_db: str, tmp_path: Path) -> None:
    """`--db-restarts`: every session of the soak's database is ended again and again
    under two working hosts; they go on, none is taken over for it, and every
    invariant holds."""
    soak = ["--url", postgres_db, "--hosts", "2", "--db-restarts", "--seconds", "12", "--json"]
    report = soak_on_postgres(soak, tmp_path)
    assert report["db_restarts"] >= 2 and report["db_sessions_ended"] > report["db_restarts"]
    assert report["ops"] > 200 and report["acked"]["events"] > 0
    assert "internal_error" not in report["errors_by_reason"], report["errors_by_reason"]
    assert hosts_left(tmp_path) == []


@pytest.fixture
def own_server() -> Iterator[postgres.Server]:
    """A cluster of the test's own: the soak restarts it."""
    if postgres.binaries() is None:
        pytest.skip("no PostgreSQL server")
    server = postgres.start()
    if server.restart_command is None:
        server.stop()
        pytest.skip("a given server cannot be restarted here")
    yield server
    server.stop()


@pytest.mark.timeout(180)
def test_soak_through_server_restarts_on_postgres(
    own_server: postgres.Server, tmp_path: Path
) -> None:
    """`--db-restart-command`: the server itself is stopped (`pg_ctl stop -m fast`) and
    started a second later (1.3-2.5 s away), again and again, under two working hosts
    whose runs take steps, read them back and sleep. No child ends with a store error
    (design §32: a blink ends no child), no step runs twice, and every invariant holds.

    The hosts beat every 2 s, the engine's default, and declare one another dead after
    8 s: a host rides out an outage shorter than host_timeout_s - 2 x host_heartbeat_s
    (4 s here) without stopping its runs. With 5 s it stopped them for the restarts
    that began late in a beat (cut off, then a new instance: legitimate, and the soak
    counted its 'no heartbeat for too long' and the rejoin's hand-over as findings)."""
    assert own_server.restart_command is not None
    soak = ["--url", own_server.url, "--hosts", "2", "--seconds", "12", "--json"]
    soak += ["--heartbeat", "2", "--host-timeout", "8"]
    report = soak_on_postgres(
        [*soak, "--db-restart-command", own_server.restart_command(1.0)], tmp_path
    )
    assert report["db_server_restarts"] >= 2, report
    assert report["db_server_restart_failures"] == 0, report
    assert report["ops"] > 200 and report["acked"]["events"] > 0
    assert report["errors_by_reason"].get("store_unavailable", 0) > 0, "no call met a restart"
    assert hosts_left(tmp_path) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--db-restarts"], "--db-restarts needs --url"),
        (["--db-restart-command", "true"], "--db-restart-command needs --url"),
        (["--hosts", "2"], "--hosts 2 needs --url"),
        (["--hosts", "0"], "--hosts must be at least 1"),
        (["--url", "sqlite:///x.db"], "--url takes a PostgreSQL URL"),
        (["--url", "mysql://db/x"], "--url:"),
        (["--heartbeat", "2", "--host-timeout", "3"], "more than two heartbeats"),
    ],
)
def test_soak_refuses_what_it_cannot_run(args: list[str], message: str, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "delegation.soak", "--seconds", "1", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr
    assert proc.stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_soak_summary_for_people_and_exit_status(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "delegation.soak", "--seconds", "1", "--seed", "7"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "seed 7" in proc.stdout
    assert "violations: 0" in proc.stdout


def kinds(found: list[str]) -> set[str]:
    return {what.split(":", 1)[0] for what in found}


def broken(db_path: Path, name: str, *statements: str) -> Path:
    """A copy of the database with ``statements`` applied behind the engine's back
    (SQLite's backup and ``ignore_check_constraints``: written, so not tests.harness.rows)."""
    path = db_path.with_name(f"{name}.db")
    with sqlite3.connect(db_path) as source, sqlite3.connect(path) as copy:
        source.backup(copy)
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA ignore_check_constraints = ON")
        for statement in statements:
            conn.execute(statement)
    return path


@pytest.mark.sqlite_only  # the checker reads a SQLite file; the breaks are made through sqlite3
async def test_the_checker_reports_each_broken_invariant(harness: Harness, db_path: Path) -> None:
    async def three_events(ctx: ChildContext) -> None:
        await ctx.admit()
        for n in range(1, 4):
            ctx.emit(Event(kind="text", text=f"t{n}"))
        ctx.emit(Event(kind="result", text="r4"))

    harness.runner.script = three_events
    leased = await harness.start("q1", lease_id="lease-1")
    await harness.wait_done(leased.conversation_id)
    await harness.engine.close()
    assert check_file(db_path) == []
    child = f"(SELECT id FROM children WHERE run_id = '{leased.run_id}')"

    gap = broken(db_path, "gap", f"DELETE FROM events WHERE child_id = {child} AND sequence = 2")
    assert kinds(check_file(gap)) == {"event_gap"}
    zombie = broken(db_path, "zombie", "UPDATE children SET state = 'zombie'")
    assert kinds(check_file(zombie)) == {"impossible_state"}
    undone = broken(db_path, "undone", "UPDATE children SET finished_at = NULL")
    assert "finished_at" in kinds(check_file(undone))
    fenced = broken(
        db_path,
        "fenced",
        "UPDATE grants SET revoked_at = 1, revoke_reason = 'released' WHERE kind = 'lease'",
    )
    assert kinds(check_file(fenced)) == {"fencing"}
    twice = broken(
        db_path,
        "twice",
        "DROP INDEX ix_children_one_active",
        "INSERT INTO children (conversation_id, run_id, grant_id, lease_id, request_id,"
        " runner_id, runner_host_instance_id, parent_conversation_id, parent_run_id,"
        " extension_id, profile, generation, request, preset, cwd, depth, state,"
        " engine_instance_id, admitted_at, created_at, updated_at) SELECT conversation_id,"
        " 'r-copy', grant_id, lease_id, 'q-copy', runner_id, runner_host_instance_id,"
        " parent_conversation_id, parent_run_id, extension_id, profile, generation, request,"
        " preset, cwd, depth, 'running', engine_instance_id, admitted_at, created_at,"
        " updated_at FROM children",
        f"UPDATE children SET state = 'running', finished_at = NULL WHERE id = {child}",
    )
    assert "two_active" in kinds(check_file(twice))

    acks = Acks()
    acks.add({"t": "ev", "run": leased.run_id, "a": 1, "b": 3})
    acks.add(
        {
            "t": "start",
            "run": leased.run_id,
            "runner": harness.conn.runner_id,
            "lease": "lease-1",
            "sent": 0.0,
            "at": 2e9,
        }
    )
    assert check_file(db_path, acks) == []
    refused = broken(
        db_path, "refused", "UPDATE children SET error = 'database is unavailable; try again'"
    )
    assert kinds(check_file(refused, acks)) == {"store_error_ended"}
    replayed = Acks()
    for attempt in (0, 1):  # a resumed run that ran its recorded step again
        step = {"run": leased.run_id, "name": "s0", "attempt": attempt}
        replayed.add({"t": "step", **step, "value": {"attempt": attempt}})
    raised = "StoreUnavailable: database is unavailable; try again"
    replayed.add({"t": "end", "run": leased.run_id, "attempt": 1, "how": "raised", "error": raised})
    assert kinds(check_file(db_path, replayed)) == {"step_rerun", "store_error_ended"}
    acks.add({"t": "ev", "run": leased.run_id, "a": 4, "b": 6})
    acks.add(
        {
            "t": "release",
            "runner": harness.conn.runner_id,
            "lease": "lease-1",
            "sent": 0.0,
            "at": 2e9,
        }
    )
    found = kinds(check_file(db_path, acks))
    assert found == {"lost_event", "lost_tombstone"}

    acks.add({"t": "ev", "run": leased.run_id, "a": 1, "b": 1, "who": "h-someone"})
    assert kinds(check_file(db_path, acks)) == {"lost_event", "lost_tombstone"}

    checker = Checker(retention_s=60.0)
    assert checker.check(db_path) == []
    vanished = broken(db_path, "vanished", "DELETE FROM events", "DELETE FROM children")
    assert kinds(checker.check(vanished)) == {"lost_row"}

    assert kinds(check_file(db_path, final=True)) == {"lease_left"}
    overdue = Checker().check(db_path, live=True, now=4e9)
    assert "lease_overdue" in kinds(overdue)


async def test_the_checker_reads_either_store(harness: Harness, db_url: str) -> None:
    """On PostgreSQL the checker reads through the store (one read-only snapshot), not
    through a file: the same findings on either store."""

    async def written_by(ctx: ChildContext) -> None:
        await ctx.admit()
        for n in range(1, 3):
            ctx.emit(Event(kind="text", text=f"t{n}@h-one"))
        ctx.emit(Event(kind="result", text="r3@h-one"))

    harness.runner.script = written_by
    leased = await harness.start("q1", lease_id="lease-1")
    await harness.wait_done(leased.conversation_id)
    await harness.engine.close()
    acks = Acks()
    acks.add({"t": "ev", "run": leased.run_id, "a": 1, "b": 3, "who": "h-one"})
    assert check_file(db_url, acks) == []
    acks.add({"t": "ev", "run": leased.run_id, "a": 2, "b": 2, "who": "h-two"})
    assert kinds(check_file(db_url, acks)) == {"lost_event"}
    assert kinds(check_file(db_url, final=True)) == {"lease_left"}
