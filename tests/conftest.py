"""Fixtures: a template database migrated once per session and copied per test."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine

from delegation import Engine, EngineConfig
from delegation.clock import ManualClock
from delegation.store import migrate
from tests import postgres, rows
from tests.support import Harness, ScriptRunner, open_harness


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "sqlite_only: uses SQLite itself (its files, locks, PRAGMAs or stdlib driver), not"
        " the store's interface, so it runs on SQLite only",
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    rows.dispose()  # the engines tests.rows read through


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
def db_url(db_path: Path) -> str:
    return f"sqlite:///{db_path}"


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
    """A real PostgreSQL server for this test session (see tests/postgres.py)."""
    server = postgres.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def postgres_url(postgres_server: str) -> Iterator[str]:
    """A new, empty database on the session's server, dropped after the test."""
    name = f"t_{uuid.uuid4().hex[:16]}"
    admin = create_engine(postgres_server, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        yield postgres_server.rsplit("/", 1)[0] + f"/{name}"
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.dispose()
