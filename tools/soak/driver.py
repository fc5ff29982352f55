"""The soak's driver: starts host processes (:mod:`tools.soak.host`) on one database,
stops them gracefully (SIGTERM) or kills them (SIGKILL), checks the database after each
(:mod:`tools.soak.check`) and reports. :class:`Driver` runs one host at a time;
:class:`~tools.soak.fleet.FleetDriver` runs several at once on PostgreSQL.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from delegation.cli.progress import Progress
from delegation.store import passwords, stores
from tools import environment
from tools.soak import audit
from tools.soak.check import EPS, Checker
from tools.soak.details import Details, explain
from tools.soak.host import (
    CONFIG,
    DB_ENV,
    HEARTBEAT_S,
    HOST_TIMEOUT_S,
    LEASE_LIFETIME_S,
    RETENTION_S,
    runners_of,
)
from tools.soak.journal import Acks, JournalReader
from tools.soak.liveness import Fleet
from tools.soak.snapshot import Source, tally

READY_TIMEOUT_S = 60.0
CLOSE_TIMEOUT_S = 60.0


def vm_hwm_mb(pid: int) -> float:
    """The peak resident memory of a live process, from ``/proc`` (0 where unknown)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


@dataclass(eq=False)
class HostProcess:
    """One host process the driver started, and what the driver did to it."""

    slot: int
    epoch: int
    proc: subprocess.Popen[bytes]
    stderr: Path
    state: str = "starting"  # starting, running, paused, fencing, closing, gone
    since: float = field(default_factory=time.monotonic)
    paused: str = ""  # the host instance it was paused as
    resume_at: float = 0.0

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tail(self) -> str:
        """The last line the host wrote to stderr."""
        text = self.stderr.read_text(errors="replace").strip() if self.stderr.exists() else ""
        return text.splitlines()[-1] if text else "no output"

    def ready(self, timeout: float) -> bool:
        """Whether the host printed READY (its engine is open) within ``timeout``."""
        assert self.proc.stdout is not None
        return _read_line(self.proc.stdout, timeout) == b"READY\n"

    def reap(self) -> None:
        """Never leave a host behind: kill it (and close our end of its pipes)."""
        if self.proc.poll() is None:
            self.proc.kill()  # a stopped process dies of SIGKILL too
            self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        self.state = "gone"


def _spread(seconds: list[float]) -> dict[str, float]:
    """The median, 99th percentile and most of ``seconds``, in milliseconds."""
    if not seconds:
        return {}
    ordered = sorted(seconds)
    at = [ordered[int(p * (len(ordered) - 1))] for p in (0.5, 0.99)]
    return {"p50": round(at[0] * 1000, 1), "p99": round(at[1] * 1000, 1),
            "max": round(ordered[-1] * 1000, 1)}  # fmt: skip


def _read_line(stream: IO[bytes], timeout: float) -> bytes:
    ready, _, _ = select.select([stream], [], [], timeout)
    return stream.readline() if ready else b""


class Driver:
    """Starts, stops and kills one host at a time on one database, and checks it after
    each stop (a SQLite file in ``folder``, or the database ``url`` names)."""

    def __init__(
        self,
        folder: Path,
        seconds: float,
        seed: int,
        *,
        url: str | None = None,
        hosts: int = 1,
        heartbeat_s: float = HEARTBEAT_S,
        timeout_s: float = HOST_TIMEOUT_S,
        progress: Progress | None = None,
        details: Path | None = None,
    ) -> None:
        self.folder, self.seconds, self.seed, self.hosts = folder, seconds, seed, hosts
        self.details = Details(details or folder / "violations.jsonl")
        self.progress = progress
        self.started = time.monotonic()
        self.heartbeat_s, self.timeout_s = heartbeat_s, timeout_s
        file = folder / "soak.db"
        self.url = url if url is not None else f"sqlite:///{file}"
        self.source: Source = url if url is not None else file
        self.store = stores.store_name(self.url)
        self.workspace = folder / "workspace"
        (self.workspace / "sub").mkdir(parents=True, exist_ok=True)
        self.rng = random.Random(seed)
        self.acks = Acks()
        self.journals: list[JournalReader] = []
        self.checker = Checker(LEASE_LIFETIME_S, CONFIG.max_recovery_attempts, RETENTION_S)
        self.violations: dict[str, None] = {}  # an ordered set: each finding once
        self.killed: set[int] = set()
        self.paused: set[int] = set()  # pids of hosts paused at least once
        self.excused = 0  # problems a host journaled just after its pause
        self.kills = self.graceful = self.pauses = self.checks = 0
        self.rss_mb = 0.0
        self.epoch = 0  # hosts started so far: each its own epoch, journal and tags
        self.booted = False
        self.proc: HostProcess | None = None
        self.hids = {runner: f"hi-0-{runner}" for runner in runners_of(0, 1)}

    def violation(self, what: str) -> None:
        """A finding, once; its details go to the details file as it is found."""
        if what in self.violations:
            return
        self.violations[what] = None
        now = time.time() + self.acks.clock_offset
        slack = EPS + 2 * self.acks.clock_spread
        checker = self.checker
        self.details.write(
            explain(what, checker.last, self.acks, checker.record, now=now, slack=slack)
        )

    # --- the soak -----------------------------------------------------------------------

    def prepare(self) -> None:
        """The soak's database, migrated, with the soak's own record of what leaves it
        (:mod:`tools.soak.audit`), before any host opens it."""
        audit.install(self.url)

    def run(self) -> dict[str, Any]:
        started = time.monotonic()
        deadline = started + self.seconds
        self.prepare()
        try:
            while True:
                self.proc = self.spawn(0, self.hids)
                if self.proc is not None:
                    hold = self.rng.uniform(0.5, 3.0)
                    self.pause(hold / 2, deadline)
                    self.check(live=True)
                    self.pause(hold / 2, deadline)
                    self.stop(self.proc, kill=self.choose_kill())
                self.check()
                over = time.monotonic() - deadline
                if over >= 0 and ((self.kills and self.graceful) or over > 60):
                    break
                self.hids = self.next_instances(self.hids)
                if self.rng.random() < 0.15:  # down a while: leases may expire meanwhile
                    self.pause(self.rng.uniform(0.0, 1.5), deadline)
            self.proc = self.spawn(0, self.final_instances(), final=True)
            if self.proc is not None:
                self.finish_last(self.proc)
            self.check(final=True)
        finally:
            if self.proc is not None:
                self.proc.reap()
        return self.report(time.monotonic() - started)

    @staticmethod
    def pause(seconds: float, deadline: float) -> None:
        time.sleep(max(0.0, min(seconds, deadline - time.monotonic())))

    def choose_kill(self) -> bool:
        """The first stop is graceful and the second a kill; then either, at random."""
        if not self.graceful:
            return False
        return not self.kills or self.rng.random() < 0.5

    def next_instances(self, hids: dict[str, str]) -> dict[str, str]:
        """Runners come back as the host instance they last were, or now and then anew."""
        self.read_journals()
        nxt = {runner: self.acks.hids.get(runner, hid) for runner, hid in hids.items()}
        for runner in nxt:
            if self.rng.random() < 0.3:
                nxt[runner] = f"hi-{self.epoch}-{runner}"
        return nxt

    def final_instances(self) -> dict[str, str]:
        """Every runner as a new host instance: every lease is revoked."""
        runners = [r for slot in range(self.hosts) for r in runners_of(slot, self.hosts)]
        return {runner: f"hi-final-{runner}" for runner in runners}

    # --- hosts ------------------------------------------------------------------------------

    def spawn(
        self, slot: int, hids: dict[str, str], *, final: bool = False, wait: bool = True
    ) -> HostProcess | None:
        """Start a host; with ``wait``, wait until its engine is open (None if never)."""
        epoch, self.epoch = self.epoch, self.epoch + 1
        journal = self.folder / f"journal-{epoch}.jsonl"
        self.journals.append(JournalReader(journal))
        command = [
            sys.executable,
            "-m",
            "tools.soak",
            "--host",
            "--workspace",
            str(self.workspace),
            "--journal",
            str(journal),
            "--seed",
            str(self.seed),
            "--epoch",
            str(epoch),
            "--instances",
            json.dumps(hids),
            "--heartbeat",
            str(self.heartbeat_s),
            "--host-timeout",
            str(self.timeout_s),
        ]
        if final:
            command.append("--final")
        if self.hosts > 1:
            command.append("--shared")
        err = self.folder / f"host-{epoch}.err"
        with err.open("wb") as stderr:
            proc = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env=environment({**os.environ, DB_ENV: self.url}),
            )
        host = HostProcess(slot, epoch, proc, err)
        if not wait:
            return host
        if host.ready(READY_TIMEOUT_S):
            host.state, self.booted = "running", True
            return host
        self.violation(f"host_start: a host never opened its engine: {host.tail()}")
        host.reap()
        return None

    def stop(self, host: HostProcess, *, kill: bool) -> None:
        """Close the host gracefully (SIGTERM) or kill it (SIGKILL), and reap it."""
        proc = host.proc
        if proc.poll() is not None:
            self.violation(f"host_died: a host exited by itself ({host.tail()})")
        elif kill:
            self.rss_mb = max(self.rss_mb, vm_hwm_mb(proc.pid))
            proc.kill()
            proc.wait()
            self.killed.add(proc.pid)
            self.kills += 1
        else:
            self.rss_mb = max(self.rss_mb, vm_hwm_mb(proc.pid))
            proc.send_signal(signal.SIGTERM)
            self.graceful += 1
            self.await_close(host)
        host.reap()

    def finish_last(self, host: HostProcess) -> None:
        """The last host drains by itself and closes; wait for it."""
        self.rss_mb = max(self.rss_mb, vm_hwm_mb(host.pid))
        self.await_close(host)
        host.reap()

    def await_close(self, host: HostProcess) -> None:
        """Wait for a graceful close: exit status 0, and ``closed`` in the journal."""
        try:
            code = host.proc.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.violation("close_hang: a host did not close within a minute")
            return
        self.closed(host, code)

    def closed(self, host: HostProcess, code: int) -> None:
        self.read_journals()
        if code != 0 or host.pid not in self.acks.closed:
            self.violation(f"close_failed: a closing host exited with {code} ({host.tail()})")

    # --- checks and the report ----------------------------------------------------------------

    def read_journals(self) -> None:
        """Fold what the hosts journaled since the last call. What a host saw go wrong
        just after a pause is a finding unless the driver did pause it."""
        for journal in self.journals:  # in the order the hosts started
            journal.read_into(self.acks)
        woken, self.acks.woken = self.acks.woken, []
        for pid, what in woken:
            if pid in self.paused:
                self.excused += 1
            else:
                self.violation(what)

    def lost(self) -> frozenset[str]:
        """Host instances that ended without a graceful close: killed, or fenced."""
        dead = {i for i, pid in self.acks.instances.items() if pid in self.killed}
        return frozenset(dead | set(self.acks.fenced))

    def check(self, *, live: bool = False, final: bool = False, fleet: Fleet | None = None) -> None:
        self.read_journals()
        if not self.booted:
            return
        found = self.checker.check(
            self.source,
            self.acks,
            lost=self.lost(),
            live=live,
            final=final,
            now=time.time() + self.acks.clock_offset,  # on the engines' clock
            fleet=fleet,
            slack=EPS + 2 * self.acks.clock_spread,
        )
        for what in found:
            self.violation(what)
        self.checks += 1
        self.tell()

    def tell(self) -> None:
        """The progress line, after each check: the time, calls, restarts, violations."""
        if self.progress is None:
            return
        elapsed = time.monotonic() - self.started
        what = "soak" if elapsed < self.seconds else "draining"
        self.progress.update(
            f"{what}: {self.acks.ops} calls, {self.kills + self.graceful} restarts,"
            f" {len(self.violations)} violations",
            done=min(elapsed, self.seconds),
        )

    def takeovers(self) -> int:
        """Host instances taken over after their host was killed or paused."""
        taken = set(self.checker.taken) | self.acks.taken
        return len(taken & self.lost())

    def report(self, elapsed: float) -> dict[str, Any]:
        latencies = sorted(self.acks.latencies)

        def percentile(p: float) -> float:
            return round(latencies[int(p * (len(latencies) - 1))], 2) if latencies else 0.0

        found = list(self.violations)
        acks = self.acks
        return {
            "seconds": self.seconds,
            "seed": self.seed,
            "store": self.store,
            "database": passwords.redacted(self.url),
            "hosts": self.hosts,
            "heartbeat_s": self.heartbeat_s,
            "host_timeout_s": self.timeout_s,
            "elapsed_s": round(elapsed, 1),
            "ops": acks.ops,
            "violations": len(found),
            "violations_by_kind": dict(Counter(v.split(":", 1)[0] for v in found)),
            "violation_samples": found[:20],
            "details": str(self.details.path) if self.details.written else None,
            "restarts": self.kills + self.graceful,
            "kills": self.kills,
            "graceful": self.graceful,
            "pauses": self.pauses,
            "takeovers": self.takeovers(),
            "fenced": len(acks.fenced),
            "excused_after_pause": self.excused,
            "contention": acks.contention,
            "clock_spread_ms": round(acks.clock_spread * 1000, 1),
            "end_lag_ms": _spread(self.checker.end_lags),
            "calls": dict(acks.calls.most_common()),
            "errors_by_reason": dict(sorted(acks.refusals.items())),
            "p50_ms": percentile(0.5),
            "p99_ms": percentile(0.99),
            "max_ms": round(latencies[-1], 1) if latencies else 0.0,
            "rss_mb": round(max(self.rss_mb, acks.rss_mb), 1),
            **(tally(self.source) if self.booted else {}),
            "acked": {
                "starts": len(acks.starts),
                "events": sum(len(s) for s in acks.events.values()),
                "releases": len(acks.releases),
                "cancels": len(acks.cancels),
                "steers": len(acks.steers),
            },
            "checks": self.checks,
        }
