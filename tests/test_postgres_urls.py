"""PostgreSQL URLs with ``target_session_attrs=read-write`` (SPEC §19), what
pg_auto_failover prints, on a real server: every connection the package makes -- the
engine's writer and reader, its host lock and ``LISTEN`` watch, the read-only CLI,
``db upgrade`` and ``serve`` -- must be a read-write session. Readers are read-only per
transaction, not per session (a session started read-only is one ``read-write``
refuses); that a read still cannot write is in tests/test_store_contract.py.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from sqlalchemy import Connection, create_engine, text

from delegation import Engine, EngineConfig, errors
from delegation.store import migrate, run, stores
from tests.support import ScriptRunner, open_harness
from tests.test_cli_passwords import a_child_on_a_host
from tests.test_postgres_cli import cli, needs_postgres

READ_WRITE = "target_session_attrs=read-write"
FORMS = ["one host"]


def spelled(url: str, form: str) -> str:
    """``url`` (``postgresql+psycopg://USER@HOST:PORT/DB``, no query) with
    ``target_session_attrs=read-write``, in ``form``."""
    return {"one host": f"{url}?{READ_WRITE}"}[form]


def applications(url: str) -> set[str]:
    """The application names of the server's sessions on this database."""
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            sql = "SELECT application_name FROM pg_stat_activity WHERE datname = current_database()"
            return set(conn.execute(text(sql)).scalars())
    finally:
        admin.dispose()


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
    store = stores.open_store(spelled(postgres_db, "one host"), synchronous="FULL",
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
            await store.read_now(lambda conn: run(conn, "DELETE FROM host_instances"))
        assert "read-only transaction" in str(refused.value)
        assert await store.read(count) == 0
    finally:
        await store.aclose()


def count(conn: Connection) -> int:
    return int(run(conn, "SELECT COUNT(*) FROM host_instances").fetchone()[0])


def _terminate(url: str, application: str) -> int:
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            sql = (
                "SELECT COUNT(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE datname = current_database() AND application_name = :name"
            )
            return int(conn.execute(text(sql), {"name": application}).scalar_one())
    finally:
        admin.dispose()


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
