"""Long operations show progress for people and stay quiet with ``--json`` (design §13):
``db upgrade``, ``python -m delegation.bench`` and ``python -m delegation.soak`` draw a
progress line on stderr when it is a terminal (a real one here), nothing when it is
not, and nothing at all with ``--json``, whose stdout holds only the JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine

from delegation.store import migrate, stores
from tests.harness.terminal import ROOT, in_terminal

SCRIPTS = ScriptDirectory.from_config(migrate.config())
REVISIONS = [script.revision for script in SCRIPTS.iterate_revisions("heads", "base")][::-1]


def test_db_upgrade_shows_each_revision_on_a_terminal(tmp_path: Path) -> None:
    db = tmp_path / "new.db"
    ran = in_terminal(["-m", "delegation.cli", "db", "upgrade", "--db", str(db)], stream="stderr")
    assert (ran.code, ran.other) == (0, f"upgraded empty -> {migrate.head()}\n")
    assert "migrating" in ran.terminal
    assert f"migrated ━━━━━━━━━━━━ {len(REVISIONS)}/{len(REVISIONS)}" in ran.terminal
    assert ran.raw.endswith(b"\x1b[2K"), "the progress line is taken away at the end"


def test_db_upgrade_json_is_quiet_on_a_terminal(tmp_path: Path) -> None:
    argv = ["-m", "delegation.cli", "db", "upgrade", "--json", "--db", str(tmp_path / "x.db")]
    ran = in_terminal(argv, stream="stderr")
    assert (ran.code, ran.raw) == (0, b"")
    assert json.loads(ran.other) == {"before": None, "after": migrate.head()}
    argv = ["-m", "delegation.cli", "db", "current", "--json", "--db", str(tmp_path / "x.db")]
    ran = in_terminal(argv, stream="stderr")
    assert (ran.code, ran.raw, json.loads(ran.other)) == (0, b"", {"revision": migrate.head()})


def test_an_upgrade_tells_of_each_revision_it_applies(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = create_engine(url)
    with engine.connect() as conn:
        migrate.upgrade(conn, REVISIONS[4])
    engine.dispose()
    told: list[tuple[list[str], int]] = []
    before, after = stores.upgrade(
        url, apply=True, on_step=lambda steps, done: told.append(([s for s, _ in steps], done))
    )
    assert (before, after) == (REVISIONS[4], migrate.head())
    newer = REVISIONS[5:]
    assert told == [(newer, done) for done in range(len(newer) + 1)]
    told.clear()
    stores.upgrade(url, apply=True, on_step=lambda steps, done: told.append((steps, done)))
    assert told == [([], 0)], "nothing to apply"


def test_an_upgrade_on_postgres_tells_of_each_revision(postgres_url: str) -> None:
    told: list[int] = []
    stores.upgrade(postgres_url, apply=True, on_step=lambda steps, done: told.append(done))
    assert told == list(range(len(REVISIONS) + 1))


@pytest.mark.timeout(300)
def test_bench_shows_its_scenarios_and_is_quiet_with_json() -> None:
    bench = ["-m", "delegation.bench", "--quick", "--only", "events_1", "read_page"]
    ran = in_terminal(bench, stream="stderr")
    assert ran.code == 0 and "raw sqlite3" in ran.other
    assert "events_1 ━" in ran.terminal and "read_page ━" in ran.terminal  # what runs now
    assert "1/2" in ran.terminal and "  events_1: {'engine'" in ran.terminal  # and its figures
    ran = in_terminal([*bench, "--json"], stream="stderr")
    assert (ran.code, ran.raw) == (0, b"")
    assert set(json.loads(ran.other)) == {"events_1", "read_page", "machine"}
    piped = subprocess.run(
        [sys.executable, *bench], capture_output=True, text=True, cwd=ROOT, timeout=240
    )
    assert "━" not in piped.stderr, "no progress line drawn into a pipe"
    assert "  events_1: {'engine'" in piped.stderr, "each scenario's figures, as they come"


@pytest.mark.timeout(300)
def test_soak_shows_its_progress_and_is_quiet_with_json() -> None:
    soak = ["-m", "delegation.soak", "--seconds", "1", "--seed", "3"]
    ran = in_terminal(soak, stream="stderr")
    assert ran.code == 0 and "violations: 0" in ran.other
    assert " calls, " in ran.terminal and " restarts, 0 violations" in ran.terminal
    assert "1/1 s" in ran.terminal
    ran = in_terminal([*soak, "--json"], stream="stderr")
    assert (ran.code, ran.raw) == (0, b"")
    assert json.loads(ran.other)["violations"] == 0
