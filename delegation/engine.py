"""The embedding API (SPEC §6): ``Engine`` wires the store, the use cases and the runs.

One engine owns one database (a SQLite file, or a PostgreSQL database); the runs it
executes are in :mod:`delegation.local_runs`. Every child method checks authority inside the
transaction that acts on it (see :mod:`delegation.service`); what must follow a
commit (starting, stopping or waking a run) happens here, after the commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import math
import secrets
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from delegation import (
    authority,
    errors,
    machine,
    maintenance,
    processes,
    queries,
    service,
    telemetry,
    tmpdirs,
)
from delegation.clock import Clock, ServerClock, SystemClock
from delegation.codec import decode
from delegation.config import EngineConfig
from delegation.controls import WATCH_INTERVAL_S, ControlWatcher
from delegation.local_runs import LocalRun, LocalRuns
from delegation.options import ExecutionOptions
from delegation.protection import Protected, host_code
from delegation.records import ChildRecord, LeaseRecord, RunnerConnection, ToolHandle
from delegation.runs import ChildContext, NotResumable, Recovery, Runner
from delegation.scheduler import Timers
from delegation.store import Connection
from delegation.store import processes as store_processes
from delegation.store.database import boot_clock
from delegation.store.interface import Store
from delegation.store.stores import open_store
from delegation.watch import Notices
from delegation.wire import (
    CANCEL_METHOD,
    CHILD_METHODS,
    READ_METHOD,
    RELEASE_METHOD,
    START_METHOD,
    STEER_METHOD,
    Event,
    Params,
    Preset,
    Result,
    SteerResult,
)

if TYPE_CHECKING:
    from delegation.telemetry import MeterProvider, TracerProvider

log = logging.getLogger("delegation.engine")
T = TypeVar("T")
# What the child methods take: Params, the JSON of them, or a dict of wire names.
ParamsLike = Params | bytes | bytearray | memoryview | str | dict[str, Any]
_json = msgspec.json.Encoder()


class Engine:
    """Durable child runs on SQLite or PostgreSQL.

    Use as ``async with Engine(url, runner=...) as engine``.

    With OpenTelemetry's API installed (``delegation[otel]``), spans and metrics go to
    ``tracer_provider`` and ``meter_provider``, or to the global providers when None
    (see :mod:`delegation.telemetry`); without it, both are ignored."""

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
        self.config = config or EngineConfig()
        self.instance_id = ""
        self._runner = runner
        self._db: Store = open_store(
            url, synchronous=self.config.synchronous, busy_timeout_ms=self.config.busy_timeout_ms
        )
        self._telemetry = telemetry.for_engine(tracer_provider, meter_provider)
        if self._telemetry is not None:
            self._db.on_commit = self._telemetry.committed
        # Several hosts share a database: its server's clock is everyone's (SPEC §12).
        self.clock: Clock = clock or (ServerClock() if self._db.shared else SystemClock())
        self._local = LocalRuns()
        # On a server a statement costs a round trip: a start under a tool grant found
        # open before reserves without reading it first (service.reserve_start).
        self._seen_tools = service.SeenTools() if self._db.shared else None
        self._notices = Notices(self._announced)
        self._controls: ControlWatcher | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._watching: set[asyncio.Task[None]] = set()
        # Children a committed takeover gave this host, not yet spawned; and those among
        # them whose cancellation came meanwhile (see _stop).
        self._resuming: set[int] = set()
        self._rejoining = False  # fenced, and not yet a new instance: writes are refused
        self._cancel_on_resume: set[int] = set()
        self._open = False
        self._alive_deadline = math.inf  # see _alive_since; none before the first beat
        self._cut = False  # runs were stopped for a heartbeat lapse (see _cut_off)
        self._protected = Protected()  # what no child process may reach; set at open
        self.timers = Timers(
            self.clock, self._expire_on_time, self._sweep, self.config.retention_sweep_s
        )

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
        arm the lease timer and resume the children this host owns (SPEC §7). Before
        resuming, kill what lost runs left running and remove the private temp dirs
        hosts that ended left (:mod:`delegation.tmpdirs`)."""
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
        # Every run is handed this set: no runner that wraps another can forget it.
        self._protected = Protected.of(self._db.protected_paths(), host_code())
        protect = getattr(self._runner, "protect_paths", None)
        if callable(protect):  # the v2 way, kept for runners written for it
            protect(self._db.protected_paths())
        self.instance_id = f"h-{secrets.token_hex(16)}"
        with _collector_paused():
            try:
                await loop.run_in_executor(None, self._db.claim, self.instance_id)
                if isinstance(self.clock, ServerClock):  # before anything is stamped
                    await self._correct_clock(self.clock)
                beat = boot_clock()
                takeover = await self._write(
                    maintenance.reconcile, self.config, self.instance_id, self._db.shared
                )
                self._alive_since(beat)  # the boot's own heartbeat
                self._ended(takeover.ended)
                await self._kill_lost(takeover)
                # After the orphans, which could still be writing in theirs.
                await loop.run_in_executor(None, tmpdirs.remove_stale)
                await self._stop(takeover.stopping)
                deadline = await self._db.read(maintenance.next_deadline)
            except BaseException:
                # Give the file back (the writer thread, the connections): a host may retry.
                await self._db.aclose()
                raise
            self._open = True
            self.timers.start(loop)
            self.timers.arm(deadline)
            self._resume(takeover)
            self._controls = ControlWatcher(self, self._db.watch(WATCH_INTERVAL_S))
            self._controls.start()  # operators' requests: those left while down first
            if self._db.shared:
                self._heartbeat = asyncio.create_task(self._heartbeats(), name="delegation-beat")
            try:
                await asyncio.sleep(0)  # each resumed run takes its first step
            except BaseException:  # cancelled here, the caller would never close it
                await self.close()
                raise

    async def _kill_lost(self, takeover: maintenance.Takeover) -> None:
        """Before anything resumes: a process a lost run started and that outlived its
        host would otherwise run beside the resumed child."""
        if takeover.processes:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, _kill_orphans, takeover.processes)

    def _resume(self, takeover: maintenance.Takeover) -> None:
        for item in takeover.resumable:
            recovery = Recovery(item.attempt, item.last_sequence, item.delivered)
            plan = service.plan_of(item.child, item.policy)
            local = self._spawn(item.child, plan, recovery, item.steers)
            self._resuming.discard(item.child.id)
            if item.child.id in self._cancel_on_resume:
                self._cancel_on_resume.discard(item.child.id)
                local.cancel()
            log.info(
                "child resumed",
                extra={"action": "child_recovered", "run_id": item.child.run_id},
            )

    # --- several hosts on one database (SPEC §12) -------------------------------------

    async def _heartbeats(self) -> None:
        """Heartbeat every ``host_heartbeat_s``, and take over what dead hosts left.

        The first beat comes at once: a host killed just before this one opened is seen
        dead (its lock free) without waiting a whole period. Nothing a beat meets ends
        the loop: a host that stopped beating would be taken over while it runs."""
        delay = 0.25
        while True:
            await asyncio.sleep(delay)
            delay = self.config.host_heartbeat_s
            try:
                await self._beat()
            except errors.DelegationError as exc:  # busy, or the server away: next beat
                log.warning("heartbeat failed: %s", exc, extra={"action": "heartbeat_failed"})
                await self._cut_off()
            except Exception:
                log.exception("heartbeat failed", extra={"action": "heartbeat_failed"})

    async def _beat(self) -> None:
        # The lock first: a heartbeat commits only after it is held on the same server.
        await asyncio.get_running_loop().run_in_executor(None, self._db.keep_lock)
        beat = boot_clock()
        try:  # a closing host only beats: it takes nothing over
            takeover = await self._write(
                maintenance.heartbeat,
                self.config,
                self.instance_id,
                self._open,
                self._db.reconnected,  # read as the beat runs: after any reconnect
                committed=self._will_resume,
            )
        except errors.HostFenced:
            await self._fenced()
            return
        self._alive_since(beat)
        if self._cut:
            await self._back_from_cut()
        self._ended(takeover.ended)
        if isinstance(self.clock, ServerClock):
            await self._correct_clock(self.clock)
        if takeover.taken:
            await self._take_over(takeover)

    def _will_resume(self, takeover: maintenance.Takeover) -> None:
        """At the takeover's commit, before any other task sees it: until spawned, its
        children are this host's runs to stop (a lease expiring meanwhile would find no
        run and finish the child, then see it resumed)."""
        self._resuming.update(item.child.id for item in takeover.resumable)

    async def _take_over(self, takeover: maintenance.Takeover) -> None:
        """Run what a takeover committed to this instance: nothing else would (the
        children are a live host's now), so a failure on the way resumes them anyway."""
        log.warning(
            "took over %d dead host instances",
            len(takeover.taken),
            extra={"action": "hosts_taken_over", "instances": takeover.taken},
        )
        await self._kill_lost(takeover)
        try:
            await self._stop(takeover.stopping)
        finally:
            self._resume(takeover)
        self.timers.arm(await self._db.read(maintenance.next_deadline))

    async def _correct_clock(self, clock: ServerClock) -> None:
        """Read the server's clock on the reader (not behind queued writes), so the
        round trip that brackets it is one statement's."""
        sent = time.time()
        try:
            server_now = await self._db.read_now(maintenance.server_time)
        except errors.DelegationError as exc:
            log.warning("server clock not read: %s", exc, extra={"action": "clock_unread"})
            return
        clock.correct(server_now, sent, time.time())

    def _alive_since(self, beat: float) -> None:
        """A heartbeat sent at ``beat`` (``boot_clock``) committed: no host declares this
        one dead before host_timeout_s after it (on the database's clock); a heartbeat's
        margin covers the clocks' drift."""
        cfg = self.config
        self._alive_deadline = beat + cfg.host_timeout_s - cfg.host_heartbeat_s
        self._db.alive_until(self._alive_deadline)

    async def _cut_off(self) -> None:
        """No heartbeat has committed for so long that another host may declare this
        one dead any moment (the database away, or this host cut off from it): stop
        every local run now, without a write, so none runs beside the copy a taking
        host would resume (SPEC §19). Once a heartbeat commits again, the host rejoins
        (:meth:`_back_from_cut`)."""
        if self._cut or boot_clock() < self._alive_deadline:
            return
        self._cut = True
        log.error(
            "no heartbeat for too long: %d runs stopped until the database is back",
            len(self._local),
            extra={"action": "host_cut_off", "instance": self.instance_id},
        )
        await self._suspend_runs()

    async def _back_from_cut(self) -> None:
        """A heartbeat committed after :meth:`_cut_off`, and nobody took this instance
        over: its stopped runs' children are still its own, yet nothing runs them. The
        host goes on as a new instance, as a fenced one does, and takes the old one over
        itself (:func:`maintenance.hand_over`): that resumes those children here."""
        old = self.instance_id
        await self._rejoin()
        takeover = await self._write(
            maintenance.hand_over, self.config, old, self.instance_id, committed=self._will_resume
        )
        self._cut = False  # only now: a failure on the way is tried again at the next beat
        log.warning(
            "the database is back: this host goes on as a new instance",
            extra={"action": "host_rejoined", "old_instance": old, "instance": self.instance_id},
        )
        if takeover.taken:
            await self._take_over(takeover)

    async def _fenced(self) -> None:
        """Another host declared this one dead (it was paused, or cut off, past
        ``host_timeout_s``) and took its children: every local run stops without a
        write (the store refuses them anyway), and the host goes on as a new instance.

        Until it has, writes are refused: one begun now would name the instance that
        was taken over, yet be fenced on the new one (a connection left open on it)."""
        lost, old = len(self._local), self.instance_id
        self._cut = False  # what a cut stopped was taken over: nothing to resume here
        await self._rejoin()
        log.error(
            "this host was taken over while it could not heartbeat; %d runs stopped",
            lost,
            extra={"action": "host_fenced", "old_instance": old, "instance": self.instance_id},
        )

    async def _rejoin(self) -> None:
        """Stop every local run without a write, and go on as a new host instance."""
        self._rejoining = True
        try:
            await self._suspend_runs()
            new = f"h-{secrets.token_hex(16)}"
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self._db.claim, new)
            await self._submit(maintenance.rejoin, new)
            self.instance_id = new  # once its row exists: connections name it
        finally:
            self._rejoining = False

    async def expire_due(self) -> None:
        """Expire every lease past its deadline now, then re-arm at the next deadline.

        The timer calls this; calling it again is harmless (the database is the truth).
        """
        affected, deadline = await self._write(maintenance.expire_due)
        if affected:
            log.info("leases expired", extra={"action": "lease_expired", "children": len(affected)})
        await self._stop(affected)
        self.timers.arm(deadline)

    async def _expire_on_time(self) -> None:
        """The lease timer: a database busy or away puts the expiry off, never drops it
        (the one-shot timer is armed again; SPEC §19)."""
        try:
            await self.expire_due()
        except (errors.DatabaseBusy, errors.StoreUnavailable) as exc:
            log.warning("leases not expired yet: %s", exc, extra={"action": "expiry_delayed"})
            self.timers.arm(self.clock.now() + _OWED_PAUSE_MAX_S)

    async def purge(self) -> int:
        """Purge everything past ``retention_s`` now; returns how many children went."""
        total = 0
        while True:
            count = await self._write(maintenance.purge, self.config.retention_s)
            total += count
            if count < 1000:
                return total

    async def _sweep(self) -> None:
        try:
            purged = await self.purge()
        except (errors.DatabaseBusy, errors.StoreUnavailable, errors.HostFenced) as exc:
            # The next sweep purges it: retention is late, never lost.
            log.warning("retention sweep put off: %s", exc, extra={"action": "sweep_delayed"})
            return
        if purged:
            log.info("children purged", extra={"action": "retention_purged", "children": purged})

    async def close(self) -> None:
        """Stop local execution gracefully; leased children are resumed at the next boot.

        Tool grants end, so their foreground children are cancelled (and given up to
        ``release_drain_s`` to stop); every other run is stopped without a state change.
        """
        if not self._open:
            return
        self._open = False
        self._notices.close()
        if self._controls is not None:
            await self._controls.stop()
            self._controls = None
        self.timers.stop()
        # Even when the database refuses these writes (then close raises), nothing of the
        # engine outlives close: the next boot settles the rest, as after a crash.
        try:
            try:
                affected = await self._write(service.shutdown, self.instance_id)
                await self._drain(await self._stop(affected), self.config.release_drain_s)
            finally:
                reaped = await self._suspend_runs()
            if reaped:  # their processes are reaped: no record may outlive them
                await self._write(_forget_processes, reaped)
            await self._stop_heartbeats()  # beating through the drains: never thought dead
            await self._write(service.close_instance, self.instance_id)
        finally:
            await self._stop_heartbeats()
            await _cancelled(self._watching)
            await self._db.aclose()

    async def _stop_heartbeats(self) -> None:
        beating, self._heartbeat = self._heartbeat, None
        if beating is not None:
            await _cancelled([beating])

    async def _suspend_runs(self) -> list[int]:
        """Stop every local run without a state change; leased ones resume at next boot.

        A run that ignores its cancellation is waited for ``release_drain_s`` at most:
        close goes on without it (its later writes are refused), as a crash would.
        Returns the children whose recorded process ended with their stopped run.
        """
        running = list(self._local)
        for local in running:
            local.suspend()
        tasks = [lo.task for lo in running if lo.task is not None]
        if not tasks:
            return []
        _, stuck = await asyncio.wait(tasks, timeout=self.config.release_drain_s)
        if stuck:
            log.warning(
                "%d child runs ignored cancellation at close",
                len(stuck),
                extra={"action": "child_runs_stuck_at_close"},
            )
        return [lo.child_id for lo in running if lo.tracked and lo.task in tasks and lo.task.done()]

    def _require_open(self) -> None:
        # Closing counts as closed: a connection or tool call opened after close() ended
        # this instance's would outlive the instance, open in the database.
        if not self._open:
            raise errors.StoreError("the engine is not open")

    # --- runners, tools, runs ---------------------------------------------------------

    async def connect(self, runner_id: str, host_instance_id: str) -> RunnerConnection:
        """Register a runner connection, one generation above its last.

        A different ``host_instance_id`` than last time revokes the runner's leases.
        """
        self._require_open()
        handle, affected = await self._write(
            service.connect, self.config, self.instance_id, runner_id, host_instance_id
        )
        await self._stop(affected)
        return handle

    async def disconnect(self, conn: RunnerConnection) -> None:
        """End a connection: its tool grants end; leases survive for a reconnect."""
        await self._stop(await self._write(service.disconnect, conn))

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
        started under this tool (or a lease made from it) may widen it (SPEC §9).
        None: no ceiling but each preset's own.
        """
        self._require_open()
        now = self.clock.now()
        grant = await self._db.write(
            lambda c: service.open_tool(
                c,
                self.config,
                self.instance_id,
                conn,
                run_id=run_id,
                conversation_id=conversation_id,
                tool_call_id=tool_call_id,
                extension_id=extension_id,
                presets=list(presets),
                workspace=workspace,
                now=now,
                policy=policy,
            ),
        )
        return ToolHandle(
            grant.id, conn.runner_id, conn.id, run_id, conversation_id, tool_call_id, extension_id
        )

    async def close_tool(self, tool: ToolHandle) -> None:
        """The tool call ended: its foreground children are cancelled."""
        await self._stop(await self._write(service.close_tool, tool.grant_id))

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
        ended = await self._write(service.finish_run, self.config, run_id, succeeded, conn)
        waits = await self._stop(ended.affected)
        if ended.own_child is not None:
            await self._confirm_cancelled(ended.own_child, waits)

    async def cancel_child(
        self,
        conversation_id: str,
        run_id: str | None = None,
        reason: str = service.HOST_CANCELLED,
    ) -> Result:
        """The host's own cancel of exactly one execution, whatever its grant: the newest
        of the conversation, or the one ``run_id`` names. ``reason`` becomes its error.

        Returns the child's Result once it is terminal (a finished child's unchanged).

        Raises:
            errors.ChildNotFound: no such child.
            errors.CancelUnconfirmed: its run has not stopped within ``release_drain_s``
                (the cancellation stays requested; calling again waits again).
        """
        self._require_open()
        child = await self._write(service.cancel_exact, conversation_id, run_id, reason)
        if not child.terminal:
            await self._confirm_cancelled(child.id, await self._stop([child.id]))
        limit = self.config.events_per_read
        return await self._db.read(lambda c: queries.page(c, child.id, 0, limit, strict=False))

    async def steer_child(
        self,
        conversation_id: str,
        message: str,
        run_id: str | None = None,
        request_id: str | None = None,
    ) -> SteerResult:
        """The host's own steer of exactly one execution, whatever its grant (an
        operator's): queued for the running child like ``child.steer``, idempotent per
        ``request_id`` (a fresh one if None).

        Raises:
            errors.ChildNotFound: no such child.
            errors.BadSteer: an empty or oversized message, or an invalid request id.
        """
        self._require_open()
        rid = request_id or f"host-{secrets.token_hex(8)}"
        outcome = await self._write(
            service.steer_exact, self.config, conversation_id, run_id, rid, message
        )
        self._deliver_steer(outcome)
        return outcome.result

    def _deliver_steer(self, outcome: service.SteerOutcome) -> None:
        local = self._local.get(outcome.child_id)
        if outcome.queued is not None and local is not None and local.ctx is not None:
            local.ctx.deliver(*outcome.queued)

    async def _confirm_cancelled(self, child_id: int, waits: list[asyncio.Event]) -> None:
        await self._drain(waits, self.config.release_drain_s)
        child = await self._db.read(lambda c: queries.child_by_id(c, child_id))
        if child is not None and not child.terminal:
            raise errors.CancelUnconfirmed()

    # --- the five methods -------------------------------------------------------------

    async def call(
        self, conn: RunnerConnection, method: str, params: ParamsLike
    ) -> Result | SteerResult:
        """Serve one child method by its wire name (JSON-RPC dispatch); raises a
        :class:`DelegationError` for every refusal. Typed code calls :meth:`start`,
        :meth:`read`, :meth:`cancel`, :meth:`steer` and :meth:`release` instead."""
        self._require_open()
        name = CHILD_METHODS.get(method)
        if name is None:
            raise errors.MethodNotFound(f"method not found: {method}")
        # The typed method's own body (``_start`` for ``start``): one await less per call.
        handler: Callable[[RunnerConnection, Params], Awaitable[Result | SteerResult]]
        handler = getattr(self, f"_{name}")
        return await self._method(method, handler, conn, params)

    async def start(self, conn: RunnerConnection, params: ParamsLike) -> Result:
        """``child.start``: the child's Result once it is admitted (SPEC §5)."""
        self._require_open()
        return await self._method(START_METHOD, self._start, conn, params)

    async def read(self, conn: RunnerConnection, params: ParamsLike) -> Result:
        """``child.read``: the page of events after ``params.after``."""
        self._require_open()
        return await self._method(READ_METHOD, self._read, conn, params)

    async def cancel(self, conn: RunnerConnection, params: ParamsLike) -> Result:
        """``child.cancel``: request cancellation of exactly that child."""
        self._require_open()
        return await self._method(CANCEL_METHOD, self._cancel, conn, params)

    async def steer(self, conn: RunnerConnection, params: ParamsLike) -> SteerResult:
        """``child.steer``: queue a message for the running child, idempotently."""
        self._require_open()
        return await self._method(STEER_METHOD, self._steer, conn, params)

    async def release(self, conn: RunnerConnection, params: ParamsLike) -> Result:
        """``child.lease.release``: revoke a lease and wait for its children to stop."""
        self._require_open()
        return await self._method(RELEASE_METHOD, self._release, conn, params)

    def _method(
        self,
        method: str,
        handler: Callable[[RunnerConnection, Params], Awaitable[T]],
        conn: RunnerConnection,
        params: ParamsLike,
    ) -> Awaitable[T]:
        """``handler``'s answer to ``params``, decoded; in a span named ``method`` when
        traced (decoding included: a malformed call is a call too)."""
        if self._telemetry is None:
            return handler(conn, self._params(params))
        return self._telemetry.method(
            method, lambda: self._params(params), lambda decoded: handler(conn, decoded)
        )

    def _params(self, params: ParamsLike) -> Params:
        """``Params`` from Params, its JSON, or a dict of wire names (strictly decoded)."""
        if isinstance(params, Params):
            return params
        if isinstance(params, dict):
            try:
                params = _json.encode(params)
            except (TypeError, msgspec.EncodeError) as exc:
                raise errors.MalformedInput(f"malformed child input: {exc}") from None
        if not isinstance(params, bytes | bytearray | memoryview | str):
            raise errors.MalformedInput("child params must be Params, JSON or a dict")
        return decode(params, Params, providers=self.config.providers)

    async def _start(self, conn: RunnerConnection, params: Params) -> Result:
        now = self.clock.now()
        # The reservation is nobody's answer yet: the admission commit that answers the
        # caller syncs it to disk too (SPEC §4: committed before ``prepare``). A caller
        # that goes away must not strand a committed reservation unrun: the commit
        # itself spawns the run, and the caller only waits for it.
        # Without a leaseId its one write is the reservation's INSERT, after every check.
        traced = self._telemetry.trace_context() if self._telemetry is not None else None
        plan = await self._db.submit(
            lambda c: service.reserve_start(
                c,
                self.config,
                conn,
                params,
                self.instance_id,
                now,
                trace_context=traced,
                seen=self._seen_tools,
            ),
            durable=False,
            committed=self._reserved,
            one_write=not params.lease_id,
        )
        try:
            return await self._outcome(plan.child.id, params.after, first=not plan.replay)
        except errors.ChildPurged:
            if plan.replay:
                raise
            # Its reservation was lost with the server (an unflushed commit a failover
            # did not carry over): nothing was started, and a replay starts it anew.
            raise errors.StoreUnavailable() from None

    def _reserved(self, plan: service.StartPlan) -> None:
        if plan.new_lease_deadline is not None:
            self.timers.arm_earlier(plan.new_lease_deadline)
        if not plan.replay:
            self._spawn(plan.child, plan, None)

    async def _read(self, conn: RunnerConnection, params: Params) -> Result:
        now = self.clock.now()
        limit = self.config.events_per_read

        def locate_and_page(c: Connection) -> tuple[int, Result | None]:
            child = service.locate_child(c, conn, params, now)
            local = self._local.get(child.id)
            if local is not None and not local.decided.is_set():
                return child.id, None  # admission still pending: wait, then read again
            return child.id, queries.page_of(c, child, params.after, limit)

        child_id, result = await self._db.read_now(locate_and_page)
        return result if result is not None else await self._outcome(child_id, params.after)

    async def _cancel(self, conn: RunnerConnection, params: Params) -> Result:
        child = await self._write(service.cancel, conn, params)
        if not child.terminal:
            await self._stop([child.id])
        return await self._page(child.id, params.after)

    async def _steer(self, conn: RunnerConnection, params: Params) -> SteerResult:
        now = self.clock.now()
        outcome = await self._db.write(lambda c: service.steer(c, self.config, conn, params, now))
        self._deliver_steer(outcome)
        return outcome.result

    async def _release(self, conn: RunnerConnection, params: Params) -> Result:
        now = self.clock.now()
        affected = await self._db.write(
            lambda c: service.release(c, self.config, conn, params, now)
        )
        await self._drain(await self._stop(affected), self.config.release_drain_s)
        remaining = await self._db.read(
            lambda c: queries.active_under_lease(c, conn.runner_id, params.lease_id)
        )
        if remaining:
            raise errors.ReleaseUnconfirmed()
        return Result(done=True)

    # --- read models ------------------------------------------------------------------

    async def get_child(
        self, conversation_id: str, run_id: str | None = None
    ) -> ChildRecord | None:
        """The newest execution of a conversation (or the one ``run_id`` names), or None."""
        return await self._db.read(lambda c: queries.find_child(c, conversation_id, run_id))

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
        filters = {
            "state": state,
            "lease_id": lease_id,
            "parent_run_id": parent_run_id,
            "parent_conversation_id": parent_conversation_id,
            "limit": limit,
        }
        return await self._db.read(lambda c: queries.list_children(c, **filters))

    async def events(
        self,
        conversation_id: str,
        run_id: str | None = None,
        after: int = 0,
        limit: int | None = None,
    ) -> list[Event]:
        """Committed events of an execution with ``sequence > after``, oldest first."""
        size = limit or self.config.events_per_read
        return await self._db.read(
            lambda c: queries.child_events(c, conversation_id, run_id, after, size)
        )

    def _announced(self, wanted: bool) -> None:
        """The store announces committed events only while a child is followed: a
        batch then wakes the loop once more, which no one should pay for unasked."""
        self._db.on_events = self._notices.bump if wanted else None

    async def follow(
        self, conversation_id: str, run_id: str | None = None, after: int = 0
    ) -> AsyncIterator[Event]:
        """Every committed event of an execution after ``after``, each once, in order,
        as it commits; the iterator ends once the execution is terminal and its last
        event was given. Woken by the commit itself: nothing polls.

        Raises:
            errors.ChildNotFound: no such execution.
            errors.HostClosing: the engine closed while following.
        """
        self._require_open()
        child = await self.get_child(conversation_id, run_id)
        if child is None:
            raise errors.ChildNotFound(f"child not found: {conversation_id}")
        child_id, limit = child.id, self.config.events_per_read
        with self._notices.following(child_id):
            while True:
                seen = self._notices.version(child_id)
                page = await self._db.read(
                    functools.partial(
                        queries.page, child_id=child_id, after=after, limit=limit, strict=False
                    )
                )
                for event in page.events:
                    yield event
                after = page.events[-1].sequence if page.events else after
                if len(page.events) == limit:
                    continue  # more are committed already
                if page.done:
                    return
                await self._notices.moved(child_id, seen)

    async def leases(self, runner_id: str | None = None) -> list[LeaseRecord]:
        """Leases and tombstones, newest first."""
        return await self._db.read(lambda c: queries.leases(c, runner_id))

    # --- runs in this process ---------------------------------------------------------

    def _spawn(
        self,
        child: ChildRecord,
        plan: service.StartPlan,
        recovery: Recovery | None,
        steers: Sequence[tuple[int, str]] = (),
    ) -> LocalRun:
        local = LocalRun(self, child.id, child.cwd, plan.lease_pending)
        self._local.add(local)
        local.task = asyncio.create_task(
            self._execute(local, child, plan, recovery, steers),
            name=f"delegation-child-{child.run_id}",
        )
        return local

    async def _execute(
        self,
        local: LocalRun,
        child: ChildRecord,
        plan: service.StartPlan,
        recovery: Recovery | None,
        steers: Sequence[tuple[int, str]],
    ) -> None:
        error = ""
        ctx: ChildContext | None = None
        ended: ChildRecord | None = None  # its terminal record, once recorded
        tel = self._telemetry
        traced = tel.begin(child, recovery.attempt if recovery else 0) if tel else None
        try:
            run = await self._runner.prepare(plan.request, plan.preset, plan.identity, recovery)
            if recovery is not None:
                authority.confirm_cwd(child.cwd)  # admitted before: no admit() re-checks it
            ctx = ChildContext(
                identity=plan.identity,
                request=plan.request,
                preset=plan.preset,
                cwd=child.cwd,
                recovery=recovery,
                last_sequence=recovery.last_sequence if recovery else 0,
                max_field_bytes=self.config.max_event_field_bytes,
                hooks=local,
                protected=self._protected,
            )
            ctx.admitted = recovery is not None
            if ctx.admitted:
                local.admitted()
            local.ctx = ctx
            ctx.bind()
            for steer_id, message in steers:  # queued before a restart
                ctx.deliver(steer_id, message)
            await run(ctx)
        except NotResumable:
            error = maintenance.INTERRUPTED
        except asyncio.CancelledError as exc:
            # Cancelled by the engine: the state follows the durable cancellation request.
            # A CancelledError that nobody asked for is the run's own failure.
            task = asyncio.current_task()
            if task is not None and not task.cancelling():
                error = str(exc) or type(exc).__name__
        except Exception as exc:
            error = str(exc) or type(exc).__name__
        finally:
            local.finishing()
            if ctx is not None:
                ctx.close()
            try:
                ended = await self._finish(local, error)
            except errors.DelegationError as exc:
                # A run stopped with its host meanwhile was not to record its end: its
                # child resumes at the next boot or on the host that took it over.
                level = logging.WARNING if local.suspended else logging.ERROR
                log.log(
                    level,
                    "child finish not recorded: %s",
                    exc,
                    extra={"action": "child_finish_failed"},
                )
            finally:
                self._local.remove(child.id)
                local.end()
                if tel is not None:
                    tel.end(traced, ended)

    async def _finish(self, local: LocalRun, error: str) -> ChildRecord | None:
        """Record the end of a run (unless the engine is closing): its terminal record,
        None when closing. A busy database delays it, never loses it: the run is over,
        and no caller will retry for it."""
        ended = await self._owed(
            lambda: local.suspended, service.finish, local.child_id, error, local.tracked
        )
        if ended is not None:
            self._notices.bump([local.child_id])
        return ended

    def _owe_later(self, given_up: Callable[[], bool], fn: Callable[..., Any], *args: Any) -> None:
        """:meth:`_owed` for a write nobody waits for (a steer's delivery): queued now,
        in order with what the run emitted, and tried again in a task of its own (which
        close cancels like the other watchers) if the database was busy or away."""
        now = self.clock.now()
        try:
            first = self._db.submit(lambda conn: fn(conn, *args, now))
        except errors.StoreError as exc:  # closed
            log.warning("background write dropped: %s", exc, extra={"action": "write_dropped"})
            return
        task = asyncio.create_task(self._settle(first, given_up, fn, *args))
        self._watching.add(task)
        task.add_done_callback(self._watching.discard)

    async def _settle(
        self, first: Awaitable[Any], given_up: Callable[[], bool], fn: Callable[..., Any], *a: Any
    ) -> None:
        try:
            try:
                await first
            except (errors.DatabaseBusy, errors.StoreUnavailable):
                await self._owed(given_up, fn, *a)
        except errors.DelegationError as exc:  # a fenced host, a closed store: the next boot
            log.warning("background write dropped: %s", exc, extra={"action": "write_dropped"})

    async def _owed(
        self,
        given_up: Callable[[], bool],
        fn: Callable[..., T],
        *args: Any,
        committed: Callable[[T], None] | None = None,
        one_write: bool = False,
    ) -> T | None:
        """A write the engine owes and nobody would retry (a run's end, its admission,
        its process, a steer's delivery): tried again while the database is busy or
        away (SPEC §19), with pauses from 50 ms doubling to 0.4 s, until it commits (its
        value) or ``given_up()`` (None: the run was stopped with its host, whose next
        boot, or the host that took it over, settles it). Anything else is raised."""
        pause = _OWED_PAUSE_S
        while not given_up():
            try:
                return await self._write(fn, *args, committed=committed, one_write=one_write)
            except errors.DatabaseBusy:
                continue  # the writer waited busy_timeout already
            except errors.StoreUnavailable:
                await asyncio.sleep(pause)
                pause = min(pause * 2, _OWED_PAUSE_MAX_S)
        return None

    async def _stop(self, child_ids: Sequence[int]) -> list[asyncio.Event]:
        """Stop the runs of children whose cancellation was requested.

        Local runs are cancelled (their state follows when they stop); children no
        task runs are finished as cancelled at once. Returns the local runs' end events.
        """
        waits: list[asyncio.Event] = []
        orphans: list[int] = []
        for child_id in child_ids:
            local = self._local.get(child_id)
            if local is None and child_id in self._resuming:
                self._cancel_on_resume.add(child_id)  # stopped as it is spawned
                continue
            if local is None:
                orphans.append(child_id)
                continue
            local.cancel()
            waits.append(local.ended)
        if orphans:
            elsewhere, stopped = await self._write(service.stop_unowned, self.instance_id, orphans)
            self._notices.bump(orphans)
            self._ended({machine.Outcome.CANCELLED: stopped})
            # Running on another live host: it was asked (a control request and a
            # NOTIFY), and stops them; their end is seen in the database.
            waits += [self._ended_elsewhere(child_id) for child_id in elsewhere]
        return waits

    def _ended(self, counts: Mapping[machine.Outcome, int]) -> None:
        """Children ended without a run in this process (a takeover, or a cancel of a
        child nothing ran), counted once their end committed."""
        if self._telemetry is not None:
            self._telemetry.finished(counts)

    def _ended_elsewhere(self, child_id: int) -> asyncio.Event:
        """Set once the child, run by another host, is terminal (watched for at most
        ``release_drain_s`` and a little more: a drain gives up after that anyway)."""
        ended = asyncio.Event()

        async def watch() -> None:
            deadline = asyncio.get_running_loop().time() + self.config.release_drain_s + 1
            while asyncio.get_running_loop().time() < deadline:
                if await self._terminal_or_gone(child_id):  # busy or away: looked at again
                    ended.set()
                    return
                await asyncio.sleep(0.05)

        task = asyncio.create_task(watch())
        self._watching.add(task)
        task.add_done_callback(self._watching.discard)
        return ended

    async def _terminal_or_gone(self, child_id: int) -> bool:
        try:
            child = await self._db.read_now(lambda c: queries.child_by_id(c, child_id))
        except errors.DelegationError:  # busy or away: looked at again (close cancels)
            return False
        return child is None or child.terminal

    @staticmethod
    async def _drain(waits: list[asyncio.Event], timeout: float) -> None:
        if not waits:
            return
        pending = [asyncio.ensure_future(w.wait()) for w in waits]
        _, late = await asyncio.wait(pending, timeout=timeout)
        for waiter in late:
            waiter.cancel()

    async def _outcome(self, child_id: int, after: int, *, first: bool = False) -> Result:
        """Wait until admission is decided (without cancelling anything if the caller
        goes away), then answer the child's Result.

        ``first``: the caller started this child, and the page read in the admission
        transaction (committed when it is handed over) answers it.
        """
        local = self._local.get(child_id)
        if local is not None:
            await local.decided.wait()
            if local.suspended:
                raise errors.HostClosing()
            page = local.admitted_page
            if first and after == 0 and page is not None:
                local.admitted_page = None  # its one caller has it; the child lives on
                return page
        return await self._page(child_id, after)

    async def _page(self, child_id: int, after: int) -> Result:
        limit = self.config.events_per_read
        return await self._db.read(lambda c: queries.page(c, child_id, after, limit))

    async def _write(
        self,
        fn: Callable[..., T],
        *args: Any,
        committed: Callable[[T], None] | None = None,
        one_write: bool = False,
    ) -> T:
        """Run a use case in the next write batch with the clock's ``now`` appended
        (``one_write``: see ``Store.submit``)."""
        if self._rejoining:
            raise errors.HostFenced(
                f"host instance {self.instance_id} was taken over; this host is rejoining"
            )
        return await self._submit(fn, *args, committed=committed, one_write=one_write)

    async def _submit(
        self,
        fn: Callable[..., T],
        *args: Any,
        committed: Callable[[T], None] | None = None,
        one_write: bool = False,
    ) -> T:
        now = self.clock.now()

        def job(conn: Connection) -> T:
            return fn(conn, *args, now)

        return await self._db.submit(job, committed=committed, one_write=one_write)


_OWED_PAUSE_S, _OWED_PAUSE_MAX_S = 0.05, 0.4


def _forget_processes(conn: Connection, child_ids: list[int], now: float) -> None:
    for child_id in child_ids:
        store_processes.forget(conn, child_id)


async def _cancelled(tasks: Iterable[asyncio.Task[None]]) -> None:
    """Cancel ``tasks`` and wait for them, their exceptions retrieved (and dropped)."""
    pending = list(tasks)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


def _kill_orphans(recorded: Sequence[processes.ProcessId]) -> None:
    killed = [p.pid for p in recorded if processes.kill_group(p)]
    if killed:
        log.warning(
            "killed %d child processes that outlived their host",
            len(killed),
            extra={"action": "orphans_killed", "pids": killed},
        )


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a boot resumes its children.

    Resuming 10k children allocates a few hundred thousand long-lived objects, none
    of them garbage, and the full collections they trigger each scan the whole heap:
    half the boot went there. The collector is restored on the way out.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
