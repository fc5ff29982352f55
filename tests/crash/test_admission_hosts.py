"""Admission across several PostgreSQL hosts (design §22): the limits hold across every
host of the database, and a host killed while holding slots gives them back at its
takeover. The hosts are real processes (``tests/harness/admission_host.py``) on a real server;
each run appends when it started and ended to one shared file.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy
from sqlalchemy.pool import NullPool

# Hosts race heartbeat timeouts here: run alone, after the rest (see conftest).
pytestmark = pytest.mark.serial

HOST = Path(__file__).resolve().parents[1] / "harness" / "admission_host.py"
ROOT = Path(__file__).resolve().parents[2]
BEATS = ("0.5", "3")  # heartbeat and host timeout (seconds): a takeover within seconds


class Host:
    def __init__(self, url: str, name: str, count: int, log: Path, run_s: float) -> None:
        self.name = name
        self.out = log.with_name(f"host-{name}.out")
        self.err = log.with_name(f"host-{name}.err")
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(HOST), url, name, str(count), str(log), str(run_s), *BEATS],
                stdout=out,
                stderr=err,
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )

    def lines(self) -> list[str]:
        return self.out.read_text().splitlines()

    def ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while "READY" not in self.lines():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"host {self.name} not ready:\n{self.err.read_text()}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def hosts() -> Iterator[list[Host]]:
    started: list[Host] = []
    yield started
    for host in started:
        host.stop()


def states(url: str) -> dict[str, str]:
    engine = sqlalchemy.create_engine(url.replace("postgresql://", "postgresql+psycopg://"),
                                      poolclass=NullPool)  # fmt: skip
    try:
        with engine.connect() as conn:
            rows = conn.execute(sqlalchemy.text("SELECT conversation_id, state FROM children"))
            return {conversation: state for conversation, state in rows}
    finally:
        engine.dispose()


def until_all_done(url: str, count: int, timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        found = states(url)
        if len(found) == count and all(s in ("done", "cancelled") for s in found.values()):
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"not all ended: {sorted(found.values())}")
        time.sleep(0.2)


def intervals(log: Path, killed: dict[str, float]) -> list[tuple[float, float, str, str]]:
    """Each run's (start, end, conversation, host); a run of a killed host ends when it
    was killed."""
    starts: dict[tuple[str, str], float] = {}
    found: list[tuple[float, float, str, str]] = []
    for line in log.read_text().splitlines():
        what, conversation, host, at = line.split(" ")
        key = (conversation, host)
        if what == "START":
            assert key not in starts, f"{conversation} started twice on {host}"
            starts[key] = float(at)
        else:
            found.append((starts.pop(key), float(at), conversation, host))
    for (conversation, host), began in starts.items():
        assert host in killed, f"{conversation} never ended on live host {host}"
        found.append((began, killed[host], conversation, host))
    return found


def most_at_once(runs: list[tuple[float, float, str, str]]) -> int:
    marks = sorted([(s, 1) for s, _, _, _ in runs] + [(e, -1) for _, e, _, _ in runs])
    running = most = 0
    for _, step in marks:  # an end sorts before a start at the same instant
        running += step
        most = max(most, running)
    return most


def test_three_hosts_never_run_more_than_a_presets_concurrency(
    postgres_db: str, tmp_path: Path, hosts: list[Host]
) -> None:
    log = tmp_path / "runs.log"
    for name in ("b", "c"):
        hosts.append(Host(postgres_db, name, 0, log, 0.3))
    for host in hosts:
        host.ready()
    a = Host(postgres_db, "a", 30, log, 0.3)
    hosts.append(a)
    a.ready()
    found = until_all_done(postgres_db, 30, timeout=90)
    assert set(found.values()) == {"done"}  # nothing lost, nothing cancelled
    runs = intervals(log, {})
    assert sorted(c for _, _, c, _ in runs) == sorted(found)  # each ran exactly once
    assert most_at_once(runs) <= 2
    ran_on = {host for _, _, _, host in runs}
    print(f"runs by host: { {h: sum(1 for r in runs if r[3] == h) for h in sorted(ran_on)} }")


def test_three_hosts_starting_under_one_parent_share_its_two_slots(
    postgres_db: str, tmp_path: Path, hosts: list[Host]
) -> None:
    log = tmp_path / "runs.log"
    for name in ("a", "b", "c"):
        hosts.append(Host(postgres_db, name, 10, log, 0.1))
    for host in hosts:
        host.ready()
    found = until_all_done(postgres_db, 30, timeout=90)
    assert set(found.values()) == {"done"}
    runs = intervals(log, {})
    assert sorted(c for _, _, c, _ in runs) == sorted(found)
    assert most_at_once(runs) <= 2
    print(f"runs by host: { {h: sum(1 for r in runs if r[3] == h) for h in 'abc'} }")


def test_a_host_killed_holding_both_slots_gives_them_back_at_its_takeover(
    postgres_db: str, tmp_path: Path, hosts: list[Host]
) -> None:
    log = tmp_path / "runs.log"
    a = Host(postgres_db, "a", 6, log, 2.0)
    hosts.append(a)
    a.ready()
    deadline = time.monotonic() + 30
    while not log.exists() or log.read_text().count("START") < 2:
        assert time.monotonic() < deadline, "a never held both slots"
        time.sleep(0.05)
    held = states(postgres_db)
    assert sorted(held.values()) == ["queued"] * 4 + ["running"] * 2
    b = Host(postgres_db, "b", 0, log, 2.0)
    hosts.append(b)
    b.ready()
    os.kill(a.proc.pid, signal.SIGKILL)
    a.proc.wait()
    killed_at = time.time()
    found = until_all_done(postgres_db, 6, timeout=90)
    assert set(found.values()) == {"done"}
    runs = intervals(log, {"a": killed_at})
    assert most_at_once(runs) <= 2
    # The two a held were resumed by b (a lease outlives its host), the rest ran once.
    assert {c for _, _, c, h in runs if h == "b"} == set(found)
