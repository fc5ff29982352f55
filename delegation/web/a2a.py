"""An A2A face over children (design §29): the official ``a2a-sdk``'s ``RequestHandler``,
ours, over the database (the ``a2a`` extra).

Every answer is read from the database, never from the SDK's in-memory task store or
agent executor, so every server on a PostgreSQL database answers alike and a restart
forgets nothing. Identity: a task is an execution (``Task.id`` its ``runId``, its
``context_id`` the ``conversationId``); event ``n`` is a Message ``"{runId}:n"`` with
``metadata.sequence``; the output is the artifact ``"{runId}:output"``. States are
:func:`task_state`'s table.

* **Writes are operator controls.** Answering an input request, steering and cancelling
  go through :class:`~delegation.operator.Operator`, judged when given and applied by
  whichever host owns the child, exactly as ``delegation input/steer/cancel``. A
  SendMessage's ``message_id`` is the control's request id (hashed when it is not a
  valid id), so the same message twice is one answer and answers its first outcome.
* **A subscription loses nothing.** SubscribeToTask and SendStreamingMessage give the
  Task with the first page of its events (``metadata.sequence`` = N), then exactly the
  events after N as status updates, as they commit, then the artifact and the terminal
  status, and end. A reconnecting client is given the whole sequence again, paged.
* **Bounded.** A history is one page (``PAGE`` events, ``PAGE_BYTES``); a list page is at
  most ``MAX_PAGE`` tasks from at most ``MAX_SCAN`` rows; the SDK's event stream takes a
  page only as its client reads (§9, §18). A subscription takes a place among the web
  app's ``MAX_STREAMS`` (its request's :class:`Slot`); the controls, which wait for their
  outcome, run on ``CONTROL_THREADS`` threads of their own, never the pool the reads use.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn, TypeVar

import msgspec
from a2a.server.context import ServerCallContext
from a2a.server.events.event_queue import Event as Streamed
from a2a.server.request_handlers.request_handler import RequestHandler
from a2a.types.a2a_pb2 import (
    AgentCard,
    Artifact,
    CancelTaskRequest,
    DeleteTaskPushNotificationConfigRequest,
    GetExtendedAgentCardRequest,
    GetTaskPushNotificationConfigRequest,
    GetTaskRequest,
    ListTaskPushNotificationConfigsRequest,
    ListTaskPushNotificationConfigsResponse,
    ListTasksRequest,
    ListTasksResponse,
    Message,
    Part,
    Role,
    SendMessageRequest,
    SubscribeToTaskRequest,
    Task,
    TaskArtifactUpdateEvent,
    TaskPushNotificationConfig,
    TaskState,
    TaskStatus,
    TaskStatusUpdateEvent,
)
from a2a.utils.errors import (
    A2AError,
    InternalError,
    InvalidParamsError,
    PushNotificationNotSupportedError,
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)

from delegation import errors
from delegation._struct import I64_MAX
from delegation.operator import APPLY_WAIT_S, Operator
from delegation.records import ChildSummary
from delegation.usecases.follow import PASSING, Wake, pages
from delegation.usecases.inspector import PAGE, ChildPage, Inspector
from delegation.usecases.views import number
from delegation.web.stream import StreamCount
from delegation.wire import Event, InputRequest, valid_id

T = TypeVar("T")

CANCEL_WAIT_S = 10.0  # a CancelTask waits this long for the run to stop (then WORKING)
MAX_PAGE = 100  # tasks one ListTasks page holds at most (50 unless asked)
MAX_SCAN = 1_000  # rows one ListTasks page reads at most looking for its state
SCAN_BATCH = 200  # rows one read of that scan takes
CLIP = 2_000  # characters of an error or output a ListTasks page gives (GetTask: whole)
ANSWERS = ("input", "steer")  # the controls a SendMessage gives
CONTROL_THREADS = 4  # controls given (and waited for) at once; more wait their turn
SLOT = "delegation.a2a.slot"  # a request's Slot, in its scope and its call context's state
_WORKING = TaskState.TASK_STATE_WORKING
_ENDED = (
    TaskState.TASK_STATE_COMPLETED,
    TaskState.TASK_STATE_FAILED,
    TaskState.TASK_STATE_CANCELED,
    TaskState.TASK_STATE_REJECTED,
)


def task_state(child: ChildSummary) -> TaskState:
    """The A2A state of an execution: prepared/queued SUBMITTED; admitted/running/waiting
    WORKING, or INPUT_REQUIRED with an open input request (held in memory or suspended);
    done COMPLETED, FAILED with an error, REJECTED when never admitted; cancelled
    CANCELED. Never AUTH_REQUIRED."""
    if child.state == "cancelled":
        return TaskState.TASK_STATE_CANCELED
    if child.state == "done":
        if child.admitted_at is None:
            return TaskState.TASK_STATE_REJECTED
        return TaskState.TASK_STATE_FAILED if child.error else TaskState.TASK_STATE_COMPLETED
    if child.state in ("prepared", "queued"):
        return TaskState.TASK_STATE_SUBMITTED
    return TaskState.TASK_STATE_INPUT_REQUIRED if child.inputs_open else _WORKING


def event_message(child: ChildSummary, event: Event) -> Message:
    """Event ``n`` of the execution as the Message ``"{runId}:n"``: its text as the part,
    the event's fields (``sequence``, ``kind``, …) as metadata."""
    message = _message(child, str(event.sequence), event.text or event.kind)
    message.metadata.update(msgspec.to_builtins(event))
    return message


def status_of(child: ChildSummary, asks: dict[str, InputRequest]) -> TaskStatus:
    """The execution's status: INPUT_REQUIRED's message holds each open request's prompt
    and ``metadata.inputRequests`` (by inputId, as ``delegation show --json``); FAILED,
    REJECTED and CANCELED say why."""
    state = task_state(child)
    if state == TaskState.TASK_STATE_INPUT_REQUIRED and asks:
        message = _message(child, "input", *(ask.prompt or ask.kind for ask in asks.values()))
        message.metadata.update({"inputRequests": msgspec.to_builtins(asks)})
        return TaskStatus(state=state, message=message)
    why = child.error or (child.cancel_reason or "" if state in _ENDED else "")
    if why and state != TaskState.TASK_STATE_COMPLETED:
        return TaskStatus(state=state, message=_message(child, "status", why))
    return TaskStatus(state=state)


def artifact_of(child: ChildSummary) -> Artifact:
    return Artifact(
        artifact_id=f"{child.run_id}:output", name="output", parts=[Part(text=child.output)]
    )


def task_of(
    child: ChildSummary,
    events: Sequence[Event] = (),
    asks: dict[str, InputRequest] | None = None,
    *,
    artifacts: bool = True,
) -> Task:
    """The execution as a Task: its status, ``events`` as its history, its output as an
    artifact; ``metadata`` has ``sequence`` (its last event given), ``state`` (ours) and
    who runs it."""
    task = Task(
        id=child.run_id, context_id=child.conversation_id, status=status_of(child, asks or {})
    )
    task.history.extend(event_message(child, event) for event in events)
    if artifacts and child.output:
        task.artifacts.append(artifact_of(child))
    sequence = events[-1].sequence if events else 0
    task.metadata.update(
        {"sequence": sequence, "state": child.state, "profile": child.profile}
        | {"extensionId": child.extension_id, "parentRunId": child.parent_run_id}
    )
    return task


def control_id(message_id: str) -> str:
    """A SendMessage's ``message_id`` as a control's request id: itself when it is a valid
    id, else ``a2a-`` and its hash (the same message id, the same request id)."""
    if valid_id(message_id):
        return message_id
    return "a2a-" + hashlib.sha256(message_id.encode("utf-8", "surrogatepass")).hexdigest()[:32]


@contextlib.contextmanager
def refusals(
    ended: type[A2AError] = UnsupportedOperationError, *, passing: bool = False
) -> Iterator[None]:
    """Our refusals as A2A's, one to one: no such child TaskNotFound (-32001); an ended
    child ``ended`` (a cancel's TaskNotCancelable, -32002; a message's
    UnsupportedOperation, -32004); the store's faults InternalError, except the busy or
    away database's (:data:`~delegation.usecases.follow.PASSING`) when ``passing`` (a
    follow's read: it tries again); every other refusal (an unknown or answered input, a
    decision not among its options, an empty steer) InvalidParams (-32602) with its
    message."""
    try:
        yield
    except (errors.ChildNotFound, errors.ChildPurged) as exc:
        raise TaskNotFoundError(str(exc)) from exc
    except errors.ChildEnded as exc:
        raise ended(str(exc)) from exc
    except PASSING as exc:
        if passing:
            raise
        raise InternalError(str(exc)) from exc
    except errors.StoreError as exc:
        raise InternalError(str(exc)) from exc
    except errors.DelegationError as exc:
        raise InvalidParamsError(str(exc), {"reason": exc.reason}) from exc


class Slot:
    """A request's place among the open ``streams``: taken by a subscription (when one is
    free), given back by the endpoint once the answer ended, however it ended."""

    def __init__(self, streams: StreamCount) -> None:
        self.streams, self.taken = streams, False

    def take(self) -> bool:
        """Whether the request holds a place (now, or already)."""
        if not self.taken and not self.streams.full():
            self.streams.open += 1
            self.taken = True
        return self.taken

    def release(self) -> None:
        if self.taken:
            self.streams.open -= 1
            self.taken = False


class Face(RequestHandler):
    """The A2A methods over the database at ``inspector.url``: reads through ``inspector``
    (woken by ``wake`` when the database moves), controls through ``operator``
    (:meth:`close` it after)."""

    def __init__(self, inspector: Inspector, operator: Operator, wake: Wake, card: AgentCard):
        self.inspector, self.operator, self.wake, self.card = inspector, operator, wake, card
        self._controls = ThreadPoolExecutor(CONTROL_THREADS, thread_name_prefix="a2a-control")

    def close(self) -> None:
        self._controls.shutdown(wait=False, cancel_futures=True)

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn`` on a worker thread: the inspector's reads block."""
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def _control(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn`` on one of the controls' own threads: the operator blocks, and waits
        for an outcome for seconds; the reads' pool (the page's too) stays free."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._controls, functools.partial(fn, *args, **kwargs))

    async def _child(self, task_id: str) -> ChildSummary:
        found = await self._call(self.inspector.by_run, task_id) if task_id else None
        if found is None:
            raise TaskNotFoundError(f"no child execution has the runId {task_id!r}")
        return found

    async def _asks(self, child: ChildSummary) -> dict[str, InputRequest]:
        if task_state(child) != TaskState.TASK_STATE_INPUT_REQUIRED:
            return {}
        return await self._call(self.inspector.input_requests, child)

    async def _task(self, child: ChildSummary, history: int = PAGE) -> Task:
        """The execution as it is now, with its newest ``history`` events (one page)."""
        page = await self._call(
            self.inspector.tail, child.conversation_id, child.run_id, max(0, min(history, PAGE))
        )
        now = page.child or child
        return task_of(now, page.events if history else [], await self._asks(now))

    # --- reads ------------------------------------------------------------------------

    async def on_get_task(self, params: GetTaskRequest, context: ServerCallContext) -> Task:
        """The task with its newest ``history_length`` events (at most one page)."""
        child = await self._child(params.id)
        history = params.history_length if params.HasField("history_length") else PAGE
        with refusals():
            return await self._task(child, history)

    async def on_list_tasks(
        self, params: ListTasksRequest, context: ServerCallContext
    ) -> ListTasksResponse:
        """The executions, newest first, of one context and one state when asked; a page
        of ``page_size`` (at most ``MAX_PAGE``) from at most ``MAX_SCAN`` rows, and the
        token of the next when more may follow. Histories only when asked for
        (``history_length``), artifacts only with ``include_artifacts``."""
        size = params.page_size if params.HasField("page_size") else 50
        if not 1 <= size <= MAX_PAGE:
            raise InvalidParamsError(f"page_size must be a whole number from 1 to {MAX_PAGE}")
        try:  # ASCII digits only, an int64 at most: a token this face gave
            before = number(params.page_token, "page_token", 1, I64_MAX, 0) or None
        except errors.InputError as exc:
            raise InvalidParamsError(f"{exc} (a next_page_token as given)") from exc
        history = params.history_length if params.HasField("history_length") else 0
        found: list[ChildSummary] = []
        scanned, more = 0, True
        while len(found) < size and scanned < MAX_SCAN and more:
            # By state: a batch of rows at a time; else just the rows the page needs.
            limit = min(SCAN_BATCH, MAX_SCAN - scanned) if params.status else size - len(found)
            batch = await self._call(
                self.inspector.listing, params.context_id or None, before, limit, CLIP
            )
            more = len(batch) == limit
            scanned += len(batch)
            for n, child in enumerate(batch, 1):
                before = child.id
                if not params.status or task_state(child) == params.status:
                    found.append(child)
                if len(found) == size:
                    more = more or n < len(batch)
                    break
        tasks = []
        for child in found:  # the rows as listed: no second read of each
            events = []
            if history > 0:
                events = await self._call(self.inspector.newest, child.id, min(history, PAGE))
            task = task_of(child, events, await self._asks(child))
            if not params.include_artifacts:
                del task.artifacts[:]
            tasks.append(task)
        token = str(before) if more and before is not None else ""
        return ListTasksResponse(tasks=tasks, next_page_token=token, page_size=size)

    # --- controls ---------------------------------------------------------------------

    async def on_cancel_task(self, params: CancelTaskRequest, context: ServerCallContext) -> Task:
        """Cancel as ``delegation cancel`` does, then wait up to ``CANCEL_WAIT_S`` for the
        run to stop: CANCELED once it did (our two phases), WORKING until then.

        Raises:
            TaskNotFoundError: no such execution.
            TaskNotCancelableError: it had ended.
        """
        child = await self._child(params.id)
        if child.terminal:
            raise TaskNotCancelableError(f"the task has ended ({child.state})")
        with refusals(TaskNotCancelableError):
            await self._control(self.operator.cancel, child.conversation_id, child.run_id)
            await self._control(
                self.operator.wait_ended, child.conversation_id, child.run_id, CANCEL_WAIT_S
            )
            return await self._task(child, 0)

    async def on_message_send(self, params: SendMessageRequest, context: ServerCallContext) -> Task:
        """Answer the task's open input request (INPUT_REQUIRED) or steer it (otherwise),
        once per ``message_id``; the task once the owning host applied it (or as it is
        after ``APPLY_WAIT_S``, no host having applied it yet)."""
        child = await self._give(params.message)
        with refusals():
            return await self._task(child, 0)

    async def on_message_send_stream(
        self, params: SendMessageRequest, context: ServerCallContext
    ) -> AsyncGenerator[Streamed, None]:
        """:meth:`on_message_send`, then the task followed as :meth:`on_subscribe_to_task`
        (refused before the message is given when no stream is free)."""
        _place(context)
        child = await self._give(params.message)
        async for streamed in self._follow(child):
            yield streamed

    async def _give(self, message: Message) -> ChildSummary:
        """Give ``message`` to its task as an answer or a steer (the same ``message_id``
        again: the control it gave first, whatever the task's state now) and wait for
        the outcome.

        Raises:
            UnsupportedOperationError: no task id (children are started by their
                extension, never here), or the task has ended.
            TaskNotFoundError, InvalidParamsError: as :func:`refusals` maps ours.
        """
        if not message.task_id:
            raise UnsupportedOperationError(
                "a child is started by its extension; send a message to a task (its runId)"
            )
        if not message.message_id:  # else every message without one would be one answer
            raise InvalidParamsError("a message needs its message_id (its request id)")
        child = await self._child(message.task_id)
        request_id = control_id(message.message_id)
        cid, run_id = child.conversation_id, child.run_id
        with refusals():
            first = await self._call(self.inspector.control_by_request, cid, ANSWERS, request_id)
            if first is not None and first.run_id != run_id:  # as operating.give refuses it
                raise InvalidParamsError(
                    "message_id was already used for another task of this context",
                    {"reason": errors.SteerRequestIdReused.reason},
                )
            if first is not None:  # idempotency wins, even over an ended task
                await self._control(self.operator.wait, first.id, APPLY_WAIT_S)
                return child
            if child.terminal:
                raise UnsupportedOperationError(f"the task has ended ({child.state})")
            text = "".join(part.text for part in message.parts if part.HasField("text"))
            asks = await self._asks(child)
            if not asks:
                await self._control(self.operator.steer, cid, text, run_id, request_id=request_id)
                return child
            chosen = str(_meta(message, "inputId") or next(iter(asks)))
            ask = asks.get(chosen)
            decision = str(_meta(message, "decision") or "")
            if not decision and ask is not None and text in ask.options:
                decision, text = text, ""
            await self._control(
                self.operator.answer_input, cid, chosen,
                decision=decision or None, text=text or None, run_id=run_id,
                request_id=request_id,
            )  # fmt: skip
        return child

    # --- streams ----------------------------------------------------------------------

    async def on_subscribe_to_task(
        self, params: SubscribeToTaskRequest, context: ServerCallContext
    ) -> AsyncGenerator[Streamed, None]:
        """The task with the first page of its events (``metadata.sequence`` = N), then
        exactly the events after N as they commit, then its artifact and terminal
        status; an ended task's whole sequence the same way. With ``MAX_STREAMS`` open
        already, InternalError (-32603), as the page's 503: try again later."""
        _place(context)
        child = await self._child(params.id)
        async for streamed in self._follow(child):
            yield streamed

    async def _follow(self, child: ChildSummary) -> AsyncIterator[Streamed]:
        cid, run_id = child.conversation_id, child.run_id

        async def read(after: int, limit: int) -> ChildPage:
            with refusals(passing=True):  # a busy or away database: pages() tries again
                return await self._call(self.inspector.page, cid, run_id, after, limit)

        said: tuple[TaskState, tuple[str, ...]] | None = None
        last: ChildPage | None = None
        async for last in pages(read, self.wake, 0, PAGE):
            now = last.child
            if now is None:  # purged meanwhile
                return
            state = task_state(now)
            asks = await self._asks(now)
            if said is None:
                yield task_of(now, last.events, asks)
            else:  # an event's own state is not kept: WORKING, the current one after
                for event in last.events:
                    status = TaskStatus(state=_WORKING)
                    status.message.CopyFrom(event_message(now, event))
                    yield _update(now, status)
                if last.events:
                    said = (_WORKING, ())  # what the client saw last
                if state not in _ENDED and said != (state, tuple(asks)):
                    yield _update(now, status_of(now, asks))
            said = (state, tuple(asks))
        if last is None or last.child is None or not last.done:
            return  # the server is stopping: the client subscribes again
        ended = last.child
        if ended.output:
            yield TaskArtifactUpdateEvent(
                task_id=run_id, context_id=cid, artifact=artifact_of(ended), last_chunk=True
            )
        yield _update(ended, status_of(ended, {}))  # v1.0 has no `final`: the stream ends

    # --- what this face does not do ---------------------------------------------------

    async def on_create_task_push_notification_config(
        self, params: TaskPushNotificationConfig, context: ServerCallContext
    ) -> TaskPushNotificationConfig:
        _no_push()

    async def on_get_task_push_notification_config(
        self, params: GetTaskPushNotificationConfigRequest, context: ServerCallContext
    ) -> TaskPushNotificationConfig:
        _no_push()

    async def on_list_task_push_notification_configs(
        self, params: ListTaskPushNotificationConfigsRequest, context: ServerCallContext
    ) -> ListTaskPushNotificationConfigsResponse:
        _no_push()

    async def on_delete_task_push_notification_config(
        self, params: DeleteTaskPushNotificationConfigRequest, context: ServerCallContext
    ) -> None:
        _no_push()

    async def on_get_extended_agent_card(
        self, params: GetExtendedAgentCardRequest, context: ServerCallContext
    ) -> AgentCard:
        return self.card


def _place(context: ServerCallContext) -> None:
    """Take the request's place among the open streams (none to take: not served by the
    endpoint's guard, a test's direct call).

    Raises:
        InternalError: every place is taken.
    """
    slot = context.state.get(SLOT)
    if isinstance(slot, Slot) and not slot.take():
        raise InternalError("too many open streams: try again later")


def _no_push() -> NoReturn:
    raise PushNotificationNotSupportedError("push notifications are off: subscribe instead")


def _message(child: ChildSummary, suffix: str, *texts: str) -> Message:
    return Message(
        message_id=f"{child.run_id}:{suffix}",
        context_id=child.conversation_id,
        task_id=child.run_id,
        role=Role.ROLE_AGENT,
        parts=[Part(text=text) for text in texts],
    )


def _update(child: ChildSummary, status: TaskStatus) -> TaskStatusUpdateEvent:
    return TaskStatusUpdateEvent(
        task_id=child.run_id, context_id=child.conversation_id, status=status
    )


def _meta(message: Message, name: str) -> Any:
    """A message's metadata value ``name`` (None when absent)."""
    return message.metadata[name] if name in message.metadata else None  # noqa: SIM401
