"""``python -m delegation.soak --seconds N [--json] [--seed S]``: a soak test of the engine
with real crashes, and every invariant checked on the database.

This process (the driver) starts a host process (:mod:`delegation.soak.host`) on a
fresh database: an :class:`~delegation.Engine` under a random workload of several
runners with many children (start, read, steer, cancel, release, tool end, parent
finish, reconnect). It lets the host run a random while, then closes it gracefully
(SIGTERM) or kills it (SIGKILL), checks the file (:mod:`delegation.soak.check`) and
starts the next host on the same file, which resumes the leased children, until the
time is up. A last host comes back as a new host instance for every runner (so every
lease is revoked), waits until every child has ended and closes; the file is checked
once more, with nothing left unfinished. Prints a summary, or with ``--json`` one line
of JSON; exits non-zero when a violation was found.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import IO, Any

from delegation.soak.check import Checker
from delegation.soak.host import CONFIG, LEASE_LIFETIME_S, RETENTION_S, RUNNERS, HostOptions
from delegation.soak.journal import Acks, JournalReader

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


class Driver:
    """Starts, stops and kills hosts on one database, and checks it after each."""

    def __init__(self, folder: Path, seconds: float, seed: int) -> None:
        self.folder, self.seconds, self.seed = folder, seconds, seed
        self.db = folder / "soak.db"
        self.workspace = folder / "workspace"
        (self.workspace / "sub").mkdir(parents=True, exist_ok=True)
        self.rng = random.Random(seed)
        self.acks = Acks()
        self.journal = JournalReader(folder / "journal.jsonl")
        self.checker = Checker(LEASE_LIFETIME_S, CONFIG.max_recovery_attempts, RETENTION_S)
        self.violations: dict[str, None] = {}  # an ordered set: each finding once
        self.killed: set[int] = set()
        self.kills = self.graceful = self.checks = 0
        self.rss_mb = 0.0
        self.proc: subprocess.Popen[bytes] | None = None
        self.epoch = 0
        self.hids = {runner: f"hi-0-{runner}" for runner in RUNNERS}

    def violation(self, what: str) -> None:
        self.violations.setdefault(what)

    # --- the soak -----------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        started = time.monotonic()
        deadline = started + self.seconds
        epoch = 0
        try:
            while True:
                if self.spawn(epoch):
                    hold = self.rng.uniform(0.5, 3.0)
                    self.pause(hold / 2, deadline)
                    self.check(live=True)
                    self.pause(hold / 2, deadline)
                    self.stop(kill=self.choose_kill())
                self.check()
                epoch += 1
                over = time.monotonic() - deadline
                if over >= 0 and ((self.kills and self.graceful) or over > 60):
                    break
                self.next_instances(epoch)
                if self.rng.random() < 0.15:  # down a while: leases may expire meanwhile
                    self.pause(self.rng.uniform(0.0, 1.5), deadline)
            self.hids = {runner: f"hi-final-{runner}" for runner in RUNNERS}
            if self.spawn(epoch, final=True):
                self.finish_last()
            self.check(final=True)
        finally:
            self.reap()
        return self.report(time.monotonic() - started)

    @staticmethod
    def pause(seconds: float, deadline: float) -> None:
        time.sleep(max(0.0, min(seconds, deadline - time.monotonic())))

    def choose_kill(self) -> bool:
        """The first stop is graceful and the second a kill; then either, at random."""
        if not self.graceful:
            return False
        return not self.kills or self.rng.random() < 0.5

    def next_instances(self, epoch: int) -> None:
        """Runners come back as the host instance they last were, or now and then anew."""
        self.hids.update(self.acks.hids)
        for runner in RUNNERS:
            if self.rng.random() < 0.3:
                self.hids[runner] = f"hi-{epoch}-{runner}"

    # --- hosts ------------------------------------------------------------------------------

    def spawn(self, epoch: int, *, final: bool = False) -> bool:
        """Start a host and wait until its engine is open; False if it never was."""
        self.journal.seal()
        command = [
            sys.executable,
            "-m",
            "delegation.soak",
            "--host",
            "--db",
            str(self.db),
            "--workspace",
            str(self.workspace),
            "--journal",
            str(self.journal.path),
            "--seed",
            str(self.seed),
            "--epoch",
            str(epoch),
            "--instances",
            json.dumps(self.hids),
        ]
        if final:
            command.append("--final")
        self.epoch = epoch
        with (self.folder / f"host-{epoch}.err").open("wb") as stderr:
            self.proc = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr
            )
        assert self.proc.stdout is not None
        if _read_line(self.proc.stdout, READY_TIMEOUT_S) == b"READY\n":
            return True
        self.violation(f"host_start: a host never opened its engine: {self.tail()}")
        self.reap()
        return False

    def stop(self, *, kill: bool) -> None:
        """Close the host gracefully (SIGTERM) or kill it (SIGKILL), and reap it."""
        proc = self.proc
        assert proc is not None
        if proc.poll() is not None:
            self.violation(f"host_died: a host exited by itself ({self.tail()})")
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
            self.await_close(proc)
        self.reap()

    def finish_last(self) -> None:
        """The last host drains by itself and closes; wait for it."""
        assert self.proc is not None
        self.rss_mb = max(self.rss_mb, vm_hwm_mb(self.proc.pid))
        self.await_close(self.proc)
        self.reap()

    def await_close(self, proc: subprocess.Popen[bytes]) -> None:
        """Wait for a graceful close: exit status 0, and ``closed`` in the journal."""
        try:
            code = proc.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.violation("close_hang: a host did not close within a minute")
            return
        self.journal.read_into(self.acks)
        if code != 0 or proc.pid not in self.acks.closed:
            self.violation(f"close_failed: a closing host exited with {code} ({self.tail()})")

    def reap(self) -> None:
        """Never leave a host behind: kill it (and close our end of its pipes)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()

    def tail(self) -> str:
        """The last line the current host wrote to stderr."""
        text = (self.folder / f"host-{self.epoch}.err").read_text(errors="replace").strip()
        return text.splitlines()[-1] if text else "no output"

    # --- checks and the report ----------------------------------------------------------------

    def check(self, *, live: bool = False, final: bool = False) -> None:
        self.journal.read_into(self.acks)
        if not self.db.exists():
            return
        found = self.checker.check(
            self.db,
            self.acks,
            killed=frozenset(self.killed),
            live=live,
            final=final,
            now=time.time(),
        )
        for what in found:
            self.violation(what)
        self.checks += 1

    def report(self, elapsed: float) -> dict[str, Any]:
        latencies = sorted(self.acks.latencies)

        def percentile(p: float) -> float:
            return round(latencies[int(p * (len(latencies) - 1))], 2) if latencies else 0.0

        found = list(self.violations)
        acks = self.acks
        return {
            "seconds": self.seconds,
            "seed": self.seed,
            "elapsed_s": round(elapsed, 1),
            "ops": acks.ops,
            "violations": len(found),
            "violations_by_kind": dict(Counter(v.split(":", 1)[0] for v in found)),
            "violation_samples": found[:20],
            "restarts": self.kills + self.graceful,
            "kills": self.kills,
            "graceful": self.graceful,
            "calls": dict(acks.calls.most_common()),
            "errors_by_reason": dict(sorted(acks.refusals.items())),
            "p50_ms": percentile(0.5),
            "p99_ms": percentile(0.99),
            "max_ms": round(latencies[-1], 1) if latencies else 0.0,
            "rss_mb": round(max(self.rss_mb, acks.rss_mb), 1),
            **tally(self.db),
            "acked": {
                "starts": len(acks.starts),
                "events": sum(len(s) for s in acks.events.values()),
                "releases": len(acks.releases),
                "cancels": len(acks.cancels),
                "steers": len(acks.steers),
            },
            "checks": self.checks,
        }


def _read_line(stream: IO[bytes], timeout: float) -> bytes:
    ready, _, _ = select.select([stream], [], [], timeout)
    return stream.readline() if ready else b""


def tally(db: Path) -> dict[str, Any]:
    """What the soak left in the database: children by state, events, resumes, leases."""
    if not db.exists():
        return {}
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        states = dict(conn.execute("SELECT state, COUNT(*) FROM children GROUP BY state"))
        (events,) = conn.execute("SELECT COUNT(*) FROM events").fetchone()
        (resumes,) = conn.execute("SELECT SUM(recovery_attempts) FROM children").fetchone()
        (leases,) = conn.execute("SELECT COUNT(*) FROM grants WHERE kind = 'lease'").fetchone()
        (purged,) = conn.execute("SELECT COUNT(*) FROM purged").fetchone()
    finally:
        conn.close()
    return {
        "children": sum(states.values()),
        "children_by_state": states,
        "events": events,
        "resumed": resumes or 0,
        "leases": leases,
        "purged": purged,
    }


def summary(report: dict[str, Any]) -> str:
    lines = [
        f"soak: {report['elapsed_s']} s, seed {report['seed']}: {report['ops']} calls,"
        f" {report['restarts']} restarts ({report['kills']} kill -9,"
        f" {report['graceful']} graceful), {report['checks']} checks",
        f"children: {report.get('children', 0)} {report.get('children_by_state', {})},"
        f" events: {report.get('events', 0)}, resumed: {report.get('resumed', 0)},"
        f" purged: {report.get('purged', 0)}",
        f"acknowledged: {report['acked']}",
        f"latency: p50 {report['p50_ms']} ms, p99 {report['p99_ms']} ms,"
        f" max {report['max_ms']} ms; host rss {report['rss_mb']} MB",
        f"calls: {report['calls']}",
        f"refusals: {report['errors_by_reason']}",
        f"violations: {report['violations']}",
    ]
    lines += [f"  {what}" for what in report["violation_samples"]]
    return "\n".join(lines)


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through Driver.run, which kills its host


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m delegation.soak", description=__doc__)
    parser.add_argument("--seconds", type=float, default=20.0, help="how long to soak")
    parser.add_argument("--json", action="store_true", help="one line, one JSON object")
    parser.add_argument("--seed", type=int, help="the random seed (default: a fresh one)")
    parser.add_argument("--keep", type=Path, help="keep the database and journal here")
    host = parser.add_argument_group("host process (internal)")
    host.add_argument("--host", action="store_true", help=argparse.SUPPRESS)
    host.add_argument("--db", help=argparse.SUPPRESS)
    host.add_argument("--workspace", help=argparse.SUPPRESS)
    host.add_argument("--journal", help=argparse.SUPPRESS)
    host.add_argument("--epoch", type=int, default=0, help=argparse.SUPPRESS)
    host.add_argument("--instances", default="{}", help=argparse.SUPPRESS)
    host.add_argument("--final", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "big")
    if args.host:
        from delegation.soak import host as soak_host

        return soak_host.main(
            HostOptions(
                args.db,
                args.workspace,
                args.journal,
                seed,
                args.epoch,
                json.loads(args.instances),
                args.final,
            )
        )
    signal.signal(signal.SIGTERM, _terminate)
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        report = Driver(args.keep, args.seconds, seed).run()
    else:
        with tempfile.TemporaryDirectory(prefix="delegation-soak-") as folder:
            report = Driver(Path(folder), args.seconds, seed).run()
    print(json.dumps(report, separators=(",", ":")) if args.json else summary(report))
    return 1 if report["violations"] else 0
