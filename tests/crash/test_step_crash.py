"""The step journal through real crashes (design §15): a host killed with SIGKILL between
two steps or inside one, and the child resumed by a new host process (or, on
PostgreSQL, taken over by one of two other live hosts).

Afterwards each recorded step's function ran exactly once, the one in flight at the
kill at most twice (its effect outside the database is at-least-once), the events the
killed host emitted before each step it recorded are all there, and the child ends.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.harness import rows, step_hosts
from tests.harness.step_hosts import Host

hosts = step_hosts.hosts  # the fixture


def launch(hosts: list[Host], *args: str) -> Host:
    host = Host(*args)
    hosts.append(host)
    host.wait(lambda lines: "READY" in lines, 60, "READY")
    return host


def recorded_by(host: Host) -> list[int]:
    return [int(line.split()[2]) for line in host.saw("RECORDED")]


def check(url: str, log: Path, first: Host, in_flight: int | None) -> None:
    ran = Counter(int(line.split()[1]) for line in log.read_text().splitlines())
    for n in range(1, 7):
        if n == in_flight:
            assert 1 <= ran[n] <= 2, f"step {n} in flight at the kill ran {ran[n]} times"
        else:
            assert ran[n] == 1, f"step s{n} ran {ran[n]} times"
    # DONE is printed when the run returns; the finish commits just after it.
    deadline = time.monotonic() + 30
    while True:
        (child,) = rows.rows(url, "SELECT id, state, output FROM children", {})
        if child[1] != "running" or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert (child[1], child[2]) == ("done", "six steps")
    names = rows.rows(
        url, "SELECT name FROM steps WHERE child_id = :c ORDER BY ordinal", {"c": child[0]}
    )
    assert [name for (name,) in names] == [f"s{n}" for n in range(1, 7)]
    bodies = rows.rows(
        url, "SELECT body FROM events WHERE child_id = :c ORDER BY sequence", {"c": child[0]}
    )
    events = [json.loads(bytes(body)) for (body,) in bodies]
    assert [e["sequence"] for e in events] == list(range(1, len(events) + 1))
    recovery = next(i for i, e in enumerate(events) if e["kind"] == "recovery")
    before_kill = [e.get("text") for e in events[:recovery]]
    # Every step the killed host recorded was committed after the events before it.
    for n in recorded_by(first):
        assert f"before {n}" in before_kill, f"the event before s{n} was lost"
    assert recorded_by(first) == list(range(1, len(recorded_by(first)) + 1))


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("stop", "in_flight"), [("between", None), ("inside", 3)])
def test_a_killed_host_s_child_resumes_and_runs_no_recorded_step_again(
    db_url: str, tmp_path: Path, hosts: list[Host], stop: str, in_flight: int | None
) -> None:
    log = tmp_path / "effects.log"
    first = launch(hosts, db_url, "first", str(log), stop, "--start")
    first.wait(lambda lines: f"AT {stop}" in lines, 60, f"AT {stop}")
    first.kill()
    assert recorded_by(first) == ([1, 2, 3] if stop == "between" else [1, 2])
    second = launch(hosts, db_url, "second", str(log), "none")
    second.wait(lambda lines: any(x.startswith("DONE") for x in lines), 60, "DONE")
    # The resumed run recorded only the steps the first had not.
    assert recorded_by(second) == list(range(1, 7))  # replayed ones return at once, too
    check(db_url, log, first, in_flight)
    ran = [line.split()[0] for line in log.read_text().splitlines()]
    assert ran.count("second") == 6 - len(recorded_by(first))


@pytest.mark.timeout(240)
def test_a_step_in_flight_on_a_killed_host_is_taken_over_by_one_of_two_live_hosts(
    postgres_db: str, tmp_path: Path, hosts: list[Host]
) -> None:
    log = tmp_path / "effects.log"
    timing = ("--beat", "0.5", "--dead", "2.0")
    a = launch(hosts, postgres_db, "A", str(log), "inside", "--start", *timing)
    b = launch(hosts, postgres_db, "B", str(log), "none", *timing)
    c = launch(hosts, postgres_db, "C", str(log), "none", *timing)
    a.wait(lambda lines: "AT inside" in lines, 60, "AT inside")
    a.kill()
    deadline = time.monotonic() + 60
    while not (b.saw("DONE") or c.saw("DONE")):
        assert time.monotonic() < deadline, "no live host finished the child"
        time.sleep(0.05)
    time.sleep(0.5)
    takers = [host for host in (b, c) if host.saw("DONE")]
    assert len(takers) == 1, "exactly one live host took the child over"
    check(postgres_db, log, a, in_flight=3)
    (taker,) = takers
    ran = [line.split()[0] for line in log.read_text().splitlines()]
    # A ran s1-s3 (s3 cut off by the kill); the taker s3 again, then s4-s6.
    assert ran.count("A") == 3
    assert ran.count("B" if taker is b else "C") == 4
