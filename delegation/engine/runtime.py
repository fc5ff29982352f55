"""What every part of the engine shares, and the one way they write.

A use case (:mod:`delegation.usecases.service`, :mod:`delegation.usecases.maintenance`) is
a function ``fn(conn, now, *args, **kwargs)`` run in one write transaction. :class:`Use` binds it to
its arguments, checked by the type checker against ``fn``'s own signature, and
:meth:`Runtime.write` is the one entry through which every use case of the engine is
queued.

**Stamped when it runs, not when it was queued** (design §12, issue 36): ``now`` is read
from the engine's clock as the use case runs in its write transaction, a moment before
its commit. A write may wait in the queue (a busy writer, a host stopped or starved for
seconds); stamped when queued, a purge committed 12 s late said it was 12 s old, and the
next sweep forgot it within a second. Every time a use case writes (a purge, an end, an
admission, an expiry, a heartbeat's effects, a lease's deadline) is therefore the time
it became true in the database, as near as the clock can tell: on PostgreSQL the
server's (:class:`~delegation.clock.ServerClock`). The time a caller asked is
:attr:`Use.asked_at` (read as it is queued), for what measures a wait; no use case
stores it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar

from delegation import errors
from delegation.clock import Clock
from delegation.config import EngineConfig
from delegation.engine.notices import Notices
from delegation.store.interface import Store
from delegation.store.sql import Connection

if TYPE_CHECKING:
    from delegation.engine.telemetry import Telemetry

log = logging.getLogger("delegation.engine")
T = TypeVar("T")
P = ParamSpec("P")

OWED_PAUSE_S, OWED_PAUSE_MAX_S = 0.05, 0.4


class Use(Generic[T]):
    """A use case and its arguments: run as ``fn(conn, now, *args, **kwargs)``."""

    __slots__ = ("args", "asked_at", "fn", "kwargs")

    def __init__(
        self,
        fn: Callable[Concatenate[Connection, float, P], T],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> None:
        self.fn: Callable[..., T] = fn
        self.args = args
        self.kwargs = kwargs
        self.asked_at: float | None = None  # when it was queued (Runtime.write)

    def job(self, clock: Clock) -> Callable[[Connection], T]:
        """The job a write batch runs: this use case, ``now`` read from ``clock`` as it
        runs in the batch's transaction."""
        fn, args, kwargs, now = self.fn, self.args, self.kwargs, clock.now
        if kwargs:
            return lambda conn: fn(conn, now(), *args, **kwargs)
        return lambda conn: fn(conn, now(), *args)


class Runtime:
    """The store, the clock, the configuration and this host's instance, shared by the
    engine's parts; :meth:`write` is how each of them writes."""

    def __init__(
        self,
        config: EngineConfig,
        db: Store,
        clock: Clock,
        telemetry: Telemetry | None,
        notices: Notices,
    ) -> None:
        self.config = config
        self.db = db
        self.clock = clock
        self.telemetry = telemetry
        self.notices = notices
        self.instance_id = ""
        self.rejoining = False  # fenced, and not yet a new instance: writes are refused
        # No heartbeat for too long: the runs were stopped, and the rejoin that follows
        # the next committed beat resumes their children (Membership._cut_off).
        self.cut_off = False
        self.lost: errors.DelegationError | None = None  # the database was replaced
        self._background: set[asyncio.Task[Any]] = set()

    def write(
        self,
        use: Use[T],
        *,
        committed: Callable[[T], None] | None = None,
        one_write: bool = False,
        durable: bool = True,
        while_rejoining: bool = False,
    ) -> asyncio.Future[T]:
        """Queue ``use`` for the next write batch; the future resolves after its commit.

        ``committed``, ``one_write`` and ``durable``: see ``Store.submit``. While the host
        rejoins (fenced, not yet a new instance) a write is refused with ``HostFenced``
        unless ``while_rejoining`` (the rejoin's own write). Once the database was found
        replaced (design §18), every write is refused with that error."""
        if self.lost is not None:
            raise type(self.lost)(str(self.lost))
        if self.rejoining and not while_rejoining:
            raise errors.HostFenced(
                f"host instance {self.instance_id} was taken over; this host is rejoining"
            )
        use.asked_at = self.clock.now()
        job = use.job(self.clock)  # stamped as it runs, not now (see the module)
        return self.db.submit(job, durable=durable, committed=committed, one_write=one_write)

    async def owed(
        self,
        given_up: Callable[[], bool],
        use: Use[T],
        *,
        committed: Callable[[T], None] | None = None,
        one_write: bool = False,
    ) -> T | None:
        """A write the engine owes and nobody would retry (a run's end, its admission,
        its process, a steer's delivery): tried again while the database is busy or
        away (design §19), with pauses from 50 ms doubling to 0.4 s, until it commits (its
        value) or ``given_up()`` (None: the run was stopped with its host, whose next
        boot, or the host that took it over, settles it). Anything else is raised."""
        pause = OWED_PAUSE_S
        while not given_up():
            try:
                return await self.write(use, committed=committed, one_write=one_write)
            except errors.DatabaseBusy:
                continue  # the writer waited busy_timeout already
            except errors.StoreUnavailable:
                await asyncio.sleep(pause)
                pause = min(pause * 2, OWED_PAUSE_MAX_S)
        return None

    async def owed_read(
        self, given_up: Callable[[], bool], fn: Callable[[Connection], T], *, snapshot: bool = True
    ) -> T:
        """A read a run makes (a recorded step, a wait's state): like :meth:`owed`, read
        again while the database is busy or away (design §32: a blink ends no child),
        until it answers. Raises ``HostClosing`` once ``given_up()`` (the run was stopped
        with its host), and anything else the read raises. Not a ``snapshot``: no
        transaction is opened (``Database.read_now``), for rows no one changes meanwhile."""
        read = self.db.read if snapshot else self.db.read_now
        pause = OWED_PAUSE_S
        while not given_up():
            try:
                return await read(fn)
            except (errors.DatabaseBusy, errors.StoreUnavailable):
                await asyncio.sleep(pause)
                pause = min(pause * 2, OWED_PAUSE_MAX_S)
        raise errors.HostClosing("this run was stopped with its host while it read")

    async def through_blink(self, seconds: float, use: Callable[[], Use[T]]) -> T:
        """A write tried again while the database is busy or away, or this host is
        fenced and rejoining, for up to ``seconds`` (design §32: a graceful close rides
        out a blink); then the refusal is raised. ``use`` makes it anew for each try: the
        instance it names may be a new one after a rejoin."""
        loop = asyncio.get_running_loop()
        until = loop.time() + seconds
        pause = OWED_PAUSE_S
        while True:
            try:
                return await self.write(use())
            except (errors.DatabaseBusy, errors.StoreUnavailable, errors.HostFenced):
                if loop.time() + pause > until:
                    raise
            await asyncio.sleep(pause)
            pause = min(pause * 2, OWED_PAUSE_MAX_S)

    def owe_later(self, given_up: Callable[[], bool], use: Use[Any]) -> None:
        """:meth:`owed` for a write nobody waits for (a steer's delivery): queued now,
        in order with what the run emitted, and tried again in a task of its own (which
        close cancels like the other watchers) if the database was busy or away."""
        try:
            first = self.write(use, while_rejoining=True)
        except errors.StoreError as exc:  # closed
            log.warning("background write dropped: %s", exc, extra={"action": "write_dropped"})
            return
        self.background(self._settle(first, given_up, use))

    async def _settle(
        self, first: asyncio.Future[Any], given_up: Callable[[], bool], use: Use[Any]
    ) -> None:
        try:
            try:
                await first
            except (errors.DatabaseBusy, errors.StoreUnavailable):
                await self.owed(given_up, use)
        except errors.DelegationError as exc:  # a fenced host, a closed store: the next boot
            log.warning("background write dropped: %s", exc, extra={"action": "write_dropped"})

    def background(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``work`` in a task of its own, cancelled at close; a failure nobody
        awaits is logged (``background_failed``), never silent."""
        task = asyncio.create_task(work)
        self._background.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error(
                "background task failed: %s",
                exc,
                exc_info=exc,
                extra={"action": "background_failed"},
            )

    async def stop_background(self) -> None:
        await cancelled(self._background)


def unreadable(run_ids: Sequence[str]) -> None:
    """Say so of children ended because their stored record no longer decodes."""
    for run_id in run_ids:
        log.error(
            "child ended: %s",
            errors.ChildUnreadable.default_message(),
            extra={"action": "child_unreadable", "run_id": run_id},
        )


def refused(run_ids: Sequence[str]) -> None:
    """Say so of children a resume refused: another runner version ran them (§34)."""
    for run_id in run_ids:
        log.warning(
            "child ended: another runner version ran it (on_version_change=refuse)",
            extra={"action": "runner_version_changed", "run_id": run_id},
        )


async def cancelled(tasks: Any) -> None:
    """Cancel ``tasks`` and wait for them, their exceptions retrieved (and dropped)."""
    pending = list(tasks)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
