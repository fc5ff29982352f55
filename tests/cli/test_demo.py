"""``delegation demo``, the main job on a fresh machine, runs and proves what it shows:
on a new SQLite file (the default ``./delegation.db``) and on an empty PostgreSQL
database (``--db postgresql+psycopg://…``), which the demo's host migrates."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from delegation.store import passwords
from tests.harness import rows

ROOT = Path(__file__).resolve().parents[2]


def test_demo_runs_and_the_leased_child_survives_the_crash(
    db_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    machine = tmp_path / "machine"
    machine.mkdir()
    if rows.is_sqlite(db_url):
        argv: list[str] = []  # the default: ./delegation.db, created here
        db = rows.url_of(machine / "delegation.db")
    else:
        db = str(request.getfixturevalue("postgres_url"))  # empty: no schema yet
        argv = ["--db", db]
    proc = subprocess.run(
        [sys.executable, "-m", "delegation.cli", "demo", "--fast", *argv],
        cwd=machine,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        # Piped, with a terminal's width in COLUMNS: no line is wrapped all the same.
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "COLUMNS": "60"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Issue 29: piped, the closing hint was wrapped at 80 columns, mid-path.
    leased_id = "SELECT conversation_id FROM children WHERE request_id LIKE 'bg-%'"
    ((leased,),) = rows.rows(db, leased_id)
    where = "" if passwords.in_url(db) else f" --db {db.removeprefix('sqlite:///')}"
    assert f"\n» look around: delegation children{where}, delegation events {leased}{where}\n" in (
        proc.stdout
    )
    assert "kill -9 the host" in proc.stdout
    assert "finished after the crash" in proc.stdout
    # The heading it was steered to before the kill survives the resume (Recovery's
    # delivered steers): the last step and the result still name it.
    after_kill = proc.stdout.split("kill -9 the host", 1)[1]
    assert "thinking about durability first" in after_kill
    assert "finished 12 steps on durability first" in after_kill
    states = dict(rows.rows(db, "SELECT request_id LIKE 'bg-%', state FROM children"))
    kinds = [json.loads(body)["kind"] for (body,) in rows.rows(db, "SELECT body FROM events")]
    assert states == {1: "done", 0: "cancelled"}
    assert kinds.count("recovery") == 1
    if not rows.is_sqlite(db_url):
        assert not list(machine.iterdir()), "no file of a database server is made here"
