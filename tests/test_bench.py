"""``python -m delegation.bench --quick --json`` runs every scenario and prints the shape
the benchmark issue pins. No timing is asserted: figures are for people to read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RATIOS = ("start_seq", "start_concurrent", "events_100", "events_1")
NUMBERS = ("recover_10k_s", "expire_5k_s", "rss_growth_mb")


def test_quick_bench_prints_one_json_line_with_every_scenario() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "delegation.bench", "--quick", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    report = json.loads(lines[0])
    assert set(report) == {*RATIOS, "read_page", *NUMBERS, "machine"}
    for name in RATIOS:
        figures = report[name]
        assert set(figures) == {"engine", "raw", "ratio"}
        assert figures["engine"] > 0
        assert figures["raw"] > 0
        assert abs(figures["ratio"] - figures["engine"] / figures["raw"]) < 0.01
    page = report["read_page"]
    assert set(page) == {"engine_ms", "raw_ms", "ratio"}
    assert page["engine_ms"] > 0
    assert page["raw_ms"] > 0
    for name in NUMBERS:
        assert isinstance(report[name], int | float)
    assert report["recover_10k_s"] > 0
    assert report["expire_5k_s"] > 0
    assert {"cores", "python", "sqlite"} <= set(report["machine"])


def test_bench_table_for_people() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "delegation.bench", "--quick", "--only", "events_1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "events_1" in proc.stdout
    assert "raw sqlite3" in proc.stdout
    assert "machine:" in proc.stdout
