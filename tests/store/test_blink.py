"""A database blink ends no child (design §32): every call a run makes on the store
waits for the database through an outage, as ``flush`` does, instead of raising
``StoreUnavailable`` into the runner's code.

A real PostgreSQL server of this module's own is stopped (``pg_ctl stop -m fast``) and
started again while children step, read recorded steps, ask, sleep, wait for an event and
flush: each ends ``done`` with its work, nothing it recorded before is lost, and no child
ran twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from delegation import ChildContext, Engine, EngineConfig, Event, errors
from delegation.store.stores import libpq, with_database
from tests.harness import postgres
from tests.harness.own_servers import own_harness
from tests.harness.support import ScriptRunner, wait_terminal

pytestmark = pytest.mark.skipif(postgres.binaries() is None, reason="no PostgreSQL server")

KINDS = ("step", "recorded", "ask", "sleep", "event", "flush")


@pytest.fixture(scope="module")
def server() -> Iterator[postgres.Server]:
    """A cluster of this module's own: the tests stop and start it."""
    own = postgres.start()
    if own.ctl is None:
        own.stop()
        pytest.skip("a given server cannot be restarted here")
    yield own
    own.stop()


@pytest.fixture
def blink_url(server: postgres.Server) -> str:
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(libpq(server.url), autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    return with_database(server.url, name)


class Blinked:
    """Runs that record a step and flush, wait for ``gate``, then make the store call
    their message names, a few times over (the server stops meanwhile), and end with
    what they got."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.calls: dict[str, int] = {}  # each step's function, by child and name

    async def __call__(self, ctx: ChildContext) -> None:
        kind, cid = ctx.request.message, ctx.identity.conversation_id
        await ctx.admit()
        await ctx.step("first", self._counted, cid, "first")
        ctx.emit(Event(kind="text", text="before"))
        await ctx.flush()
        await self.gate.wait()
        got: object = None
        for n in range(10):
            if kind == "step":
                got = await ctx.step(f"s{n}", self._counted, cid, f"s{n}")
            elif kind == "recorded":
                got = await ctx.recorded("first", type=int)
            elif kind == "flush":
                ctx.emit(Event(kind="text", text=f"during {n}"))
                await ctx.flush()
            await asyncio.sleep(0.1)
        if kind == "ask":
            got = await ctx.ask("question", "go on?")
        elif kind == "sleep":
            await ctx.sleep("nap", 0.5)
            got = "slept"
        elif kind == "event":
            got = await ctx.wait_event("go", "go")
        ctx.emit(Event(kind="result", text=f"{kind}: {got}"))

    def _counted(self, cid: str, name: str) -> int:
        key = f"{cid}/{name}"
        self.calls[key] = self.calls.get(key, 0) + 1
        return 1


@pytest.mark.parametrize("hosts", [1, 2])
async def test_a_restart_of_the_server_ends_no_child(
    blink_url: str, server: postgres.Server, hosts: int
) -> None:
    """Issue 46: a 1-2 s restart ended 62-140 children of a run with "database is
    unavailable; try again", raised out of ctx.ask and ctx.recorded into the runner.
    With two hosts, every other child runs on the second; answers and events are given
    on the first."""
    script = Blinked()
    runners = [ScriptRunner(script) for _ in range(hosts)]
    config = EngineConfig(host_heartbeat_s=0.5, hold_s=30.0)
    assert server.ctl is not None
    async with contextlib.AsyncExitStack() as stack:
        harnesses = []
        for n, runner in enumerate(runners):
            engine = await stack.enter_async_context(
                Engine(blink_url, runner=runner, config=config)
            )
            harnesses.append(await own_harness(engine, runner, f"runner-{n}"))
        engine = harnesses[0].engine
        started = {
            kind: await harnesses[n % hosts].start(f"q-{kind}", message=kind)
            for n, kind in enumerate(KINDS)
        }
        ids = {kind: r.conversation_id for kind, r in started.items()}

        async def flushed() -> bool:
            for cid in ids.values():
                if [e.text for e in await engine.events(cid)] != ["before"]:
                    return False
            return True

        await _until(flushed)
        server.ctl("stop", "-m", "fast")
        try:
            script.gate.set()  # every run makes its store calls while the server is away
            await asyncio.sleep(1.5)
        finally:
            server.ctl("start")

        async def asked() -> bool:
            with contextlib.suppress(errors.StoreUnavailable):
                record = await engine.get_child(ids["ask"])
                return record is not None and (record.terminal or record.inputs_open > 0)
            return False

        await _until(asked)
        with contextlib.suppress(errors.InputClosed):  # ended: the assertion below says how
            await engine.answer_input(ids["ask"], "question", text="yes")
        await _retried(lambda: engine.send_event(ids["event"], "go", "now"))
        ended = {kind: await wait_terminal(engine, cid, timeout=60) for kind, cid in ids.items()}
        assert {kind: (r.state, r.error) for kind, r in ended.items()} == {
            kind: ("done", "") for kind in KINDS
        }
        results = {kind: [e.text for e in await engine.events(cid)] for kind, cid in ids.items()}
    expected = {"step": "1", "recorded": "1", "ask": "yes", "sleep": "slept", "event": "now"}
    for kind, text in expected.items():
        assert results[kind][0] == "before" and results[kind][-1] == f"{kind}: {text}", results
    assert results["flush"] == ["before", *(f"during {n}" for n in range(10)), "flush: None"]
    assert sum(r.started for r in runners) == len(KINDS), "no child ran twice"
    assert set(script.calls.values()) == {1}, "no step ran twice"


async def _until(check: object, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await check():  # type: ignore[operator]
        if loop.time() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.05)


async def _retried(call: object, timeout: float = 30.0) -> object:
    """``call()`` once the server takes it (the test's own call, not a run's)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            return await call()  # type: ignore[operator]
        except errors.StoreUnavailable:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.05)
