"""The engine survives its database failing over (design §19), on a real pg_auto_failover
formation (tests/harness/failover.py) with real host processes doing work
(tests/harness/failover_host.py): leased children streaming, others started every 0.2 s that
emit, flush and end.

Through a planned failover and through a primary killed with SIGKILL, each host, never
restarted, writes again by itself; afterwards every start it was answered and every
event whose flush returned is on the new primary, no child whose run ended is left
``running``, and no child ran twice. While the database could not be reached, calls and
flushes were refused with ``store_unavailable`` only (``errors.StoreUnavailable``, named
by its reason: never ``internal_error``). With two hosts through a failover, neither is
taken over: each only lost its connection.

How long a host took to write again is printed, never asserted (``tests/harness/resume_times.py``
measures it); the bounds below only end a test that would otherwise wait forever.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from tests.harness import failover, resume_times, rows
from tests.harness.failover import Formation
from tests.harness.failover_checks import EVENTS, STREAMERS, busy, check_after, settle, writes_again
from tests.harness.failover_host import Host

# Hosts race heartbeat timeouts here: run alone, after the rest (see conftest).
pytestmark = pytest.mark.serial


@pytest.fixture(scope="module")
def formation_once() -> Iterator[Formation]:
    formation = failover.start()
    print(f"formation started: {formation.timings}")
    try:
        yield formation
    finally:
        formation.stop()


@pytest.fixture
def formation(formation_once: Formation) -> Formation:
    """The module's formation, healthy: a node an earlier test killed runs again."""
    for node in formation_once.nodes:
        if not node.running:
            formation_once.revive(node)
    formation_once.wait_healthy()
    return formation_once


@pytest.fixture
def hosts() -> Iterator[list[Host]]:
    started: list[Host] = []
    yield started
    for host in started:
        host.stop()


def new_database(formation: Formation) -> str:
    name = f"t_{uuid.uuid4().hex[:12]}"
    formation.create_database(name)
    return formation.url(name)


def launch(hosts: list[Host], url: str, name: str) -> Host:
    host = Host(url, name, STREAMERS, EVENTS)
    hosts.append(host)
    host.ready()
    host.wait(lambda: busy(host, 0.0), 30, "streaming and starting")
    return host


def test_the_formation_names_both_nodes_in_either_spelling(formation: Formation) -> None:
    """pg_autoctl's URI (which names no user) and the engine's URL reach the same primary."""
    uri, url = formation.uri(), formation.url(attrs="read-write")
    ports = [str(node.port) for node in formation.nodes]
    assert uri.startswith("postgres://127.0.0.1:") and "target_session_attrs=read-write" in uri
    assert ",".join(f"127.0.0.1:{port}" for port in ports) in uri
    assert f"port={','.join(ports)}" in url and "target_session_attrs=read-write" in url
    primary = formation.primary().port
    for conninfo in (uri, url.replace("postgresql+psycopg://", "postgresql://", 1)):
        with psycopg.connect(conninfo, user="postgres", connect_timeout=5) as conn:
            assert conn.info.port == primary


@pytest.mark.timeout(240)
def test_a_host_writes_again_by_itself_after_a_planned_failover(
    formation: Formation, hosts: list[Host]
) -> None:
    url = new_database(formation)
    host = launch(hosts, url, "A")
    formation.perform_failover()
    writes_again(host, time.time())
    settle(url, host)
    host.stop()
    check_after(url, host)


@pytest.mark.timeout(240)
def test_two_hosts_through_a_failover_are_neither_taken_over(
    formation: Formation, hosts: list[Host]
) -> None:
    """Neither host is dead: both only lost their connection (the failover takes about
    a second of host_timeout_s's 10), so neither may take the other's children over."""
    url = new_database(formation)
    a, b = launch(hosts, url, "A"), launch(hosts, url, "B")
    formation.perform_failover()
    now = time.time()
    for host in (a, b):
        writes_again(host, now)
    time.sleep(3 * 2.0)  # three heartbeats of each host, each a chance to take over
    for host in (a, b):
        settle(url, host)
    taken = rows.rows(url, "SELECT id, taken_by FROM engine_instances WHERE taken_by IS NOT NULL")
    assert not taken, f"a live host was taken over: {taken}"
    for host in (a, b):
        for conversation in list(host.started())[:STREAMERS]:
            owner = rows.scalar(
                url,
                "SELECT engine_instance_id FROM children WHERE conversation_id = :c",
                {"c": conversation},
            )
            assert owner == host.instance, f"{conversation} moved from {host.name} to {owner}"
    for host in (a, b):
        host.stop()
    check_after(url, a, b)


@pytest.mark.timeout(120)
def test_resume_times_measures_a_failover(formation: Formation) -> None:
    """The measuring script (python -m tests.harness.resume_times), once, on this formation."""
    found = resume_times.failovers(1, formation)
    print(found.summary())
    assert not found.failed, found.failed
    assert len(found.runs) == 1, "the probe saw the primary go and the new one come"


@pytest.mark.timeout(240)
def test_a_host_writes_again_by_itself_after_its_primary_is_killed(
    formation: Formation, hosts: list[Host]
) -> None:
    url = new_database(formation)
    synchronous = rows.scalar(url, "SHOW synchronous_standby_names")
    assert synchronous, "acknowledged writes must be on the secondary before the kill"
    host = launch(hosts, url, "A")
    killed = formation.kill_primary()
    formation.wait_promoted(killed)
    writes_again(host, time.time())
    settle(url, host)
    host.stop()
    check_after(url, host)
