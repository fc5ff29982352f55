"""The operator's Python door (design §33): act on children from another process.

An :class:`Operator` gives a control (cancel, steer, an answer, an event, an unpin, a
rewind) to a child of whatever host owns the database, or of none: the control is
judged against the database when given and refused at once when it cannot apply (the
same typed errors the engine raises), else recorded; the owning host applies it within
about 0.1 s (or at its next boot), and the operator waits up to ``wait`` seconds for
what happened. It never opens
an engine: it reads as :class:`~delegation.usecases.inspector.Inspector` does and writes
one short transaction per control.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from types import TracebackType

from delegation import errors
from delegation.config import EngineConfig
from delegation.records import ChildRecord, ChildSummary
from delegation.rpc import error_from_wire
from delegation.store.controls import (
    Cancel,
    Control,
    EventSend,
    InputAnswer,
    Rewind,
    Steer,
    Unpin,
)
from delegation.store.stores import open_watch, write_once
from delegation.usecases import operating
from delegation.usecases.inspector import Inspector
from delegation.usecases.operating import Outcome
from delegation.wire import Event, InputRequest

APPLY_WAIT_S = 3.0  # a live host applies a control within about 0.1 s
WATCH_S = 0.02  # how often a wait asks the database whether something committed


class Operator:
    """Controls and reads of the children in the database at ``url`` (SQLite or
    PostgreSQL), beside a live host or none. ``config``: the bounds a control is judged
    by (a steer's length, an event's size and buffer), the engine's defaults unless the
    hosts run with others. A context manager; :meth:`close` releases its connections.
    """

    def __init__(self, url: str = "sqlite:///delegation.db", *, config: EngineConfig | None = None):
        self.url = url
        self.config = config or EngineConfig()
        self.inspector = Inspector(url)

    def __enter__(self) -> Operator:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self.inspector.close()

    # --- controls ---------------------------------------------------------------------

    def cancel(
        self, conversation_id: str, run_id: str | None = None, *, wait: float = APPLY_WAIT_S
    ) -> Outcome:
        """Cancel the execution (the newest of the conversation unless ``run_id``); its
        outcome once applied (``fields["state"]`` ``cancelling`` or how it ended)."""
        return self.submit(conversation_id, Cancel(), run_id, wait=wait)

    def steer(
        self,
        conversation_id: str,
        message: str,
        run_id: str | None = None,
        *,
        request_id: str = "",
        wait: float = APPLY_WAIT_S,
    ) -> Outcome:
        """Give the running execution a new heading (once per ``request_id``)."""
        return self.submit(conversation_id, Steer(message), run_id, request_id, wait=wait)

    def answer_input(
        self,
        conversation_id: str,
        input_id: str,
        *,
        decision: str | None = None,
        text: str | None = None,
        run_id: str | None = None,
        request_id: str = "",
        wait: float = APPLY_WAIT_S,
    ) -> Outcome:
        """Answer the execution's open input request ``input_id``: ``decision`` one of
        its options (an approval's ``approve`` or ``deny``), or ``text``."""
        answer = InputAnswer(input_id, decision or "", text or "")
        return self.submit(conversation_id, answer, run_id, request_id, wait=wait)

    def send_event(
        self,
        conversation_id: str,
        key: str,
        payload: object = None,
        *,
        idempotency_key: str = "",
        wait: float = APPLY_WAIT_S,
    ) -> Outcome:
        """Send the event ``key`` with ``payload`` (any JSON) to the conversation's live
        execution, for its ``ctx.wait_event`` (once per ``idempotency_key``);
        ``fields["accepted"]`` is False when it changed nothing."""
        event = EventSend(key, payload)
        return self.submit(conversation_id, event, None, idempotency_key, wait=wait)

    def unpin(
        self, conversation_id: str, run_id: str | None = None, *, wait: float = APPLY_WAIT_S
    ) -> Outcome:
        """Let the current code resume an execution its version pinned (design §34):
        the host that holds it resumes it within about a second."""
        return self.submit(conversation_id, Unpin(), run_id, wait=wait)

    def rewind(
        self,
        conversation_id: str,
        run_id: str,
        step: str | None = None,
        *,
        request_id: str = "",
        wait: float = APPLY_WAIT_S,
    ) -> Outcome:
        """Run the conversation again from its ended execution ``run_id`` (design §35):
        a new execution seeded with the steps it recorded before ``step`` (every step
        when None), under the conversation's live lease, once per ``request_id``;
        ``fields["rewoundAs"]`` is the new execution once applied."""
        return self.submit(conversation_id, Rewind(step), run_id, request_id, wait=wait)

    def submit(
        self,
        conversation_id: str,
        control: Control,
        run_id: str | None = None,
        request_id: str = "",
        *,
        wait: float = APPLY_WAIT_S,
    ) -> Outcome:
        """Give ``control`` and wait up to ``wait`` seconds for its outcome: applied, or
        still ``pending`` (no live host applied it yet: the next one will).

        Raises:
            errors.DelegationError: refused, when given or when the host applied it
                (``ChildNotFound``, ``ChildEnded``, ``InputAnswered``, ``EventClosed`` …).
        """
        given = write_once(
            self.url,
            lambda c: operating.give(
                c, time.time(), self.config, conversation_id, run_id, control, request_id
            ),
        )
        return self.wait(given.control.id, wait)

    def wait(self, control_id: int, seconds: float = APPLY_WAIT_S) -> Outcome:
        """The control ``control_id`` once applied, or as it is after ``seconds``.

        Raises:
            errors.ChildNotFound: no such control.
            errors.DelegationError: the host refused it (the refusal it recorded).
        """
        found: list[Outcome] = []

        def settled() -> bool:
            record = self.inspector.control(control_id)
            if record is None:
                raise errors.ChildNotFound(f"control request not found: {control_id}")
            found[:] = [operating.outcome_of(record)]
            return found[0].status != "pending"

        with contextlib.closing(open_watch(self.url, WATCH_S)) as watch:
            watch.until(settled, None if math.isinf(seconds) else max(0.0, seconds))
        return refused_raised(found[0])

    def wait_ended(
        self, conversation_id: str, run_id: str | None = None, seconds: float = math.inf
    ) -> ChildRecord | None:
        """The execution once it is terminal, or as it is after ``seconds`` (None: it
        is gone)."""
        last: list[ChildRecord | None] = []

        def ended() -> bool:
            last[:] = [self.inspector.get_child(conversation_id, run_id)]
            return last[0] is None or last[0].terminal

        with contextlib.closing(open_watch(self.url, 0.05)) as watch:
            watch.until(ended, None if math.isinf(seconds) else max(0.0, seconds))
        return last[0]

    def controls(self, conversation_id: str | None = None, limit: int = 100) -> list[Outcome]:
        """The newest ``limit`` controls given (of one conversation, or all), each with
        what became of it, newest first: none disappears without a record."""
        return self.inspector.controls(conversation_id, limit)

    # --- reads ------------------------------------------------------------------------

    def children(self, *, state: str | None = None, limit: int = 100) -> list[ChildSummary]:
        """The newest ``limit`` executions (of one ``state``), as a list shows them."""
        return self.inspector.summaries(state=state, limit=limit)

    def show(self, conversation_id: str, run_id: str | None = None) -> ChildRecord | None:
        """The execution (the newest of the conversation unless ``run_id``), or None."""
        return self.inspector.get_child(conversation_id, run_id)

    def input_requests(
        self, conversation_id: str, run_id: str | None = None
    ) -> dict[str, InputRequest]:
        """The execution's open input requests by ``inputId`` (empty when none is open)."""
        record = self.inspector.get_child(conversation_id, run_id)
        return {} if record is None else self.inspector.input_requests(record)

    def events(
        self, conversation_id: str, run_id: str | None = None, after: int = 0
    ) -> Iterator[Event]:
        """Every committed event after ``after``, oldest first, read page by page."""
        return self.inspector.all_events(conversation_id, run_id, after)

    def follow(
        self, conversation_id: str, run_id: str | None = None, after: int = 0
    ) -> Iterator[Event]:
        """Every event after ``after`` as it commits, until the execution is terminal
        (runs its own event loop: call it where none runs)."""
        return self.inspector.follow(conversation_id, run_id, after)


def refused_raised(outcome: Outcome) -> Outcome:
    """``outcome``, unless the host refused it: then that refusal, as its typed error."""
    if outcome.status != "refused":
        return outcome
    error = error_from_wire(-32602, outcome.error or "refused", outcome.reason)
    error.outcome = outcome  # type: ignore[attr-defined]
    raise error
