"""A client for ``delegation serve`` (design §11): :class:`Client` (async) and :class:`SyncClient`.

One client is one runner connection: line-delimited JSON-RPC 2.0 over a Unix socket
(``serve --socket``, :meth:`Client.connect`) or the stdin/stdout of a host subprocess it
starts (``serve --stdio``, :meth:`Client.spawn`). Many calls may be in flight at once: one
reader task matches each answer to its call by id, whatever the order of the answers.

Answers are decoded strictly into the wire types. A refusal raises the
:class:`~delegation.errors.DelegationError` subclass named by its ``data.reason``, with
the host's message as ``str(error)``. A call that fails fails alone: the connection goes
on for the others, whatever the size of an answer. Calls still waiting when the
connection ends, and calls made after, fail with :class:`~delegation.errors.HostClosing`
(retry them, replaying the requestId), or with the refusal the host ended it with (a
connection past ``serve --max-connections``: :class:`~delegation.errors.ConnectionLimit`).

:class:`SyncClient` runs a :class:`Client` on an event loop of its own, in a background
thread; each of its methods blocks until the answer arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import sys
import threading
from collections.abc import (
    AsyncGenerator,
    Callable,
    Coroutine,
    Iterator,
    Mapping,
    Sequence,
)
from typing import IO, Any, Concatenate, ParamSpec, TypeVar

import msgspec

from delegation import errors, rpc
from delegation._struct import WireStruct
from delegation.client.wire import (
    READ_CHUNK,
    FollowPages,
    answers,
    encoder,
    notices,
    params_after,
    read_lines,
    unreadable,
    wire_params,
)
from delegation.codec import checked, decode
from delegation.options import ExecutionOptions
from delegation.protocol import (
    CANCEL,
    EVENTS,
    FOLLOW,
    FOLLOW_STOP,
    INPUT,
    READ,
    REGISTER,
    RELEASE,
    RUN_FINISH,
    SEND,
    START,
    STEER,
    TOOL_BEGIN,
    TOOL_END,
    FollowStop,
    Method,
    Register,
    Registration,
    RunFinish,
    ToolBegin,
    ToolEnd,
)
from delegation.wire import Event, ParamsLike, Preset, Result, SteerResult

__all__ = ["Client", "ParamsLike", "Registration", "SyncClient"]

log = logging.getLogger("delegation.client")
R = TypeVar("R")
W = TypeVar("W", bound=WireStruct)

# How long closing waits for a spawned host to exit after its input ends.
CLOSE_TIMEOUT_S = 15.0
# How many bytes of a follow's events (as they came on the wire) may wait here for its
# caller by default; past it the follow is stopped and later started again (Client.follow).
FOLLOW_BUFFER_BYTES = 16 * 1024 * 1024
# A follow starting again that finds the connection's follows all taken waits for one.
FOLLOW_AGAIN_PAUSE_S, FOLLOW_AGAIN_PAUSE_MAX_S = 0.05, 1.0


class Client:
    """One runner connection to a ``delegation serve`` host.

    Open it with :meth:`connect` or :meth:`spawn`, and close it with :meth:`close` or
    ``async with``. Every method raises the :class:`~delegation.errors.DelegationError`
    the host refused with, or :class:`~delegation.errors.HostClosing` when the
    connection ended before the answer.
    """

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        process: asyncio.subprocess.Process | None = None,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._process = process
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[msgspec.Raw]] = {}
        # Each follow's pages of events as the host pushes them, until taken.
        self._follows: dict[int, FollowPages] = {}
        self._stops: set[asyncio.Task[None]] = set()  # of follows that overflowed
        self._sending = asyncio.Lock()
        self._ended: errors.DelegationError | None = None
        self._closing = False
        self._listener = asyncio.create_task(self._listen())

    @classmethod
    async def connect(cls, socket_path: str | os.PathLike[str]) -> Client:
        """Connect to ``delegation serve --socket socket_path``."""
        path = os.fspath(socket_path)
        reader, writer = await asyncio.open_unix_connection(path, limit=READ_CHUNK)
        return cls(reader, writer)

    @classmethod
    async def spawn(
        cls,
        args: Sequence[str] = (),
        *,
        env: Mapping[str, str] | None = None,
        stderr: int | IO[Any] | None = None,
        cwd: str | os.PathLike[str] | None = None,
    ) -> Client:
        """Start ``delegation serve --stdio *args`` (e.g. ``["--db", path, "--runner",
        "scripted"]``) with this Python, and connect to its stdin and stdout. A database
        URL with a password goes in ``env`` as ``DELEGATION_DB``: ``--db`` refuses it."""
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "delegation.cli", "serve", "--stdio", *args,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=stderr, env=env, cwd=cwd, limit=READ_CHUNK,
        )  # fmt: skip
        assert process.stdin is not None
        assert process.stdout is not None
        return cls(process.stdout, process.stdin, process)

    @property
    def process(self) -> asyncio.subprocess.Process | None:
        """The host subprocess :meth:`spawn` started (None for a socket)."""
        return self._process

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection; for a spawned host, end its input, wait up to
        :data:`CLOSE_TIMEOUT_S` for it to exit (it answers the calls in flight first),
        then kill it. Calls still waiting fail with HostClosing."""
        if self._closing:
            return
        self._closing = True
        self._writer.close()
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()
        await asyncio.gather(*self._stops, return_exceptions=True)  # they send nothing now
        if self._process is not None:
            try:
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await self._process.wait()
            except TimeoutError:
                self._process.kill()
                await self._process.wait()
        await asyncio.wait({self._listener}, timeout=CLOSE_TIMEOUT_S)
        self._listener.cancel()
        await asyncio.gather(self._listener, return_exceptions=True)

    # --- runner and tool lifecycle ------------------------------------------------------

    async def register(self, runner_id: str, host_instance_id: str) -> Registration:
        """``runner.register``: must come first on a connection. The same
        ``host_instance_id`` after a restart reclaims the runner's leases."""
        return await self._ask(REGISTER, Register(runner_id, host_instance_id))

    async def begin_tool(
        self,
        *,
        run_id: str,
        conversation_id: str,
        tool_call_id: str,
        extension_id: str,
        presets: Sequence[Preset],
        workspace: str,
        policy: ExecutionOptions | None = None,
    ) -> None:
        """``tool.begin``: open a tool call that may start children from ``presets``
        in ``workspace``; ``policy`` is the parent run's own options, the ceiling of
        its children."""
        params = ToolBegin(
            run_id, conversation_id, tool_call_id, extension_id, list(presets), workspace,
            msgspec.UNSET if policy is None else policy,
        )  # fmt: skip
        params = checked(params, ToolBegin, providers=None, label="malformed params")
        await self._ask(TOOL_BEGIN, params)

    async def end_tool(self, run_id: str, tool_call_id: str) -> None:
        """``tool.end``: close a tool call opened on this connection (its leased
        children carry on under their leases)."""
        await self._ask(TOOL_END, ToolEnd(run_id, tool_call_id))

    async def finish_run(self, run_id: str, succeeded: bool = True) -> None:
        """``run.finish``: end a parent run and this runner's grants, leases and
        children of it."""
        await self._ask(RUN_FINISH, RunFinish(run_id, succeeded))

    # --- the five child methods ---------------------------------------------------------

    async def start(self, params: ParamsLike) -> Result:
        """``child.start``: start (or replay, by requestId) a child; answers once it is
        admitted, with its first page of events."""
        return await self._ask(START, wire_params(params))

    async def read(self, params: ParamsLike) -> Result:
        """``child.read``: a child's state and its events after ``params.after``."""
        return await self._ask(READ, wire_params(params))

    async def cancel(self, params: ParamsLike) -> Result:
        """``child.cancel``: cancel a child; answers once it has stopped."""
        return await self._ask(CANCEL, wire_params(params))

    async def steer(self, params: ParamsLike) -> SteerResult:
        """``child.steer``: hand a running child a message."""
        return await self._ask(STEER, wire_params(params))

    async def release(self, params: ParamsLike) -> Result:
        """``child.lease.release``: release a lease and stop its children."""
        return await self._ask(RELEASE, wire_params(params))

    async def input(self, params: ParamsLike) -> Result:
        """``child.input`` (design §21): answer a waiting child's input request
        (``inputId``, and ``decision`` or a text ``message``; ``requestId``)."""
        return await self._ask(INPUT, wire_params(params))

    async def send(self, params: ParamsLike) -> Result:
        """``child.send`` (design §33): send the event ``key`` with ``data`` (any JSON)
        to the child's conversation, for its ``ctx.wait_event``; once per ``requestId``."""
        return await self._ask(SEND, wire_params(params))

    async def follow(
        self, params: ParamsLike, *, max_buffered: int = FOLLOW_BUFFER_BYTES
    ) -> AsyncGenerator[Event]:
        """``child.follow``: every event of the child after ``params.after``, each once,
        in order, as it commits (the host pushes them: nothing polls); ends once the
        child is terminal and its last event was given. The host reads each page as a
        ``child.read``: a refusal raises what ``read`` raises, on the first page or later.

        Closing the iterator early (``aclose()``, or leaving ``contextlib.aclosing``)
        stops the follow on the host and returns once the host has answered it. Events
        are read off the connection as they arrive (other calls' answers never wait
        behind them) and wait here until taken, at most ``max_buffered`` bytes of them
        (as they came on the wire; one page always fits): past it the follow is stopped
        on the host, what came after is dropped, and once the caller has taken what
        waits, the follow starts again after the last event given. Starting again takes
        one of the connection's follows (``follow_limit``) as a new follow does: if
        others took them all meanwhile, it waits until one ends (pauses from 50 ms up
        to 1 s). A refusal (say the lease was released meanwhile) then comes from the
        follow started again, so events dropped before it are not given.
        """
        wire = wire_params(params)
        last: int | None = None  # the sequence of the last event given
        pause = FOLLOW_AGAIN_PAUSE_S
        while True:
            request_id = next(self._ids)
            pages = self._follows[request_id] = FollowPages(max_buffered)
            answer = asyncio.ensure_future(self._call(request_id, FOLLOW.name, wire))
            answer.add_done_callback(pages.end)  # after every page
            refused = False  # this follow starting again found no follow free
            try:
                while (page := await pages.get()) is not None:
                    events, size = page
                    for event in events:
                        yield event
                        last = event.sequence
                    pages.given(size)
                try:
                    decode(answer.result(), FOLLOW.result)  # a refusal raises here
                except errors.FollowLimit:
                    if last is None:  # the caller's own follow, not one started again
                        raise
                    refused = True
            finally:
                del self._follows[request_id]
                if not answer.done():
                    await self._stop_follow(request_id)
                    await asyncio.gather(answer, return_exceptions=True)
            if refused:
                log.debug("follow waits for a free one", extra={"action": "client_follow_waits"})
                await asyncio.sleep(pause)
                pause = min(pause * 2, FOLLOW_AGAIN_PAUSE_MAX_S)
                continue
            if not pages.overflowed:
                return
            log.debug("follow started again", extra={"action": "client_follow_again"})
            pause = FOLLOW_AGAIN_PAUSE_S
            if last is not None:  # (always: a page was kept before one overflowed)
                wire = params_after(wire, last)

    # --- JSON-RPC -----------------------------------------------------------------------

    async def _ask(self, method: Method[Any, W], params: Any) -> W:
        """Call ``method`` and decode its answer strictly into its result type."""
        return decode(await self.call(method.name, params), method.result)

    async def call(self, method: str, params: Any) -> msgspec.Raw:
        """Send one request (``params``: anything msgspec encodes) and wait for its
        answer: the raw JSON of its result."""
        return await self._call(next(self._ids), method, params)

    async def _call(self, request_id: int, method: str, params: Any) -> msgspec.Raw:
        if self._ended is not None:  # why it ended: HostClosing, or the host's refusal
            ended = self._ended
            raise rpc.error_from_wire(ended.rpc_code, str(ended), ended.reason)
        if self._closing:
            raise errors.HostClosing("the client is closed")
        envelope = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}
        try:
            frame = encoder.encode(envelope)
        except (TypeError, ValueError, OverflowError) as exc:
            raise errors.MalformedInput(f"malformed params: {exc}") from exc
        if len(frame) > rpc.MAX_FRAME_BYTES:  # the host would answer it with no id
            raise errors.InvalidRpcRequest("invalid request: message exceeds 4 MiB")
        future: asyncio.Future[msgspec.Raw] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            async with self._sending:
                self._writer.write(frame + b"\n")
                await self._writer.drain()
            return await future
        except OSError as exc:  # the connection broke while sending
            raise errors.HostClosing(f"the connection to the host failed: {exc}") from exc
        finally:
            self._pending.pop(request_id, None)

    async def _notify(self, method: str, params: Any) -> None:
        """Send a notification (no answer comes); nothing once the connection ended."""
        if self._ended is not None or self._closing:
            return
        frame = encoder.encode({"jsonrpc": "2.0", "method": method, "params": params})
        async with self._sending:
            self._writer.write(frame + b"\n")
            await self._writer.drain()

    async def _listen(self) -> None:
        ended: errors.DelegationError = errors.HostClosing("the host closed the connection")
        said = False  # the host said why the stream ends (an error for no call)
        try:
            async for line in read_lines(self._reader):
                if (why := self._deliver(line)) is not None:
                    ended, said = why, True
        except OSError as exc:
            if not said:
                ended = errors.HostClosing(f"the connection to the host failed: {exc}")
        finally:
            if self._closing:
                ended = errors.HostClosing("the client closed before the answer")
            self._ended = ended
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(
                        rpc.error_from_wire(ended.rpc_code, str(ended), ended.reason)
                    )
            self._pending.clear()

    def _deliver(self, line: bytes) -> errors.DelegationError | None:
        """Settle the call ``line`` answers. An error for no call (a refused peer, a
        frame the host could not read) is returned: it says why the stream ends."""
        try:
            answer = answers.decode(line)
        except (msgspec.MsgspecError, ValueError) as exc:
            log.warning("unreadable answer: %s", exc, extra={"action": "client_bad_answer"})
            answer = unreadable(line, exc)
        error = None
        if not isinstance(answer.error, msgspec.UnsetType):
            data = answer.error.data or {}
            error = rpc.error_from_wire(answer.error.code, answer.error.message, data.get("reason"))
        if answer.id is None:
            if error is None:
                self._notified(line)
            return error  # for no call: why the stream ends
        future = self._pending.pop(answer.id, None) if isinstance(answer.id, int) else None
        if future is None or future.done():
            return None  # the answer to a call its caller gave up: nobody's business
        if error is not None:
            future.set_exception(error)
        elif isinstance(answer.result, msgspec.UnsetType):
            future.set_exception(errors.InternalError("the host answered neither result nor error"))
        else:
            future.set_result(answer.result)
        return None

    def _notified(self, line: bytes) -> None:
        """A message of the host's own: a follow's next events (others are ignored)."""
        try:
            notice = notices.decode(line)
            if notice.method != EVENTS.name:
                return
            page = decode(notice.params, EVENTS.params)
        except (msgspec.MsgspecError, ValueError, errors.DelegationError) as exc:
            log.warning("unreadable notice: %s", exc, extra={"action": "client_bad_notice"})
            return
        pages = self._follows.get(page.follow) if isinstance(page.follow, int) else None
        # None: a follow its caller stopped, nobody's business.
        if pages is not None and pages.put(page.events, len(line)):
            stop = asyncio.ensure_future(self._stop_follow(page.follow))
            self._stops.add(stop)
            stop.add_done_callback(self._stops.discard)

    async def _stop_follow(self, request_id: int | str) -> None:
        """Ask the host to end a follow (its caller left it, or left too much waiting:
        see :meth:`follow`); nothing if the connection ended."""
        with contextlib.suppress(OSError, errors.DelegationError):
            await self._notify(FOLLOW_STOP.name, FollowStop(request_id))


P = ParamSpec("P")
E = TypeVar("E")


async def _next(iterator: AsyncGenerator[E]) -> E:
    return await anext(iterator)


async def _close(iterator: AsyncGenerator[E]) -> None:
    await iterator.aclose()


def _blocking(
    method: Callable[Concatenate[Client, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[SyncClient, P], R]:
    """The blocking form of a :class:`Client` method, run on the SyncClient's loop."""

    @functools.wraps(method)
    def call(self: SyncClient, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._run(method(self._client, *args, **kwargs))

    return call


def _opening(opener: Callable[P, Coroutine[Any, Any, Client]]) -> Callable[P, SyncClient]:
    """A SyncClient constructor from a :class:`Client` one (``connect``, ``spawn``)."""

    @functools.wraps(opener)
    def open_client(*args: P.args, **kwargs: P.kwargs) -> SyncClient:
        return SyncClient(lambda: opener(*args, **kwargs))

    return open_client


class SyncClient:
    """A :class:`Client` for synchronous code: the same methods, blocking.

    It runs the client on an event loop in a daemon thread of its own; ``close`` (or
    leaving ``with``) closes the client, then ends the loop and joins the thread.
    """

    def __init__(self, opening: Callable[[], Coroutine[Any, Any, Client]]) -> None:
        ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None

        async def main() -> None:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            ready.set()
            await self._stop.wait()

        name = "delegation-client"
        self._thread = threading.Thread(target=asyncio.run, args=(main(),), name=name, daemon=True)
        self._thread.start()
        ready.wait()
        try:
            self._client = self._run(opening())
        except BaseException:
            self._end_loop()
            raise
        self._closed = False

    # SyncClient.connect(socket_path), SyncClient.spawn(args, env=…, stderr=…, cwd=…)
    connect = staticmethod(_opening(Client.connect))
    spawn = staticmethod(_opening(Client.spawn))

    @property
    def process(self) -> asyncio.subprocess.Process | None:
        """The host subprocess :meth:`spawn` started (None for a socket)."""
        return self._client.process

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the client (see :meth:`Client.close`), end the loop, join the thread."""
        if self._closed:
            return
        self._closed = True
        try:
            self._run(self._client.close())
        finally:
            self._end_loop()

    def _run(self, coroutine: Coroutine[Any, Any, R]) -> R:
        assert self._loop is not None
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # an interrupted caller leaves no call behind
            raise

    def follow(
        self, params: ParamsLike, *, max_buffered: int = FOLLOW_BUFFER_BYTES
    ) -> Iterator[Event]:
        """:meth:`Client.follow`, blocking: a generator of the child's events as they
        commit. Closing it early (``close()``, or leaving ``contextlib.closing``) stops
        the follow on the host."""
        follower = self._client.follow(params, max_buffered=max_buffered)
        try:
            while True:
                try:
                    yield self._run(_next(follower))
                except StopAsyncIteration:
                    return
        finally:
            if not self._closed:
                self._run(_close(follower))

    def _end_loop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join()

    register = _blocking(Client.register)
    begin_tool = _blocking(Client.begin_tool)
    end_tool = _blocking(Client.end_tool)
    finish_run = _blocking(Client.finish_run)
    start = _blocking(Client.start)
    read = _blocking(Client.read)
    cancel = _blocking(Client.cancel)
    steer = _blocking(Client.steer)
    release = _blocking(Client.release)
    input = _blocking(Client.input)
    send = _blocking(Client.send)
    call = _blocking(Client.call)
