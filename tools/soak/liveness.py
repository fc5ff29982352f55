"""The soak's rules about host instances: which may own running children, which must be
closed or taken over, and by when.

On one host (either store) the newest instance is the live one: every running child is
its, and while it runs no other instance is open. With several hosts on one PostgreSQL
database (:class:`Fleet`) the driver says what it did to each host: an instance is dead
from the moment its host was killed, exited after a graceful close, or was paused
(SIGSTOP); a dead instance must be taken over within ``settle_s`` (then its running
children run under a live instance), and no instance whose host the driver never
stopped (killed, paused, or told to close) may ever be taken over.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from tools.soak.snapshot import Snapshot

ACTIVE = ("prepared", "admitted", "running")
# The server ends a session idle in its transaction this long after (the store sets
# idle_in_transaction_session_timeout on every session that opens transactions).
IDLE_S = 5.0


@dataclass(frozen=True)
class Fleet:
    """What the driver knows of its hosts at one check (several hosts on a database)."""

    dead: Mapping[str, float]  # host instance -> when its host stopped running it
    stopped: frozenset[str]  # instances of hosts killed, paused or told to close
    known: frozenset[str]  # every host instance a host journaled
    settle_s: float  # how long after a death its takeover may take
    now: float  # the driver's time of the check (of ``dead``, not of the engines)
    # How long the hosts still running went unscheduled from a time on (a starved
    # machine): a takeover may come that much later (README, "Liveness on a starved
    # machine"). None: not measured.
    stalled: Callable[[float], float] | None = None
    # (instance, when) of each pause: a paused host's open transaction holds its rows
    # until the server ends it, IDLE_S after it went idle, and a takeover that needs
    # them waits that long (README, "Liveness on a starved machine").
    pauses: tuple[tuple[str, float], ...] = ()

    def allowed(self, instance: str, died: float) -> float:
        """How long after ``died`` the takeover of ``instance`` may come: ``settle_s``,
        the time the hosts still running went unscheduled since, and ``IDLE_S`` when
        another host was paused from ``IDLE_S`` before its death on."""
        allowance = self.settle_s + (self.stalled(died) if self.stalled is not None else 0.0)
        held = any(who != instance and died - IDLE_S <= at for who, at in self.pauses)
        return allowance + (IDLE_S if held else 0.0)


def one_host(snap: Snapshot, *, live: bool, final: bool) -> Iterator[str]:
    """One host at a time: the newest instance owns every running child."""
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
    yield from _closed(snap)
    if final:
        yield from _final(snap, open_ids)


def several_hosts(snap: Snapshot, fleet: Fleet, *, final: bool) -> Iterator[str]:
    """Several hosts: a dead instance is taken over within ``settle_s``; a live one never."""
    now = fleet.now
    settled = {i for i, died in fleet.dead.items() if now - died > fleet.allowed(i, died)}
    for h in snap.instances:
        instance = h["id"]
        if h["taken_by"] is not None and instance in fleet.known - fleet.stopped:
            yield f"live_taken: host instance {instance} of a running host was taken over"
        if h["closed_at"] is None and instance in settled:
            late = now - fleet.dead[instance]
            yield f"not_taken_over: host instance {instance} is open {late:.1f} s after death"
    for c in snap.children:
        if c["state"] == "running" and c["engine_instance_id"] in settled:
            yield f"running_on_dead_host: child {c['run_id']} runs on a dead host instance"

    def written_late(instance: str, closed_at: float) -> bool:
        # A stopped host's rows, written after its takeover, last until the next beat
        # of a live host (beats a server restart may hold back): as long as a takeover.
        allowed = fleet.allowed(instance, closed_at)
        return not final and instance in fleet.stopped and now - closed_at <= allowed

    yield from _closed(snap, written_late)
    if final:
        yield from _final(snap, {h["id"] for h in snap.instances if h["closed_at"] is None})


def _closed(snap: Snapshot, late: Callable[[str, float], bool] | None = None) -> Iterator[str]:
    """A graceful close, a boot and a takeover end every connection and tool call of
    the host instance they close, in the same transaction; ``late`` excuses an instance
    closed at a time whose stopped host may still commit one it began before (a fenced
    host's connect, ended by a live host's next heartbeat)."""
    closed = {
        h["id"]
        for h in snap.instances
        if h["closed_at"] is not None and not (late and late(h["id"], h["closed_at"]))
    }
    for c in snap.open_connections:
        if (instance := c["engine_instance_id"]) in closed:
            yield f"connection_left: a connection of closed host instance {instance} is open"
    for g in snap.grants.values():
        if (
            g["kind"] == "tool"
            and g["closed_at"] is None
            and (i := g["engine_instance_id"]) in closed
        ):
            yield f"tool_left: a tool call of closed host instance {i} is open"


def _final(snap: Snapshot, open_ids: set[str]) -> Iterator[str]:
    """After the last host closed: nothing unfinished, no live lease, no open instance."""
    for c in snap.children:
        if c["state"] in ACTIVE:
            yield f"unfinished: child {c['run_id']} still {c['state']} after the last host"
    for g in snap.grants.values():
        if g["kind"] == "lease" and g["revoked_at"] is None:
            yield f"lease_left: lease {g['runner_id']}/{g['lease_id']} live at the end"
    if open_ids:
        yield f"instances_open: {len(open_ids)} host instances open after the last close"
