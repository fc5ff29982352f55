"""The ``delegation`` command on PostgreSQL (design §12), each command a process of its own,
as an operator runs it: ``db current``/``db upgrade`` on an empty, a foreign and a live
host's database; the inspection commands beside a live ``serve`` host; and the
refusals: a ``--db`` URL of no store delegation has (one line, exit 2, nothing made) and
a server that cannot be reached (one line, exit 1, no traceback, no password).

``serve``, ``cancel``/``steer`` and ``demo`` on PostgreSQL run in tests/host/test_serve.py,
test_client.py, test_push_control.py and test_demo.py, on both stores.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from pathlib import Path

import pytest
from sqlalchemy import create_engine
from sqlalchemy.pool import NullPool

from delegation import Engine
from delegation.cli.commands import main
from delegation.store import migrate
from tests.harness import rows
from tests.harness.pg_cli import COMMANDS, ROOT, cli, needs_postgres, one_line
from tests.harness.serving import OWNER, Client, host, start_params
from tests.harness.support import ScriptRunner

# --- db current / db upgrade ---------------------------------------------------------------


@needs_postgres
def test_db_upgrade_migrates_an_empty_database_and_then_does_nothing(postgres_url: str) -> None:
    head = migrate.head()
    done = cli("db", "current", "--db", postgres_url)
    assert (done.returncode, done.stdout, done.stderr) == (0, "empty (no schema yet)\n", "")
    refused = cli("children", "--db", postgres_url)
    assert refused.returncode == 1
    assert "no schema" in one_line(refused.stderr) and "delegation db upgrade" in refused.stderr
    done = cli("db", "upgrade", "--db", postgres_url)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"upgraded empty -> {head}\n", "")
    assert rows.scalar(postgres_url, "SELECT version_num FROM alembic_version") == head
    done = cli("db", "current", "--db", postgres_url)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"{head}\n", "")
    done = cli("db", "upgrade", "--db", postgres_url)
    assert (done.returncode, done.stdout) == (0, f"upgraded {head} -> {head}\n")
    done = cli("children", "--json", "--db", postgres_url)
    assert (done.returncode, done.stdout, done.stderr) == (0, "[]\n", "")


@needs_postgres
def test_db_commands_refuse_another_applications_database(postgres_url: str) -> None:
    engine = create_engine(postgres_url, poolclass=NullPool)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE accounts (id INTEGER PRIMARY KEY)")
    finally:
        engine.dispose()
    before = rows.snapshot(postgres_url)
    for command in (("db", "current"), ("db", "upgrade"), ("children",), ("serve", "--stdio")):
        done = cli(*command, "--db", postgres_url)
        assert (done.returncode, done.stdout) == (1, ""), (command, done.stderr)
        assert "not a delegation database" in one_line(done.stderr), command
    assert rows.snapshot(postgres_url) == before, "nothing was written"


# --- beside a live host --------------------------------------------------------------------


@needs_postgres
async def test_the_inspection_commands_read_a_live_hosts_database(
    postgres_db: str, workspace: Path
) -> None:
    proc = await host("--stdio", "--db", postgres_db)
    assert proc.stdin is not None and proc.stdout is not None
    client = Client(proc.stdout, proc.stdin)
    try:
        await client.setup(workspace)
        started = await client.ok(
            "child.start", start_params("q1", "work in 20 steps", leaseId="L1")
        )
        child = started["conversationId"]
        # Followed from another process from the start: every event once, then its end.
        follower = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "delegation.cli", "events", child, "--follow", "--json",
            "--db", postgres_db, cwd=ROOT, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        listed = await asyncio.to_thread(cli, "children", "--json", "--db", postgres_db)
        assert listed.returncode == 0, listed.stderr
        (record,) = json.loads(listed.stdout)
        assert record["conversationId"] == child and record["leaseId"] == "L1"
        leases = await asyncio.to_thread(cli, "leases", "--json", "--db", postgres_db)
        assert [lease["leaseId"] for lease in json.loads(leases.stdout)] == ["L1"]
        upgrade = await asyncio.to_thread(cli, "db", "upgrade", "--db", postgres_db)
        assert upgrade.returncode == 1, "never migrated beside a live host"
        assert "another live host" in one_line(upgrade.stderr)
        handle = {**OWNER, "childId": child, "leaseId": "L1"}
        result, events = await client.read_until_done(handle)
        assert result["output"].startswith("finished 20 steps")
        out, err = await asyncio.wait_for(follower.communicate(), 30)
        assert follower.returncode == 0, err
        lines = [json.loads(line) for line in out.decode().splitlines()]
        assert lines[-1]["end"]["state"] == "done", lines[-1]
        assert lines[-1]["end"]["output"] == result["output"]
        assert [line["sequence"] for line in lines[:-1]] == [e["sequence"] for e in events]
        shown = await asyncio.to_thread(cli, "show", child, "--json", "--db", postgres_db)
        document = json.loads(shown.stdout)
        assert (document["state"], document["eventCount"]) == ("done", len(events))
        current = await asyncio.to_thread(cli, "db", "current", "--db", postgres_db)
        assert current.stdout == migrate.head() + "\n", "reading beside a live host is fine"
    finally:
        proc.stdin.close()
        assert await asyncio.wait_for(proc.wait(), 20) == 0
        await client.close()


# --- refusals ------------------------------------------------------------------------------

BAD_URLS = [
    "mysql://user@db.example/app",
    "postgresql+psycopg2://user@db.example/app",
    "postgresql+asyncpg://user@db.example/app",
    "sqlite://",
    "sqlite:///:memory:",
]


@pytest.mark.parametrize("url", BAD_URLS)
def test_a_db_url_of_no_store_is_one_line_and_exit_2(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for command in COMMANDS:
        assert main([*command, "--db", url]) == 2, command
        out, err = capsys.readouterr()
        assert out == ""
        assert one_line(err).startswith(f"delegation: --db {url}: "), command
    assert not list(tmp_path.iterdir()), "nothing was created"


@pytest.mark.parametrize("url", BAD_URLS[:2])
def test_a_db_url_of_no_store_is_refused_by_the_real_command(url: str, tmp_path: Path) -> None:
    for command in (("serve", "--stdio"), ("db", "upgrade")):
        done = cli(*command, "--db", url, cwd=tmp_path)
        assert (done.returncode, done.stdout) == (2, ""), command
        line = one_line(done.stderr)
        if "postgresql" in url:
            assert "psycopg 3: postgresql+psycopg://" in line, line
    assert not list(tmp_path.iterdir()), "nothing was created"


@pytest.mark.parametrize("url", ["mysql://user@db.example/app", "sqlite://", "postgres://u@h/app"])
def test_a_db_url_of_no_store_names_both_forms_delegation_takes(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 29: the refusal said only "a SQLite file URL such as sqlite:///…", as if
    PostgreSQL were not an answer."""
    assert main(["children", "--db", url]) == 2
    line = one_line(capsys.readouterr().err)
    assert "sqlite:///PATH" in line and "postgresql://USER@HOST/DB" in line, line
    with pytest.raises(ValueError, match="or a PostgreSQL URL"):
        Engine(url, runner=ScriptRunner())


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # nothing listens there once closed


def test_an_unreachable_server_is_one_clear_line_and_exit_1(tmp_path: Path) -> None:
    port = _closed_port()
    # A password comes from the environment (tests/cli/test_cli_passwords.py: never --db).
    url = f"postgresql+psycopg://operator:s3cret@127.0.0.1:{port}/delegation"
    env = {**os.environ, "DELEGATION_DB": url}
    for command in COMMANDS:
        if command[0] == "demo":
            continue  # below: the demo tells its own story
        done = cli(*command, cwd=tmp_path, env=env)
        assert (done.returncode, done.stdout) == (1, ""), (command, done.stderr)
        line = one_line(done.stderr)
        # Unreachable is the retryable refusal (design §19), with libpq's own first line.
        assert "(store_unavailable)" in line and f'"127.0.0.1", port {port} failed' in line, line
        assert "s3cret" not in line, "a password is never printed"
    demo = cli("demo", "--fast", cwd=tmp_path, env=env)
    assert demo.returncode == 1
    said = demo.stdout + demo.stderr
    assert "database is unavailable" in said and "Traceback" not in said, said
    assert "s3cret" not in said
    assert not list(tmp_path.iterdir()), "nothing was created"
