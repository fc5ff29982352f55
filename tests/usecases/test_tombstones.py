"""Tombstones are fenced per extension (design §18): each (runner, extension) keeps its own
newest 1024, so one extension's releases never drop another's, and a released lease id
stays refused (``not_owned``, the wire contract's answer) whatever the others release.
On both stores, through a real Engine, and through the upgrade to revision 0013."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, create_engine, inspect, text

from delegation import Engine, EngineConfig, Preset, errors
from delegation.clock import ManualClock
from delegation.store import migrate
from tests.harness.support import PRESET, Harness, ScriptRunner, open_harness
from tests.harness.tool_calls import open_tool

OTHER = Preset(name="worker", extension_id="ext-b", generation=PRESET.generation)


async def release(h: Harness, lease_id: str) -> Any:
    return await h.engine.call(h.conn, "child.lease.release", h.params(lease_id=lease_id))


async def tombstones(h: Harness) -> Counter[str]:
    """How many tombstones each extension of the runner keeps."""
    leases = await h.engine.leases("runner-1")
    return Counter(lease.extension_id for lease in leases if lease.revoked_at is not None)


async def test_another_extensions_releases_never_evict_a_released_lease(harness: Harness) -> None:
    """Extension A releases its lease L; extension B of the same runner then releases
    more unknown leases than a runner used to keep tombstones of. A's L is still fenced:
    a start with it is refused as ``not_owned`` and never reaches prepare (it used to be
    dropped with the runner's oldest tombstones, and L was accepted as a new lease)."""
    started = await harness.start("q1", lease_id="L")
    await harness.wait_done(started.conversation_id)
    assert (await release(harness, "L")).done
    other = await open_tool(harness, "call-b", extension_id="ext-b", presets=(OTHER,))
    outcomes = await asyncio.wait_for(
        asyncio.gather(*(release(other, f"T{i}") for i in range(1100))), 60
    )
    assert all(result.done for result in outcomes)
    prepared = len(harness.runner.prepared)
    with pytest.raises(errors.NotOwned) as refused:
        await harness.start("q2", lease_id="L")
    assert (refused.value.reason, str(refused.value)) == (
        "not_owned",
        "child requires active tool ownership or an unexpired retained lease",
    )
    assert len(harness.runner.prepared) == prepared
    # Each extension holds its own at most 1024: B's newest, and A's one.
    assert await tombstones(harness) == Counter({"ext-b": 1024, "ext": 1})
    kept = {lease.lease_id for lease in await harness.engine.leases("runner-1")}
    assert {f"T{i}" for i in range(1100)} & kept == {f"T{i}" for i in range(76, 1100)}


@pytest.mark.parametrize("config", [EngineConfig(max_tombstones_per_extension=3)], ids=["keep3"])
async def test_each_extension_keeps_its_newest_tombstones(
    harness: Harness, clock: ManualClock
) -> None:
    """Released leases (real ones: revoked) and releases of unknown ones alike: each
    extension keeps its newest ``max_tombstones_per_extension``, the oldest dropped
    first, whatever another extension of the runner releases."""
    other = await open_tool(harness, "call-b", extension_id="ext-b", presets=(OTHER,))
    for i in range(4):
        started = await harness.start(f"q{i}", lease_id=f"L{i}")
        await harness.wait_done(started.conversation_id)
        assert (await release(harness, f"L{i}")).done
        clock.advance(0.001)  # "newest" is by the time of the release
    for i in range(5):
        assert (await release(other, f"T{i}")).done
        clock.advance(0.001)
    kept = {lease.lease_id for lease in await harness.engine.leases("runner-1")}
    assert kept == {"L1", "L2", "L3", "T2", "T3", "T4"}
    # A's revocation trims A's tombstones only.
    started = await harness.start("q4", lease_id="L4")
    await harness.wait_done(started.conversation_id)
    assert (await release(harness, "L4")).done
    kept = {lease.lease_id for lease in await harness.engine.leases("runner-1")}
    assert kept == {"L2", "L3", "L4", "T2", "T3", "T4"}
    # A kept tombstone still fences its lease id.
    with pytest.raises(errors.NotOwned):
        await harness.start("q-fenced", lease_id="L2")


def _tombstone(conn: Connection, n: int, extension_id: str) -> None:
    conn.execute(
        text(
            "INSERT INTO grants (id, kind, runner_id, extension_id, lease_id, generations,"
            " created_at, revoked_at, revoke_reason) VALUES (:id, 'lease', 'runner-1', :ext,"
            " :lease, '7', :at, :at, 'released')"
        ),
        {"id": f"g-{extension_id}-{n:04d}", "ext": extension_id, "lease": f"{extension_id}-{n}",
         "at": T0 + n},
    )  # fmt: skip


T0 = 1_800_000_000.0


async def test_revision_0013_keeps_every_tombstone_and_trims_per_extension_after(
    db_url: str, workspace: Path
) -> None:
    """A database at revision 0011 with tombstones of two extensions of one runner (more
    than the runner used to keep in all): the upgrade keeps every row and adds the index;
    the next release trims only the releasing extension's, to its newest 1024."""
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            migrate.downgrade(conn, "0011")
            for n in range(1030):
                _tombstone(conn, n, "ext-b")
            _tombstone(conn, 0, "ext")
            conn.commit()
            migrate.upgrade(conn)
            assert migrate.current(conn) == migrate.head()
            assert conn.execute(text("SELECT COUNT(*) FROM grants")).scalar_one() == 1031
            indexes = {index["name"] for index in inspect(conn).get_indexes("grants")}
            assert "ix_grants_tombstones" in indexes
    finally:
        engine.dispose()
    runner = ScriptRunner()
    clock = ManualClock(T0 + 2000)
    async with Engine(db_url, runner=runner, clock=clock) as host:
        h = await open_harness(host, runner, workspace)
        other = await open_tool(h, "call-b", extension_id="ext-b", presets=(OTHER,))
        assert (await release(other, "ext-b-new")).done
        counts = await tombstones(h)
        assert counts == Counter({"ext-b": 1024, "ext": 1})
        kept = {lease.lease_id for lease in await host.leases("runner-1")}
        assert {"ext-0", "ext-b-new", "ext-b-1029"} <= kept and "ext-b-6" not in kept
        with pytest.raises(errors.NotOwned):
            await h.start("q-fenced", lease_id="ext-0")
