"""One run executing in this process (:class:`LocalRun`), and their registry.

A local run goes through one lifecycle (:class:`Phase`)::

    PREPARING ──admitted──▶ ADMITTED ──run returns──▶ FINISHING ──end recorded──▶ ENDED
        └───────────────run fails before admission──────▶ FINISHING

``suspended`` is not a phase: it is the engine's graceful close asking the run to stop
*without* recording an end (a leased child resumes at the next boot). It can arrive in
any phase, a run that is already FINISHING included; then the end it is recording is
not retried once refused, and callers waiting for its admission get ``HostClosing``.
What a suspended run emits after that is not written, and its flushes raise
``HostClosing``: its child resumes from what was committed, here at the next boot or
on the host that took it over (where an event written late would sit beside its own).

``first`` is the answer of the caller that started the child: the first page, read in
the admission transaction as it commits (None when the run ended or was suspended before
its admission, or was admitted before a restart). That caller alone awaits it.

The run object is also the hooks (``runs.Hooks``) by which its context reaches the
store, through the engine's runtime (:class:`delegation.engine.runtime.Runtime`): one
object per child, as a long-lived child's footprint is what the garbage collector walks.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, NamedTuple, TypeVar

from delegation import authority, errors
from delegation import os_processes as processes
from delegation.engine.runtime import Runtime, Use
from delegation.records import ChildRecord, RecordedStep
from delegation.run import emits
from delegation.store import processes as store_processes
from delegation.store import steps
from delegation.store import waits as store_waits
from delegation.store.events import EventRow
from delegation.store.sql import Connection
from delegation.store.steers import mark_delivered
from delegation.store.waits import WaitRow
from delegation.usecases import queries, service, waiting
from delegation.wire import Result

if TYPE_CHECKING:
    from delegation.run.context import ChildContext, Recovery

T = TypeVar("T")


class Phase(enum.Enum):
    PREPARING = "preparing"  # the runner prepares it, or it has not been admitted yet
    ADMITTED = "admitted"  # its admission committed (or it was admitted before a restart)
    FINISHING = "finishing"  # its run returned, raised or was cancelled: recording the end
    ENDED = "ended"  # out of the registry; nothing of it runs


class LocalRun:
    """A child executing in this process (see the module's docstring)."""

    __slots__ = (
        "_decided",
        "_ended",
        "child_id",
        "conversation_id",
        "ctx",
        "cwd",
        "deadline_at",
        "emitted",
        "first",
        "how",
        "lease_pending",
        "on_parked",
        "parked",
        "phase",
        "rt",
        "suspended",
        "task",
        "tracked",
    )

    def __init__(
        self,
        rt: Runtime,
        child_id: int,
        cwd: str,
        lease_pending: bool,
        first: asyncio.Future[Result | None] | None = None,
        conversation_id: str = "",
        how: service.Admission | None = None,
    ) -> None:
        self.rt = rt
        # How its admission goes (design §22: slotted by its policy's turn, a deadline),
        # and the deadline it got (set once admitted here).
        self.how = how or service.Admission()
        self.deadline_at: float | None = None
        self.child_id = child_id
        self.conversation_id = conversation_id
        self.cwd = cwd
        self.lease_pending = lease_pending  # a first admission under its lease re-checks
        self.phase = Phase.PREPARING
        self.suspended = False  # graceful close: stop without recording an end
        # Its child waits (design §21): the run's task ends without recording an end.
        self.parked = False
        # ADMITTED or ENDED, and ENDED: the events are made when first asked for (True:
        # set before anyone asked), as each object of a run costs in every GC run.
        self._decided: asyncio.Event | bool = False
        self._ended: asyncio.Event | bool = False
        # The answer of the caller that started it (see the module), or a future of its own.
        self.first = first or asyncio.get_running_loop().create_future()
        self.task: asyncio.Task[None] | None = None
        self.ctx: ChildContext | None = None
        self.emitted = False  # an event was appended in this process
        self.tracked = False  # a process of the run is recorded (ended with the run)
        self.on_parked: Callable[[float | None], None] | None = None

    # --- lifecycle ----------------------------------------------------------------------

    @property
    def decided(self) -> asyncio.Event:
        """Set once ADMITTED or ENDED: a caller may be answered."""
        self._decided = _waitable(self._decided)
        return self._decided

    @property
    def ended(self) -> asyncio.Event:
        """Set once ENDED."""
        self._ended = _waitable(self._ended)
        return self._ended

    def is_decided(self) -> bool:
        return _is_set(self._decided)

    def admitted(self, page: Result | None) -> None:
        """Admitted: ``page`` is the first page read as the admission committed (None:
        admitted before a restart, nobody to answer)."""
        self.phase = Phase.ADMITTED
        self._decided = _set(self._decided)
        if not self.first.done():  # or its caller went away (cancelled it)
            self.first.set_result(page)

    def finishing(self) -> None:
        self.phase = Phase.FINISHING
        self._mark_asked()

    def end(self) -> None:
        self.phase = Phase.ENDED
        self._decided = _set(self._decided)
        if not self.first.done():
            self.first.set_result(None)
        self._ended = _set(self._ended)

    def cancel(self) -> None:
        """Cancel the run's task, unless its end is already being recorded."""
        if self.task is not None and self.phase in (Phase.PREPARING, Phase.ADMITTED):
            self.task.cancel()

    def suspend(self) -> None:
        """The engine closes: stop without recording an end (see the module)."""
        self.suspended = True
        self.cancel()

    # --- hooks of the run's context (runs.Hooks) ------------------------------------------

    async def admit(self) -> None:
        # Confined at the start, but the path may have been swapped since (design §3.4).
        authority.confirm_cwd(self.cwd)
        # Owed (design §19): a database away delays the admission, never drops it; a run
        # stopped meanwhile (its task cancelled) stops waiting.
        owed, stopped, on_admitted = self.rt.owed, self.stopped, self._on_admitted
        if not self.lease_pending:
            # The usual case is one guarded UPDATE, which a server store commits as its
            # own transaction; when it does not match, admit() learns why.
            usual = owed(stopped, Use(self._try_admit), committed=on_admitted, one_write=True)
            if await usual is not None:
                return
        if await owed(stopped, Use(self._admit_and_page), committed=on_admitted) is None:
            raise errors.HostClosing()

    def stopped(self) -> bool:
        """Whether the run was stopped with its host (its owed writes are given up)."""
        return self.suspended

    def _try_admit(self, conn: Connection, now: float) -> Result | None:
        child = service.try_admit(conn, now, self.child_id, self.rt.instance_id, self.how)
        return None if child is None else self._first_page(conn, child)

    def _admit_and_page(self, conn: Connection, now: float) -> Result:
        rt = self.rt
        child = service.admit(
            conn, now, self.child_id, rt.instance_id, self.lease_pending, self.how
        )
        return self._first_page(conn, child)

    def _first_page(self, conn: Connection, child: ChildRecord) -> Result:
        self.deadline_at = child.deadline_at
        if not self.emitted:  # a fresh child's events all come from its run: none yet
            return queries.result_of(child, [])
        config = self.rt.config
        return queries.page_of(conn, child, 0, config.events_per_read, config.max_page_bytes).result

    def _on_admitted(self, page: Result | None) -> None:  # answered at the commit
        if page is not None:
            self.admitted(page)

    def append(self, sequence: int, body: bytes, output: str | None) -> None:
        if self.suspended:
            return  # see the module
        # Set before queueing: a batch that holds this event sees it when it admits.
        self.emitted = True
        self.rt.db.append_event(EventRow(self.child_id, sequence, body, output))

    async def flush(self) -> None:
        try:
            await self.rt.db.barrier()
        except errors.StoreUnavailable:
            # The events are kept and written once the database is back (design §19): a
            # run waits for that, as for a slow disk, rather than fail for it.
            await self.rt.owed(self.stopped, Use(_barrier))
        if self.suspended:  # what it emitted since is not written (see the module)
            raise errors.HostClosing(
                "this run was stopped with its host: what it emitted since is not written"
            )

    async def record_process(self, pid: int) -> None:
        process = processes.identify(pid)
        if process is None:
            return  # already gone: nothing could outlive the host
        recorded = await self.rt.owed(self.stopped, Use(_record, self.child_id, process))
        if recorded is None:
            raise errors.HostClosing("this run was stopped with its host before it started")
        self.tracked = True

    def delivered(self, steer_ids: list[int]) -> None:
        self.rt.owe_later(self.stopped, Use(_delivered, steer_ids))

    # --- hooks of the run's journal (journal.JournalHooks, design §15) -------------------

    async def record_step(
        self,
        name: str,
        ordinal: int,
        step: RecordedStep,
        closes_wait: bool,
        asked: list[str],
        began: int | None,
    ) -> RecordedStep:
        # Queued behind every event the run appended before it: one commit holds them
        # all (or they were committed earlier). Owed like an admission (design §19).
        # The step keeps the runner version and attempt that recorded it (design §34),
        # and the events its function emitted: those after ``began`` up to the last.
        journaled = _Journaled(
            self.rt.config.runner_version, self._attempt(), asked, began, self.numbered()
        )
        use = Use(_record_step, self.child_id, name, ordinal, step, closes_wait, journaled)
        recorded = await self.rt.owed(self.stopped, use)
        if recorded is None:
            raise errors.HostClosing("this run was stopped with its host: its step is not recorded")
        return recorded

    def numbered(self) -> int | None:
        return None if self.ctx is None else self.ctx.last_sequence

    async def read_step(self, name: str, run_id: str | None) -> RecordedStep | None:
        if run_id is None:
            return await self._read(lambda c: steps.value(c, self.child_id, name))
        assert self.ctx is not None  # read by the run, through its context
        conversation = self.ctx.identity.conversation_id
        return await self._read(lambda c: steps.of_run(c, conversation, run_id, name))

    async def step_names(self) -> list[str]:
        return await self._read(lambda c: steps.names(c, self.child_id))

    def _attempt(self) -> int:
        """This attempt: 0 for a first run, else its ``Recovery.attempt``."""
        recovery = None if self.ctx is None else self.ctx.recovery
        return 0 if recovery is None else recovery.attempt

    def _asked(self) -> list[str]:
        """The recorded steps the run replayed since its last record (design §34)."""
        return [] if self.ctx is None else self.ctx.asked_steps()

    def _mark_asked(self) -> None:
        """The attempt ends: what it replayed since its last record is marked asked,
        queued before its end (a commit nobody waits for; lost with a crash, when the
        next attempt asks again)."""
        asked = self._asked()
        if asked:
            use = Use(_marked, self.child_id, asked, self._attempt())
            self.rt.owe_later(self.stopped, use)

    async def committed(self, run_id: str, recovery: Recovery | None) -> emits.Committed | None:
        """A resumed run's own events, committed before this attempt: what its emits are
        matched with (design §26). None for a first run, or none committed."""
        if recovery is None:
            return None
        config = self.rt.config
        return await emits.committed(
            # What an execution committed before this attempt does not change.
            partial(self.rt.owed_read, self.stopped, snapshot=False),
            self.child_id,
            run_id,
            recovery.last_sequence,
            config.events_per_read,
            config.max_page_bytes,
            recorded=recovery.steps,
        )

    async def _read(self, fn: Callable[[Connection], T]) -> T:
        """A read the run makes: it waits through an outage, as its writes do (design
        §32: a blink ends no child)."""
        return await self.rt.owed_read(self.stopped, fn)

    # --- hooks of the run's waits (waits.WaitHooks, design §21) --------------------------

    def now(self) -> float:
        return self.rt.clock.now()

    async def wait_state(self, name: str) -> WaitRow | None:
        return await self._read(lambda c: waiting.wait_state(c, self.child_id, name))

    async def open_wait(
        self, name: str, spec: waiting.WaitSpec, event: tuple[int, bytes] | None
    ) -> WaitRow:
        row = None if event is None else EventRow(self.child_id, event[0], event[1], None)
        if row is not None:
            self.emitted = True
        use = Use(waiting.open_wait, self.rt.config, self.child_id, name, spec, row)
        return await self._owed_wait(use)

    async def take_event(self, name: str) -> WaitRow:
        return await self._owed_wait(Use(waiting.take_event, self.child_id, name))

    async def _owed_wait(self, use: Use[WaitRow]) -> WaitRow:
        found = await self.rt.owed(self.stopped, use)
        if found is None:
            raise errors.HostClosing("this run was stopped with its host while it waited")
        return found

    async def suspend_waiting(self) -> bool:
        """Suspend the child (``waiting``) unless something it waits for can end now; once
        committed its task is cancelled, and it is this host's to wake (the supervisor's
        ``parked`` callback: its timer)."""
        # What it replayed is marked in the same commit: a waiting child's drift is whole.
        asked = self._asked()
        use = Use(_suspend, self.child_id, self.rt.instance_id, asked, self._attempt())
        suspended = await self.rt.owed(self.stopped, use)
        if suspended is None:
            return False
        self.parked = True
        if self.on_parked is not None:
            self.on_parked(suspended.wake_at)
        if self.task is not None:
            self.task.cancel()
        return True

    async def previous_run_id(self, conversation_id: str) -> str | None:
        """The execution before this one in its conversation (a follow-up's), if any."""
        return await self._read(lambda c: steps.previous_run_id(c, conversation_id, self.child_id))


# A run's two flags (decided, ended) are plain booleans until someone waits for one:
# each event of a held run costs in every pass of the garbage collector.
Flag = asyncio.Event | bool


def _waitable(flag: Flag) -> asyncio.Event:
    """The flag as an event to wait for (made, and set if it was, the first time)."""
    if isinstance(flag, asyncio.Event):
        return flag
    event = asyncio.Event()
    if flag:
        event.set()
    return event


def _set(flag: Flag) -> Flag:
    """The flag, set (waking whoever waits for it)."""
    if isinstance(flag, asyncio.Event):
        flag.set()
        return flag
    return True


def _is_set(flag: Flag) -> bool:
    return flag.is_set() if isinstance(flag, asyncio.Event) else flag


def _delivered(conn: Connection, now: float, steer_ids: list[int]) -> None:
    mark_delivered(conn, steer_ids, now)


class _Journaled(NamedTuple):
    """Who records a step (design §34): the runner version, the attempt, the recorded
    steps the attempt replayed since its last record, and the events before it (§35)."""

    version: str | None
    attempt: int
    asked: list[str]
    # The run's last numbered event when the step's function began, and when it
    # returned (committed before the step): the events between are the step's own.
    first_sequence: int | None
    last_sequence: int | None


def _record_step(
    conn: Connection,
    now: float,
    child_id: int,
    name: str,
    ordinal: int,
    step: RecordedStep,
    closes_wait: bool,
    by: _Journaled,
) -> RecordedStep:
    if by.asked:
        steps.mark_asked(conn, child_id, by.asked, by.attempt)
    recorded = steps.record(
        conn,
        child_id,
        name,
        ordinal,
        step,
        now,
        version=by.version,
        attempt=by.attempt,
        sequences=(by.first_sequence, by.last_sequence),
    )
    if closes_wait:
        store_waits.close(conn, child_id, name, now)
    return recorded


def _marked(conn: Connection, now: float, child_id: int, asked: list[str], attempt: int) -> None:
    steps.mark_asked(conn, child_id, asked, attempt)


def _suspend(
    conn: Connection, now: float, child_id: int, instance_id: str, asked: list[str], attempt: int
) -> waiting.Suspended | None:
    if asked:
        steps.mark_asked(conn, child_id, asked, attempt)
    return waiting.suspend(conn, now, child_id, instance_id)


def _barrier(conn: Connection, now: float) -> bool:
    """A job that writes nothing: committed once everything queued before it is."""
    return True


def _record(conn: Connection, now: float, child_id: int, process: processes.ProcessId) -> bool:
    store_processes.record(conn, child_id, process, now)
    return True


class LocalRuns:
    """The registry: the runs this process executes, by child id."""

    __slots__ = ("_runs",)

    def __init__(self) -> None:
        self._runs: dict[int, LocalRun] = {}

    def add(self, run: LocalRun) -> None:
        self._runs[run.child_id] = run

    def get(self, child_id: int) -> LocalRun | None:
        return self._runs.get(child_id)

    def remove(self, child_id: int) -> None:
        self._runs.pop(child_id, None)

    def __iter__(self) -> Iterator[LocalRun]:
        return iter(list(self._runs.values()))  # a copy: runs leave as they end

    def __len__(self) -> int:
        return len(self._runs)
