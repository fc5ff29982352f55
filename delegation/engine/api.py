"""The embedding API (design §6): ``Engine`` wires the store, the use cases and the runs.

One engine owns one database (a SQLite file, or a PostgreSQL database). Its parts share
a :class:`~delegation.engine.runtime.Runtime` (the store, the clock, the one write
entry): the :class:`~delegation.engine.supervisor.Supervisor` runs the children, the
:class:`~delegation.engine.starting.Starting` reserves and answers their starts, the
:class:`~delegation.engine.resuming.Resuming` runs again those that ran before, the
:class:`~delegation.engine.membership.Membership` keeps this host among the others, the
:class:`~delegation.engine.operators.ControlWatcher` applies operators' requests and
:class:`~delegation.engine.timers.Timers` wake lease expiry and retention. The host's own
controls (``cancel_child``, ``steer_child``, ``answer_input``, ``send_event``,
``set_admission``) are :class:`~delegation.engine.controlling.HostControls`, and its
reads (``get_child``, ``events``, ``follow`` ...) hand over to
:class:`~delegation.engine.reads.EngineReads`. Every child
method checks authority inside the transaction that acts on it (see
:mod:`delegation.usecases.service`); what must follow a commit (starting, stopping or waking a
run) happens here, after the commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar

import msgspec

from delegation import errors
from delegation.backlog import UNBOUNDED, Room
from delegation.clock import Clock, ServerClock, SystemClock
from delegation.codec import checked
from delegation.config import EngineConfig
from delegation.engine import telemetry, versions
from delegation.engine.admitting import Admitting
from delegation.engine.adoption import Adoption
from delegation.engine.controlling import ControlParts, HostControls
from delegation.engine.membership import Membership
from delegation.engine.methods import ChildMethods
from delegation.engine.notices import Notices
from delegation.engine.operators import WATCH_INTERVAL_S, ControlWatcher
from delegation.engine.reads import EngineReads
from delegation.engine.resuming import Resuming, collector_paused
from delegation.engine.runtime import Runtime, Use
from delegation.engine.starting import Starting
from delegation.engine.supervisor import Supervisor
from delegation.engine.timers import Timers
from delegation.engine.upkeep import Upkeep
from delegation.engine.waking import OperatorWaits, Waking
from delegation.options import ExecutionOptions
from delegation.protocol import ToolBegin
from delegation.records import ChildFilter, ChildRecord, LeaseRecord, RunnerConnection, ToolHandle
from delegation.run.context import Runner
from delegation.run.protection import Protected, host_code, host_imports
from delegation.store import processes as store_processes
from delegation.store.interface import Store
from delegation.store.sql import Connection
from delegation.store.stores import open_store
from delegation.usecases import maintenance, service
from delegation.wire import (
    CANCEL_METHOD,
    INPUT_METHOD,
    READ_METHOD,
    RELEASE_METHOD,
    SEND_METHOD,
    START_METHOD,
    STEER_METHOD,
    Event,
    ParamsLike,
    Preset,
    Result,
    SteerResult,
)

if TYPE_CHECKING:
    from delegation.engine.telemetry import MeterProvider, TracerProvider

log = logging.getLogger("delegation.engine")
T = TypeVar("T")
_json = msgspec.json.Encoder()


class Engine(HostControls):
    """Durable child runs on SQLite or PostgreSQL.

    Use as ``async with Engine(url, runner=...) as engine``.

    With OpenTelemetry's API installed (``durable-delegation[otel]``), spans and metrics go to
    ``tracer_provider`` and ``meter_provider``, or to the global providers when None
    (see :mod:`delegation.engine.telemetry`); without it, both are ignored."""

    def __init__(
        self,
        url: str = "sqlite:///delegation.db",
        *,
        runner: Runner,
        config: EngineConfig | None = None,
        clock: Clock | None = None,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
    ) -> None:
        # The runner version this host runs, resolved once (design §34).
        self.config = versions.configured(config or EngineConfig(), runner)
        self._runner = runner
        self._db: Store = open_store(
            url, synchronous=self.config.synchronous, busy_timeout_ms=self.config.busy_timeout_ms
        )
        self._telemetry = telemetry.for_engine(tracer_provider, meter_provider)
        if self._telemetry is not None:
            self._db.on_commit = self._telemetry.committed
        # Several hosts share a database: its server's clock is everyone's (design §12).
        clock = clock or (ServerClock() if self._db.shared else SystemClock())
        notices = Notices(self._announced)
        self._rt = Runtime(self.config, self._db, clock, self._telemetry, notices)
        self.timers = Timers(
            self.clock,
            self._expire_on_time,
            self._sweep,
            self.config.retention_sweep_s,
            wake=self._wake_on_time,
        )
        self._supervisor = Supervisor(self._rt, runner)
        self._resuming = Resuming(self._rt, self._supervisor)
        self._upkeep = Upkeep(self._rt, self._supervisor, self.timers)
        self._membership = Membership(self._rt, self._supervisor, self._resuming, self.timers)
        starting = Starting(self._rt, self._supervisor, self.timers)
        self._methods = ChildMethods(self._rt, self._supervisor, starting)
        self._reads = EngineReads(self._rt, self._methods, self._require_open)
        self._waking = Waking(self._rt, self._supervisor, self._resuming, self.timers)
        self._admitting = Admitting(self._rt, self._supervisor, self._resuming)
        self._methods.on_delivered = self._waking.delivered
        self._db.on_lost = self._membership.lost
        self._db.on_back = Adoption(self._rt, self._supervisor, self._resuming).back
        # The host's own controls act through these parts (cancel_child, steer_child ...).
        parts = (self._rt, self._supervisor, self._methods, self._waking, self._admitting)
        controls = ControlParts(*parts, starting, require_open=self._require_open)
        HostControls.__init__(self, controls)
        self._controls: ControlWatcher | None = None
        self._open = False

    @property
    def clock(self) -> Clock:
        """The clock every write is stamped with (a new one takes effect at once)."""
        return self._rt.clock

    @clock.setter
    def clock(self, clock: Clock) -> None:
        self._rt.clock = clock

    @property
    def instance_id(self) -> str:
        """This host's current instance (a new one after a rejoin); "" before open."""
        return self._rt.instance_id

    # --- lifecycle --------------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        return self._open

    async def __aenter__(self) -> Engine:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def open(self) -> None:
        """Open (and migrate) the database, take over from the previous host instance,
        arm the lease timer and resume the children this host owns (design §7). Before
        resuming, kill what lost runs left running and remove the private temp dirs
        hosts that ended left (:mod:`delegation.runners.tmpdirs`).

        Before anything is opened, a runner whose own confinement settings would give
        its children the database, its credentials or the host's code (design §23:
        ``check_confinement``, as the command runner's ``read_write``) is refused: its
        error is raised and nothing is created."""
        self._supervisor.closing = False
        # Every run is handed this set: no runner that wraps another can forget it.
        self._supervisor.protected = Protected.of(
            database=self._db.protected_paths(),
            host=host_code(),
            imports=host_imports(),
            secret=self._db.secret_paths(),
        )
        check = getattr(self._runner, "check_confinement", None)
        if callable(check):
            check(self._supervisor.protected)
        loop = asyncio.get_running_loop()
        opening = loop.run_in_executor(None, self._db.open, loop)
        try:
            await asyncio.shield(opening)
        except asyncio.CancelledError:
            # The thread goes on and may yet lock and open the file: give it back then,
            # or this process would hold the file with no engine to close it.
            def give_back(done: asyncio.Future[None]) -> None:
                if not done.cancelled() and done.exception() is None:
                    self._db.close()  # on the loop's thread; the writer is idle

            opening.add_done_callback(give_back)
            raise
        try:
            with collector_paused():
                await self._boot(loop)
        except BaseException:
            # A boot that fails gives everything back, the host lock first: the process
            # may exit or try again, and the next host may open (design §18).
            await self._give_back()
            raise

    async def _boot(self, loop: asyncio.AbstractEventLoop) -> None:
        """Take over, arm the timers, resume what this host owns (see :meth:`open`)."""
        protect = getattr(self._runner, "protect_paths", None)
        if callable(protect):  # the v2 way, kept for runners written for it
            protect(self._db.protected_paths())
        takeover = await self._membership.boot()
        deadline = await self._db.read(maintenance.next_deadline)
        self._open = self._membership.open = True
        if self._telemetry is not None:  # its gauges read the database from now on
            self._telemetry.watch(self._db, loop)
        self.timers.start(loop)
        self.timers.arm(deadline)
        await self._admitting.boot()  # the configured policies, before any start (§22)
        self._resuming.resume(takeover)
        await self._waking.arm()  # the waiting children it owns now (design §21)
        self._controls = ControlWatcher(
            self._rt,
            self._supervisor,
            self.steer_child,
            self._db.watch(WATCH_INTERVAL_S),
            OperatorWaits(self.answer_input, self.send_event, self._waking, self.rewind_child),
        )
        self._controls.start()  # operators' requests: those left while down first
        self._membership.start()
        self._admitting.start()
        self._admitting.soon()  # what waits its turn since before
        await asyncio.sleep(0)  # each resumed run takes its first step

    async def _give_back(self) -> None:
        """After a failed boot: stop what it started, close the database and its lock."""
        try:
            if self._open:
                await self.close()  # its last step closes the database, come what may
            else:
                await self._membership.stop()  # a file replaced meanwhile: its path too
                await self._db.aclose()
        except Exception:
            log.exception("a failed open left things to close", extra={"action": "open_abandoned"})

    async def failed(self) -> errors.DelegationError:
        """Wait until the engine stopped on its own while open: its SQLite file was
        replaced while in use (design §18). Its runs are stopped, nothing more is written,
        and :meth:`close` raises the error returned here: the host should close, exit."""
        return await self._membership.failed()

    async def expire_due(self) -> None:
        """Expire every lease past its deadline now, then re-arm at the next deadline
        (the timer calls this; calling it again is harmless)."""
        await self._upkeep.expire_due()

    async def purge(self) -> int:
        """Purge everything past ``retention_s`` now; returns how many children went."""
        return await self._upkeep.purge()

    async def _expire_on_time(self) -> None:  # the timers' jobs: coroutine functions
        await self._upkeep.expire_on_time()

    async def _sweep(self) -> None:
        await self._upkeep.sweep()

    async def _wake_on_time(self) -> None:
        await self._waking.wake_on_time()

    async def close(self) -> None:
        """Stop local execution gracefully; leased children are resumed at the next boot.

        Tool grants end, so their foreground children are cancelled (and given up to
        ``release_drain_s`` to stop); every other run is stopped without a state change.
        """
        if not self._open:
            return
        self._open = self._membership.open = False
        self._supervisor.closing = True
        self._rt.notices.close()
        if self._controls is not None:
            await self._controls.stop()
            self._controls = None
        self.timers.stop()
        self._admitting.stop()
        rt, supervisor = self._rt, self._supervisor
        # Its writes ride out a blink of the database (up to host_timeout_s each). Even
        # when the database refuses them longer (then close raises), nothing of the
        # engine outlives close: the next boot settles the rest, as after a crash.
        blink = self.config.host_timeout_s
        try:
            try:
                ending = lambda: Use(service.shutdown, rt.instance_id)  # noqa: E731
                affected = await rt.through_blink(blink, ending)
                await supervisor.drain(await supervisor.stop(affected), self.config.release_drain_s)
            finally:
                reaped = await supervisor.suspend_all()
            if reaped:  # their processes are reaped: no record may outlive them
                await rt.through_blink(blink, lambda: Use(_forget_processes, reaped))
            await self._membership.stop()  # beating through the drains: never thought dead
            await rt.through_blink(blink, lambda: Use(service.close_instance, rt.instance_id))
        finally:
            await self._membership.stop()
            await rt.stop_background()
            await self._db.aclose()

    def _announced(self, wanted: bool) -> None:
        """The store announces committed events only while a child is followed: a
        batch then wakes the loop once more, which no one should pay for unasked."""
        self._db.on_events = self._rt.notices.bump if wanted else None

    def _require_open(self) -> None:
        # Closing counts as closed: a connection or tool call opened after close() ended
        # this instance's would outlive the instance, open in the database.
        if not self._open:
            raise errors.StoreError("the engine is not open")

    # --- reads (design §6) --------------------------------------------------------------

    async def get_child(
        self, conversation_id: str, run_id: str | None = None
    ) -> ChildRecord | None:
        """The newest execution of a conversation (or the one ``run_id`` names), or None."""
        return await self._reads.get_child(conversation_id, run_id)

    async def list_children(
        self,
        *,
        state: str | None = None,
        lease_id: str | None = None,
        parent_run_id: str | None = None,
        parent_conversation_id: str | None = None,
        limit: int = 100,
    ) -> list[ChildRecord]:
        """Child records, newest first, filtered by state, lease and parent."""
        wanted = ChildFilter(state, lease_id, parent_run_id, parent_conversation_id, limit)
        return await self._reads.list_children(wanted)

    async def events(
        self,
        conversation_id: str,
        run_id: str | None = None,
        after: int = 0,
        limit: int | None = None,
    ) -> list[Event]:
        """Committed events of an execution with ``sequence > after``, oldest first."""
        return await self._reads.events(conversation_id, run_id, after, limit)

    async def follow(
        self, conversation_id: str, run_id: str | None = None, after: int = 0
    ) -> AsyncIterator[Event]:
        """Every committed event of an execution after ``after``, each once, in order,
        as it commits; the iterator ends once the execution is terminal and its last
        event was given, whoever ended it (this host, another one, a takeover). Woken by
        the commit itself (another host's by its ``NOTIFY``); with no wake-up for a
        second it reads again anyway, so a lost notice only delays the end. A read the
        database could not answer is tried again (see :mod:`delegation.usecases.follow`).

        Raises:
            errors.ChildNotFound: no such execution.
            errors.ChildPurged: the execution was purged before its end was read.
            errors.HostClosing: the engine closed while following.
        """
        committed = self._reads.follow(conversation_id, run_id, after)
        async with contextlib.aclosing(committed) as events:
            async for event in events:
                yield event

    def follow_read(
        self, conn: RunnerConnection, params: ParamsLike, *, room: Room = UNBOUNDED
    ) -> AsyncGenerator[Result]:
        """``child.follow``: the pages ``child.read`` answers from ``params.after`` on,
        each read as the child's commits land, until the one that finds it terminal.
        Every page is a read: its authority and refusals (see ``owned_pages``), and its
        room reserved in ``room`` (see :meth:`call`)."""
        return self._reads.follow_read(conn, params, room)

    async def leases(self, runner_id: str | None = None) -> list[LeaseRecord]:
        """Leases and tombstones, newest first."""
        return await self._reads.leases(runner_id)

    # --- runners, tools, runs ---------------------------------------------------------

    async def connect(self, runner_id: str, host_instance_id: str) -> RunnerConnection:
        """Register a runner connection, one generation above its last.

        A different ``host_instance_id`` than last time revokes the runner's leases and
        cancels their children ("cancelled: runner restarted"), logged once as
        ``runner_restarted``: keep the id across a host's restarts.
        """
        self._require_open()
        use = Use(service.connect, self.config, self.instance_id, runner_id, host_instance_id)
        connected = await self._rt.write(use)
        if connected.was is not None and (connected.revoked or connected.affected):
            log.warning(
                "runner %s came back as host instance %s (it was %s): its %d leases were"
                " revoked and %d children cancelled (keep host_instance_id across restarts"
                " to keep them)",
                runner_id,
                host_instance_id,
                connected.was,
                connected.revoked,
                len(connected.affected),
                extra={"action": "runner_restarted", "runner_id": runner_id},
            )
        await self._supervisor.stop(connected.affected)
        return connected.handle

    async def disconnect(self, conn: RunnerConnection) -> None:
        """End a connection: its tool grants end; leases survive for a reconnect."""
        await self._supervisor.stop(await self._rt.write(Use(service.disconnect, conn)))

    async def open_tool(
        self,
        conn: RunnerConnection,
        *,
        run_id: str,
        conversation_id: str,
        tool_call_id: str,
        extension_id: str,
        presets: Sequence[Preset],
        workspace: str,
        policy: ExecutionOptions | None = None,
    ) -> ToolHandle:
        """Open the tool grant of one live extension tool call.

        ``policy`` is the parent run's own effective ``ExecutionOptions``: no child
        started under this tool (or a lease made from it) may widen it (design §9).
        None: no ceiling but each preset's own.
        """
        begin = ToolBegin(
            run_id,
            conversation_id,
            tool_call_id,
            extension_id,
            list(presets),
            workspace,
            msgspec.UNSET if policy is None else policy,
        )
        return await self.begin_tool(conn, begin)

    async def begin_tool(self, conn: RunnerConnection, begin: ToolBegin) -> ToolHandle:
        """:meth:`open_tool` with its input as ``tool.begin`` carries it, whole."""
        self._require_open()
        begin = checked(begin, ToolBegin, providers=None, label="malformed params")
        grant = await self._rt.write(
            Use(service.open_tool, self.config, self.instance_id, conn, begin)
        )
        return ToolHandle(
            grant.id,
            conn.runner_id,
            conn.id,
            begin.run_id,
            begin.conversation_id,
            begin.tool_call_id,
            begin.extension_id,
        )

    async def close_tool(self, tool: ToolHandle) -> None:
        """The tool call ended: its foreground children are cancelled."""
        await self._supervisor.stop(await self._rt.write(Use(service.close_tool, tool.grant_id)))

    async def finish_run(
        self, run_id: str, succeeded: bool = True, conn: RunnerConnection | None = None
    ) -> None:
        """A run ended: its tool grants end. On failure its leases are dropped and their
        children cancelled, and if ``run_id`` is a child's own run, that child is
        cancelled as :meth:`cancel_child` does.

        Given ``conn``, only that runner's grants, leases and children are touched
        (``run.finish`` over serve): a runner never ends another runner's.

        Raises:
            errors.CancelUnconfirmed: the cancelled child's run has not stopped within
                ``release_drain_s`` (its cancellation stays requested).
        """
        use = Use(service.finish_run, self.config, run_id, succeeded, conn)
        ended = await self._rt.write(use)
        waits = await self._supervisor.stop(ended.affected)
        if ended.own_child is not None:
            await self._methods.confirm_cancelled(ended.own_child, waits)

    # --- the five methods -------------------------------------------------------------

    async def call(
        self, conn: RunnerConnection, method: str, params: ParamsLike, *, room: Room = UNBOUNDED
    ) -> Result | SteerResult:
        """Serve one child method by its wire name (JSON-RPC dispatch); raises a
        :class:`DelegationError` for every refusal. Typed code calls :meth:`start`,
        :meth:`read`, :meth:`cancel`, :meth:`steer` and :meth:`release` instead. A page
        is read once ``room`` (serve: the stream's unread bytes) holds ``max_page_bytes``."""
        self._require_open()
        methods = self._methods
        return await methods.answer(method, methods.handler(method), conn, params, room)

    async def start(self, conn: RunnerConnection, params: ParamsLike) -> Result:
        """``child.start``: the child's Result once it is admitted (design §5)."""
        self._require_open()
        return await self._methods.answer(
            START_METHOD, self._methods.start, conn, params, UNBOUNDED
        )

    async def read(self, conn: RunnerConnection, params: ParamsLike) -> Result:
        """``child.read``: the page of events after ``params.after``."""
        self._require_open()
        return await self._methods.answer(READ_METHOD, self._methods.read, conn, params, UNBOUNDED)

    async def cancel(self, conn: RunnerConnection, params: ParamsLike) -> Result:
        """``child.cancel``: request cancellation of exactly that child."""
        self._require_open()
        return await self._methods.answer(
            CANCEL_METHOD, self._methods.cancel, conn, params, UNBOUNDED
        )

    async def steer(self, conn: RunnerConnection, params: ParamsLike) -> SteerResult:
        """``child.steer``: queue a message for the running child, idempotently."""
        self._require_open()
        return await self._methods.answer(
            STEER_METHOD, self._methods.steer, conn, params, UNBOUNDED
        )

    async def input(self, conn: RunnerConnection, params: ParamsLike) -> Result:
        """``child.input`` (design §21): answer an input request of the child, with
        ``inputId`` and ``decision`` (or ``message`` for a text), idempotent per
        ``requestId``; the child's Result."""
        self._require_open()
        return await self._methods.answer(
            INPUT_METHOD, self._methods.input, conn, params, UNBOUNDED
        )

    async def send(self, conn: RunnerConnection, params: ParamsLike) -> Result:
        """``child.send`` (design §33): send the event ``key`` with ``data`` to the
        child's conversation (refused ``event_closed`` once it has no live execution),
        once per ``requestId``; the child's Result."""
        self._require_open()
        return await self._methods.answer(SEND_METHOD, self._methods.send, conn, params, UNBOUNDED)

    async def release(self, conn: RunnerConnection, params: ParamsLike) -> Result:
        """``child.lease.release``: revoke a lease and wait for its children to stop."""
        self._require_open()
        return await self._methods.answer(
            RELEASE_METHOD, self._methods.release, conn, params, UNBOUNDED
        )


def _forget_processes(conn: Connection, now: float, child_ids: list[int]) -> None:
    store_processes.forget(conn, child_ids)
