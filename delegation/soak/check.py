"""The soak's invariant checker: a database file, read-only, against what hosts were told.

:func:`check_file` reads a delegation database through SQLite's read-only mode (safe
beside a running host) and returns every violation found, each ``"kind: detail"``.
Without a journal it checks what the file alone must satisfy: states, timestamps,
gap-free event sequences, one unfinished execution per conversation, cancellation
and fencing under ended grants, leases live or tombstoned, SQLite's own integrity.
With the :class:`~delegation.soak.journal.Acks` of a soak journal it also checks every
acknowledgement: each flushed event present with its text, each start admitted, each
cancel durable, each release confirmed only once its children had ended, no start after
a tombstone, no run executed twice, steers taken once. A :class:`Checker` called again
and again also sees rows change: a terminal row never does, and a row leaves only by
the retention purge, once due.
"""

from __future__ import annotations

import itertools
import sqlite3
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from delegation import maintenance, service
from delegation.soak.journal import Acks
from delegation.soak.runner import PLANNED_FAILURE, PREPARE_FAILURE

ACTIVE = ("prepared", "admitted", "running")
TERMINAL = ("done", "cancelled")
# How long past its deadline a live host may leave a lease unexpired (a timer's slack).
EXPIRY_GRACE_S = 3.0
EPS = 1e-3  # for comparing an engine timestamp with a host's later acknowledgement
SOAK_DONE_ERRORS = frozenset(
    {
        "",
        PLANNED_FAILURE,
        PREPARE_FAILURE,
        service.NOT_ADMITTED,
        maintenance.ADMISSION_INTERRUPTED,
        maintenance.INTERRUPTED,
    }
)

Row = sqlite3.Row


@dataclass
class Snapshot:
    """One consistent read of everything the checks look at."""

    children: list[Row]
    grants: dict[str, Row]
    leases: dict[tuple[str, str], Row]
    events: dict[int, tuple[int, int, int]]  # child id -> (count, first, last sequence)
    recoveries: Counter[int]
    last_result: dict[int, str]
    instances: list[Row]
    open_connections: list[Row]
    steers: set[tuple[int, str]]  # injected receipts: (child id, requestId)
    integrity: list[str]
    bodies: dict[int, dict[int, tuple[str, str]]]  # child -> sequence -> (kind, text)
    purged: dict[str, float]  # run id -> when it was purged after retention


def read_snapshot(path: Path, wanted: set[int], *, integrity: bool) -> Snapshot:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30, isolation_level=None)
    conn.row_factory = sqlite3.Row
    try:
        conn.execute("BEGIN")
        children = conn.execute("SELECT * FROM children ORDER BY id").fetchall()
        grants = {g["id"]: g for g in conn.execute("SELECT * FROM grants")}
        events = {
            r[0]: (r[1], r[2], r[3])
            for r in conn.execute(
                "SELECT child_id, COUNT(*), MIN(sequence), MAX(sequence) FROM events"
                " GROUP BY child_id"
            )
        }
        kinds = "json_extract(CAST(body AS TEXT), '$.kind')"
        recoveries: Counter[int] = Counter(
            dict(
                conn.execute(
                    f"SELECT child_id, COUNT(*) FROM events WHERE {kinds} = 'recovery'"
                    " GROUP BY child_id"
                ).fetchall()
            )
        )
        last_result = dict(
            conn.execute(
                "SELECT e.child_id, json_extract(CAST(e.body AS TEXT), '$.text') FROM events e"
                f" JOIN (SELECT child_id, MAX(sequence) AS s FROM events WHERE {kinds} = 'result'"
                " GROUP BY child_id) m ON m.child_id = e.child_id AND m.s = e.sequence"
            ).fetchall()
        )
        bodies: dict[int, dict[int, tuple[str, str]]] = {}
        for child_id in wanted:
            bodies[child_id] = {
                seq: (kind or "", text or "")
                for seq, kind, text in conn.execute(
                    f"SELECT sequence, {kinds}, json_extract(CAST(body AS TEXT), '$.text')"
                    " FROM events WHERE child_id = ?",
                    (child_id,),
                )
            }
        steers = {
            (r[0], r[1])
            for r in conn.execute(
                "SELECT child_id, request_id FROM steers WHERE outcome = 'injected'"
            )
        }
        instances = conn.execute("SELECT * FROM host_instances ORDER BY started_at").fetchall()
        open_connections = conn.execute(
            "SELECT * FROM connections WHERE closed_at IS NULL"
        ).fetchall()
        purged = dict(conn.execute("SELECT run_id, purged_at FROM purged").fetchall())
        checks: list[str] = []
        if integrity:
            checks = [r[0] for r in conn.execute("PRAGMA integrity_check")]
            checks += [f"foreign key {tuple(r)}" for r in conn.execute("PRAGMA foreign_key_check")]
        conn.execute("COMMIT")
    finally:
        conn.close()
    leases = {(g["runner_id"], g["lease_id"]): g for g in grants.values() if g["kind"] == "lease"}
    return Snapshot(
        children,
        grants,
        leases,
        events,
        recoveries,
        last_result,
        instances,
        open_connections,
        steers,
        checks,
        bodies,
        purged,
    )


@dataclass
class Checker:
    """Checks a database again and again as a soak goes on. It remembers every child it
    saw: a terminal row never changes, and a row leaves only by the retention purge,
    finished at least ``retention_s`` earlier."""

    lifetime_s: float | None = None
    max_recovery_attempts: int = 3
    retention_s: float | None = None  # None: nothing may be purged
    seen_terminal: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    seen_active: dict[str, float] = field(default_factory=dict)  # run id -> when last seen
    # The purge forgets what it purged after one more period; the checker does not.
    purged: dict[str, float] = field(default_factory=dict)
    tombstones: dict[tuple[str, str], set[float]] = field(default_factory=lambda: defaultdict(set))

    def check(
        self,
        path: Path,
        acks: Acks | None = None,
        *,
        killed: frozenset[int] = frozenset(),
        live: bool = False,
        final: bool = False,
        now: float = 0.0,
    ) -> list[str]:
        """Every violation in the file (and against ``acks``), each ``"kind: detail"``.

        ``live``: a booted host has the file open (so leases past their deadline must
        be gone, and every other host instance closed); ``final``: every host has closed
        gracefully and every lease was revoked, so nothing may be left unfinished.
        """
        by_run_id: dict[str, int] = {}
        if acks is not None:
            by_run_id = self._ids(path, set(acks.events))
        snap = read_snapshot(path, set(by_run_id.values()), integrity=not live)
        self.purged.update(snap.purged)
        snap = replace(snap, purged=self.purged)
        for key, lease in snap.leases.items():
            if lease["revoked_at"] is not None:
                self.tombstones[key].add(lease["revoked_at"])
        found = [*self._file(snap), *self._leases(snap, live, now)]
        found += self._vanished(snap, now)
        found += self._hosts(snap, live, final)
        if acks is not None:
            found += _journal(snap, acks, killed, self.tombstones, self.retention_s, now)
        return found

    def _vanished(self, snap: Snapshot, now: float) -> Iterator[str]:
        """Rows gone since the last check: only purged ones, and only once due."""
        present = {c["run_id"] for c in snap.children}
        retention = self.retention_s
        for run in [r for r in self.seen_active if r not in present]:
            seen = self.seen_active.pop(run)
            if run not in snap.purged or retention is None:
                yield f"lost_row: child {run} vanished while unfinished"
            elif snap.purged[run] < seen + retention:
                yield f"purged_early: child {run} was purged less than retention after it ran"
        for run in [r for r in self.seen_terminal if r not in present]:
            finished = self.seen_terminal.pop(run)[2]
            if run not in snap.purged or retention is None:
                yield f"lost_row: finished child {run} vanished without a purge"
            elif snap.purged[run] < finished + retention:
                yield f"purged_early: child {run} purged before its retention period"
        self.seen_active.update(
            (c["run_id"], now) for c in snap.children if c["state"] not in TERMINAL
        )

    @staticmethod
    def _ids(path: Path, runs: set[str]) -> dict[str, int]:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
        try:
            return {r: i for i, r in conn.execute("SELECT id, run_id FROM children") if r in runs}
        finally:
            conn.close()

    def _file(self, snap: Snapshot) -> Iterator[str]:
        active = Counter(c["conversation_id"] for c in snap.children if c["state"] in ACTIVE)
        for conv, count in active.items():
            if count > 1:
                yield f"two_active: conversation {conv} has {count} unfinished executions"
        for c in snap.children:
            yield from self._child(snap, c)

    def _child(self, snap: Snapshot, c: Row) -> Iterator[str]:
        run, state = c["run_id"], c["state"]
        if state not in (*ACTIVE, *TERMINAL):
            yield f"impossible_state: child {run} is {state!r}"
            return
        if (state in TERMINAL) != (c["finished_at"] is not None):
            yield f"finished_at: child {run} is {state} with finished_at {c['finished_at']}"
        admitted = c["admitted_at"] is not None
        if (state == "prepared" and admitted) or (
            state in ("admitted", "running") and not admitted
        ):
            yield f"admitted_at: child {run} is {state} with admitted_at {c['admitted_at']}"
        if state == "running" and c["engine_instance_id"] is None:
            yield f"running_unowned: child {run} is running under no host instance"
        if state == "cancelled" and (
            c["cancel_requested_at"] is None or c["error"] != c["cancel_reason"]
        ):
            yield f"cancelled_unrequested: child {run} cancelled without its request"
        if state == "done" and c["cancel_requested_at"] is not None:
            yield f"done_after_cancel: child {run} asked to cancel ended done"
        if c["recovery_attempts"] > self.max_recovery_attempts:
            yield f"resumed_too_often: child {run} resumed {c['recovery_attempts']} times"
        count, first, last = snap.events.get(c["id"], (0, 0, 0))
        if count and (first != 1 or last != count):
            yield f"event_gap: child {run} has {count} events numbered {first}..{last}"
        if snap.recoveries[c["id"]] != c["recovery_attempts"]:
            yield (
                f"recovery_events: child {run} has {snap.recoveries[c['id']]} recovery events"
                f" for {c['recovery_attempts']} resumes"
            )
        if c["output"] != snap.last_result.get(c["id"], ""):
            yield f"output: child {run} output is not the text of its last result event"
        grant = snap.grants.get(c["grant_id"]) if c["grant_id"] else None
        if state in ACTIVE and c["cancel_requested_at"] is None:
            if c["lease_id"] and (grant is None or grant["revoked_at"] is not None):
                yield f"not_cancelled: active child {run} under a revoked or expired lease"
            if not c["lease_id"] and (grant is None or grant["closed_at"] is not None):
                yield f"not_cancelled: active foreground child {run} of an ended tool call"
        if grant is not None and grant["kind"] == "lease" and grant["revoked_at"] is not None:
            fence = grant["revoked_at"]
            if c["created_at"] > fence or (c["admitted_at"] or 0) > fence:
                yield f"fencing: child {run} reserved or admitted under a tombstoned lease"
        if state in TERMINAL:
            self.seen_active.pop(run, None)
            seen = (state, c["error"], c["finished_at"], c["output"], count)
            before = self.seen_terminal.setdefault(run, seen)
            if before != seen:
                yield f"terminal_changed: child {run} was {before}, is {seen}"

    def _leases(self, snap: Snapshot, live: bool, now: float) -> Iterator[str]:
        for (runner, lease_id), g in snap.leases.items():
            name = f"{runner}/{lease_id}"
            if g["revoked_at"] is not None:
                if not g["revoke_reason"]:
                    yield f"tombstone: lease {name} revoked without a reason"
                continue
            if g["expires_at"] is None:
                yield f"lease_incomplete: live lease {name} has no deadline"
                continue
            if (
                self.lifetime_s is not None
                and abs(g["expires_at"] - g["created_at"] - self.lifetime_s) > 1e-6
            ):
                yield f"lease_lifetime: lease {name} does not live exactly its lifetime"
            if live and g["expires_at"] < now - EXPIRY_GRACE_S:
                late = now - g["expires_at"]
                yield f"lease_overdue: lease {name} still live {late:.1f} s past its deadline"

    @staticmethod
    def _hosts(snap: Snapshot, live: bool, final: bool) -> Iterator[str]:
        yield from (f"integrity: {line}" for line in snap.integrity if line != "ok")
        if not snap.instances:
            return
        newest = snap.instances[-1]["id"]
        open_ids = {h["id"] for h in snap.instances if h["closed_at"] is None}
        if live and open_ids != {newest}:
            yield f"instances_open: {len(open_ids)} host instances open beside the live one"
        for c in snap.children:
            if c["state"] == "running" and c["engine_instance_id"] != newest:
                yield f"running_on_dead_host: child {c['run_id']} runs on an old host instance"
        # A graceful close and a boot end every connection and tool call of the host
        # instance they close, in the same transaction.
        closed = {h["id"] for h in snap.instances if h["closed_at"] is not None}
        for c in snap.open_connections:
            if c["engine_instance_id"] in closed:
                yield "connection_left: a connection of a closed host instance is open"
        for g in snap.grants.values():
            if g["kind"] == "tool" and g["closed_at"] is None and g["engine_instance_id"] in closed:
                yield "tool_left: a tool call of a closed host instance is open"
        if not final:
            return
        for c in snap.children:
            if c["state"] in ACTIVE:
                yield f"unfinished: child {c['run_id']} still {c['state']} after the last host"
        for g in snap.grants.values():
            if g["kind"] == "lease" and g["revoked_at"] is None:
                yield f"lease_left: lease {g['runner_id']}/{g['lease_id']} live at the end"
        if open_ids:
            yield f"instances_open: {len(open_ids)} host instances open after the last close"


def _journal(
    snap: Snapshot,
    acks: Acks,
    killed: frozenset[int],
    tombstones: dict[tuple[str, str], set[float]],
    retention: float | None,
    now: float,
) -> list[str]:
    """Every acknowledgement the hosts journaled, against the snapshot (a child purged
    after retention answers for nothing any more)."""
    by_run = {c["run_id"]: c for c in snap.children}
    gone = snap.purged.keys()
    found = list(acks.problems)
    for c in snap.children:
        if c["state"] == "done" and c["error"] not in SOAK_DONE_ERRORS:
            found.append(f"run_error: child {c['run_id']} failed with {c['error']!r}")
    for run, sequences in acks.events.items():
        child = by_run.get(run)
        if run in gone:
            continue
        if child is None:
            found.append(f"lost_child: child {run} with flushed events is gone")
            continue
        bodies = snap.bodies.get(child["id"], {})
        for seq in sorted(sequences):
            kind, text = bodies.get(seq, ("", ""))
            if text != f"{kind[:1]}{seq}" or kind not in ("text", "result"):
                what = "missing" if seq not in bodies else f"{kind} {text!r}"
                found.append(f"lost_event: child {run} flushed event {seq} is {what}")
    for start in acks.starts:
        child = by_run.get(start["run"])
        if start["run"] in gone:
            continue
        if child is None or child["admitted_at"] is None or child["admitted_at"] > start["at"]:
            found.append(f"lost_start: child {start['run']} answered started is not admitted")
        elif (child["lease_id"] or "", child["runner_id"]) != (start["lease"], start["runner"]):
            found.append(f"wrong_start: child {start['run']} is not under its lease and runner")
    found += _releases(snap, acks, tombstones, retention, now)
    for cancel in acks.cancels:
        child = by_run.get(cancel["run"])
        if cancel["run"] in gone:
            continue
        requested = child is not None and (child["cancel_requested_at"] or 1e300) <= cancel["at"]
        ended = child is not None and (child["finished_at"] or 1e300) <= cancel["at"] + EPS
        if not (requested or ended):
            found.append(f"lost_cancel: child {cancel['run']} has no durable cancel request")
    for failed in acks.failed_runs:
        for g in snap.grants.values():
            mine = (g["kind"], g["run_id"]) == ("lease", failed["run_id"])
            if mine and g["revoked_at"] is None and g["created_at"] <= failed["sent"]:
                found.append(f"lease_kept: a lease of failed run {failed['run_id']} is live")
    for runner, sent in acks.revocations:
        for (owner, lease_id), g in snap.leases.items():
            if owner == runner and g["revoked_at"] is None and g["created_at"] <= sent:
                found.append(f"lease_kept: lease {runner}/{lease_id} outlived a new host instance")
    found += _executions(snap, acks, killed, by_run)
    return found


def _releases(
    snap: Snapshot,
    acks: Acks,
    tombstones: dict[tuple[str, str], set[float]],
    retention: float | None,
    now: float,
) -> Iterator[str]:
    """A confirmed release: every child under the lease ended by then, the lease revoked
    by then, and its tombstone kept and fencing starts until it may be purged
    (``retention`` after the revocation; ``tombstones``: every revocation seen)."""
    keep = float("inf") if retention is None else retention
    under: dict[tuple[str, str], list[Row]] = defaultdict(list)
    for c in snap.children:
        if c["lease_id"]:
            under[(c["runner_id"], c["lease_id"])].append(c)
    for release in acks.releases:
        key = (release["runner"], release["lease"])
        name, at = f"{key[0]}/{key[1]}", release["at"]
        lease = snap.leases.get(key)
        released = lease is not None and lease["created_at"] <= at
        if released and lease is not None and (lease["revoked_at"] or 1e300) > at + EPS:
            yield f"lost_tombstone: released lease {name} was not revoked"
        revoked = max((r for r in tombstones.get(key, ()) if r <= at + EPS), default=None)
        if lease is None and revoked is not None and now < revoked + keep:
            yield f"lost_tombstone: lease {name} lost its tombstone within retention"
        for c in under[key]:
            if c["created_at"] <= at:
                if c["finished_at"] is None or c["finished_at"] > at + EPS:
                    yield f"release_early: lease {name} confirmed before {c['run_id']} ended"
            elif revoked is not None and c["created_at"] < revoked + keep:
                yield f"fencing: child {c['run_id']} started under lease {name} after its release"


def _executions(
    snap: Snapshot, acks: Acks, killed: frozenset[int], by_run: dict[str, Row]
) -> Iterator[str]:
    """No run executed twice; steers taken once (again only after a crash), and real."""
    for (run, attempt), pids in acks.executions.items():
        if len(pids) > 1:
            yield f"twice: child {run} attempt {attempt} executed {len(pids)} times"
        child = by_run.get(run)
        if child is not None and attempt > child["recovery_attempts"]:
            yield f"twice: child {run} resumed as attempt {attempt} the database never made"
        if child is not None and attempt and not child["lease_id"]:
            yield f"resumed_foreground: child {run} resumed without a lease"
    ids = {c["id"]: c["run_id"] for c in snap.children}
    injected = {(ids[cid], req) for cid, req in snap.steers if cid in ids}
    gone = snap.purged.keys()
    for (run, req), pids in acks.took.items():
        if (run, req) not in injected and run not in gone:
            yield f"steer_unknown: child {run} took steer {req} that was never injected for it"
        for before, after in itertools.pairwise(pids):
            if before == after or before not in killed:
                yield f"steer_twice: child {run} took steer {req} twice"
    for run, req in acks.steers:
        if (run, req) not in injected and run not in gone:
            yield f"steer_lost: injected steer {req} of child {run} has no receipt"


def check_file(path: Path, acks: Acks | None = None, *, final: bool = False) -> list[str]:
    """Every violation in one database file (and against ``acks`` if given)."""
    return Checker().check(path, acks, final=final, now=time.time())
