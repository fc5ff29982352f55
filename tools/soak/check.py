"""The soak's invariant checker: a database, read-only, against what hosts were told.

:meth:`Checker.check` reads a delegation database in one read-only snapshot
(:mod:`tools.soak.snapshot`: a SQLite file, or any store by URL; safe beside running
hosts) and returns every violation found, each ``"kind: detail"``. Without a journal it
checks what the database alone must satisfy: states, timestamps, gap-free event
sequences, one unfinished execution per conversation, cancellation and fencing under
ended grants, leases live or tombstoned, one writer between two recoveries of a child,
SQLite's own integrity. With the :class:`~tools.soak.journal.Acks` of the soak's
journals it also checks every acknowledgement: each flushed event present with its
text, each start admitted, each cancel durable, each release confirmed only once its
children had ended, no start after a tombstone, no run executed twice, steers taken
once, a step's one value in every attempt (``step_rerun``: a resumed run ran a recorded
step again), no child ended by a store refusal (``store_error_ended``: the database away
or busy raised into a run, which design §32 forbids; any other unplanned error is
``run_error``). A :class:`Checker` called again and again also sees rows change: a terminal row
never does, and a row leaves only by the retention purge, once due. The rules about
host instances (one host, or several: :class:`~tools.soak.liveness.Fleet`) are in
:mod:`tools.soak.liveness`.

**What left, it learns from the soak's own record** (:mod:`tools.soak.audit`):
every child row deleted, with whether the engine's purge row was written beside it and
the engine's stamps of its end and its purge. So a legitimate purge is never judged a
loss, however briefly its ``purged`` row lived, and a deletion without a purge is always
found: ``deleted_unpurged``; ``purged_early`` (deleted less than the retention after
its end's write ran, as the engine stamped it); ``purge_forgotten_early`` (its
``purged`` row, the ``child_purged`` answer to a late handle, gone less than a period
after the purge's write ran); ``lost_row`` (a row gone with no deletion recorded at
all). The stamps themselves are held to the time the write ran, not the time it was
queued, by tests that stop a host in between (tests/crash/test_stamped_at_commit.py); the
record measures how long after its stamp each end's write reached its row
(``end_lags``). A database
without that record (one the soak did not make) is judged by the ``purged`` rows a
check sees, as before.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from delegation import EngineConfig, errors
from delegation.usecases import maintenance, service
from tools.soak import liveness
from tools.soak.journal import Acks
from tools.soak.liveness import Fleet
from tools.soak.runner import PLANNED_FAILURE, PREPARE_FAILURE, event_text
from tools.soak.snapshot import Row, Snapshot, Source, read_snapshot

ACTIVE = ("prepared", "admitted", "running")
TERMINAL = ("done", "cancelled")
# How long past its deadline a live host may leave a lease unexpired (a timer's slack).
EXPIRY_GRACE_S = 3.0
# The soak's hosts keep the engine's default: a runner's extension keeps its newest 1,024
# tombstones (design §18), and a soak revokes more than that within retention.
TOMBSTONE_CAP = EngineConfig().max_tombstones_per_extension
# For comparing an engine timestamp with a host's acknowledgement: on PostgreSQL each
# host's engine stamps the server's time as it measured it, so the soak widens this by
# how far the measurements differed (``Acks.clock_spread``).
EPS = 1e-3
# A store's refusals (StoreUnavailable, DatabaseBusy) and the words of any other error
# saying the database was away: a child that ended with one is ``store_error_ended``.
STORE_REFUSALS = (
    str(errors.StoreUnavailable()),
    str(errors.DatabaseBusy()),
    "database is unavailable",
    "store is unavailable",
)
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
    # The purge forgets what it purged after one more period; the checker does not:
    # run -> when it was deleted (the soak's record) or seen purged (without it).
    purged: dict[str, float] = field(default_factory=dict)
    ended: dict[str, float] = field(default_factory=dict)  # run -> its end's write, ran
    # How long after the engine stamped an end its write ran (the record's time less the
    # stamp): what "a moment before its commit" was, measured.
    end_lags: list[float] = field(default_factory=list)
    record: dict[str, list[Row]] = field(default_factory=lambda: defaultdict(list))
    audit_after: int = 0  # the last row of the soak's record read
    last: Any = None  # the last snapshot, for explain()
    tombstones: dict[tuple[str, str], set[float]] = field(default_factory=lambda: defaultdict(set))
    # Host instances seen taken over (their rows are purged after retention).
    taken: dict[str, str] = field(default_factory=dict)
    slack: float = EPS  # of the check under way

    def check(
        self,
        source: Source,
        acks: Acks | None = None,
        *,
        lost: frozenset[str] = frozenset(),
        live: bool = False,
        final: bool = False,
        now: float = 0.0,
        fleet: Fleet | None = None,
        slack: float = EPS,
    ) -> list[str]:
        """Every violation in the database (and against ``acks``), each ``"kind: detail"``.

        ``source``: a SQLite file, or a database URL. ``lost``: the host instances that
        ended without a graceful close (killed, or fenced after a pause): what they
        handed a run may be handed again. ``live``: a booted host has the database open
        (so leases past their deadline must be gone, and on one host every other host
        instance closed); ``final``: every host has closed gracefully and every lease
        was revoked, so nothing may be left unfinished. ``fleet``: several hosts share
        the database, and this is what the driver knows of them. ``slack``: how far
        two clocks' times may differ and still mean the same moment.
        """
        self.slack = slack
        wanted = set(acks.events) if acks is not None else set()
        began = time.monotonic()
        snap = read_snapshot(
            source, wanted, integrity=not live and fleet is None, audit_after=self.audit_after
        )
        # The read is retried while a restarted server is away (seconds): what the
        # snapshot misses may have gone as late as its end, so a row judged lost
        # "within retention" is judged at that end (``now`` is when the read began).
        read_end = now + (time.monotonic() - began)
        audited = list(self._audited(snap.audit or []))
        if snap.audit is None:
            self.purged.update(snap.purged)
        snap = replace(snap, purged=self.purged)
        self.last = snap
        for key, lease in snap.leases.items():
            if lease["revoked_at"] is not None:
                self.tombstones[key].add(lease["revoked_at"])
        self.taken.update((h["id"], h["taken_by"]) for h in snap.instances if h["taken_by"])
        grace = EXPIRY_GRACE_S + (fleet.settle_s if fleet is not None else 0.0)
        found = [*audited, *self._file(snap), *self._leases(snap, live, now, grace, acks)]
        found += self._vanished(snap, now)
        found += _writers(snap)
        if fleet is None:
            found += liveness.one_host(snap, live=live, final=final)
        else:
            found += liveness.several_hosts(snap, fleet, final=final)
        if acks is not None:
            found += _journal(snap, acks, lost, self.tombstones, self.retention_s, read_end, slack)
        return found

    def _audited(self, rows: list[Row]) -> Iterator[str]:
        """Fold the soak's record of what left, and judge each deletion as it is read."""
        retention, slack = self.retention_s, self.slack
        for row in rows:
            self.audit_after = max(self.audit_after, int(row["id"]))
            run, at = row["run_id"], float(row["at"])
            self.record[run].append(row)
            if row["what"] == "child_ended":
                self.ended[run] = at
                self.end_lags.append(at - float(row["finished_at"]))
            elif row["what"] == "child_deleted":
                self.purged[run] = at
                ended = row["finished_at"]  # the engine's stamp: when its end's write ran
                if not row["purge_row"] or retention is None:
                    yield f"deleted_unpurged: child {run} ({row['state']}) deleted with no purge"
                elif ended is None or at < ended + retention - slack:
                    after = "before its end" if ended is None else f"{at - ended:.2f} s after"
                    yield (
                        f"purged_early: child {run} purged {after} its end was written"
                        f" (retention {retention} s)"
                    )
            elif row["what"] == "purge_forgotten" and retention is not None:
                purged = row["purged_at"]  # the engine's stamp: when the purge's write ran
                if purged is not None and at < purged + retention - slack:
                    yield (
                        f"purge_forgotten_early: child {run} remembered as purged"
                        f" {at - purged:.2f} s of {retention} s"
                    )

    def _vanished(self, snap: Snapshot, now: float) -> Iterator[str]:
        """Rows gone since the last check: only purged ones, and (without the soak's
        record, which judges each deletion itself) only once due."""
        present = {c["run_id"] for c in snap.children}
        retention = self.retention_s
        judged = snap.audit is not None
        for run in [r for r in self.seen_active if r not in present]:
            seen = self.seen_active.pop(run)
            if run not in snap.purged or retention is None:
                yield f"lost_row: child {run} vanished while unfinished"
            elif not judged and snap.purged[run] < seen + retention - self.slack:
                yield f"purged_early: child {run} was purged less than retention after it ran"
        for run in [r for r in self.seen_terminal if r not in present]:
            finished = self.seen_terminal.pop(run)[2]
            if run not in snap.purged or retention is None:
                yield f"lost_row: finished child {run} vanished without a purge"
            elif not judged and snap.purged[run] < finished + retention - self.slack:
                yield f"purged_early: child {run} purged before its retention period"
        self.seen_active.update(
            (c["run_id"], now) for c in snap.children if c["state"] not in TERMINAL
        )

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
            fence = grant["revoked_at"] + self.slack
            if c["created_at"] > fence or (c["admitted_at"] or 0) > fence:
                yield f"fencing: child {run} reserved or admitted under a tombstoned lease"
        if state in TERMINAL:
            self.seen_active.pop(run, None)
            seen = (state, c["error"], c["finished_at"], c["output"], count)
            before = self.seen_terminal.setdefault(run, seen)
            if before != seen:
                yield f"terminal_changed: child {run} was {before}, is {seen}"

    def _leases(
        self, snap: Snapshot, live: bool, now: float, grace: float, acks: Acks | None
    ) -> Iterator[str]:
        """Leases whole and exactly their lifetime; with a host live, none past its
        deadline by more than ``grace`` and however long the hosts went unscheduled
        since (a starved machine: README, "Liveness on a starved machine")."""
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
            starved = acks.stalled_since(g["expires_at"]) if acks is not None else 0.0
            if live and g["expires_at"] < now - grace - starved - self.slack:
                late = now - g["expires_at"]
                yield f"lease_overdue: lease {name} still live {late:.1f} s past its deadline"


def _writers(snap: Snapshot) -> Iterator[str]:
    """Between two recoveries of a child (and before the first, and after the last)
    one host instance writes its events, and no instance writes in two such stretches:
    once a child was taken over, what its old instance writes is refused (a fenced
    host's late write would show here as its name after a recovery). Events name their
    writer (:func:`~tools.soak.runner.event_text`); the checked children are those
    ever resumed."""
    runs = {c["id"]: c["run_id"] for c in snap.children}
    for child_id in snap.recoveries:
        stretches: list[set[str]] = [set()]
        for sequence in sorted(bodies := snap.bodies.get(child_id, {})):
            kind, text = bodies[sequence]
            if kind == "recovery":
                stretches.append(set())
            elif kind in ("text", "result") and "@" in text:
                stretches[-1].add(text.partition("@")[2])
        run = runs.get(child_id, child_id)
        if any(len(writers) > 1 for writers in stretches):
            yield f"two_writers: child {run} has events of two host instances in one run"
        seen = [w for writers in stretches for w in writers]
        if len(seen) != len(set(seen)):
            yield f"fenced_write: child {run} has events of an instance after it was resumed"


def _journal(
    snap: Snapshot,
    acks: Acks,
    lost: frozenset[str],
    tombstones: dict[tuple[str, str], set[float]],
    retention: float | None,
    now: float,
    slack: float,
) -> list[str]:
    """Every acknowledgement the hosts journaled, against the snapshot (a child purged
    after retention answers for nothing any more); ``now``: when the snapshot's read
    ended, the latest moment it may show."""
    by_run = {c["run_id"]: c for c in snap.children}
    gone = snap.purged.keys()
    found = list(acks.problems)
    raised = dict(_store_errors_raised(acks))
    found += raised.values()
    for c in snap.children:
        if c["state"] == "done" and c["error"] not in SOAK_DONE_ERRORS:
            if not store_refusal(c["error"]):
                found.append(f"run_error: child {c['run_id']} failed with {c['error']!r}")
            elif c["run_id"] not in raised:  # else found as its run raised it, just above
                found.append(f"store_error_ended: child {c['run_id']} failed with {c['error']!r}")
    for run, sequences in acks.events.items():
        child = by_run.get(run)
        if run in gone:
            continue
        if child is None:
            found.append(f"lost_child: child {run} with flushed events is gone")
            continue
        bodies = snap.bodies.get(child["id"], {})
        for seq, who in sorted(sequences.items()):
            kind, text = bodies.get(seq, ("", ""))
            if text != event_text(kind, seq, who) or kind not in ("text", "result"):
                what = "missing" if seq not in bodies else f"{kind} {text!r}"
                found.append(f"lost_event: child {run} flushed event {seq} is {what}")
    for start in acks.starts:
        child = by_run.get(start["run"])
        if start["run"] in gone:
            continue
        admitted = None if child is None else child["admitted_at"]
        if child is None or admitted is None or admitted > start["at"] + slack:
            how = (
                "is missing"
                if child is None
                else f"is {child['state']}, not admitted"
                if admitted is None
                else f"was admitted {admitted - start['at']:.3f} s after its answer"
            )
            found.append(f"lost_start: child {start['run']} answered started {how}")
        elif (child["lease_id"] or "", child["runner_id"]) != (start["lease"], start["runner"]):
            found.append(f"wrong_start: child {start['run']} is not under its lease and runner")
    found += _releases(snap, acks, tombstones, retention, now, slack)
    for cancel in acks.cancels:
        child = by_run.get(cancel["run"])
        if cancel["run"] in gone:
            continue
        requested = (
            child is not None and (child["cancel_requested_at"] or 1e300) <= cancel["at"] + slack
        )
        ended = child is not None and (child["finished_at"] or 1e300) <= cancel["at"] + slack
        if not (requested or ended):
            found.append(f"lost_cancel: child {cancel['run']} has no durable cancel request")
    for failed in acks.failed_runs:
        for g in snap.grants.values():
            mine = (g["kind"], g["run_id"]) == ("lease", failed["run_id"])
            if mine and g["revoked_at"] is None and g["created_at"] <= failed["sent"] - slack:
                found.append(f"lease_kept: a lease of failed run {failed['run_id']} is live")
    for runner, sent in acks.revocations:
        for (owner, lease_id), g in snap.leases.items():
            if owner == runner and g["revoked_at"] is None and g["created_at"] <= sent - slack:
                found.append(f"lease_kept: lease {runner}/{lease_id} outlived a new host instance")
    found += _executions(snap, acks, lost, by_run)
    found += _steps(acks)
    return found


def store_refusal(error: str) -> bool:
    """Whether a child's error is the store's refusal (the database away or busy), which
    a run's store calls wait through instead of raising (design §32: a blink ends no
    child)."""
    text = error.lower()
    return any(words in text for words in STORE_REFUSALS)


def _store_errors_raised(acks: Acks) -> Iterator[tuple[str, str]]:
    """Runs that ended raising a store refusal, each once: (run, violation). The host
    journals it before the engine writes the child's end, so this finds it first, and
    also where that end is never written (its host fenced or closing, the child
    resumed): the refusal reached the runner's code all the same."""
    for run, ends in acks.raised.items():
        end = next((e for e in ends if store_refusal(e["error"])), None)
        if end is not None:
            yield (
                run,
                (
                    f"store_error_ended: child {run} attempt {end['attempt']} raised"
                    f" {end['error']!r} at {end.get('where', '?')}"
                ),
            )


def _steps(acks: Acks) -> Iterator[str]:
    """A step returns one value in every attempt: a resumed run gets back what an
    earlier one recorded, never runs it again (each value names the attempt that ran
    it)."""
    for (run, name), returned in acks.steps.items():
        first_attempt, first = returned[0]
        for attempt, value in returned[1:]:
            if value != first:
                yield (
                    f"step_rerun: child {run} step {name} returned {first} in attempt"
                    f" {first_attempt}, {value} in attempt {attempt}"
                )
                break


def _releases(
    snap: Snapshot,
    acks: Acks,
    tombstones: dict[tuple[str, str], set[float]],
    retention: float | None,
    now: float,
    slack: float,
) -> Iterator[str]:
    """A confirmed release: every child under the lease ended by then, the lease revoked
    by then, and its tombstone kept and fencing starts until it may be purged
    (``retention`` after the revocation; ``tombstones``: every revocation seen)."""
    keep = float("inf") if retention is None else retention
    # Each runner's revocations as seen (the soak's runners have one extension each): a
    # tombstone with TOMBSTONE_CAP newer ones beside it is trimmed by the cap (design §18).
    revoked_of: dict[str, list[float]] = defaultdict(list)
    for (runner, _), times in tombstones.items():
        revoked_of[runner].append(max(times))
    kept_of: dict[str, list[float]] = defaultdict(list)  # tombstones in the snapshot
    for (runner, _), row in snap.leases.items():
        if row["revoked_at"] is not None:
            kept_of[runner].append(float(row["revoked_at"]))
    under: dict[tuple[str, str], list[Row]] = defaultdict(list)
    for c in snap.children:
        if c["lease_id"]:
            under[(c["runner_id"], c["lease_id"])].append(c)
    for release in acks.releases:
        key = (release["runner"], release["lease"])
        name, at = f"{key[0]}/{key[1]}", release["at"]
        lease = snap.leases.get(key)
        released = lease is not None and lease["created_at"] <= at - slack
        if released and lease is not None and (lease["revoked_at"] or 1e300) > at + slack:
            yield f"lost_tombstone: released lease {name} was not revoked"
        revoked = max((r for r in tombstones.get(key, ()) if r <= at + slack), default=None)
        if lease is None and revoked is not None and now < revoked + keep - slack:
            # Newer revocations of the runner: those seen, or the tombstones the snapshot
            # holds, whichever is more (a lease made and revoked between two looks is
            # never seen, yet its tombstone counts against the cap).
            newer = max(
                sum(1 for r in revoked_of[key[0]] if r > revoked),
                sum(1 for at_ in kept_of[key[0]] if at_ > revoked),
            )
            if newer < TOMBSTONE_CAP:
                yield (
                    f"lost_tombstone: lease {name} lost its tombstone within retention"
                    f" (gone {now - revoked:.2f} s after its revocation, {newer} newer)"
                )
        for c in under[key]:
            if c["created_at"] <= at - slack:
                if c["finished_at"] is None or c["finished_at"] > at + slack:
                    yield f"release_early: lease {name} confirmed before {c['run_id']} ended"
            elif revoked is not None and revoked + slack < c["created_at"] < revoked + keep:
                yield f"fencing: child {c['run_id']} started under lease {name} after its release"


def _executions(
    snap: Snapshot, acks: Acks, lost: frozenset[str], by_run: dict[str, Row]
) -> Iterator[str]:
    """No run executed twice; steers taken once (again only after its first taker was
    lost: killed, or fenced), and real."""
    for (run, attempt), runs in acks.executions.items():
        if len(runs) > 1:
            yield f"twice: child {run} attempt {attempt} executed {len(runs)} times"
        child = by_run.get(run)
        if child is not None and attempt > child["recovery_attempts"]:
            yield f"twice: child {run} resumed as attempt {attempt} the database never made"
        if child is not None and attempt and not child["lease_id"]:
            yield f"resumed_foreground: child {run} resumed without a lease"
    ids = {c["id"]: c["run_id"] for c in snap.children}
    injected = {(ids[cid], req) for cid, req in snap.steers if cid in ids}
    gone = snap.purged.keys()
    for (run, req), takers in acks.took.items():
        if (run, req) not in injected and run not in gone:
            yield f"steer_unknown: child {run} took steer {req} that was never injected for it"
        for before, after in itertools.pairwise(takers):
            if before == after or before not in lost:
                yield f"steer_twice: child {run} took steer {req} twice"
    for run, req in acks.steers:
        if (run, req) not in injected and run not in gone:
            yield f"steer_lost: injected steer {req} of child {run} has no receipt"


def check_file(source: Source, acks: Acks | None = None, *, final: bool = False) -> list[str]:
    """Every violation in one database, a file or a URL (and against ``acks`` if given)."""
    return Checker().check(source, acks, final=final, now=time.time())
