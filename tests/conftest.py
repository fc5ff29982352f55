"""Fixtures: a template database migrated once per session and copied per test.

Every test that takes ``db_url`` (or an ``engine``/``harness`` built on it) runs twice:
on a SQLite file (``[sqlite]``) and on a database of a real PostgreSQL server
(``[postgres]``, see tests/harness/postgres.py). A test marked ``sqlite_only``, or that asks for
``db_path`` itself (it looks at the file), runs on SQLite only.
``DELEGATION_TEST_STORES=sqlite`` (or ``postgres``) keeps one of them.

A third store, ``[pgbouncer]``, is the same server reached through a real PgBouncer in
session mode (tests/harness/pgbouncer.py, one per test session): the suites of
:data:`THROUGH_PGBOUNCER` run through it too by default, and
``DELEGATION_TEST_STORES=pgbouncer`` runs every test that takes ``db_url`` through it.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine

from delegation import Engine, EngineConfig
from delegation.clock import ManualClock
from delegation.store import migrate
from tests.harness import pgbouncer, postgres, rows
from tests.harness.support import Harness, ScriptRunner, open_harness


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "serial: hosts raced against heartbeat timeouts (soaks, several hosts, failover):"
        " run alone, after the rest (`pytest -n 0 -m serial`), never beside other tests",
    )
    config.addinivalue_line(
        "markers",
        "sqlite_only: uses SQLite itself (its files, locks, PRAGMAs or stdlib driver), not"
        " the store's interface, so it runs on SQLite only",
    )


STORES = ("sqlite", "postgres", "pgbouncer")
# The suites that also run through PgBouncer by default (design §25): the child methods,
# their lifecycle, recovery, follow, admission, waiting, the step journal, operators.
THROUGH_PGBOUNCER = frozenset(
    {
        "test_methods",
        "test_lifecycle",
        "test_recovery",
        "test_follow",
        "test_admission",
        "test_waiting",
        "test_steps",
        "test_run_ends",
        "test_operator_cancel",
    }
)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "db_url" not in metafunc.fixturenames:
        return
    module = metafunc.module.__name__.rpartition(".")[2]
    default = STORES if module in THROUGH_PGBOUNCER else STORES[:2]
    wanted = os.environ.get("DELEGATION_TEST_STORES", ",".join(default)).split(",")
    own = inspect.signature(metafunc.function).parameters
    if metafunc.definition.get_closest_marker("sqlite_only") or "db_path" in own:
        wanted = [name for name in wanted if name == "sqlite"] or ["sqlite"]
    metafunc.parametrize("db_url", [n for n in STORES if n in wanted], indirect=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    rows.dispose()  # the engines tests.harness.rows read through


@pytest.fixture(scope="session")
def template_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "template.db"
    engine = create_engine(f"sqlite:///{path}")
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("PRAGMA journal_mode=WAL")
            migrate.upgrade(conn)
    finally:
        engine.dispose()
    return path


@pytest.fixture
def db_path(tmp_path: Path, template_db: Path) -> Path:
    path = tmp_path / "delegation.db"
    shutil.copyfile(template_db, path)
    return path


@pytest.fixture
def db_url(request: pytest.FixtureRequest) -> str:
    """The test's database: a copy of the SQLite template, or a new PostgreSQL database
    made from the migrated template database (see ``postgres_url``)."""
    store = getattr(request, "param", "sqlite")
    if store == "postgres":
        return str(request.getfixturevalue("postgres_db"))
    if store == "pgbouncer":
        port = request.getfixturevalue("pgbouncer_port")
        return pgbouncer.through(str(request.getfixturevalue("postgres_db")), port)
    return f"sqlite:///{request.getfixturevalue('db_path')}"


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    root = tmp_path / "workspace"
    (root / "sub").mkdir(parents=True)
    return root


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1_800_000_000.0)


@pytest.fixture
def config() -> EngineConfig:
    return EngineConfig(release_drain_s=1.0)


@pytest.fixture
def runner() -> ScriptRunner:
    return ScriptRunner()


@pytest.fixture
async def engine(
    db_url: str, runner: ScriptRunner, config: EngineConfig, clock: ManualClock
) -> AsyncIterator[Engine]:
    async with Engine(db_url, runner=runner, config=config, clock=clock) as engine:
        yield engine


@pytest.fixture
async def harness(engine: Engine, runner: ScriptRunner, workspace: Path) -> Harness:
    return await open_harness(engine, runner, workspace)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """A real PostgreSQL server for this test session (see tests/harness/postgres.py)."""
    server = postgres.start(durable=False)
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def pgbouncer_port(postgres_server: str) -> Iterator[int]:
    """A PgBouncer in session mode before the session's server (tests/harness/pgbouncer.py)."""
    with pgbouncer.bouncer(postgres_server, "session") as port:
        yield port


@pytest.fixture(scope="session")
def postgres_template(postgres_server: str) -> Iterator[str]:
    """A database migrated to head once, which each test's database is a copy of."""
    name = f"template_{uuid.uuid4().hex[:12]}"
    admin = create_engine(postgres_server, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        template = create_engine(_database(postgres_server, name))
        try:
            with template.connect() as conn:
                migrate.upgrade(conn)
        finally:
            template.dispose()
        yield name
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.dispose()


def _database(server: str, name: str) -> str:
    return server.rsplit("/", 1)[0] + f"/{name}"


@contextlib.contextmanager
def _new_database(server: str, template: str | None = None) -> Iterator[str]:
    name = f"t_{uuid.uuid4().hex[:16]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            copy = f' TEMPLATE "{template}"' if template else ""
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"{copy}')
        yield _database(server, name)
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.dispose()


@pytest.fixture
def postgres_url(postgres_server: str) -> Iterator[str]:
    """A new, empty database on the session's server, dropped after the test."""
    with _new_database(postgres_server) as url:
        yield url


@pytest.fixture
def postgres_db(postgres_server: str, postgres_template: str) -> Iterator[str]:
    """A new database at head on the session's server, dropped after the test."""
    with _new_database(postgres_server, postgres_template) as url:
        yield url
