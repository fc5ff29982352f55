"""Emits are exact across a resume (design §26), through real crashes: a host killed with
SIGKILL after a step and before its emit, after an emit and before the next step, or
just after an emit that may not have committed; the child resumed by a new host process.

Afterwards every event the run emits appears exactly once, in the order the run emits
them, beside one ``recovery`` event, with gap-free sequences, on SQLite and PostgreSQL.
A command child killed with its host runs again from the start: the lines it prints
again are not written twice either.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import rows
from tests.harness.step_hosts import Host

EMITS = [
    "begin",
    *(f"after {n}: {n * n}" for n in range(1, 6)),
    "five steps",
]


class EmitHost(Host):
    script = Path(__file__).resolve().parents[1] / "harness" / "emit_host.py"


@pytest.fixture
def emit_hosts() -> Iterator[list[EmitHost]]:
    started: list[EmitHost] = []
    yield started
    for host in started:
        host.stop()


def launch(hosts: list[EmitHost], *args: str) -> EmitHost:
    host = EmitHost(*args)
    hosts.append(host)
    host.wait(lambda lines: "READY" in lines, 60, "READY")
    return host


def events_of(url: str) -> list[dict[str, object]]:
    """The one child's events, oldest first, once its end is committed."""
    deadline = time.monotonic() + 30
    while True:
        (child,) = rows.rows(url, "SELECT id, state FROM children", {})
        if child[1] == "done" or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert child[1] == "done"
    bodies = rows.rows(
        url, "SELECT body FROM events WHERE child_id = :c ORDER BY sequence", {"c": child[0]}
    )
    return [json.loads(bytes(body)) for (body,) in bodies]


def check_exact(events: list[dict[str, object]], texts: list[str]) -> None:
    assert [e["sequence"] for e in events] == list(range(1, len(events) + 1)), "a gap"
    assert [e["kind"] for e in events].count("recovery") == 1
    own = [e.get("text") for e in events if e["kind"] != "recovery"]
    assert own == texts, "an event written twice, or lost"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stop", ["after-step", "after-emit", "unflushed"])
def test_a_run_that_emits_after_each_step_and_is_killed_shows_every_event_once(
    db_url: str, emit_hosts: list[EmitHost], stop: str
) -> None:
    first = launch(emit_hosts, db_url, stop, "--start")
    first.wait(lambda lines: f"AT {stop}" in lines, 60, f"AT {stop}")
    first.kill()
    second = launch(emit_hosts, db_url, "none")
    second.wait(lambda lines: "DONE" in lines, 60, "DONE")
    events = events_of(db_url)
    check_exact(events, EMITS)
    recovery = next(i for i, e in enumerate(events) if e["kind"] == "recovery")
    # What the killed host committed stays where it was; the rest follows the recovery.
    before = [e["text"] for e in events[:recovery]]
    assert before == EMITS[: len(before)]
    if stop == "after-step":
        assert before == EMITS[:3]  # begin, after 1, after 2: committed with step 3
    elif stop == "after-emit":
        assert before == EMITS[:4]  # and after 3, flushed


@pytest.mark.timeout(120)
def test_a_command_child_run_again_after_a_kill_writes_no_line_twice(
    db_url: str, emit_hosts: list[EmitHost], tmp_path: Path
) -> None:
    work = tmp_path / "work"  # not the database's directory: a command may not reach it
    work.mkdir()
    first = launch(emit_hosts, db_url, "none", "--start", "--command", "--workspace", str(work))
    deadline = time.monotonic() + 60
    while len(rows.rows(db_url, "SELECT sequence FROM events", {})) < 3:
        assert time.monotonic() < deadline, "the command's first three lines never committed"
        time.sleep(0.05)
    first.kill()
    launch(emit_hosts, db_url, "none", "--command")
    check_exact(events_of(db_url), [f"line {n}" for n in range(1, 6)] + ["five lines"])
