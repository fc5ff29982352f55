"""What other tests use of engine/test_rewind.py, kept here so that no test module imports
another: LEASE, NAMES, Steps, TABLES, counts, events_of."""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec

from delegation import (
    ChildContext,
    Event,
)
from tests.harness import rows

LEASE = "lease-1"
NAMES = ("a", "b", "c", "d", "e")


# What a rewind's refusals may not change: every row a rewind writes lives in these.
TABLES = ("children", "steps", "events", "waits", "signals", "grants")


class Steps:
    """A run that takes the steps ``a``..``e``, emitting after each; counts each call."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.recoveries: list[Any] = []

    async def run(self, ctx: ChildContext) -> None:
        await ctx.admit()
        self.recoveries.append(ctx.recovery)
        for name in NAMES:
            value = await ctx.step(name, self._fn(name))
            ctx.emit(Event(kind="text", text=f"{name}={value}"))
        ctx.emit(Event(kind="result", text="ok"))

    def _fn(self, name: str) -> Any:
        def fn() -> str:
            self.calls[name] += 1
            return f"{name}{self.calls[name]}"

        return fn


def events_of(db_url: str, run_id: str) -> list[Event]:
    sql = (
        "SELECT e.body FROM events e JOIN children c ON c.id = e.child_id"
        " WHERE c.run_id = :r ORDER BY e.sequence"
    )
    found = rows.rows(db_url, sql, {"r": run_id})
    return [msgspec.json.decode(bytes(body), type=Event) for (body,) in found]


def counts(db_url: str) -> dict[str, int]:
    return {t: int(rows.scalar(db_url, f"SELECT count(*) FROM {t}")) for t in TABLES}
