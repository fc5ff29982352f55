"""What the soak writes down of each violation it finds (issue 36): a line of JSON in a
file beside its report, so that a finding can be diagnosed after the run without running
it again.

For a violation naming a child (``child RUN``), the line holds what the hosts were
acknowledged for it (starts, flushed events, cancels, steers, executions, the values
its steps returned, and what its runs raised and where), what the
database held at that check (its row, its events' count), and what the soak's own record
says left or ended (:mod:`tools.soak.audit`); for one naming a lease or a host
instance, that row. Every line has the violation, the check's time and its slack.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tools.soak.journal import Acks
from tools.soak.snapshot import Snapshot

_CHILD = re.compile(r"\bchild (\S+)")
_LEASE = re.compile(r"\blease (\S+)/(\S+)")
_INSTANCE = re.compile(r"\bhost instance (\S+)")
_STEPS = 20  # events and records shown at most per child


def explain(
    violation: str,
    snap: Snapshot | None,
    acks: Acks | None,
    record: dict[str, list[dict[str, Any]]],
    *,
    now: float,
    slack: float,
) -> dict[str, Any]:
    """The details of one violation found at the check of ``snap`` (see the module)."""
    found: dict[str, Any] = {"violation": violation, "kind": violation.split(":", 1)[0]}
    found.update(checked_at=now, slack=slack)
    if (match := _CHILD.search(violation)) is not None:
        run = match[1]
        found["run"] = run
        found["acknowledged"] = _acknowledged(acks, run) if acks is not None else None
        found["database"] = _held(snap, run)
        found["record"] = record.get(run, [])[-_STEPS:]
    if snap is not None and (match := _LEASE.search(violation)) is not None:
        found["lease"] = snap.leases.get((match[1], match[2].rstrip(":")))
    if snap is not None and (match := _INSTANCE.search(violation)) is not None:
        found["instance"] = next((h for h in snap.instances if h["id"] == match[1]), None)
    return found


def _acknowledged(acks: Acks, run: str) -> dict[str, Any]:
    events = acks.events.get(run, {})
    flushed = {"count": len(events), "first": min(events, default=None)}
    flushed["last"] = max(events, default=None)
    return {
        "starts": [s for s in acks.starts if s["run"] == run],
        "events": flushed,
        "cancels": [c for c in acks.cancels if c["run"] == run],
        "steers": [req for r, req in acks.steers if r == run][-_STEPS:],
        "executions": {f"{a}": who for (r, a), who in acks.executions.items() if r == run},
        # what its runs raised, and where (runner -> library API -> the raising line)
        "raised": [
            {k: r.get(k) for k in ("attempt", "who", "error", "where")}
            for r in acks.raised.get(run, [])
        ][-_STEPS:],
        "steps": {name: returned for (r, name), returned in acks.steps.items() if r == run},
    }


def _held(snap: Snapshot | None, run: str) -> dict[str, Any] | None:
    if snap is None:
        return None
    child = next((c for c in snap.children if c["run_id"] == run), None)
    held: dict[str, Any] = {"row": _plain(child), "purged_at": snap.purged.get(run)}
    if child is not None:
        count, first, last = snap.events.get(child["id"], (0, 0, 0))
        held["events"] = {"count": count, "first": first, "last": last}
    return held


def _plain(row: dict[str, Any] | None) -> dict[str, Any] | None:
    """A row fit for JSON: the stored request and preset (bytes) left out."""
    if row is None:
        return None
    return {k: v for k, v in row.items() if not isinstance(v, bytes | bytearray | memoryview)}


class Details:
    """The file of one soak's violation details (one JSON line each, as found)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.written = 0

    def write(self, details: dict[str, Any]) -> None:
        with self.path.open("a", encoding="utf-8") as file:
            file.write(json.dumps(details, default=str) + "\n")
        self.written += 1
