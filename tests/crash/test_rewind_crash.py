"""A host killed mid-rewind duplicates nothing (design §35): the rewound execution's
first run is killed with SIGKILL between two steps, the next host resumes it through
the one replay path, and asking for the rewind again (its request id) is the same
execution. Real processes (tests/harness/rewind_host.py), both stores.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests.harness import rows
from tests.harness import step_hosts as crash
from tests.harness.rewinds import events_of
from tests.harness.step_hosts import Host

HOST = Path(__file__).resolve().parents[1] / "harness" / "rewind_host.py"
hosts = crash.hosts  # the fixture: every host started is stopped after the test


class RewindHost(Host):
    script = HOST


def launch(started: list[Host], *args: str) -> RewindHost:
    host = RewindHost(*args)
    started.append(host)
    host.wait(lambda lines: "READY" in lines, 60, "READY")
    return host


@pytest.mark.timeout(240)
def test_a_host_killed_mid_rewind_duplicates_nothing(
    db_url: str, hosts: list[Host], tmp_path: Path
) -> None:
    log = tmp_path / "effects.log"
    first = launch(hosts, db_url, str(log), "--start")
    ((_, conversation, source),) = [line.split() for line in first.saw("DONE")]
    first.stop()
    rewinding = launch(hosts, db_url, str(log), "--rewind", conversation, source, "s3")
    rewinding.wait(lambda lines: "AT stop" in lines, 60, "AT stop")
    (rewound,) = [line.split()[1] for line in rewinding.saw("REWOUND")]
    rewinding.kill()
    # Asked again after the crash: the same execution, resumed, not a second one.
    again = launch(hosts, db_url, str(log), "--rewind", conversation, source, "s3")
    again.wait(lambda lines: f"FINISHED {rewound}" in lines, 60, "FINISHED")
    assert again.saw("REWOUND") == [f"REWOUND {rewound}"]
    executions = rows.scalar(
        db_url, "SELECT count(*) FROM children WHERE conversation_id = :c", {"c": conversation}
    )
    assert executions == 2
    effects = Counter(log.read_text().splitlines())
    # The source ran each step once; the rewind ran s1 and s2 zero times, the rest once.
    assert effects == Counter(
        [f"{source} s{n}" for n in range(1, 7)] + [f"{rewound} s{n}" for n in range(3, 7)]
    )
    before, after = events_of(db_url, source), events_of(db_url, rewound)
    assert [e.sequence for e in after] == list(range(1, len(after) + 1))  # gap-free
    # 1..E are the source's (the events before s1's and s2's commits), then `rewind`.
    assert after[:2] == before[:2] and [e.text for e in before[:2]] == ["before 1", "before 2"]
    assert after[2].kind == "rewind"
    texts = [e.text for e in after if e.kind == "text"]
    assert texts == [f"before {n}" for n in range(1, 7)]  # each once: nothing doubled
    assert [e.kind for e in after].count("recovery") == 1
    assert after[-1].kind == "result"
