"""A Patroni cluster for the high-availability tests (design §25): etcd and three
PostgreSQL 15 nodes under Patroni, on loopback only, in a temporary directory.

Debian's ``patroni`` (3.0) and ``etcd-server`` (3.4, its v2 API on, which Debian's
``python3-etcd`` speaks). etcd runs as the tests' user; each Patroni node, and so its
PostgreSQL, as the unprivileged user of tests/harness/postgres.py when the tests run as root,
under ``tests/harness/reaper.py`` so that every process of a node is found and ended. The
leader key's TTL is short (8 s, a loop every second): a dead leader is replaced within
seconds. ``fsync`` stays on, and replication is synchronous (Patroni's
``synchronous_mode``): a failover test is a durability test, and with asynchronous
replication a dead leader takes its last acknowledged commits with it.

Each node has a loopback address of its own (``127.77.X.N``): its PostgreSQL and its REST
API listen there, and its Patroni reaches etcd there (etcd listens on every node's
address; ``use_proxies``: no discovery of etcd's own address). So a firewall rule on
that address cuts the node off from everything -- the hosts, the other nodes, etcd --
while it runs on: ``cut`` (tests/harness/netcut.py), ``heal``.

The tests skip without the packages, unless ``DELEGATION_REQUIRE_PATRONI=1`` (CI's
``.ci/run`` installs them and sets it): then their absence is a failure.

    cluster = start()
    cluster.url("db")      # postgresql+psycopg://postgres@/db?host=…,…,…&port=…&target_session_attrs=read-write
    cluster.perform_failover()   # a planned switchover to a replica
    cluster.kill_primary()       # SIGKILL to the leader's postmaster (and so its backends)
    cluster.cut(cluster.primary())  # the leader's network cut (nftables); cluster.heal()
    cluster.stop()
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.harness import failover, netcut, postgres

REQUIRE = "DELEGATION_REQUIRE_PATRONI"
ROOT = Path(__file__).resolve().parents[2]


def require_patroni() -> tuple[str, str, str]:
    """``patroni``, ``patronictl`` and ``etcd``; skip without them (fail when required)."""
    found = [shutil.which(name) for name in ("patroni", "patronictl", "etcd")]
    if None in found:
        if os.environ.get(REQUIRE) == "1":
            pytest.fail("patroni and etcd are not installed (apt-get install patroni etcd-server)")
        pytest.skip("patroni and etcd are not installed")
    return found[0] or "", found[1] or "", found[2] or ""


@dataclass
class Node:
    name: str
    address: str
    port: int
    api: int
    pgdata: Path
    config: Path
    log: Path
    reaper: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self.reaper is not None and self.reaper.poll() is None


@dataclass
class Cluster:
    root: Path
    patroni: str
    patronictl: str
    etcd: subprocess.Popen[bytes]
    nodes: list[Node]
    timings: dict[str, float] = field(default_factory=dict)
    cut_off: str | None = None  # the nftables table of a cut

    def url(self, database: str = "postgres", attrs: str = "read-write") -> str:
        """The engine's URL: every node, the writable one chosen (libpq's
        ``target_session_attrs``), as README gives it."""
        ports = ",".join(str(node.port) for node in self.nodes)
        hosts = ",".join(node.address for node in self.nodes)
        query = f"host={hosts}&port={ports}&target_session_attrs={attrs}"
        return f"postgresql+psycopg://postgres@/{database}?{query}"

    def _conninfo(self, database: str, connect_timeout: int) -> str:
        hosts = ",".join(n.address for n in self.nodes)
        ports = ",".join(str(n.port) for n in self.nodes)
        return (
            f"host={hosts} port={ports} user=postgres dbname={database}"
            f" target_session_attrs=read-write connect_timeout={connect_timeout}"
        )

    def create_database(self, name: str) -> None:
        with psycopg.connect(self._conninfo("postgres", 5), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')

    def status(self, node: Node) -> dict[str, Any] | None:
        try:
            url = f"http://{node.address}:{node.api}/patroni"
            with urllib.request.urlopen(url, timeout=2) as r:
                return dict(json.loads(r.read()))
        except Exception:
            return None

    def primary(self) -> Node:
        for node in self.nodes:
            found = self.status(node)
            if (
                found
                and found.get("role") in ("master", "primary")
                and found.get("state") == ("running")
            ):
                return node
        raise RuntimeError(f"no leader: {self.describe()}")

    def members(self) -> list[dict[str, Any]] | None:
        """The cluster's members as Patroni's ``/cluster`` shows them (asked of the first
        node that answers), or None when none does."""
        for node in self.nodes:
            if self.cut_off is not None and node.address.replace(".", "_") in self.cut_off:
                continue
            try:
                url = f"http://{node.address}:{node.api}/cluster"
                with urllib.request.urlopen(url, timeout=2) as r:
                    return list(json.loads(r.read())["members"])
            except Exception:
                continue
        return None

    def healthy(self) -> bool:
        """A leader, a synchronous standby and a replica, all running (synchronous mode:
        only the synchronous standby may be promoted, so there must be one)."""
        members = self.members()
        if members is None or len(members) != len(self.nodes):
            return False
        if any(m.get("state") not in ("running", "streaming") for m in members):
            return False
        return sorted(str(m.get("role")) for m in members) == ["leader", "replica", "sync_standby"]

    def describe(self) -> str:
        return ", ".join(
            f"{n.name}:{(self.status(n) or {}).get('role')}/{(self.status(n) or {}).get('state')}"
            for n in self.nodes
        )

    def wait_healthy(self, timeout: float = 90.0) -> float:
        return _wait(self.healthy, timeout, lambda: f"cluster not healthy: {self.describe()}")

    def perform_failover(self, timeout: float = 60.0) -> Node:
        """A planned switchover (``patronictl switchover``) to the synchronous standby,
        waited for."""
        old = self.primary()
        done = subprocess.run(
            [self.patronictl, "-c", str(old.config), "switchover", "--master", old.name,
             "--force"],
            capture_output=True, text=True, check=True, timeout=timeout,
        )  # fmt: skip
        if "failed" in done.stdout.lower():  # patronictl says so, and exits 0
            raise RuntimeError(f"switchover refused: {done.stdout.strip()[-400:]}")
        return self.wait_promoted(old, timeout)

    def kill_postmaster(self) -> Node:
        """SIGKILL to the leader's postmaster only (its backends end with it): Patroni
        on that node finds it dead and starts it again, still the leader."""
        node = self.primary()
        pid = int((node.pgdata / "postmaster.pid").read_text().split()[0])
        os.kill(pid, signal.SIGKILL)
        return node

    def kill_primary(self) -> Node:
        """SIGKILL to every process of the leader's node (its Patroni, its postmaster and
        so its backends): the machine died. Once its leader key expires (8 s), a replica
        takes it (``wait_promoted``); the killed node, to ``revive``."""
        node = self.primary()
        failover._kill_tree(node)  # type: ignore[arg-type]
        return node

    def revive(self, node: Node, timeout: float = 90.0) -> None:
        """Run a killed node's Patroni again: it rejoins as a replica (``pg_rewind``)."""
        if not node.running:
            _run(node, self.patroni)
        self.wait_healthy(timeout)

    def logs(self) -> str:
        """What each node said last, and who leads: what a failed wait shows."""
        tails = "".join(f"\n--- {node.name}\n{_tail(node, 40)}" for node in self.nodes)
        return f"{self.describe()}{tails}"

    def wait_promoted(self, old: Node, timeout: float = 60.0) -> Node:
        _wait(lambda: _quietly(self.primary) not in (None, old), timeout, self.logs)
        return self.primary()

    def wait_writable(self, timeout: float = 60.0) -> float:
        """Wait until some node takes a write (after a kill, it may be the same). Asked of
        the database, not of Patroni: right after a postmaster's kill, Patroni still says
        ``running`` until its next loop finds it dead."""
        return _wait(lambda: _quietly(self._writes) is not None, timeout, self.logs)

    def _writes(self) -> int:
        with psycopg.connect(self._conninfo("postgres", 2), autocommit=True) as conn:
            row = conn.execute("SELECT txid_current()").fetchone()
        assert row is not None
        return int(row[0])

    def cut(self, node: Node) -> None:
        """Cut ``node`` off the network (tests/harness/netcut.py), until :meth:`heal`."""
        self.heal()
        self.cut_off = netcut.cut(node.address)

    def heal(self) -> None:
        """The network whole again."""
        if self.cut_off is not None:
            netcut.heal(self.cut_off)
            self.cut_off = None

    def stop(self) -> None:
        self.heal()
        for node in self.nodes:
            _end(node)
        self.etcd.terminate()
        try:
            self.etcd.wait(10)
        except subprocess.TimeoutExpired:
            self.etcd.kill()
            self.etcd.wait()
        shutil.rmtree(self.root, ignore_errors=True)


def start() -> Cluster:
    patroni, patronictl, etcd = require_patroni()
    bin_dir = postgres.binaries()
    assert bin_dir is not None
    root = Path(tempfile.mkdtemp(prefix="delegation-patroni-"))
    os.chown(root, *postgres._owner())
    began = time.monotonic()
    client, peer = postgres._free_port(), postgres._free_port()
    nodes = [_node(root, f"n{i}", i) for i in range(1, 4)]
    addresses = ["127.0.0.1", *(node.address for node in nodes)]
    etcd_log = (root / "etcd.log").open("wb")
    etcd_proc = subprocess.Popen(
        [etcd, "--name", "e1", "--data-dir", str(root / "etcd"), "--enable-v2=true",
         "--listen-client-urls", ",".join(f"http://{a}:{client}" for a in addresses),
         "--advertise-client-urls", f"http://127.0.0.1:{client}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"e1=http://127.0.0.1:{peer}"],
        stdout=etcd_log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    etcd_log.close()
    cluster = Cluster(root, patroni, patronictl, etcd_proc, nodes)
    try:
        _wait(lambda: _etcd_up(client), 30, lambda: (root / "etcd.log").read_text()[-2000:])
        for node in nodes:
            _write_config(node, root, client, bin_dir)
            _run(node, patroni)
            if node is nodes[0]:  # the first bootstraps; the others clone it
                _wait(lambda: _quietly(cluster.primary) is not None, 90, lambda: _tail(nodes[0]))
        cluster.wait_healthy()
    except BaseException:
        for node in nodes:
            print(f"--- {node.name}\n{_tail(node)}")
        cluster.stop()
        raise
    cluster.timings["start_s"] = round(time.monotonic() - began, 1)
    return cluster


def _node(root: Path, name: str, n: int) -> Node:
    return Node(
        name,
        netcut.address(n),
        postgres._free_port(),
        postgres._free_port(),
        root / name,
        root / f"{name}.yml",
        root / f"{name}.log",
    )


def _write_config(node: Node, root: Path, client: int, bin_dir: Path) -> None:
    sockets = root / "sockets"
    sockets.mkdir(exist_ok=True)
    os.chown(sockets, *postgres._owner())
    config = {
        "scope": "delegation-test",
        "name": node.name,
        "restapi": {
            "listen": f"{node.address}:{node.api}",
            "connect_address": f"{node.address}:{node.api}",
        },
        "etcd": {"host": f"{node.address}:{client}", "use_proxies": True},
        "bootstrap": {
            "dcs": {
                "ttl": 8,
                "loop_wait": 1,
                "retry_timeout": 3,
                # Nothing acknowledged may be lost with a dead leader: a commit returns
                # once a standby has it too, and only that standby may be promoted.
                "synchronous_mode": True,
                "maximum_lag_on_failover": 64 * 1048576,
                "postgresql": {"use_pg_rewind": True, "parameters": {"wal_log_hints": "on"}},
            },
            "initdb": [{"encoding": "UTF8"}, {"auth": "trust"}],
            "pg_hba": [
                "local all all trust",
                "host all all 127.0.0.0/8 trust",
                "host replication all 127.0.0.0/8 trust",
            ],
        },
        "postgresql": {
            "listen": f"{node.address}:{node.port}",
            "connect_address": f"{node.address}:{node.port}",
            "use_unix_socket": True,  # Patroni's own connection stays up through a cut
            "data_dir": str(node.pgdata),
            "bin_dir": str(bin_dir),
            "pgpass": str(root / f"{node.name}.pgpass"),
            "authentication": {
                "superuser": {"username": "postgres"},
                "replication": {"username": "postgres"},
                "rewind": {"username": "postgres"},
            },
            "parameters": {
                "unix_socket_directories": str(sockets),
                "max_connections": 200,
                "shared_buffers": "32MB",
            },
        },
        "tags": {"nofailover": False, "noloadbalance": False, "clonefrom": False},
    }
    node.config.write_text(json.dumps(config))  # JSON is YAML
    os.chown(node.config, *postgres._owner())


def _run(node: Node, patroni: str) -> None:
    with node.log.open("ab") as log:
        node.reaper = subprocess.Popen(
            [sys.executable, "-m", "tests.harness.reaper", patroni, str(node.config)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
            env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "HOME": str(node.pgdata.parent),
                 "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
    os.chown(node.log, *postgres._owner())


def _end(node: Node) -> None:
    """Patroni stopped (it stops its PostgreSQL), then whatever is left, SIGKILLed."""
    if node.reaper is None:
        return
    for pid in failover._descendants(node.reaper.pid):
        if failover._comm(pid) == "patroni":
            failover._signal(pid, signal.SIGTERM)
    try:
        node.reaper.wait(20)
    except subprocess.TimeoutExpired:
        failover._kill_tree(node)  # type: ignore[arg-type]


def _etcd_up(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return bool(json.loads(r.read()).get("health") == "true")
    except Exception:
        return False


def _wait(done: Callable[[], bool], timeout: float, what: Callable[[], object]) -> float:
    began = time.monotonic()
    while not done():
        if time.monotonic() - began > timeout:
            raise RuntimeError(f"timed out after {timeout} s: {what()}")
        time.sleep(0.2)
    return time.monotonic() - began


def _quietly(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:
        return None


def _tail(node: Node, lines: int = 30) -> str:
    if not node.log.exists():
        return ""
    return "\n".join(node.log.read_text(errors="replace").splitlines()[-lines:])
