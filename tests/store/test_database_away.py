"""The engine survives its database going away (design §19), with a real server stopped
and started under a running host, and with its sessions killed:

- while the server is away, calls are refused with ``StoreUnavailable`` (reason
  ``store_unavailable``), never ``internal_error``;
- afterwards the host writes again by itself: a new child starts, runs and ends;
- a run that ended while the server was away is recorded as ended (its finish is owed,
  not dropped), and its events emitted meanwhile are kept;
- everything acknowledged before is there, and no child ran twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import threading
import uuid
from collections.abc import AsyncIterator, Iterator

import psycopg
import pytest

from delegation import ChildContext, Engine, EngineConfig, Event, errors
from delegation.client.api import Client
from delegation.store.stores import libpq, with_database
from tests.harness import postgres
from tests.harness.own_servers import own_harness
from tests.harness.pg_sessions import _terminate
from tests.harness.support import PRESET, Harness, ScriptRunner, open_harness

pytestmark = pytest.mark.skipif(postgres.binaries() is None, reason="no PostgreSQL server")


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
def away_url(server: postgres.Server) -> str:
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(libpq(server.url), autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    return with_database(server.url, name)


class Gate:
    """Runs that emit, flush, wait for ``gate``, emit once more and end."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()

    async def __call__(self, ctx: ChildContext) -> None:
        await ctx.admit()
        ctx.emit(Event(kind="text", text="before"))
        await ctx.flush()
        await self.gate.wait()
        ctx.emit(Event(kind="result", text="after"))


@contextlib.asynccontextmanager
async def hosted(db_url: str, runner: ScriptRunner) -> AsyncIterator[Harness]:
    config = EngineConfig(release_drain_s=2.0, host_heartbeat_s=0.5)
    async with Engine(db_url, runner=runner, config=config) as engine:
        yield await open_harness(engine, runner, "/tmp", [PRESET])


async def refused_while_away(h: Harness) -> list[str]:
    """What a start and a read get while the server is away: their reasons."""
    reasons = []
    for attempt in (h.start("while-away"), h.engine.get_child("c-" + "0" * 32)):
        try:
            await attempt
        except errors.DelegationError as exc:
            reasons.append(exc.reason)
        else:
            reasons.append("answered")
    return reasons


async def until(check: object, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await check():  # type: ignore[operator]
        if loop.time() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.05)


def kill_sessions(url: str) -> int:
    """End every session of the engine's (pg_terminate_backend), as an operator or a
    crashed backend would."""
    with psycopg.connect(libpq(url), autocommit=True) as admin:
        rows = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE application_name LIKE 'delegation%' AND pid != pg_backend_pid()"
        ).fetchall()
    return len(rows)


async def _through(h: Harness, runner: ScriptRunner, script: Gate, outage: object) -> None:
    first = await h.start("q1")

    async def flushed() -> bool:
        return [e.text for e in await h.engine.events(first.conversation_id)] == ["before"]

    await until(flushed)
    reasons = await outage(script)  # type: ignore[operator]
    if reasons is not None:
        assert set(reasons) == {"store_unavailable"}, reasons

    async def ended() -> bool:
        with contextlib.suppress(errors.StoreUnavailable):
            record = await h.engine.get_child(first.conversation_id)
            return record is not None and record.terminal
        return False

    await until(ended)
    record = await h.engine.get_child(first.conversation_id)
    assert record is not None and (record.state, record.error) == ("done", "")
    assert [e.text for e in await h.engine.events(first.conversation_id)] == ["before", "after"]
    second = await until_started(h)
    script.gate.set()
    done = await h.wait_done(second.conversation_id, timeout=20)
    assert done.state == "done"
    assert runner.started == 2, "no child ran twice"
    assert [p.recovery for p in runner.prepared] == [None, None]


async def until_started(h: Harness):  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while True:
        try:
            return await h.start("q2")
        except (errors.StoreUnavailable, errors.DatabaseBusy):  # behind a failing beat
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.05)


@pytest.mark.parametrize("mode", ["fast", "immediate"])
async def test_a_host_writes_again_after_its_server_restarts(
    away_url: str, server: postgres.Server, mode: str
) -> None:
    """Issue 24, finding 1: after `pg_ctl stop -m fast` and a start, the host never
    wrote again (every start and flush: internal error)."""
    script = Gate()
    runner = ScriptRunner(script)
    assert server.ctl is not None
    async with hosted(away_url, runner) as h:

        async def restart(gate: Gate) -> list[str]:
            server.ctl("stop", "-m", mode)  # type: ignore[misc]
            try:
                gate.gate.set()  # the run ends while the server is away
                await asyncio.sleep(0.3)  # its finish meets the server away
                return await refused_while_away(h)
            finally:
                server.ctl("start")  # type: ignore[misc]

        await _through(h, runner, script, restart)


async def test_a_host_writes_again_after_its_sessions_are_killed(away_url: str) -> None:
    script = Gate()
    runner = ScriptRunner(script)
    async with hosted(away_url, runner) as h:

        async def kill(gate: Gate) -> None:
            assert kill_sessions(away_url) >= 2  # the writer, the lock, the reader, the watch
            gate.gate.set()
            return None

        await _through(h, runner, script, kill)


async def test_no_live_host_is_taken_over_for_a_restart_of_the_server(
    away_url: str, server: postgres.Server
) -> None:
    """A restart frees every host's lock: the first host to beat after it must not take
    the others over (the lock proved death before; they were only cut off for a while),
    and each host's child goes on running where it ran."""
    assert server.ctl is not None
    scripts = [Gate(), Gate()]
    runners = [ScriptRunner(script) for script in scripts]
    # The first host beats often, the second seldom: after the restart the first looks
    # at the second's lock long before the second has taken it again.
    beats = [0.2, 3.0]
    async with contextlib.AsyncExitStack() as stack:
        hosts = []
        for i, runner in enumerate(runners):
            config = EngineConfig(release_drain_s=2.0, host_heartbeat_s=beats[i])
            engine = await stack.enter_async_context(Engine(away_url, runner=runner, config=config))
            hosts.append(await own_harness(engine, runner, f"runner-{i}"))
        children = [await h.start("q1", lease_id="") for h in hosts]
        server.ctl("stop", "-m", "fast")
        await asyncio.sleep(1.0)
        server.ctl("start")
        await asyncio.sleep(2.0)  # the first host's ten heartbeats, the second's none
        with psycopg.connect(libpq(away_url), autocommit=True) as admin:
            taken = admin.execute(
                "SELECT count(*) FROM engine_instances WHERE taken_by IS NOT NULL"
            ).fetchone()
        assert taken == (0,), "a live host was taken over"
        for script in scripts:
            script.gate.set()
        for h, child in zip(hosts, children, strict=True):
            done = await h.wait_done(child.conversation_id, timeout=20)
            assert (done.state, done.error) == ("done", "")
        assert [r.started for r in runners] == [1, 1], "no child ran twice"


async def test_a_host_booting_just_after_a_restart_of_the_server_takes_no_live_host_over(
    away_url: str, server: postgres.Server
) -> None:
    """The soak's finding (design §32): a restart freed a live host's lock, and a host
    that booted (or beat) before the live one had beaten again took a free lock with a
    heartbeat two beats old for a dead host's, and took it over. A free lock proves a
    death only on a server up for two beats, and a failed beat is tried again at once."""
    assert server.ctl is not None
    script = Gate()
    runner = ScriptRunner(script)
    # The live host beats seldom; the booting one counts a free lock after two of its
    # own beats (1 s).
    config = EngineConfig(release_drain_s=2.0, host_heartbeat_s=3.0, host_timeout_s=30.0)
    booting = EngineConfig(release_drain_s=2.0, host_heartbeat_s=0.5, host_timeout_s=30.0)
    async with Engine(away_url, runner=runner, config=config) as engine:
        h = await own_harness(engine, runner, "runner-0")
        child = await h.start("q1")
        live = engine.instance_id
        server.ctl("stop", "-m", "fast")
        await asyncio.sleep(1.0)
        server.ctl("start")
        async with Engine(away_url, runner=ScriptRunner(), config=booting):
            await asyncio.sleep(2.0)
            with psycopg.connect(libpq(away_url), autocommit=True) as admin:
                taken = admin.execute(
                    "SELECT taken_by FROM engine_instances WHERE id = %s", (live,)
                ).fetchone()
            assert taken == (None,), "a live host was taken over"
        script.gate.set()
        done = await h.wait_done(child.conversation_id, timeout=20)
        assert (done.state, done.error) == ("done", "")
        assert runner.started == 1, "no child ran twice"


async def test_a_close_rides_out_a_restart_of_the_server(
    away_url: str, server: postgres.Server
) -> None:
    """A graceful close (SIGTERM to serve) that meets a restart waits for the server, up
    to host_timeout_s, instead of raising store_unavailable: the soak's close_failed."""
    assert server.ctl is not None
    script = Gate()
    runner = ScriptRunner(script)
    engine = Engine(away_url, runner=runner, config=EngineConfig(host_heartbeat_s=0.5))
    await engine.open()
    h = await own_harness(engine, runner, "runner-0")
    child = await h.start("q1")
    instance = engine.instance_id
    server.ctl("stop", "-m", "fast")
    try:
        closing = asyncio.create_task(engine.close())
        await asyncio.sleep(1.0)
        assert not closing.done(), "close gave up at once"
    finally:
        server.ctl("start")
    await asyncio.wait_for(closing, 30)  # raises what close raised
    with psycopg.connect(libpq(away_url), autocommit=True) as admin:
        state = admin.execute(
            "SELECT state, error FROM children WHERE conversation_id = %s",
            (child.conversation_id,),
        ).fetchone()
        closed = admin.execute(
            "SELECT closed_at IS NOT NULL FROM engine_instances WHERE id = %s", (instance,)
        ).fetchone()
    # Its tool call ended with the host: the foreground child is cancelled, once.
    assert state == ("cancelled", "cancelled: host closed") and closed == (True,)
    assert runner.started == 1


class Counted(Gate):
    """A Gate that counts how many of its runs run at once."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.most = 0

    async def __call__(self, ctx: ChildContext) -> None:
        self.now += 1
        self.most = max(self.most, self.now)
        try:
            await super().__call__(ctx)
        finally:
            self.now -= 1


async def test_a_host_cut_off_past_its_deadline_stops_its_runs_and_resumes_them_after(
    away_url: str, server: postgres.Server
) -> None:
    """Away longer than a takeover needs: the host stops its runs before anyone could
    take them (never two runners), and once the database is back goes on as a new
    instance that resumes them itself."""
    assert server.ctl is not None
    script = Counted()
    runner = ScriptRunner(script)
    config = EngineConfig(release_drain_s=2.0, host_heartbeat_s=0.2, host_timeout_s=1.5)
    async with Engine(away_url, runner=runner, config=config) as engine:
        h = await open_harness(engine, runner, "/tmp", [PRESET])
        child = await h.start("q1", lease_id="L1")  # leased: resumed by a takeover
        server.ctl("stop", "-m", "fast")
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 20
            while script.now and loop.time() < deadline:  # stopped at the deadline
                await asyncio.sleep(0.05)
            assert script.now == 0, "the run went on past the host's deadline"
        finally:
            server.ctl("start")
        while len(runner.prepared) < 2 and loop.time() < deadline:
            await asyncio.sleep(0.05)
        assert [p.recovery is not None for p in runner.prepared] == [False, True]
        script.gate.set()
        done = await h.wait_done(child.conversation_id, timeout=20)
        assert (done.state, done.error) == ("done", "")
        assert script.most == 1, "two runs of the child at once"


async def test_a_host_cut_off_adopts_nothing_before_it_rejoins(
    away_url: str, server: postgres.Server
) -> None:
    """The soak's finding: a cut-off stopped the runs, and the first commit once the
    database was back (not yet the heartbeat's) had the host adopt their children, held
    by it with no run here (design §32), and run them under the old instance; its rejoin
    then stopped them and resumed them again (each child ran twice). Here the test locks
    the host's row as the server comes back, so its heartbeats fail (busy) and the host
    stays cut off while a write commits; the adoption must leave the children to the
    rejoin."""
    assert server.ctl is not None
    script = Counted()
    runner = ScriptRunner(script)
    config = EngineConfig(
        release_drain_s=2.0, host_heartbeat_s=0.2, host_timeout_s=1.5, busy_timeout_ms=100
    )
    async with Engine(away_url, runner=runner, config=config) as engine:
        h = await open_harness(engine, runner, "/tmp", [PRESET])
        child = await h.start("q1", lease_id="L1")
        old = engine.instance_id
        server.ctl("stop", "-m", "fast")
        lock = None
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 20
            while script.now and loop.time() < deadline:  # cut off: its run stopped
                await asyncio.sleep(0.05)
            assert script.now == 0, "the run went on past the host's deadline"
        finally:
            server.ctl("start")
            # Before the loop runs again, so before any heartbeat: it updates this row.
            lock = psycopg.connect(libpq(away_url))
            row = "SELECT 1 FROM engine_instances WHERE id = %s FOR SHARE"  # as a batch does
            assert lock.execute(row, (old,)).fetchall() == [(1,)]
        try:
            await until_connected(h)  # a commit after the outage: the store's on_back
            adoption = engine._db.on_back.__self__  # type: ignore[union-attr]
            while adoption._adopting is None or not adoption._adopting.done():
                await asyncio.sleep(0.05)
            assert engine.instance_id == old, "the host rejoined with its row locked"
            assert len(runner.prepared) == 1, "a run of the child while its host is cut off"
        finally:
            lock.close()
        while len(runner.prepared) < 2 and loop.time() < deadline + 20:
            await asyncio.sleep(0.05)
        script.gate.set()
        done = await h.wait_done(child.conversation_id, timeout=20)
        assert (done.state, done.error) == ("done", "")
        assert [p.recovery is not None for p in runner.prepared] == [False, True]
        assert script.most == 1, "two runs of the child at once"


async def until_connected(h: Harness) -> None:
    """Connect a runner once the database answers: one write committed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while True:
        try:
            await h.engine.connect("runner-late", "runner-late-host")
            return
        except errors.StoreUnavailable:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.05)


async def test_serve_stays_up_and_refuses_with_store_unavailable(
    away_url: str, server: postgres.Server
) -> None:
    """`delegation serve` over a server that goes away: its answer is the retryable
    refusal (never internal_error), it stays up, and it serves again after."""
    assert server.ctl is not None
    async with await Client.spawn(["--db", away_url], stderr=subprocess.DEVNULL) as client:
        await client.register("runner-1", "host-a")
        server.ctl("stop", "-m", "fast")
        try:
            with pytest.raises(errors.DelegationError) as away:
                await client.register("runner-1", "host-a")
        finally:
            server.ctl("start")
        assert (away.value.reason, str(away.value)) == (
            "store_unavailable",
            "database is unavailable; try again",
        )
        assert client.process is not None and client.process.returncode is None, "serve is up"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while True:
            try:
                await client.register("runner-1", "host-a")
                break
            except errors.StoreUnavailable:
                assert loop.time() < deadline, "serve never wrote again"
                await asyncio.sleep(0.1)


def test_a_watch_listens_again_after_its_session_is_ended(away_url: str) -> None:
    """LISTEN is re-established: a watch whose session was ended connects again, says
    everything may have moved (notices were lost meanwhile), then hears new ones."""
    from delegation.store.postgres.admin import CHANNEL
    from delegation.store.postgres.watch import PostgresWatch

    watch = PostgresWatch(away_url, fallback=3600)
    try:
        assert not watch.changed()
        assert _terminate(away_url, "delegation-watch") == 1
        loop_until(watch.changed)  # connected again
        assert watch.moved() is None, "notices sent while away are lost: all may have moved"
        assert not watch.changed()
        with psycopg.connect(libpq(away_url), autocommit=True) as other:
            other.execute("SELECT pg_notify(%s, '42')", (CHANNEL,))
        loop_until(watch.changed)
        assert watch.moved() == {42}
    finally:
        watch.close()


def loop_until(check: object, tries: int = 400) -> None:
    for _ in range(tries):
        if check():  # type: ignore[operator]
            return
        threading.Event().wait(0.025)
    raise AssertionError("timed out")


async def test_a_claim_whose_lock_session_ended_holds_the_lock_on_a_new_one(away_url: str) -> None:
    """A host booting while the server restarts: the lock's session ends between opening
    and claiming. The claim does not fail with the driver's own error: it holds the lock
    on a new session before the instance is written anywhere (a free lock is a dead
    host's to the others)."""
    from delegation.store.stores import open_store

    store = open_store(away_url, synchronous="NORMAL", busy_timeout_ms=5000)
    store.open(asyncio.get_running_loop())
    try:
        assert _terminate(away_url, "delegation-host") == 1
        instance = f"h-{uuid.uuid4().hex}"
        store.claim(instance)  # used to raise psycopg's AdminShutdown
        assert _advisory_locks(away_url) == 1, "the lock is held, on a new session"
        store.keep_lock()
        assert _advisory_locks(away_url) == 1, "and kept"
    finally:
        await store.aclose()


def _advisory_locks(url: str) -> int:
    with psycopg.connect(libpq(url), autocommit=True) as admin:
        row = admin.execute(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
            " WHERE l.locktype = 'advisory' AND a.application_name = 'delegation-host'"
        ).fetchone()
    return int(row[0]) if row else 0
