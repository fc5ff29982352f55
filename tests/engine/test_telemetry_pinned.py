"""The gauge of pinned children (SPEC §27, issue 48): ``delegation.children.pinned`` is
the database's count of children pinned to a runner version, read when the metrics are
collected — from a reader's own thread, and on the engine's loop — and nothing once the
engine is closed. A real engine, store and SDK (an in-memory metric reader)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics.export import NumberDataPoint

from delegation import Engine, EngineConfig, Operator
from delegation.engine import telemetry
from tests.harness.otel import Otel
from tests.harness.versioned import Versioned, asks, until_done, waiting_on
from tests.harness.waits import HOLD_S, until


@pytest.fixture
def otel() -> Iterator[Otel]:
    made = Otel.make()
    yield made
    made.shutdown()


def pinned(otel: Otel) -> list[float]:
    """The gauge's points, as a collection finds them (none: no data at all)."""
    data = otel.reader.get_metrics_data()
    found = [
        point.value
        for resource in (data.resource_metrics if data is not None else [])
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == telemetry.PINNED
        for point in metric.data.data_points
        if isinstance(point, NumberDataPoint)
    ]
    return found


async def on_loop(otel: Otel, count: int) -> bool:
    return pinned(otel) == [count]


async def test_the_gauge_counts_the_pinned_children(
    db_url: str, workspace: Path, otel: Otel
) -> None:
    cid = await waiting_on(db_url, workspace, "v1")
    v2 = Versioned("v2", script=asks)
    config = EngineConfig(release_drain_s=2.0, hold_s=HOLD_S, on_version_change="pin")
    engine = Engine(db_url, runner=v2, config=config, **otel.providers())
    assert await asyncio.to_thread(pinned, otel) == [], "nothing before the engine opens"
    async with engine as e:
        assert await asyncio.to_thread(pinned, otel) == [0]
        await e.answer_input(cid, "word", text="hello")

        async def is_pinned() -> bool:
            found = await e.get_child(cid)
            return found is not None and found.pinned_version == "v1"

        await until(is_pinned)
        # A periodic reader or an exporter's server collects on a thread of its own.
        assert await asyncio.to_thread(pinned, otel) == [1]
        metric = (await asyncio.to_thread(otel.metrics))[telemetry.PINNED]
        assert (metric.unit, type(metric.data).__name__) == ("{child}", "Gauge")

        def unpin() -> Any:
            with Operator(db_url) as op:
                return op.unpin(cid)

        assert (await asyncio.to_thread(unpin)).status == "applied"
        await until_done(e, cid)
        # On the loop's own thread: the last count read, and a read for the next one.
        assert pinned(otel) == [1]
        await until(lambda: on_loop(otel, 0))
    assert await asyncio.to_thread(pinned, otel) == [], "nothing once it is closed"


async def test_a_collection_on_the_loop_before_any_read_reports_nothing_yet(
    db_url: str, otel: Otel
) -> None:
    async with Engine(db_url, runner=Versioned("v1", script=asks), **otel.providers()):
        assert pinned(otel) == []  # the loop cannot wait for itself: read for the next
        await until(lambda: on_loop(otel, 0))


async def test_an_engine_opened_again_on_the_same_provider_is_the_one_read(
    db_url: str, otel: Otel
) -> None:
    """A provider gives its first gauge to every engine that asks again (a process's
    global provider): the engine open now is read, not the one closed before."""
    async with Engine(db_url, runner=Versioned("v1", script=asks), **otel.providers()):
        assert await asyncio.to_thread(pinned, otel) == [0]
    assert await asyncio.to_thread(pinned, otel) == []
    async with Engine(db_url, runner=Versioned("v1", script=asks), **otel.providers()):
        assert await asyncio.to_thread(pinned, otel) == [0]
    assert await asyncio.to_thread(pinned, otel) == []
