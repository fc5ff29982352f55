"""The soak's journals: what a host was *acknowledged*, one JSON line per fact.

Each host process appends to a journal of its own (``journal-<epoch>.jsonl``), and only
once the engine acknowledged what a line states: an event range once ``flush()``
returned, a start once ``child.start`` answered, a release once it answered ``done``.
Each line goes to the kernel with one ``write`` as soon as it is known, so a SIGKILL
never loses it (the host also fsyncs now and then). Every line is a promise the database
must keep; :class:`Acks` folds them for :mod:`tools.soak.check`.

Kinds (``t``), each with the writer's ``pid``: ``ev`` (a run's flushed range ``a..b``,
written by host instance ``who``), ``start``, ``cancel``, ``release``, ``steer`` (an
injected receipt), ``finish`` (a parent run's end), ``instance`` (a runner registered as
a host instance), ``run``/``end`` (a run began or ended executing, with its recovery
``attempt``; an end that raised, with the ``error`` and ``where``), ``step`` (the
``value`` a run's step ``name`` returned, in recovery ``attempt``), ``took`` (a run took
a steer), ``boot``/``closed`` (an engine opened, and
closed gracefully), ``fenced`` (the host was taken over while it could not heartbeat, and
goes on as instance ``new``), ``takeover`` (the host took dead instances over), ``stats``
(calls, latencies and refusals since the last), ``stall`` (the longest its event loop went
unscheduled past a 0.1 s sleep in the second before ``at``, as host instance
``instance``: how starved the host was), and ``bad``: what a host saw go wrong.
"""

from __future__ import annotations

import array
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec


class Journal:
    """Append-only JSON lines, one ``write`` each (atomic for a line this small)."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self.pid = os.getpid()

    def write(self, kind: str, **fields: Any) -> None:
        os.write(self._fd, msgspec.json.encode({"t": kind, "pid": self.pid, **fields}) + b"\n")

    def bad(self, what: str, *, woken: bool = False) -> None:
        """Something the host saw go wrong; ``woken``: just after a pause of its own."""
        if woken:
            self.write("bad", what=what, woken=True)
        else:
            self.write("bad", what=what)

    def sync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        os.fsync(self._fd)
        os.close(self._fd)


@dataclass
class Acks:
    """What the hosts of a soak were acknowledged, folded from their journals."""

    events: dict[str, dict[int, str]] = field(default_factory=lambda: defaultdict(dict))
    starts: list[dict[str, Any]] = field(default_factory=list)
    releases: list[dict[str, Any]] = field(default_factory=list)
    cancels: list[dict[str, Any]] = field(default_factory=list)
    failed_runs: list[dict[str, Any]] = field(default_factory=list)
    revocations: list[tuple[str, float]] = field(default_factory=list)
    hids: dict[str, str] = field(default_factory=dict)
    # (run, attempt) -> the host instances that executed it
    executions: dict[tuple[str, int], list[str]] = field(default_factory=lambda: defaultdict(list))
    took: dict[tuple[str, str], list[str]] = field(default_factory=lambda: defaultdict(list))
    # (run, step name) -> (attempt, value) each time the step returned
    steps: dict[tuple[str, str], list[tuple[int, Any]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    raised: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    steers: list[tuple[str, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    woken: list[tuple[int, str]] = field(default_factory=list)  # (pid, what) after a pause
    contention: int = 0  # lock timeouts and deadlocks between hosts, answered busy
    closed: set[int] = field(default_factory=set)  # pids that closed gracefully
    closed_instances: set[str] = field(default_factory=set)
    instances: dict[str, int] = field(default_factory=dict)  # host instance -> its pid
    current: dict[int, str] = field(default_factory=dict)  # pid -> its host instance now
    fenced: dict[str, str] = field(default_factory=dict)  # old instance -> the new one
    taken: set[str] = field(default_factory=set)  # instances taken over at a heartbeat
    stalls: list[tuple[str, float, float]] = field(default_factory=list)  # (instance, at, s)
    ops: int = 0
    latencies: array.array[float] = field(default_factory=lambda: array.array("d"))
    calls: Counter[str] = field(default_factory=Counter)
    refusals: Counter[str] = field(default_factory=Counter)
    rss_mb: float = 0.0
    torn: int = 0
    # The engine clocks' offsets from the hosts' own clocks, as journaled: 0 on SQLite;
    # on PostgreSQL the server's clock as each host measured it, now and then again.
    offsets: tuple[float, float] | None = None  # the least and the most

    @property
    def clock_spread(self) -> float:
        """How far the engine clocks of the hosts (and of one host over time) differed."""
        return self.offsets[1] - self.offsets[0] if self.offsets else 0.0

    @property
    def clock_offset(self) -> float:
        """The engines' clock is the hosts' clock plus this, give or take half the spread."""
        return (self.offsets[0] + self.offsets[1]) / 2 if self.offsets else 0.0

    def offset(self, value: float) -> None:
        low, high = self.offsets or (value, value)
        self.offsets = (min(low, value), max(high, value))

    def add(self, record: dict[str, Any]) -> None:
        kind, pid = record.get("t"), record.get("pid", 0)
        if kind == "ev":
            ranges = self.events[record["run"]]
            for sequence in range(record["a"], record["b"] + 1):
                ranges[sequence] = record.get("who", "")
        elif kind in ("start", "release", "cancel", "finish", "instance"):
            self._grant(kind, record)
        elif kind == "run":
            self.executions[(record["run"], record["attempt"])].append(record.get("who", pid))
        elif kind == "end" and "error" in record:
            self.raised[record["run"]].append(record)
        elif kind == "step":
            self.steps[(record["run"], record["name"])].append((record["attempt"], record["value"]))
        elif kind == "took":
            self.took[(record["run"], record["req"])].append(record.get("who", pid))
        elif kind == "steer":
            self.steers.append((record["run"], record["req"]))
        elif kind in ("boot", "fenced", "closed", "takeover"):
            self._host(kind, pid, record)
        elif kind == "contention":
            self.contention += 1
        elif kind == "stall":
            self.stalls.append((record["instance"], record["at"], record["worst"]))
        elif kind == "bad" and record.get("woken"):
            self.woken.append((pid, f"host: {record['what']}"))
        elif kind == "bad":
            self.problems.append(f"host: {record['what']}")
        elif kind == "stats":
            self.ops += record["ops"]
            self.latencies.extend(record["lat"])
            self.calls.update(record["calls"])
            self.refusals.update(record["err"])
            self.rss_mb = max(self.rss_mb, record["rss"])
            self.offset(record.get("off", 0.0))

    def _grant(self, kind: str, record: dict[str, Any]) -> None:
        if kind == "start":
            self.starts.append(record)
        elif kind == "release":
            self.releases.append(record)
        elif kind == "cancel":
            self.cancels.append(record)
        elif kind == "finish" and not record["ok"]:
            self.failed_runs.append(record)
        elif kind == "instance":
            runner, hid = record["runner"], record["hid"]
            if self.hids.get(runner, hid) != hid:
                self.revocations.append((runner, record["sent"]))
            self.hids[runner] = hid

    def _host(self, kind: str, pid: int, record: dict[str, Any]) -> None:
        if kind == "boot":
            self.offset(record.get("off", 0.0))
            self.instances[record["instance"]] = pid
            self.current[pid] = record["instance"]
        elif kind == "fenced":
            self.fenced[record["old"]] = record["new"]
            self.instances[record["new"]] = pid
            self.current[pid] = record["new"]
        elif kind == "closed":
            self.closed.add(pid)
            self.closed_instances.add(record.get("instance", ""))
        elif kind == "takeover":
            self.taken.update(record["instances"])

    def stalled_since(self, since: float, excluding: frozenset[str] = frozenset()) -> float:
        """The longest a host's event loop went unscheduled from ``since`` (the hosts'
        clock) on, but for the host instances ``excluding`` (paused on purpose)."""
        found = (s for instance, at, s in self.stalls if at >= since and instance not in excluding)
        return max(found, default=0.0)

    def instances_of(self, pid: int) -> set[str]:
        return {instance for instance, owner in self.instances.items() if owner == pid}


class JournalReader:
    """Reads the records appended to a journal since the last call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self._decoder = msgspec.json.Decoder(dict[str, Any])

    def read_into(self, acks: Acks) -> None:
        if not self.path.exists():
            return
        with self.path.open("rb") as journal:
            journal.seek(self.offset)
            data = journal.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        for line in data[:end].splitlines():
            try:
                acks.add(self._decoder.decode(line))
            except (msgspec.DecodeError, KeyError, TypeError):
                acks.torn += 1  # a host killed inside a write; the line promises nothing
