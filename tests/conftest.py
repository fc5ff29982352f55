"""Fixtures: a template database migrated once per session and copied per test."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine

from delegation import Engine, EngineConfig
from delegation.clock import ManualClock
from delegation.store import migrate
from tests.support import Harness, ScriptRunner, open_harness


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
