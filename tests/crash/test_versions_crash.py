"""Runner versions through real crashes (design §34): host processes of two versions
(tests/harness/version_host.py), the first killed with SIGKILL while its child runs or waits.

A host of another version resumes the child, refuses it or pins it as its policy says;
a pinned child is taken by a host of its version only — after a restart on SQLite, and
from a live host of another version on PostgreSQL, at its open and when another host
pins it (told by NOTIFY); ``delegation unpin`` from a third process lets the current
code resume it; an unversioned child, and one of a version the runner ``resumes``, run
on as before. The same in one process is in tests/engine/test_versions.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.harness import rows
from tests.harness import step_hosts as crash
from tests.harness.step_hosts import ROOT, Host

hosts = crash.hosts  # the fixture: every host started is stopped after the test
REFUSED = "runner_version_changed: ran v1, this host runs v2"
COLUMNS = "state, output, error, version, attempt_version, pinned_version, engine_instance_id"


@pytest.fixture(autouse=True)
def no_version_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each host runs the version the test gives it (the variable would override it)."""
    monkeypatch.delenv("DELEGATION_RUNNER_VERSION", raising=False)


class VersionHost(Host):
    script = Path(__file__).resolve().parents[1] / "harness" / "version_host.py"

    def started(self) -> list[str]:
        return [line.split()[1] for line in self.saw("STARTED")]

    def instance(self) -> str:
        return self.saw("INSTANCE")[0].split()[1]

    def done(self, conversation: str, timeout: float = 20) -> float:
        """When the child's run returned here (``time.time()``), waiting up to ``timeout``."""
        self.wait(lambda _: bool(self.saw(f"DONE {conversation} ")), timeout, "DONE")
        return float(self.saw(f"DONE {conversation} ")[0].split()[2])


def launch(started: list[Host], url: str, version: str, policy: str, *more: str) -> VersionHost:
    host = VersionHost(url, version, policy, *more)
    started.append(host)
    host.wait(lambda lines: "READY" in lines, 60, "READY")
    return host


def child(url: str, conversation: str) -> dict[str, Any]:
    (row,) = rows.rows(
        url, f"SELECT {COLUMNS} FROM children WHERE conversation_id = :c", {"c": conversation}
    )
    return dict(zip(COLUMNS.split(", "), row, strict=True))


def until(
    url: str, conversation: str, holds: Callable[[dict[str, Any]], bool], what: str
) -> dict[str, Any]:
    """The child's row once ``holds`` is true of it (within 20 s)."""
    deadline = time.monotonic() + 20
    while not holds(found := child(url, conversation)):
        assert time.monotonic() < deadline, f"the child never got {what}: {found}"
        time.sleep(0.05)
    return found


def ended(url: str, conversation: str) -> dict[str, Any]:
    """The child's row once it ended (DONE is printed just before its end commits)."""
    return until(url, conversation, lambda c: c["state"] in ("done", "cancelled"), "an end")


def recovery_texts(url: str, conversation: str) -> list[str]:
    bodies = rows.rows(
        url,
        "SELECT e.body FROM events e JOIN children c ON c.id = e.child_id"
        " WHERE c.conversation_id = :c ORDER BY e.sequence",
        {"c": conversation},
    )
    events = [json.loads(bytes(body)) for (body,) in bodies]
    return [str(e.get("text")) for e in events if e["kind"] == "recovery"]


def killed_mid_run(started: list[Host], url: str, version: str) -> str:
    """A child started by a host of ``version`` that recorded step one and runs on; its
    host killed with SIGKILL there. Returns its conversation."""
    first = launch(started, url, version, "resume", "--then", "hang", "--start", "q1")
    first.wait(lambda lines: "AT hang" in lines, 30, "AT hang")
    first.kill()
    (conversation,) = first.started()
    return conversation


def delegation(*args: str) -> subprocess.CompletedProcess[str]:
    """The ``delegation`` command, run as another process."""
    return subprocess.run(
        [sys.executable, "-m", "delegation.cli", *args],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=False,
    )  # fmt: skip


@pytest.mark.sqlite_only  # one host after another on the file: each boot takes over
@pytest.mark.timeout(90)
@pytest.mark.parametrize("policy", ["resume", "refuse", "pin"])
def test_a_host_of_another_version_resumes_refuses_or_pins_a_killed_host_s_child(
    db_url: str, hosts: list[Host], monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    cid = killed_mid_run(hosts, db_url, "v1")
    if policy == "resume":
        # The runner says v0; the deployment's variable overrides it.
        monkeypatch.setenv("DELEGATION_RUNNER_VERSION", "v2")
        second = launch(hosts, db_url, "v0", policy)
        monkeypatch.delenv("DELEGATION_RUNNER_VERSION")
        second.done(cid)
        assert second.saw("PREPARED") == ["PREPARED restart v1 -> v2 changed=True"]
        assert second.saw("STEP") == ["STEP two"]  # step one replayed from the journal
        row = ended(db_url, cid)
        assert (row["state"], row["output"], row["error"]) == ("done", "finished", "")
        assert (row["version"], row["attempt_version"]) == ("v1", "v2")
        (text,) = recovery_texts(db_url, cid)
        assert text.endswith("runner version v1 -> v2"), text
        return
    second = launch(hosts, db_url, "v2", policy)
    if policy == "refuse":
        row = ended(db_url, cid)
        assert (row["state"], row["error"]) == ("done", REFUSED)
        assert second.saw("PREPARED") == [] and second.saw("STEP") == []  # never prepared
        return
    row = until(db_url, cid, lambda c: c["pinned_version"] is not None, "pinned")
    time.sleep(0.5)  # a host of v2 that ran it would have by now
    assert second.saw("PREPARED") == [] and second.saw("STEP") == []
    row = child(db_url, cid)
    assert (row["state"], row["pinned_version"], row["attempt_version"]) == ("waiting", "v1", "v1")
    second.kill()
    # A host of v1 takes it (the pin's version: no change), and is killed mid-run again.
    third = launch(hosts, db_url, "v1", "pin", "--then", "hang")
    third.wait(lambda lines: "AT hang" in lines, 20, "AT hang")
    assert third.saw("PREPARED") == ["PREPARED takeover v1 -> v1 changed=False"]
    row = child(db_url, cid)
    assert (row["state"], row["pinned_version"], row["attempt_version"]) == ("running", None, "v1")
    third.kill()
    fourth = launch(hosts, db_url, "v1", "pin")
    fourth.done(cid)
    assert fourth.saw("PREPARED") == ["PREPARED restart v1 -> v1 changed=False"]
    assert [*third.saw("STEP"), *fourth.saw("STEP")] == ["STEP two"]  # one: recorded by v1
    row = ended(db_url, cid)
    assert (row["state"], row["output"], row["pinned_version"]) == ("done", "finished", None)
    assert (row["version"], row["attempt_version"]) == ("v1", "v1")
    assert not any("runner version" in text for text in recovery_texts(db_url, cid))


@pytest.mark.timeout(90)
def test_unpin_from_another_process_lets_the_live_host_of_the_current_version_resume_it(
    db_url: str, hosts: list[Host]
) -> None:
    cid = killed_mid_run(hosts, db_url, "v1")
    current = launch(hosts, db_url, "v2", "pin")
    # At its boot (SQLite), or when the killed host's heartbeat is old enough (PostgreSQL).
    until(db_url, cid, lambda c: c["pinned_version"] == "v1", "pinned")
    assert current.saw("PREPARED") == []
    unpinned = delegation("unpin", cid, "--db", db_url)
    assert unpinned.returncode == 0, unpinned.stderr
    assert unpinned.stdout.startswith(f"unpinned {cid}"), unpinned.stdout
    finished = current.done(cid, timeout=5)
    assert current.saw("PREPARED") == ["PREPARED unpin v1 -> v2 changed=True"]
    # From the unpin given (the command's clock) to the run's end (the host's): this
    # machine's clock both.
    given = rows.scalar(db_url, "SELECT created_at FROM controls WHERE action = 'unpin'")
    assert finished - given < 1.0, "the live host did not resume it within a second"
    row = ended(db_url, cid)
    assert (row["state"], row["output"], row["pinned_version"]) == ("done", "finished", None)
    assert (row["version"], row["attempt_version"]) == ("v1", "v2")


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("first", "resumes"), [("-", []), ("v1", ["--resumes", "v1"])], ids=["unversioned", "resumes"]
)
def test_an_unversioned_or_resumed_version_s_child_runs_on_under_refuse(
    db_url: str, hosts: list[Host], first: str, resumes: list[str]
) -> None:
    cid = killed_mid_run(hosts, db_url, first)
    second = launch(hosts, db_url, "v2", "refuse", *resumes)
    second.done(cid)
    (prepared,) = second.saw("PREPARED")
    previous = None if first == "-" else first
    assert prepared.endswith(f" {previous} -> v2 changed={previous is not None}"), prepared
    assert second.saw("STEP") == ["STEP two"]
    row = ended(db_url, cid)
    assert (row["state"], row["output"], row["error"]) == ("done", "finished", "")
    assert (row["version"], row["attempt_version"], row["pinned_version"]) == (previous, "v2", None)


# Two live hosts race heartbeat timeouts here: run alone, after the rest (see conftest).
@pytest.mark.serial
@pytest.mark.timeout(120)
def test_a_child_pinned_on_postgresql_is_taken_by_a_live_host_of_its_version(
    postgres_db: str, hosts: list[Host]
) -> None:
    url = postgres_db
    old = launch(hosts, url, "v1", "pin", "--then", "ask")
    new = launch(hosts, url, "v2", "pin", "--then", "ask", "--start", "q1", "--start", "q2")
    a, b = new.started()
    for cid in (a, b):
        until(url, cid, lambda c: c["state"] == "waiting", "waiting")
    new.kill()
    # The v1 host takes the dead host's waiting children over; they wait, as rows only.
    for cid in (a, b):
        until(url, cid, lambda c: c["engine_instance_id"] == old.instance(), "taken over")
    # Answered: prepared by v2, the v1 host pins the child rather than run it.
    answered = delegation("input", a, "word", "--text", "hello", "--db", url)
    assert answered.returncode == 0, answered.stderr
    row = until(url, a, lambda c: c["pinned_version"] is not None, "pinned")
    assert (row["state"], row["pinned_version"], row["engine_instance_id"]) == (
        "waiting", "v2", old.instance(),
    )  # fmt: skip
    # A host of v2 takes it at its open, from the live v1 host.
    again = launch(hosts, url, "v2", "pin", "--then", "ask")
    again.done(a)
    # The other, pinned by the v1 host once answered, is taken by the live v2 host.
    answered = delegation("input", b, "word", "--text", "there", "--db", url)
    assert answered.returncode == 0, answered.stderr
    again.done(b)
    # Woken as pinned both (an answer alone would say ``input``); step one replayed.
    assert again.saw("PREPARED") == ["PREPARED takeover v2 -> v2 changed=False"] * 2
    assert again.saw("STEP") == ["STEP two"] * 2
    assert old.saw("PREPARED") == [] and old.saw("STEP") == []  # nothing of v1 ran
    assert old.proc.poll() is None  # and it lives: the pin, not a takeover, moved them
    for cid, word in ((a, "hello"), (b, "there")):
        row = ended(url, cid)
        assert (row["state"], row["output"], row["pinned_version"]) == (
            "done", f"heard {word}", None,
        )  # fmt: skip
        assert (row["version"], row["attempt_version"]) == ("v2", "v2")
