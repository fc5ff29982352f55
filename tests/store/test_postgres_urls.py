"""PostgreSQL URLs as libpq and pg_auto_failover write them (design §19): several hosts in
each spelling, with ``target_session_attrs=read-write``, on a real server.

Each spelling names a host where nothing listens first (``127.0.0.1:1``: refused at
once) and the test's server second, so every connection the package makes -- the
engine's writer and reader, its host lock and ``LISTEN`` watch, the read-only CLI,
``db upgrade`` and ``serve`` -- must try the hosts in turn to work at all. A URL none of
them can read is one line, never a traceback. Readers are read-only per transaction,
not per session (a session started read-only is one ``read-write`` refuses); that a
read still cannot write is in tests/store/test_store_contract.py.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy import Connection, create_engine, make_url, text

from delegation import Engine, EngineConfig, errors
from delegation.cli.commands import main
from delegation.store import migrate, stores
from delegation.store.sql import run
from tests.harness.password_hosts import a_child_on_a_host
from tests.harness.pg_cli import COMMANDS, cli, needs_postgres, one_line
from tests.harness.pg_sessions import _terminate
from tests.harness.support import ScriptRunner, open_harness

READ_WRITE = "target_session_attrs=read-write"
DEAD = ("127.0.0.1", 1)  # nothing listens there: a connection is refused at once
FORMS = ["one host", "libpq URI", "libpq keywords", "SQLAlchemy"]


def spelled(url: str, form: str) -> str:
    """``url`` (``postgresql+psycopg://USER@HOST:PORT/DB``, no query) with
    ``target_session_attrs=read-write``, naming :data:`DEAD` first in every ``form`` but
    "one host". The libpq URI is what ``pg_autoctl show uri`` prints."""
    parsed = make_url(url)
    user, host, port, database = parsed.username, parsed.host, parsed.port or 5432, parsed.database
    dead, dead_port = DEAD
    return {
        "one host": f"{url}?{READ_WRITE}",
        "libpq URI": (
            f"postgresql://{user}@{dead}:{dead_port},{host}:{port}/{database}?{READ_WRITE}"
        ),
        "libpq keywords": (
            f"postgresql+psycopg://{user}@/{database}?host={dead},{host}"
            f"&port={dead_port},{port}&{READ_WRITE}"
        ),
        "SQLAlchemy": (
            f"postgresql+psycopg://{user}@/{database}?host={dead}:{dead_port}"
            f"&host={host}:{port}&{READ_WRITE}"
        ),
    }[form]


def applications(url: str) -> set[str]:
    """The application names of the server's sessions on this database."""
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            sql = "SELECT application_name FROM pg_stat_activity WHERE datname = current_database()"
            return set(conn.execute(text(sql)).scalars())
    finally:
        admin.dispose()


def test_every_spelling_of_several_hosts_is_made_one() -> None:
    made = {stores.normalize(spelled("postgresql+psycopg://app@h2:5433/db", f)) for f in FORMS[1:]}
    assert len(made) == 1, made
    (one,) = made
    assert conninfo_to_dict(stores.libpq(one)) == {
        "user": "app",
        "dbname": "db",
        "host": "127.0.0.1,h2",
        "port": "1,5433",
        "target_session_attrs": "read-write",
    }
    assert stores.normalize(one) == one
    v6 = stores.normalize("postgresql://app@[::1]:5432,h2/db")
    assert conninfo_to_dict(stores.libpq(v6))["host"] == "::1,h2"
    assert conninfo_to_dict(stores.libpq(v6))["port"] == "5432,"


# --- the engine --------------------------------------------------------------------------


@needs_postgres
@pytest.mark.parametrize("form", FORMS)
async def test_an_engine_works_on_every_spelling(
    form: str, postgres_db: str, workspace: Path
) -> None:
    runner = ScriptRunner()
    url = spelled(postgres_db, form)
    async with Engine(url, runner=runner, config=EngineConfig()) as engine:
        h = await open_harness(engine, runner, workspace)
        started = await h.start("q1")
        done = await h.wait_done(started.conversation_id)
        assert done.state == "done"
        page = await h.read(started.conversation_id)
        assert page.done and page.output == "done: do the task" and page.events, page
        # Each of its connections went through the URL: the SQLAlchemy engines' and
        # the ones it opens with psycopg itself (the host lock, the watch).
        expected = {"delegation-writer", "delegation-reader", "delegation-host", "delegation-watch"}
        assert expected <= applications(postgres_db)


@needs_postgres
async def test_a_reader_connected_again_is_read_only_too(postgres_db: str) -> None:
    # The read-only default is set on each connection once it is open, not by a
    # startup option: a connection the reader makes after losing one has it too.
    store = stores.open_store(spelled(postgres_db, "libpq URI"), synchronous="FULL",
                              busy_timeout_ms=5000)  # fmt: skip
    store.open(asyncio.get_running_loop())
    try:
        assert await store.read_now(count) == 0
        assert _terminate(postgres_db, "delegation-reader") == 1
        failed = 0
        while failed < 3:  # the read that finds the connection lost may fail
            try:
                assert await store.read_now(count) == 0
                break
            except errors.StoreError:
                failed += 1
        with pytest.raises(errors.StoreError) as refused:
            await store.read_now(lambda conn: run(conn, "DELETE FROM engine_instances"))
        assert "read-only transaction" in str(refused.value)
        assert await store.read(count) == 0
    finally:
        await store.aclose()


def count(conn: Connection) -> int:
    return int(run(conn, "SELECT COUNT(*) FROM engine_instances").fetchone()[0])


# --- the command line --------------------------------------------------------------------


@needs_postgres
@pytest.mark.parametrize("form", FORMS)
async def test_serve_and_the_cli_work_on_every_spelling(
    form: str, postgres_url: str, tmp_path: Path, workspace: Path
) -> None:
    url = spelled(postgres_url, form)
    env = {k: v for k, v in os.environ.items() if k != "DELEGATION_DB"}
    upgraded = await asyncio.to_thread(cli, "db", "upgrade", "--db", url, env=env)
    assert upgraded.returncode == 0, upgraded.stderr
    await a_child_on_a_host(env, tmp_path / "serve.log", workspace, "--db", url)
    listed = await asyncio.to_thread(cli, "children", "--json", "--db", url, env=env)
    assert listed.returncode == 0, listed.stderr
    (child,) = json.loads(listed.stdout)
    assert child["state"] == "done"
    current = await asyncio.to_thread(cli, "db", "current", "--db", url, env=env)
    assert (current.returncode, current.stdout) == (0, migrate.head() + "\n"), current.stderr


# --- URLs nothing can read ---------------------------------------------------------------

UNREADABLE = [
    ("postgresql://app@h1:x,h2:5432/app", "'x' is not a port number"),
    ("postgresql://app@h1:5432,h2:70000/app", "'70000' is not a port number"),
    ("postgresql://app@h1,h2/app?host=h3", "several hosts named both before the path and in"),
    ("postgresql+psycopg://app@/app?host=h1:5432&host=h2:5433&port=5434", "cannot go with port="),
    ("postgresql+psycopg://app@/app?host=h1,h2&port=1,2,3", "2 hosts and 3 ports"),
    ("postgresql://app@h1,h2/app?sslmode=disable&sslmode=require", "sslmode= given more than once"),
]


@pytest.mark.parametrize(("url", "why"), UNREADABLE)
def test_a_url_that_cannot_be_read_is_one_line(
    url: str,
    why: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ValueError, match=why) as refused:
        Engine(url, runner=ScriptRunner())
    assert "\n" not in str(refused.value)
    monkeypatch.chdir(tmp_path)
    for command in COMMANDS:
        assert main([*command, "--db", url]) == 2, command
        out, err = capsys.readouterr()
        assert out == ""
        line = one_line(err)
        assert line.startswith(f"delegation: --db {url}: ") and why in line, line
    assert not list(tmp_path.iterdir()), "nothing was created"


def test_serve_refuses_a_url_it_cannot_read_in_one_line(tmp_path: Path) -> None:
    url, why = UNREADABLE[0]
    done = cli("serve", "--stdio", "--db", url, cwd=tmp_path)
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert one_line(done.stderr) == f"delegation: --db {url}: {why}"
    assert not list(tmp_path.iterdir()), "nothing was created"


def _connect_failure(conninfo: str) -> BaseException:
    import psycopg

    try:
        psycopg.connect(conninfo, connect_timeout=5).close()
    except psycopg.Error as exc:
        return exc
    raise AssertionError("connected")


def test_one_node_away_among_refusals_is_an_outage(postgres_server: str) -> None:
    """Through several hosts (an HA cluster's URL), libpq says what each one answered.
    One that refuses who connects (a standby the database has not reached yet: "does
    not exist") beside one that is away (restarting) is an outage: the same URL works
    once the writable server is back (found on Patroni: it was ``store_error``)."""
    from delegation.store.failures import translate
    from tests.harness.postgres import _free_port

    server = make_url(postgres_server)
    live, closed = f"{server.host}", _free_port()
    missing = f"user={server.username} dbname=no_such_database_here"
    away = _connect_failure(f"host={live},{live} port={server.port},{closed} {missing}")
    assert "does not exist" in str(away) and "refused" in str(away)
    assert isinstance(translate(away), errors.StoreUnavailable)
    refused = _connect_failure(f"host={live},{live} port={server.port},{server.port} {missing}")
    assert isinstance(translate(refused), errors.StoreError)
    assert not isinstance(translate(refused), errors.StoreUnavailable)
