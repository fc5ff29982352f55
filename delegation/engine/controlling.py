"""The host's own controls of its children, whatever their grant (an operator's, a
person's): :class:`HostControls`, a base of :class:`~delegation.engine.api.Engine`.

They cancel or steer exactly one execution, answer a child's input request, send an event
to a conversation (design §21), set the admission policies (design §22) and rewind a
conversation under its live lease (design §35). Each writes
one use case, then does what must follow its commit: a run stopped, a steer delivered, a
waiting child woken, the admission pump run. The control watcher applies an operator's
request from another process through the same methods
(:mod:`delegation.engine.operators`).
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable

from delegation.config import AdmissionPolicy, parse_scope
from delegation.engine.admitting import Admitting
from delegation.engine.methods import ChildMethods
from delegation.engine.runtime import Runtime, Use
from delegation.engine.starting import Starting
from delegation.engine.supervisor import Supervisor
from delegation.engine.waking import Waking
from delegation.usecases import admission, operating, reservation, service, waiting
from delegation.wire import Result, SteerResult


@dataclasses.dataclass(frozen=True)
class ControlParts:
    """The parts of one engine its host's controls act through, handed over once."""

    rt: Runtime
    supervisor: Supervisor
    methods: ChildMethods
    waking: Waking
    admitting: Admitting
    starting: Starting
    require_open: Callable[[], None]  # raises StoreError unless the engine is open


class HostControls:
    """The host's own controls (see the module), on the parts it is given at init."""

    def __init__(self, parts: ControlParts) -> None:
        self._control_parts = parts

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
        parts = self._control_parts
        parts.require_open()
        child = await parts.rt.write(Use(service.cancel_exact, conversation_id, run_id, reason))
        if not child.terminal:
            waits = await parts.supervisor.stop([child.id])
            await parts.methods.confirm_cancelled(child.id, waits)
        return await parts.supervisor.answers.page(child.id, 0, strict=False)

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
        parts = self._control_parts
        parts.require_open()
        rid = request_id or f"host-{secrets.token_hex(8)}"
        use = Use(service.steer_exact, parts.rt.config, conversation_id, run_id, rid, message)
        outcome = await parts.rt.write(use)
        parts.methods.deliver_steer(outcome)
        return outcome.result

    # --- a child that waits (design §21) ------------------------------------------------

    async def set_admission(self, scope: str, policy: AdmissionPolicy | None) -> None:
        """Store the admission policy of ``scope`` (``runner:R``, ``extension:R/E``,
        ``preset:R/E/P``, ``parent:C``), or remove it with None (design §22). Every host
        of the database applies it within a second; this one at once.

        Raises:
            ValueError: the scope is not spelled as above.
        """
        parts = self._control_parts
        parts.require_open()
        parse_scope(scope)
        await parts.rt.write(Use(admission.stored_policy, scope, policy))
        await parts.admitting.refresh()
        parts.admitting.soon()

    async def admission(self) -> list[admission.ScopeUse]:
        """Every admission policy, with the slots its scope holds and its queue now."""
        parts = self._control_parts
        parts.require_open()
        return await parts.rt.db.read(admission.listing)

    async def answer_input(
        self,
        conversation_id: str,
        input_id: str,
        *,
        decision: str | None = None,
        text: str | None = None,
        run_id: str | None = None,
        request_id: str | None = None,
    ) -> Result:
        """The host's own answer to a child's input request (a person's, an operator's),
        whatever its grant: ``decision`` one of the request's options (an approval's
        ``approve`` or ``deny``), or ``text`` for a request without options. Idempotent
        per ``request_id`` (a fresh one if None); returns the child's Result.

        Raises the refusals of ``child.input``: ``InputUnknown``, ``InputAnswered``,
        ``InputInvalid``, ``InputClosed``; ``ChildNotFound`` for no such child.
        """
        parts = self._control_parts
        parts.require_open()
        rid = request_id or f"host-{secrets.token_hex(8)}"
        use = Use(
            waiting.answer_exact, conversation_id, run_id, input_id, decision or "", text or "",
            rid,
        )  # fmt: skip
        delivered = await parts.rt.write(use)
        parts.waking.delivered(delivered)
        return await parts.supervisor.answers.page(delivered.child_id, 0, strict=False)

    async def send_event(
        self,
        conversation_id: str,
        key: str,
        payload: object = None,
        *,
        idempotency_key: str | None = None,
    ) -> bool:
        """Send the event ``key`` to a conversation (design §21): a wait of its newest
        execution for ``key`` gets ``payload`` (anything msgspec encodes), now if one
        waits, else the first that asks. Among events not taken yet the first sent with
        a key wins, and an ``idempotency_key`` is sent once: False when this send
        changed nothing.

        Raises:
            errors.ChildNotFound: no such conversation.
            errors.EventTooLarge: a payload over ``max_step_bytes`` once encoded.
            errors.EventBufferFull: ``max_buffered_events`` wait to be taken already.
        """
        parts = self._control_parts
        parts.require_open()
        body = operating.encoded_payload(payload)
        config = parts.rt.config
        use = Use(waiting.send_event, config, conversation_id, key, body, idempotency_key)
        delivered = await parts.rt.write(use)
        parts.waking.delivered(delivered)
        return delivered.accepted

    async def rewind_child(
        self,
        conversation_id: str,
        *,
        run_id: str,
        step: str | None = None,
        request_id: str | None = None,
    ) -> Result:
        """Run the conversation again from its ended execution ``run_id`` (design §35): a
        new execution seeded with the steps it recorded before ``step`` (every step when
        None) and the events committed with them, asking what it asked, under the live
        lease the conversation's newest execution holds; idempotent per ``request_id``
        (a fresh one if None). Returns the new execution's first Result once admitted
        (or queued), as ``child.start`` does.

        Raises:
            errors.ChildNotFound: no such conversation.
            errors.RewindNoAuthority: its newest execution holds no live lease.
            errors.RewindRunUnknown: ``run_id`` is not an execution of it (or purged).
            errors.ActiveSubmission: an execution of it has not ended.
            errors.RewindStepUnknown: ``run_id`` recorded no step ``step``.
        """
        parts = self._control_parts
        parts.require_open()
        rid = request_id or f"host-{secrets.token_hex(8)}"
        return await parts.starting.rewind(reservation.RewindTo(conversation_id, run_id, step, rid))
