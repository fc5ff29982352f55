"""``delegation demo --runner pydantic-ai``: the tour with a real pydantic-ai agent on a
scripted model, its host loaded through serve's factory; it proves what it prints."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

from tests.harness import rows
from tests.harness.pydantic_ai_support import require_pydantic_ai

require_pydantic_ai()

ROOT = Path(__file__).resolve().parents[2]


def test_the_agent_tour_resumes_its_child_and_makes_no_request_twice(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "delegation.cli", "demo", "--fast", "--runner", "pydantic-ai"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "COLUMNS": "200"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    before = re.search(r"before the crash: (\d+) model requests answered, (\d+) tool", proc.stdout)
    after = re.search(r"after the resume: (\d+) model requests and (\d+) tool calls", proc.stdout)
    assert before is not None and after is not None, proc.stdout
    assert (int(before[1]), int(before[2])) == (3, 3)
    assert (int(after[1]), int(after[2])) == (6, 5)
    assert "none made twice" in proc.stdout
    after_kill = proc.stdout.split("kill -9 the host", 1)[1]
    assert "with 'durability first' in mind" in after_kill  # the steer survived the crash
    db = rows.url_of(tmp_path / "delegation.db")
    events = [json.loads(body) for (body,) in rows.rows(db, "SELECT body FROM events")]
    kinds = Counter(event["kind"] for event in events)
    assert (kinds["recovery"], kinds["tool-use"], kinds["tool-result"], kinds["result"]) == (
        1,
        5,
        5,
        1,
    )
    (state,) = rows.rows(db, "SELECT state FROM children")
    assert state == ("done",)
