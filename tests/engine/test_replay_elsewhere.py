"""An acknowledged start is an admitted start on every host (design §32).

Two hosts on one PostgreSQL database. Host A prepares a child slowly; the runner moves
to host B (the same ``hostInstanceId``) and replays the start by its ``requestId``
there. B runs no run of the child, yet its answer must wait for the admission outcome:
ok once A admitted it, the admission failure if it ended unadmitted, and a retryable
``admission_pending`` after ``start_wait_s`` while it is still only reserved. A read of
such a child waits the same way. The fault checker's finding was an ok answer at once,
for a child that then ended "child admission failed".
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from delegation import ChildContext, Engine, EngineConfig, Event, Params, Preset, Request, errors
from tests.harness import rows

pytestmark = pytest.mark.timeout(120)

PRESET = Preset(name="worker", extension_id="ext", generation=7)
TOOL = {"run_id": "parent", "tool_call_id": "call-1", "extension_id": "ext", "generation": 7}
OPENED = {
    "run_id": "parent",
    "conversation_id": "parent-conv",
    "tool_call_id": "call-1",
    "extension_id": "ext",
    "presets": [PRESET],
    "workspace": "/tmp",
}


class SlowToPrepare:
    """Prepares a child whose message is ``slow`` only once ``gate`` is set; every run
    admits itself, says so and holds until cancelled."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()

    async def prepare(self, request: Any, preset: Any, identity: Any, recovery: Any) -> Any:
        if request.message == "slow":
            await self.gate.wait()

        async def run(ctx: ChildContext) -> None:
            await ctx.admit()
            ctx.emit(Event(kind="text", text="admitted"))
            await ctx.flush()
            await asyncio.Event().wait()

        return run


@contextlib.asynccontextmanager
async def two_hosts(
    url: str, b_wait_s: float = 5.0
) -> AsyncIterator[tuple[Engine, Engine, asyncio.Event]]:
    """Hosts A and B, and the gate of A's slow prepare."""
    config = EngineConfig(host_heartbeat_s=0.5, host_timeout_s=30.0, release_drain_s=2.0)
    slow = SlowToPrepare()
    a = Engine(url, runner=slow, config=config)
    b_config = EngineConfig(
        host_heartbeat_s=0.5, host_timeout_s=30.0, release_drain_s=2.0, start_wait_s=b_wait_s
    )
    b = Engine(url, runner=SlowToPrepare(), config=b_config)
    await a.open()
    await b.open()
    try:
        yield a, b, slow.gate
    finally:
        await b.close()
        await a.close()


def start(request_id: str, message: str, lease_id: str = "L") -> Params:
    request = Request(request_id=request_id, profile="worker", message=message, lease_id=lease_id)
    return Params(**TOOL, lease_id=lease_id, request=request)


async def reserved(url: str, request_id: str) -> str:
    """The conversation of the child ``request_id`` reserved, once it is (``prepared``)."""
    sql = "SELECT conversation_id, state FROM children WHERE request_id = :r"
    for _ in range(500):
        found = rows.rows(url, sql, {"r": request_id})
        if found:
            assert found[0][1] == "prepared"
            return str(found[0][0])
        await asyncio.sleep(0.02)
    raise AssertionError(f"{request_id} was never reserved")


def admitted_at(url: str, conversation_id: str) -> Any:
    sql = "SELECT admitted_at FROM children WHERE conversation_id = :c"
    return rows.scalar(url, sql, {"c": conversation_id})


async def moved(a: Engine, b: Engine) -> Any:
    """Runner-1 on A, with an admitted child under lease L (its lease is active); then
    the same runner and tool call on B, as a runner moves."""
    conn = await a.connect("runner-1", "host-a")
    await a.open_tool(conn, **OPENED)
    first = await a.start(conn, start("q0", "fast"))
    assert not first.done and not first.queued
    return conn


async def test_a_replay_on_another_host_answers_once_the_child_is_admitted(
    postgres_db: str,
) -> None:
    async with two_hosts(postgres_db) as (a, b, gate):
        conn = await moved(a, b)
        on_a = asyncio.create_task(a.start(conn, start("q1", "slow")))
        cid = await reserved(postgres_db, "q1")
        conn_b = await b.connect("runner-1", "host-a")  # the same host instance: L lives
        await b.open_tool(conn_b, **OPENED)
        replay = asyncio.create_task(b.start(conn_b, start("q1", "slow")))
        await asyncio.sleep(1.0)
        assert not replay.done(), "B answered while the child was only reserved"
        gate.set()
        answered = await asyncio.wait_for(replay, 10)
        assert admitted_at(postgres_db, cid) is not None, "ok only for an admitted child"
        assert answered.conversation_id == cid and not answered.done
        on_a.cancel()
        await asyncio.gather(on_a, return_exceptions=True)


async def test_a_replay_on_another_host_answers_the_admission_failure(postgres_db: str) -> None:
    """The first child under a fresh lease: the move ends the tool call on A, which
    cancels the pending first admission (A stops preparing it). B's replay answers
    that failure, never ok."""
    async with two_hosts(postgres_db) as (a, b, _gate):
        conn = await a.connect("runner-1", "host-a")
        await a.open_tool(conn, **OPENED)
        on_a = asyncio.create_task(a.start(conn, start("q1", "slow")))
        cid = await reserved(postgres_db, "q1")
        conn_b = await b.connect("runner-1", "host-a")
        await b.open_tool(conn_b, **OPENED)
        with pytest.raises(errors.AdmissionFailed, match="originating tool ended"):
            await asyncio.wait_for(b.start(conn_b, start("q1", "slow")), 10)
        assert admitted_at(postgres_db, cid) is None
        with pytest.raises(errors.DelegationError):
            await on_a  # A's own caller: its tool call ended under it


async def test_a_replay_and_a_read_of_a_child_still_reserved_are_refused_for_now(
    postgres_db: str,
) -> None:
    """A never admits it (paused, as the checker's SIGSTOP did): after ``start_wait_s``
    B refuses with the retryable ``admission_pending``, and writes nothing; once A
    admits it, the same replay answers ok."""
    async with two_hosts(postgres_db, b_wait_s=0.5) as (a, b, gate):
        conn = await moved(a, b)
        on_a = asyncio.create_task(a.start(conn, start("q1", "slow")))
        cid = await reserved(postgres_db, "q1")
        conn_b = await b.connect("runner-1", "host-a")
        await b.open_tool(conn_b, **OPENED)
        before = rows.scalar(postgres_db, "SELECT count(*) FROM children")
        with pytest.raises(errors.AdmissionPending) as refused:
            await b.start(conn_b, start("q1", "slow"))
        assert refused.value.reason == "admission_pending"
        with pytest.raises(errors.AdmissionPending):
            await b.call(conn_b, "child.read", Params(**TOOL, lease_id="L", child_id=cid))
        assert rows.scalar(postgres_db, "SELECT count(*) FROM children") == before
        assert admitted_at(postgres_db, cid) is None
        gate.set()
        await asyncio.wait_for(on_a, 10)
        again = await b.start(conn_b, start("q1", "slow"))
        assert again.conversation_id == cid and not again.done
        assert admitted_at(postgres_db, cid) is not None
