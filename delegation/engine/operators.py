"""Operator control from another process (design §11), on the host's side.

``delegation cancel``, ``delegation steer``, ``delegation input`` and ``delegation send``
(design §21) record a control request in the database; the host that owns the file
watches it (``PRAGMA data_version``, see :class:`delegation.store.sqlite.watch.FileWatch`),
applies each pending request as its own ``cancel_child`` (the cancels pending together in
one transaction), ``steer_child``, ``answer_input`` or ``send_event``, and records what
happened. A host that was not
running applies them at its next boot. Applying twice is harmless: a cancel of a
finished child returns it unchanged, and a steer's request id makes it idempotent, so
a host that dies between applying and recording does no harm by applying again.

Nothing it meets stops it (design §18): its watch never raises (a bad notice or a failed
question is logged once and counts as "something may have moved"), a read that fails is
logged once until one succeeds again, and a loop that fails anyway is logged and run
again (:func:`delegation.engine.notices.keep_running`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

from delegation import errors
from delegation.engine.notices import keep_running
from delegation.engine.runtime import Runtime, Use
from delegation.engine.supervisor import Supervisor
from delegation.records import ChildRecord
from delegation.store.controls import (
    Cancel,
    ControlRecord,
    EventSend,
    InputAnswer,
    Rewind,
    Steer,
    Unpin,
    decoded,
)
from delegation.store.watch import Watch
from delegation.usecases import maintenance
from delegation.wire import Result, SteerResult

# The engine's own steer of one execution (Engine.steer_child).
SteerChild = Callable[[str, str, str | None, str | None], Awaitable[SteerResult]]


class Waiting(Protocol):
    """The engine's answer and event for a waiting child (design §21), and what to do
    when another host committed something a wait here may want."""

    async def answer(self, record: ControlRecord, answer: InputAnswer) -> Result: ...

    async def send(self, record: ControlRecord, event: EventSend) -> bool: ...

    async def unpin(self, record: ControlRecord) -> ChildRecord: ...

    async def rewind(self, record: ControlRecord, rewind: Rewind) -> Result: ...

    async def from_other_hosts(self) -> None: ...


log = logging.getLogger("delegation.controls")

OPERATOR_CANCELLED = maintenance.OPERATOR_CANCELLED
WATCH_INTERVAL_S = 0.1  # well inside the 1 s an operator may wait


class ControlWatcher:
    """Applies the operators' control requests of one engine's database."""

    def __init__(
        self,
        rt: Runtime,
        supervisor: Supervisor,
        steer_child: SteerChild,
        watch: Watch,
        waiting: Waiting | None = None,
    ) -> None:
        self._rt = rt
        self._supervisor = supervisor
        self._steer_child = steer_child
        self._watch = watch
        self._waiting = waiting
        self._task: asyncio.Task[None] | None = None
        self._applying: set[int] = set()
        self._running: set[asyncio.Task[None]] = set()
        self._unread: set[str] = set()  # the reads failing now (each logged once)

    def start(self) -> None:
        loop = keep_running("the control watcher", self._loop)
        self._task = asyncio.create_task(loop, name="delegation-controls")

    async def stop(self) -> None:
        """Stop watching; requests being applied are cancelled (applied again at boot)."""
        tasks = [t for t in (self._task, *self._running) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._watch.close()

    async def _loop(self) -> None:
        await self._apply_pending()  # left by operators while no host ran
        while True:
            await self._watch.wait()
            await self._apply_pending()
            if self._rt.db.shared:
                await self._from_other_hosts()

    async def _from_other_hosts(self) -> None:
        """Several hosts (design §12): steers another host accepted for a child running
        here are handed to its run, and followers of children another host runs wake."""
        notices = self._rt.notices
        moved = self._watch.moved()
        if moved is None:
            notices.bump_all()
        else:
            notices.bump(moved)
        if self._waiting is not None:
            try:
                await self._waiting.from_other_hosts()
            except errors.DelegationError as exc:
                self._unread_now("waits_unread", "waits", exc)
        local = self._supervisor.steerable()
        if not local:
            return
        try:
            steers = await self._rt.db.read(lambda c: maintenance.undelivered_steers(c, local))
        except errors.DelegationError as exc:
            self._unread_now("steers_unread", "steers", exc)
            return
        self._read_again("steers_unread")
        for child_id, steer_id, message in steers:
            self._supervisor.deliver(child_id, steer_id, message)  # each steer id at most once

    async def _apply_pending(self) -> None:
        instance_id = self._rt.instance_id
        try:
            pending = await self._rt.db.read(lambda c: maintenance.pending_controls(c, instance_id))
        except errors.DelegationError as exc:  # a busy or closing store: next change
            self._unread_now("controls_unread", "control requests", exc)
            return
        self._read_again("controls_unread")
        fresh = [control for control in pending if control.id not in self._applying]
        self._applying.update(control.id for control in fresh)
        cancels = [control for control in fresh if control.action == "cancel"]
        if cancels:  # applied together: a lease expiry across hosts asks thousands
            self._run(self._cancel(cancels))
        for control in fresh:
            if control.action != "cancel":
                self._run(self._apply(control))

    def _run(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    def _unread_now(self, action: str, what: str, exc: errors.DelegationError) -> None:
        """A read failed: logged the first time of a run of failures (read again at
        the next change or poll)."""
        if action not in self._unread:
            self._unread.add(action)
            log.warning("%s not read: %s", what, exc, extra={"action": action})

    def _read_again(self, action: str) -> None:
        if action in self._unread:
            self._unread.discard(action)
            log.info("read again after failures", extra={"action": f"{action}_ended"})

    async def _apply(self, control: ControlRecord) -> None:
        try:
            outcome = await self._outcome(control)
            use = Use(maintenance.control_applied, control.id, json.dumps(outcome))
            await self._rt.write(use)
            log.info(
                "control request applied",
                extra={"action": "control_applied", "control": control.action, **outcome},
            )
        except errors.DelegationError as exc:
            log.warning("control request not applied: %s", exc, extra={"action": "control_failed"})
        except Exception:  # not ours to end the watcher: tried again at the next change
            log.exception("control request not applied", extra={"action": "control_failed"})
        finally:
            self._applying.discard(control.id)

    async def _cancel(self, cancels: list[ControlRecord]) -> None:
        """Request the cancellations and record them applied at once, in one transaction
        (an operator learns within a second that the host has them), then stop the
        children as ``cancel_child`` does, waiting up to ``release_drain_s`` for them."""
        try:
            stopping = await self._rt.write(Use(maintenance.apply_cancels, cancels))
            log.info(
                "control request applied",
                extra={"action": "control_applied", "control": "cancel", "count": len(cancels)},
            )
            waits = await self._supervisor.stop([child.id for child in stopping])
            await self._supervisor.drain(waits, self._rt.config.release_drain_s)
            if not all(wait.is_set() for wait in waits):
                raise errors.CancelUnconfirmed()
        except errors.DelegationError as exc:
            log.warning("control request not applied: %s", exc, extra={"action": "control_failed"})
        except Exception:  # not ours to end the watcher: tried again at the next change
            log.exception("control request not applied", extra={"action": "control_failed"})
        finally:
            self._applying.difference_update(control.id for control in cancels)

    async def _outcome(self, record: ControlRecord) -> dict[str, Any]:
        """Apply the control as the engine's own call; a refusal is its outcome."""
        try:
            control = decoded(record.action, record.message)  # decoded once, matched by type
            match control:
                case Steer(message=message):
                    steered = await self._steer_child(
                        record.conversation_id, message, record.run_id, record.request_id
                    )
                    return {"outcome": steered.outcome, "reason": steered.reason}
                case InputAnswer() | EventSend() | Unpin() | Rewind() if self._waiting is None:
                    raise errors.InternalError()
                case InputAnswer():
                    assert self._waiting is not None
                    return {"state": _state_of(await self._waiting.answer(record, control))}
                case EventSend():
                    assert self._waiting is not None
                    return {"accepted": await self._waiting.send(record, control)}
                case Unpin():
                    assert self._waiting is not None
                    return {"state": (await self._waiting.unpin(record)).state}
                case Rewind():
                    assert self._waiting is not None
                    rewound = await self._waiting.rewind(record, control)
                    return {"rewoundAs": rewound.run_id, "state": _state_of(rewound)}
                case Cancel():  # applied together with the other cancels
                    raise errors.InternalError()
        except errors.DelegationError as exc:
            return {"failure": str(exc), "failureReason": exc.reason}


def _state_of(result: Result) -> str:
    if result.cancelled:
        return "cancelled"
    if result.done:
        return "done"
    return "waiting" if result.input_requests else "running"
