"""Writes are stamped when they commit, not when they were queued (issue 36).

A host stopped (SIGSTOP) between queuing a write and running it, for longer than the
retention, then continued (tests/harness/stall_host.py):

- a purge: the purged child is remembered (``child_purged``, not ``not_owned``, for a
  late handle) for the full period after the purge committed; stamped when queued, its
  ``purged_at`` was already older than the retention and the next sweep forgot it;
- a run's end: the finished child stays readable for the full retention after its end
  committed; stamped when queued, the next sweep purged it at once.
"""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness.stall_host import RETENTION_S

HOST = Path(__file__).resolve().parents[1] / "harness" / "stall_host.py"
STOPPED_S = RETENTION_S + 1.0  # longer than the retention
MARGIN_S = 0.3  # the sweep's own period and the test's polling, well inside the promise

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="SIGSTOP and /proc")


def _stopped(proc: subprocess.Popen[str]) -> bool:
    state = Path(f"/proc/{proc.pid}/stat").read_text().rpartition(")")[2].split()[0]
    return state == "T"


def _stall(db: Path, what: str) -> tuple[subprocess.Popen[str], str, float]:
    """Start the host, wait until it has stopped itself, keep it stopped for longer than
    the retention and continue it; its child and when it was continued."""
    proc = subprocess.Popen([sys.executable, str(HOST), str(db), what],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("STOPPING "), line
    conversation = line.split()[1]
    deadline = time.monotonic() + 30
    while not _stopped(proc):
        assert time.monotonic() < deadline, "the host did not stop"
        time.sleep(0.01)
    time.sleep(STOPPED_S)
    continued = time.time()
    proc.send_signal(signal.SIGCONT)
    return proc, conversation, continued


def _one(db: Path, sql: str, *args: object) -> tuple[object, ...] | None:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as conn:
        row = conn.execute(sql, args).fetchone()
    return None if row is None else tuple(row)


def _until(check: object, timeout: float = 30.0) -> object:
    deadline = time.monotonic() + timeout
    while (found := check()) is None:  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return found


def _held_until(check: object, until: float) -> None:
    """``check()`` holds at every look until the wall clock reaches ``until``."""
    while time.time() < until:
        assert check(), f"gone {until - time.time():.2f} s before it was promised to"  # type: ignore[operator]
        time.sleep(0.02)


def test_a_purge_committed_late_is_remembered_a_full_period(tmp_path: Path) -> None:
    db = tmp_path / "x.db"
    proc, conversation, continued = _stall(db, "purge")
    try:
        purged_at = _until(
            lambda: _one(db, "SELECT purged_at FROM purged WHERE conversation_id = ?", conversation)
        )
        assert isinstance(purged_at, tuple)
        assert purged_at[0] >= continued - MARGIN_S, "stamped when it committed"
        remembered = "SELECT 1 FROM purged WHERE conversation_id = ?"
        _held_until(
            lambda: _one(db, remembered, conversation), purged_at[0] + RETENTION_S - MARGIN_S
        )
    finally:
        proc.kill()
        proc.communicate()


def test_an_end_committed_late_stays_readable_a_full_retention(tmp_path: Path) -> None:
    db = tmp_path / "x.db"
    proc, conversation, continued = _stall(db, "end")
    try:
        ended = (
            "SELECT finished_at FROM children WHERE conversation_id = ? AND finished_at IS NOT NULL"
        )
        finished_at = _until(lambda: _one(db, ended, conversation))
        assert isinstance(finished_at, tuple)
        assert finished_at[0] >= continued - MARGIN_S, "stamped when it committed"
        present = "SELECT 1 FROM children WHERE conversation_id = ?"
        _held_until(
            lambda: _one(db, present, conversation), finished_at[0] + RETENTION_S - MARGIN_S
        )
    finally:
        proc.kill()
        proc.communicate()
