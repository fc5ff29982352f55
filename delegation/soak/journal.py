"""The soak's journal: what a host was *acknowledged*, one JSON line per fact.

A host appends a line only once the engine acknowledged what it states: an event range
once ``flush()`` returned, a start once ``child.start`` answered, a release once it
answered ``done``. Each line goes to the kernel with one ``write`` as soon as it is
known, so a SIGKILL never loses it (the host also fsyncs now and then). Every line is a
promise the database must keep; :class:`Acks` folds them for :mod:`delegation.soak.check`.

Kinds (``t``), each with the writer's ``pid``: ``ev`` (a run's flushed range ``a..b``),
``start``, ``cancel``, ``release``, ``steer`` (an injected receipt), ``finish`` (a parent
run's end), ``instance`` (a runner registered as a host instance), ``run``/``end`` (a
run began or ended executing, with its recovery ``attempt``), ``took`` (a run took a
steer), ``boot``/``closed`` (an engine opened, and closed gracefully), ``stats`` (calls,
latencies and refusals since the last), and ``bad``: what a host saw go wrong itself.
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

    def bad(self, what: str) -> None:
        self.write("bad", what=what)

    def sync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        os.fsync(self._fd)
        os.close(self._fd)


@dataclass
class Acks:
    """What the hosts of a soak were acknowledged, folded from their journal."""

    events: dict[str, set[int]] = field(default_factory=lambda: defaultdict(set))
    starts: list[dict[str, Any]] = field(default_factory=list)
    releases: list[dict[str, Any]] = field(default_factory=list)
    cancels: list[dict[str, Any]] = field(default_factory=list)
    failed_runs: list[dict[str, Any]] = field(default_factory=list)
    revocations: list[tuple[str, float]] = field(default_factory=list)
    hids: dict[str, str] = field(default_factory=dict)
    executions: dict[tuple[str, int], list[int]] = field(default_factory=lambda: defaultdict(list))
    took: dict[tuple[str, str], list[int]] = field(default_factory=lambda: defaultdict(list))
    steers: list[tuple[str, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    closed: set[int] = field(default_factory=set)
    ops: int = 0
    latencies: array.array[float] = field(default_factory=lambda: array.array("d"))
    calls: Counter[str] = field(default_factory=Counter)
    refusals: Counter[str] = field(default_factory=Counter)
    rss_mb: float = 0.0
    torn: int = 0

    def add(self, record: dict[str, Any]) -> None:
        kind, pid = record.get("t"), record.get("pid", 0)
        if kind == "ev":
            self.events[record["run"]].update(range(record["a"], record["b"] + 1))
        elif kind == "start":
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
        elif kind == "run":
            self.executions[(record["run"], record["attempt"])].append(pid)
        elif kind == "took":
            self.took[(record["run"], record["req"])].append(pid)
        elif kind == "steer":
            self.steers.append((record["run"], record["req"]))
        elif kind == "bad":
            self.problems.append(f"host: {record['what']}")
        elif kind == "closed":
            self.closed.add(pid)
        elif kind == "stats":
            self.ops += record["ops"]
            self.latencies.extend(record["lat"])
            self.calls.update(record["calls"])
            self.refusals.update(record["err"])
            self.rss_mb = max(self.rss_mb, record["rss"])


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

    def seal(self) -> None:
        """End a line a killed host left unfinished, so the next host starts a fresh one."""
        if self.path.exists() and self.path.stat().st_size:
            with self.path.open("rb+") as journal:
                journal.seek(-1, 2)
                if journal.read(1) != b"\n":
                    journal.write(b"\n")
