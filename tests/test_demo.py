"""``delegation demo``, the main job on a fresh machine, runs and proves what it shows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests import rows

ROOT = Path(__file__).resolve().parent.parent


def test_demo_runs_and_the_leased_child_survives_the_crash(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "delegation.cli", "demo", "--fast"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "COLUMNS": "200"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "kill -9 the host" in proc.stdout
    assert "finished after the crash" in proc.stdout
    # The heading it was steered to before the kill survives the resume (Recovery's
    # delivered steers): the last step and the result still name it.
    after_kill = proc.stdout.split("kill -9 the host", 1)[1]
    assert "thinking about durability first" in after_kill
    assert "finished 12 steps on durability first" in after_kill
    db = rows.url_of(tmp_path / "delegation.db")
    states = dict(rows.rows(db, "SELECT request_id LIKE 'bg-%', state FROM children"))
    recoveries = rows.scalar(
        db, 'SELECT COUNT(*) FROM events WHERE CAST(body AS TEXT) LIKE \'%"kind":"recovery"%\''
    )
    assert states == {1: "done", 0: "cancelled"}
    assert recoveries == 1
