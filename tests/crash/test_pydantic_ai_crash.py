"""The pydantic-ai runner through real crashes (design §16): a host killed with SIGKILL
inside a model request or inside a tool call, and the child resumed by a new host
process (tests/harness/pydantic_ai_host.py).

Afterwards every model request and every tool call that had finished before the kill
was made exactly once (counted by the host's own model function and tools, in a log
outside the database), the one in flight at most twice, and the child ends with each
tool's use and result in its events once.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.harness import rows
from tests.harness.pydantic_ai_support import require_pydantic_ai
from tests.harness.step_hosts import Host as StepHost

require_pydantic_ai()

HOST = Path(__file__).resolve().parents[1] / "harness" / "pydantic_ai_host.py"
REQUESTS = ["model 1", "model 2", "model 3", "model 4"]
CALLS = ["tool add 1 1", "tool add 2 2", "tool grep x", "tool add 3 3"]


class AgentHost(StepHost):
    """One tests/harness/pydantic_ai_host.py process and the lines it printed."""

    script = HOST


@pytest.fixture
def hosts() -> list[AgentHost]:
    return []


@pytest.fixture(autouse=True)
def stop_hosts(hosts: list[AgentHost]) -> object:
    yield
    for host in hosts:
        host.stop()


def launch(hosts: list[AgentHost], *args: str) -> AgentHost:
    host = AgentHost(*args)
    hosts.append(host)
    host.wait(lambda lines: "READY" in lines, 60, "READY")
    return host


def ended(url: str) -> tuple[int, str, str]:
    """The child's row once its run has ended (DONE is printed as its run returns)."""
    deadline = time.monotonic() + 20
    while True:
        (child,) = rows.rows(url, "SELECT id, state, output FROM children", {})
        if child[1] != "running" or time.monotonic() > deadline:
            return (int(child[0]), str(child[1]), str(child[2]))
        time.sleep(0.02)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("stop", "in_flight"), [("model", "model 3"), ("tool", "tool add 3 3")])
def test_a_killed_hosts_agent_resumes_and_repeats_no_finished_request_or_call(
    db_url: str, tmp_path: Path, hosts: list[AgentHost], stop: str, in_flight: str
) -> None:
    log = tmp_path / "effects.log"
    first = launch(hosts, db_url, str(log), stop, "--start")
    first.wait(lambda lines: f"AT {stop}" in lines, 60, f"AT {stop}")
    first.kill()
    before = Counter(log.read_text().splitlines())
    second = launch(hosts, db_url, str(log), "none")
    second.wait(lambda lines: any(x.startswith("DONE") for x in lines), 60, "DONE")
    ran = Counter(log.read_text().splitlines())
    for effect in [*REQUESTS, *CALLS]:
        if effect == in_flight:
            assert 1 <= ran[effect] <= 2, f"{effect} in flight at the kill ran {ran[effect]} times"
        else:
            assert ran[effect] == 1, f"{effect} ran {ran[effect]} times"
    # What had finished before the kill was not made again after it.
    assert all(ran[effect] == 1 for effect in before if effect != in_flight)
    child = ended(db_url)
    assert (child[1], child[2]) == ("done", "all done")
    bodies = rows.rows(
        db_url, "SELECT body FROM events WHERE child_id = :c ORDER BY sequence", {"c": child[0]}
    )
    events = [json.loads(bytes(body)) for (body,) in bodies]
    assert [e["sequence"] for e in events] == list(range(1, len(events) + 1))
    uses = [e["toolCallId"] for e in events if e["kind"] == "tool-use"]
    results = [(e["toolCallId"], e["toolOutput"]) for e in events if e["kind"] == "tool-result"]
    assert sorted(uses) == ["c1", "c2", "c3", "c4"]
    assert sorted(results) == [("c1", "2"), ("c2", "4"), ("c3", "found x"), ("c4", "6")]
    assert [e["text"] for e in events if e["kind"] == "result"] == ["all done"]
    assert [e["kind"] for e in events].count("recovery") == 1
