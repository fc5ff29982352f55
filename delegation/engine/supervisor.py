"""The runs this process executes, end to end: spawned at their reservation's commit
(or at a takeover, a wake-up, the admission pump's turn, an adoption), executed,
admitted, finished, stopped and drained.

A start is reserved and answered in :mod:`delegation.engine.starting`, whose commit
spawns its run here (see :mod:`delegation.engine.local_run` for one run's lifecycle);
a child run again (resumed by a takeover, woken) is spawned by
:mod:`delegation.engine.resuming`, one a lost commit answer left unrun by
:mod:`delegation.engine.adoption`.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

from delegation import authority, errors, machine
from delegation.engine import rewinding
from delegation.engine.answers import Answers
from delegation.engine.ends import Ends
from delegation.engine.local_run import LocalRun, LocalRuns
from delegation.engine.runtime import Runtime, Use
from delegation.options import ExecutionOptions
from delegation.records import ChildRecord
from delegation.run.context import (
    ChildContext,
    NotResumable,
    Recovery,
    Runner,
    truncate,
)
from delegation.run.journal import Journal
from delegation.run.protection import Protected
from delegation.usecases import admission, maintenance, queries, reservation, service
from delegation.usecases.redaction import redact_secrets
from delegation.wire import Result

# The error of a child cancelled for running past its deadline (design §22), or past
# EngineConfig.max_run_s.
DEADLINE_EXCEEDED = admission.DEADLINE_EXCEEDED

log = logging.getLogger("delegation.engine")

# Without news of a child another host runs, its end is looked for this often.
_ELSEWHERE_FALLBACK_S = 0.5


def run_limit(engine_limit: float | None, run: object) -> float | None:
    """The seconds a child may run: ``EngineConfig.max_run_s`` or the run's own
    ``max_run_s`` (e.g. a command profile's ``timeout_s``), whichever is smaller.

    Raises:
        ValueError: the run's ``max_run_s`` is not a positive number of seconds (the
            run then ends with that error, before it starts).
    """
    own = getattr(run, "max_run_s", None)
    if own is None:
        return engine_limit
    if isinstance(own, bool) or not isinstance(own, int | float) or not 0 < own < 10**9:
        raise ValueError(f"a run's max_run_s must be a positive number of seconds, not {own!r}")
    return float(own) if engine_limit is None else min(engine_limit, float(own))


class ToResume:
    """The children a committed takeover gave this host whose runs are not spawned yet
    (:mod:`delegation.engine.resuming`): until spawned, they are this host's runs to
    stop (a lease expiring meanwhile would find no run and finish the child, then see
    it resumed); and those among them whose cancellation came meanwhile."""

    __slots__ = ("_cancelled", "_ids")

    def __init__(self) -> None:
        self._ids: set[int] = set()
        self._cancelled: set[int] = set()

    def __contains__(self, child_id: object) -> bool:
        return child_id in self._ids

    def add(self, child_ids: Iterable[int]) -> None:
        self._ids.update(child_ids)

    def forget(self, child_ids: Iterable[int]) -> None:
        """Not spawned here after all (the host closes)."""
        self._ids.difference_update(child_ids)

    def cancel(self, child_id: int) -> None:
        """Stop its run as it is spawned (its cancellation came first)."""
        self._cancelled.add(child_id)

    def spawned(self, child_id: int) -> bool:
        """Its run is spawned: whether that run is to be cancelled at once."""
        self._ids.discard(child_id)
        if child_id not in self._cancelled:
            return False
        self._cancelled.discard(child_id)
        return True


class Supervisor:
    """The local runs of one engine (see the module's docstring)."""

    def __init__(self, rt: Runtime, runner: Runner) -> None:
        self._rt = rt
        self._runner = runner
        self.runs = LocalRuns()
        self.protected = Protected()  # what no child process may reach; set at open
        self.to_resume = ToResume()  # a takeover's children, until their runs spawn
        # The engine closes: nothing is resumed, woken, adopted or admitted here any more.
        self.closing = False
        # A run here suspended its child (design §21): when it wakes at the latest.
        self.on_parked: Callable[[float | None], None] | None = None
        # Admission (design §22): the scopes with a policy, as this host last read them,
        # and what to call when a run here gives its slots back (it ended or waits).
        self.known: frozenset[str] = frozenset()
        self.on_slot_freed: Callable[[], None] | None = None
        self._ends = Ends(rt)
        self.answers = Answers(rt, self.runs)  # what a caller is answered, and when

    # --- spawning and executing -----------------------------------------------------

    def spawn(
        self,
        child: ChildRecord,
        plan: reservation.StartPlan,
        recovery: Recovery | None,
        steers: Sequence[tuple[int, str]] = (),
        *,
        first: asyncio.Future[Result | None] | None = None,
    ) -> LocalRun:
        how = service.Admission(
            plan.slotted,
            _deadline_s(plan.request),
            child.depth,
            child.parent_run_id,
            counted=bool(self.known),
        )
        local = LocalRun(
            self._rt, child.id, child.cwd, plan.lease_pending, first, child.conversation_id, how
        )
        local.on_parked = self.on_parked
        self.runs.add(local)
        local.task = asyncio.create_task(
            self._execute(local, child, plan, recovery, steers),
            name=f"delegation-child-{child.run_id}",
        )
        return local

    async def _execute(
        self,
        local: LocalRun,
        child: ChildRecord,
        plan: reservation.StartPlan,
        recovery: Recovery | None,
        steers: Sequence[tuple[int, str]],
    ) -> None:
        error = ""
        ctx: ChildContext | None = None
        deadline: asyncio.Task[None] | None = None
        ended: ChildRecord | None = None  # its terminal record, once recorded
        tel = self._rt.telemetry
        traced = tel.begin(child, recovery.attempt if recovery else 0) if tel else None
        try:
            # A rewound execution's first run resumes from its seed (design §35).
            recovery = recovery or await rewinding.recovery(local, child, self._rt.config)
            previous = plan.previous_run_id
            if previous is None and child.followup:  # a follow-up resumed after a restart
                previous = await local.previous_run_id(child.conversation_id)
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
                max_field_bytes=self._rt.config.max_event_field_bytes,
                hooks=local,
                protected=self.protected,
                wait_hooks=local,
                hold_s=self._rt.config.hold_s,
                journal=Journal(
                    local,
                    recorded=recovery.steps if recovery else 0,
                    max_bytes=self._rt.config.max_step_bytes,
                    max_steps=self._rt.config.max_steps,
                ),
                previous_run_id=previous,
                committed=await local.committed(child.run_id, recovery),
            )
            ctx.admitted = not rewinding.first_run(recovery)
            if ctx.admitted:
                local.admitted(None)
            local.ctx = ctx
            ctx.bind()
            for steer_id, message in steers:  # queued before a restart
                ctx.deliver(steer_id, message)
            limit = run_limit(self._rt.config.max_run_s, run)
            how = local.how
            if (
                limit is not None
                or how.deadline_s is not None
                or child.deadline_at
                or how.depth > 1
            ):
                deadline = asyncio.create_task(
                    self._deadline(local, child, not rewinding.first_run(recovery), limit)
                )
            await run(ctx)
        except NotResumable:
            error = maintenance.INTERRUPTED
        except asyncio.CancelledError as exc:
            # Cancelled by the engine: the state follows the durable cancellation request.
            # A CancelledError that nobody asked for is the run's own failure.
            task = asyncio.current_task()
            if task is not None and not task.cancelling():
                error = self._failure(exc)
        except Exception as exc:
            error = self._failure(exc)
        finally:
            if deadline is not None:
                deadline.cancel()
            local.finishing()
            if ctx is not None:
                ctx.close()
            try:
                # A run whose child now waits ends without an end (design §21).
                ended = None if local.parked else await self._finish(local, error)
            except errors.DelegationError as exc:
                # A run stopped with its host meanwhile was not to record its end: its
                # child resumes at the next boot or on the host that took it over (the
                # host says so once: host_fenced or host_cut_off).
                fenced = isinstance(exc, errors.HostFenced)  # the host says so once
                level = logging.INFO if local.suspended or fenced else logging.ERROR
                log.log(
                    level,
                    "child finish not recorded: %s",
                    exc,
                    extra={"action": "child_finish_failed"},
                )
            finally:
                self.runs.remove(child.id)
                local.end()
                if self.known and self.on_slot_freed is not None:
                    self.on_slot_freed()
                if tel is not None:
                    tel.end(traced, ended)

    def _failure(self, exc: BaseException) -> str:
        """The error a run's exception leaves on its child: its text, cut as an event's
        field is (``max_event_field_bytes``, measured as the wire encodes it), since
        every page of the child carries it and a runner's exception may hold anything:
        what looks like a credential in it is redacted (design §20)."""
        text = redact_secrets(str(exc) or type(exc).__name__)
        return truncate(text, self._rt.config.max_event_field_bytes)

    async def _deadline(
        self, local: LocalRun, child: ChildRecord, resumed: bool, limit: float | None
    ) -> None:
        """Cancel the child at its deadline, as the host's own cancel would: the one
        its first admission set (design §22: never reset by a restart, a wait or a
        takeover), or ``limit`` seconds (``max_run_s``) since its run was prepared (a
        resumed one: since its first admission), whichever comes first."""
        rt = self._rt
        now = rt.clock.now()
        at = child.deadline_at
        if not resumed:
            await local.decided.wait()  # its admission sets its deadline
            at = local.deadline_at
        if limit is not None:
            admitted = child.admitted_at  # NaN: stored unreadable (see store.sql.stored_time)
            ok = resumed and admitted is not None and math.isfinite(admitted)
            since = admitted if ok and admitted is not None else now
            at = since + limit if at is None else min(at, since + limit)
        if at is None:
            return
        await asyncio.sleep(max(0.0, at - rt.clock.now()))
        use = Use(service.cancel_exact, child.conversation_id, child.run_id, DEADLINE_EXCEEDED)
        try:
            # Owed (design §32): a deadline that falls in an outage is recorded, and the
            # run stopped, once the database is back.
            cancelled = await rt.owed(local.stopped, use)
        except errors.DelegationError as exc:  # purged meanwhile, or the host fenced
            log.warning("child deadline not recorded: %s", exc, extra={"run_id": child.run_id})
            return
        if cancelled is not None and not cancelled.terminal:
            await self.stop([child.id])  # cancels the run, and this task with it

    async def _finish(self, local: LocalRun, error: str) -> ChildRecord | None:
        """Record the end of a run (unless the engine is closing): its terminal record,
        None when closing. A busy database delays it, never loses it: the run is over,
        and no caller will retry for it. Runs that end together (a lease expiry, a
        release) are written together (:class:`Ends`)."""
        ended = await self._ends.record(local, error)
        if ended is not None:
            self._rt.notices.bump([local.child_id])
        return ended

    # --- steers -----------------------------------------------------------------------

    def deliver(self, child_id: int, steer_id: int, message: str) -> None:
        """Hand a steer to the child's run, if it runs here (each steer id at most once)."""
        local = self.runs.get(child_id)
        if local is not None and local.ctx is not None:
            local.ctx.deliver(steer_id, message)

    def steerable(self) -> list[int]:
        """The children whose runs here can take a steer."""
        return [run.child_id for run in self.runs if run.ctx is not None]

    # --- stopping -----------------------------------------------------------------------

    async def stop(self, child_ids: Sequence[int]) -> list[asyncio.Event]:
        """Stop the runs of children whose cancellation was requested.

        Local runs are cancelled (their state follows when they stop); children no
        task runs are finished as cancelled at once. Returns the local runs' end events.
        """
        waits: list[asyncio.Event] = []
        orphans: list[int] = []
        for child_id in child_ids:
            local = self.runs.get(child_id)
            if local is None and child_id in self.to_resume:
                self.to_resume.cancel(child_id)  # stopped as it is spawned
                continue
            if local is None or local.parked:  # a waiting child: no run to stop
                orphans.append(child_id)
                continue
            local.cancel()
            waits.append(local.ended)
        if orphans:
            rt = self._rt
            use = Use(service.stop_unowned, rt.instance_id, orphans)
            elsewhere, stopped = await rt.write(use)
            rt.notices.bump(orphans)
            self.ended({machine.Outcome.CANCELLED: stopped})
            # Running on another live host: it was asked (a control request and a
            # NOTIFY), and stops them; their end is seen in the database.
            waits += [self._ended_elsewhere(child_id) for child_id in elsewhere]
        return waits

    def ended(self, counts: Mapping[machine.Outcome, int]) -> None:
        """Children ended without a run in this process (a takeover, or a cancel of a
        child nothing ran), counted once their end committed."""
        if self._rt.telemetry is not None:
            self._rt.telemetry.finished(counts)

    def _ended_elsewhere(self, child_id: int) -> asyncio.Event:
        """Set once the child, run by another host, is terminal (watched for at most
        ``release_drain_s`` and a little more: a drain gives up after that anyway).

        Woken by the notices of that host's commits (its NOTIFY), and looked at again
        every half second without news."""
        ended = asyncio.Event()
        self._rt.background(self._watch_elsewhere(child_id, ended))
        return ended

    async def _watch_elsewhere(self, child_id: int, ended: asyncio.Event) -> None:
        rt = self._rt
        loop = asyncio.get_running_loop()
        deadline = loop.time() + rt.config.release_drain_s + 1
        with rt.notices.following(child_id):
            while loop.time() < deadline:
                seen = rt.notices.version(child_id)
                try:
                    child = await rt.db.read_now(lambda c: queries.child_by_id(c, child_id))
                except errors.DelegationError:  # busy or away: looked at again
                    child = None
                else:
                    if child is None or child.terminal:
                        ended.set()
                        return
                left = min(_ELSEWHERE_FALLBACK_S, deadline - loop.time())
                try:
                    async with asyncio.timeout(max(left, 0)):
                        await rt.notices.moved(child_id, seen)
                except TimeoutError:
                    continue
                except errors.HostClosing:
                    return

    @staticmethod
    async def drain(waits: list[asyncio.Event], timeout: float) -> None:
        if not waits:
            return
        pending = [asyncio.ensure_future(w.wait()) for w in waits]
        _, late = await asyncio.wait(pending, timeout=timeout)
        for waiter in late:
            waiter.cancel()

    async def suspend_all(self) -> list[int]:
        """Stop every local run without a state change; leased ones resume at next boot.

        A run that ignores its cancellation is waited for ``release_drain_s`` at most:
        close goes on without it (its later writes are refused), as a crash would.
        Returns the children whose recorded process ended with their stopped run.
        """
        running = list(self.runs)
        for local in running:
            local.suspend()
        tasks = [lo.task for lo in running if lo.task is not None]
        if not tasks:
            return []
        _, stuck = await asyncio.wait(tasks, timeout=self._rt.config.release_drain_s)
        if stuck:
            log.warning(
                "%d child runs ignored cancellation at close",
                len(stuck),
                extra={"action": "child_runs_stuck_at_close"},
            )
        return [lo.child_id for lo in running if lo.tracked and lo.task in tasks and lo.task.done()]


def _deadline_s(request: object) -> float | None:
    options = getattr(request, "options", None)
    return admission.deadline_seconds(options if isinstance(options, ExecutionOptions) else None)
