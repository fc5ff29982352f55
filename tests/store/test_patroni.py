"""The engine on a real highly available PostgreSQL (design §25): a three-node Patroni
cluster with etcd (tests/harness/patroni.py), and real host processes doing work
(tests/harness/failover_host.py: leased children streaming, others started every 0.2 s that
emit, flush and end), on the URL README gives: every node, ``target_session_attrs=
read-write``.

Through a planned switchover, a leader's postmaster killed (Patroni starts it again in
place), a leader's whole node killed with SIGKILL (Patroni too, so a replica takes over
once its key expires) and a leader cut off the network (nftables: it demotes itself, a
replica takes over, the hosts give up on its silent sessions by their TCP timeouts), each
host, never restarted, writes again by itself; afterwards every start it was answered
and every event whose flush returned is on the new leader, no child whose run ended is
left ``running``, no child ran twice, and neither host was taken over (the checks of
``tests/store/test_failover.py``, design §19).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from tests.harness import patroni
from tests.harness.failover_checks import EVENTS, STREAMERS, busy, check_after, settle, writes_again
from tests.harness.failover_host import Host

pytestmark = pytest.mark.serial


@pytest.fixture(scope="module")
def cluster_once() -> Iterator[patroni.Cluster]:
    cluster = patroni.start()
    print(f"patroni cluster started: {cluster.timings}")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster(cluster_once: patroni.Cluster) -> patroni.Cluster:
    """The module's cluster, healthy: a node an earlier test killed runs again, one it
    cut off is reached again."""
    cluster_once.heal()
    for node in cluster_once.nodes:
        if not node.running:
            cluster_once.revive(node)
    cluster_once.wait_healthy()
    return cluster_once


@pytest.fixture
def hosts() -> Iterator[list[Host]]:
    started: list[Host] = []
    yield started
    for host in started:
        host.stop()


def new_database(cluster: patroni.Cluster) -> str:
    name = f"t_{uuid.uuid4().hex[:12]}"
    cluster.create_database(name)
    return cluster.url(name)


# A host cuts itself off after host_timeout_s less one beat without a heartbeat (design
# §19), so it must outlast what a failure costs its heartbeat. Patroni's leader key lives
# 8 s (tests/harness/patroni.py): a dead leader's node is replaced in 9-17 s. A cut leader costs
# more: the failover, and on top of it each of the host's sessions on the silent node
# gives up only by its TCP timeouts (about 26 s, tests/store/test_silent_server.py). At 30 s a
# cut once cost host A its heartbeat past 28 s: it rejoined as a new instance, and its
# runner connection ended with the old one. A host under an HA manager sets
# host_timeout_s above the sum.
HOST_TIMEOUT_S = 60.0


def launch(hosts: list[Host], url: str, name: str) -> Host:
    host = Host(url, name, STREAMERS, EVENTS, timeout=HOST_TIMEOUT_S)
    hosts.append(host)
    host.ready()
    host.wait(lambda: busy(host, 0.0), 30, "streaming and starting")
    return host


def through(cluster: patroni.Cluster, hosts: list[Host], fail: str) -> None:
    url = new_database(cluster)
    a, b = launch(hosts, url, "A"), launch(hosts, url, "B")
    began = time.monotonic()
    if fail == "switchover":
        cluster.perform_failover()
    elif fail == "cut":
        old = cluster.primary()
        cluster.cut(old)
        cluster.wait_promoted(old)
    elif fail == "postmaster":
        cluster.kill_postmaster()
        cluster.wait_writable()
    else:
        old = cluster.kill_primary()
        cluster.wait_promoted(old)
    print(f"{fail}: a leader takes writes {time.monotonic() - began:.1f} s after the fault")
    now = time.time()
    try:
        for host in (a, b):
            writes_again(host, now)
        for host in (a, b):
            settle(url, host)
        for host in (a, b):
            host.stop()
        check_after(url, a, b)
    except AssertionError:
        for host in (a, b):
            print(f"--- host {host.name} stderr\n{''.join(host.stderr[-40:])}")
        raise


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fail", ["switchover", "node", "postmaster", "cut"])
def test_two_hosts_write_again_by_themselves_through_the_leaders_failure(
    cluster: patroni.Cluster, hosts: list[Host], fail: str
) -> None:
    through(cluster, hosts, fail)
