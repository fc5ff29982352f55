"""A waiting child through real crashes (design §21): its host process is killed with
SIGKILL while the child waits, a new host process opens the database, and the child is
answered from a third process (``delegation input``), or its sleep's time comes. The
step before the wait ran once, the step after it once, and a sleep wakes when it was
due, not late by the time no host ran.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import rows
from tests.harness.step_hosts import Host

ROOT = Path(__file__).resolve().parents[2]


class WaitHost(Host):
    script = Path(__file__).resolve().parents[1] / "harness" / "wait_host.py"


@pytest.fixture
def hosts() -> Iterator[list[WaitHost]]:
    started: list[WaitHost] = []
    yield started
    for host in started:
        host.stop()


def launch(hosts: list[WaitHost], *args: str) -> WaitHost:
    host = WaitHost(*args)
    hosts.append(host)
    host.wait(lambda lines: "READY" in lines, 60, "READY")
    return host


def state(url: str) -> str:
    (found,) = rows.rows(url, "SELECT state FROM children", {})
    return str(found[0])


def until_state(url: str, wanted: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while state(url) != wanted:
        if time.monotonic() > deadline:
            raise AssertionError(f"the child never got {wanted} (it is {state(url)})")
        time.sleep(0.05)


def steps_ran(log: Path) -> Counter[str]:
    return Counter(log.read_text().split())


@pytest.mark.timeout(180)
def test_a_child_waiting_on_a_killed_host_is_answered_from_a_third_process(
    db_url: str, tmp_path: Path, hosts: list[WaitHost]
) -> None:
    log = tmp_path / "steps.log"
    first = launch(hosts, db_url, str(log), "ask", "--start")
    first.wait(lambda lines: any(x.startswith("STARTED") for x in lines), 30, "STARTED")
    conversation = first.saw("STARTED")[0].split()[1]
    until_state(db_url, "waiting")
    first.kill()
    second = launch(hosts, db_url, str(log), "ask")
    answered = subprocess.run(
        [sys.executable, "-m", "delegation.cli", "input", conversation, "go-ahead", "--approve",
         "--json", "--db", db_url],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=False,
    )  # fmt: skip
    assert answered.returncode == 0, answered.stderr
    outcome = json.loads(answered.stdout)
    # Applied by the live host within the command's wait (3 s by default): no timing
    # is asserted beyond it, as a busy machine starts the command slowly.
    assert outcome["applied"] is True and outcome["action"] == "input", outcome
    second.wait(lambda lines: any(x.startswith("DONE") for x in lines), 30, "DONE")
    until_state(db_url, "done")
    assert steps_ran(log) == {"before": 1, "after": 1}
    sql = "SELECT body FROM events ORDER BY child_id, sequence"
    texts = [json.loads(bytes(b)).get("text", "") for (b,) in rows.rows(db_url, sql, {})]
    assert "answered approve" in texts and texts[-1] == "finished"


@pytest.mark.timeout(180)
def test_a_sleep_survives_a_host_kill_and_wakes_on_time(
    db_url: str, tmp_path: Path, hosts: list[WaitHost]
) -> None:
    log = tmp_path / "steps.log"
    first = launch(hosts, db_url, str(log), "sleep", "--start", "--sleep", "8")
    until_state(db_url, "waiting")
    first.kill()
    killed = time.monotonic()
    time.sleep(1.5)  # no host runs for a while
    away = time.monotonic() - killed  # at least this long: the next is not started yet
    second = launch(hosts, db_url, str(log), "sleep")
    second.wait(lambda lines: any(x.startswith("DONE") for x in lines), 60, "DONE")
    (woke,) = second.saw("WOKE")
    elapsed = float(woke.split()[1])  # since it began, by the child's own wall clock
    # A sleep that counted only the time a host ran would wake at least ``away`` late.
    # 8 s leave the second host's boot 6 s before the sleep is due (a sleep due before
    # a host runs wakes when it boots, and could not tell the two apart).
    assert 8.0 <= elapsed < 8.0 + away, f"woke {elapsed:.2f} s after it began sleeping 8 s"
    assert steps_ran(log) == {"before": 1, "after": 1}


def test_an_answer_queued_while_no_host_runs_is_applied_at_the_next_boot(
    db_url: str, tmp_path: Path, hosts: list[WaitHost]
) -> None:
    log = tmp_path / "steps.log"
    first = launch(hosts, db_url, str(log), "ask", "--start")
    first.wait(lambda lines: any(x.startswith("STARTED") for x in lines), 30, "STARTED")
    conversation = first.saw("STARTED")[0].split()[1]
    until_state(db_url, "waiting")
    first.kill()
    queued = subprocess.run(
        [sys.executable, "-m", "delegation.cli", "input", conversation, "go-ahead", "--deny",
         "--db", db_url],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=False,
    )  # fmt: skip
    assert queued.returncode == 0, queued.stderr
    assert "is queued" in queued.stdout
    second = launch(hosts, db_url, str(log), "ask")
    second.wait(lambda lines: any(x.startswith("DONE") for x in lines), 30, "DONE")
    assert steps_ran(log) == {"before": 1, "after": 1}
