"""Waking the children this host owns that wait (design §21).

A child is suspended by its run (:meth:`LocalRun.suspend_waiting`): its task ends and it
holds nothing but rows. It is this host's still (``engine_instance_id``), due to wake at
``wake_at``: the earliest of its timers, or now once an answer or its event came. One
timer sits at the earliest ``wake_at`` of this host's waiting children; a commit here
that makes one due wakes it at once; another host's (PostgreSQL) is seen by the control
watcher (``NOTIFY``), and a once-a-second look catches any notice lost. To wake is to
resume: ``waiting`` → ``running`` here with a ``recovery`` event, and the run is
prepared again (``prepare(recovery)``), its journal replaying what it recorded.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from delegation import errors
from delegation.engine.resuming import Resuming
from delegation.engine.runtime import OWED_PAUSE_MAX_S, Runtime, Use, refused, unreadable
from delegation.engine.supervisor import Supervisor
from delegation.engine.timers import WAKE_JOB, Timers
from delegation.records import ChildRecord
from delegation.store.controls import ControlRecord, EventSend, InputAnswer, Rewind
from delegation.usecases import versions, waiting
from delegation.wire import Result

log = logging.getLogger("delegation.engine")

BATCH = 500  # children woken in one transaction


class Waking:
    """The wake-ups of one engine's waiting children (see the module)."""

    def __init__(
        self, rt: Runtime, supervisor: Supervisor, resuming: Resuming, timers: Timers
    ) -> None:
        self._rt = rt
        self._supervisor = supervisor
        self._resuming = resuming
        self._timers = timers
        self._soon: asyncio.Task[None] | None = None
        supervisor.on_parked = self.parked

    def parked(self, wake_at: float | None) -> None:
        """A run here suspended its child: wake it at ``wake_at`` at the latest."""
        if wake_at is not None:
            self._timers.arm_earlier(wake_at, WAKE_JOB)

    async def arm(self) -> None:
        """At the next wake-up of this host's waiting children (after a boot or a
        takeover gave it some); children pinned to this host's version that no live
        host of it holds are taken first, due now (design §34)."""
        rt = self._rt
        host = versions.HostVersion.of(rt.config)
        if host.version is not None:
            await rt.write(Use(versions.claim_pinned, rt.instance_id, host))
        at = await rt.db.read(lambda c: waiting.next_wake(c, rt.instance_id))
        self._timers.arm(at, WAKE_JOB)

    async def wake_due(self) -> None:
        """Wake every waiting child of this host that is due, then re-arm at the next."""
        rt = self._rt
        while True:
            host = versions.HostVersion.of(rt.config)
            woken = await rt.write(Use(waiting.wake_due, rt.instance_id, BATCH, host))
            unreadable(woken.unreadable)
            refused(woken.refused)
            self._resuming.wake(woken.resumable)
            if woken.settled < BATCH:
                break
        self._timers.arm(woken.next_wake, WAKE_JOB)

    async def wake_on_time(self) -> None:
        """The wake timer: a database busy or away puts the wake-up off, never drops it."""
        try:
            await self.wake_due()
        except (errors.DatabaseBusy, errors.StoreUnavailable) as exc:
            log.warning("waiting children not woken yet: %s", exc, extra={"action": "wake_delayed"})
            self._timers.arm(self._rt.clock.now() + OWED_PAUSE_MAX_S, WAKE_JOB)
        except (errors.HostClosing, errors.HostFenced):
            return

    async def unpin(self, conversation_id: str, run_id: str | None) -> ChildRecord:
        """Let the current code resume a pinned child (design §34): held here, woken now.

        Raises:
            errors.ChildNotFound, errors.ChildEnded, errors.NotPinned: it cannot be.
        """
        rt = self._rt
        child = await rt.write(Use(versions.unpin_exact, conversation_id, run_id, rt.instance_id))
        self.soon()
        return child

    def soon(self) -> None:
        """Something made a child of this host due (a commit here): wake it now."""
        if self._soon is None or self._soon.done():
            self._soon = self._rt.background(self.wake_on_time())

    def delivered(self, delivered: waiting.Delivered) -> None:
        """An answer or an event committed here for a child: its run here reads again,
        or a child of this host waiting for it wakes now. Another host that runs or
        owns it was woken by the database in the same commit."""
        if self._notify_waits(delivered.child_id):
            return
        if delivered.owner in (self._rt.instance_id, None):
            self.soon()  # waiting here (or suspended since it was read): due now

    async def from_other_hosts(self) -> None:
        """Several hosts: what another host committed may concern runs here that wait in
        memory (they read again) and children of this host that wait (due ones wake)."""
        self._notify_all_waits()
        await self.wake_on_time()

    def _notify_waits(self, child_id: int) -> bool:
        """Tell a run here that something it waits for may have come; False when the
        child runs nowhere here."""
        local = self._supervisor.runs.get(child_id)
        if local is None or local.ctx is None or local.parked:
            return False
        local.ctx.wake_waits()
        return True

    def _notify_all_waits(self) -> None:
        """Every run here reads its waits again (another host committed something)."""
        for local in self._supervisor.runs:
            if local.ctx is not None and not local.parked:
                local.ctx.wake_waits()


AnswerInput = Callable[..., Awaitable[Result]]
SendEvent = Callable[..., Awaitable[bool]]
RewindChild = Callable[..., Awaitable[Result]]


class OperatorWaits:
    """What the control watcher applies for ``delegation input``, ``send``, ``unpin`` and
    ``rewind`` (the engine's own ``answer_input``, ``send_event``, ``unpin`` and
    ``rewind_child``), and its look at waits after another host's commits."""

    def __init__(
        self,
        answer_input: AnswerInput,
        send_event: SendEvent,
        waking: Waking,
        rewind_child: RewindChild,
    ) -> None:
        self._answer_input = answer_input
        self._send_event = send_event
        self._waking = waking
        self._rewind_child = rewind_child

    async def answer(self, record: ControlRecord, answer: InputAnswer) -> Result:
        return await self._answer_input(
            record.conversation_id,
            answer.input_id,
            decision=answer.decision,
            text=answer.text,
            run_id=record.run_id,
            request_id=record.request_id or None,
        )

    async def send(self, record: ControlRecord, event: EventSend) -> bool:
        return await self._send_event(
            record.conversation_id,
            event.key,
            event.payload,
            idempotency_key=record.request_id or None,
        )

    async def unpin(self, record: ControlRecord) -> ChildRecord:
        return await self._waking.unpin(record.conversation_id, record.run_id)

    async def rewind(self, record: ControlRecord, rewind: Rewind) -> Result:
        if record.run_id is None:  # a rewind is given for the execution it starts from
            raise errors.RewindRunUnknown()
        return await self._rewind_child(
            record.conversation_id,
            run_id=record.run_id,
            step=rewind.step,
            request_id=record.request_id or None,
        )

    async def from_other_hosts(self) -> None:
        await self._waking.from_other_hosts()
