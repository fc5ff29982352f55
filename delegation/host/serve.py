"""``delegation serve``: the engine as a host process speaking JSON-RPC 2.0 (design §8).

Each stream (stdio, or one accepted Unix-socket connection) is one runner
connection: ``runner.register`` must come first, then ``tool.begin``, ``tool.end``,
``run.finish`` and the five child methods. Requests on a stream are served
concurrently and answered with their own id; notifications get no answer. A line
over 4 MiB is refused with an error and the stream goes on.

Everything a peer controls is bounded (design §9, §18): at most ``max_inflight``
requests of a stream are served at once; its answers count in bytes against its
16 MiB backlog from the moment room is reserved for a page until the peer has read
them, and while the backlog is full the stream is not read further and no page of it
is computed. At most ``max_connections`` streams are served at once; the next is
refused with one error line. Other streams are served meanwhile. A socket stream that
sends nothing for ``idle_timeout`` (60 s) while nothing of it is in flight or unread is
closed (design §23): idle peers cannot hold every slot; nor can slow ones (SPEC §31): a
request line must arrive whole within ``request_timeout`` (10 s, a new connection's
first one from its opening), and one runner holds at most ``max_runner_connections``
(16) of a socket's connections, so that one runner's cannot lock out another's. At shutdown, reading
stops; calls still in flight after a short grace are answered ``host_closing``, and
the host closes only once every stream has been answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from delegation import errors, protocol, rpc
from delegation.backlog import Answer, Backlog, Room
from delegation.codec import decode
from delegation.engine import Engine
from delegation.host.serve_follow import Follows, follow_limit
from delegation.host.serve_io import CHUNK as CHUNK  # the read size, also for peers in tests
from delegation.host.serve_io import (
    Outbox,
    Partial,
    Read,
    SocketOutbox,
    ThreadOutbox,
    allowed_peer,
    check_socket_path,
    frames,
    listening_socket,
    open_stdin,
    remove_stale_socket,
    wait_until,
)
from delegation.host.serve_streams import Runners, Streams
from delegation.records import RunnerConnection, ToolHandle
from delegation.wire import Params

log = logging.getLogger("delegation.serve")

MAX_INFLIGHT = 64
MAX_CONNECTIONS = 64
IDLE_TIMEOUT_S = 60.0
# A request line arrives whole within this (SPEC §31), and a new connection's first one
# too: a peer sending a byte now and then, or nothing, holds no slot for longer.
REQUEST_TIMEOUT_S = 10.0
# The connections one runner may hold at once, of a socket's max_connections.
MAX_RUNNER_CONNECTIONS = 16
POLL_S = 0.5  # how often a stream waiting for its next line looks at its bounds again
# At shutdown, calls in flight get this long to end with their own answer.
SHUTDOWN_GRACE_S = 0.5
CLOSING = "the host is closing: the call was not answered; retry it"


class Session:
    """One stream: one runner connection, its open tool calls, its in-flight requests.

    Answers go to ``outbox``; the next line is read only while its backlog is not
    full, and each child method reserves room there before it reads a page.
    """

    def __init__(
        self,
        engine: Engine,
        outbox: Outbox,
        *,
        max_inflight: int = MAX_INFLIGHT,
        idle_timeout: float | None = None,
        request_timeout: float | None = None,
        runners: Runners | None = None,
    ) -> None:
        self.engine = engine
        self._idle_timeout = idle_timeout
        self._request_timeout = request_timeout
        self._runners = runners
        self._partial = Partial()
        self._active_at = time.monotonic()
        self._outbox = outbox
        self._backlog = outbox.backlog
        self.conn: RunnerConnection | None = None
        self._tools: dict[tuple[str, str], ToolHandle] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(max_inflight)
        self._barrier: asyncio.Task[None] | None = None
        self._reading: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()
        self._lifecycle: dict[str, rpc.Handler] = {
            protocol.REGISTER.name: self._register,
            protocol.TOOL_BEGIN.name: self._tool_begin,
            protocol.TOOL_END.name: self._tool_end,
            protocol.RUN_FINISH.name: self._run_finish,
        }
        self._follows = Follows(engine, outbox, follow_limit(max_inflight))
        self._lifecycle[protocol.FOLLOW_STOP.name] = self._follows.stop

    async def run(self, read: Read) -> None:
        """Serve until end of input (or :meth:`stop`), then settle in-flight requests
        and disconnect. Never raises for anything the peer does, hanging up included."""
        reading = self._reading = asyncio.create_task(self._read_requests(read))
        try:
            await asyncio.wait({reading})
        finally:
            reading.cancel()
            if not self._stopped.is_set():
                runner = self.conn.runner_id if self.conn is not None else None
                extra = {
                    "action": "peer_hung_up",
                    "runner_id": runner,
                    "in_flight": len(self._tasks),
                }
                log.info("runner connection ended by the peer", extra=extra)
                self._follows.stop_all()  # no child.follow.stop can come any more
            await self._settle()
        if not reading.cancelled():
            reading.result()  # a fault of ours while reading surfaces here

    def stop(self) -> None:
        """The host is closing: read nothing more; calls still in flight after
        :data:`SHUTDOWN_GRACE_S` are answered ``host_closing``."""
        self._stopped.set()
        self._end_reading()

    def _end_reading(self) -> None:
        """Read no further line: the stream ends once its calls in flight are answered."""
        if self._reading is not None:
            self._reading.cancel()

    async def _read_requests(self, read: Read) -> None:
        async def reading(size: int) -> bytes:
            data = await read(size)
            self._active_at = time.monotonic()  # a request arriving slowly is no idler
            return data

        timed = self._idle_timeout is not None or self._request_timeout is not None
        lines = frames(reading if timed else read, rpc.MAX_FRAME_BYTES, self._partial)
        try:
            while True:
                # Bounded: a free slot and room in the backlog before the next line is read.
                await self._slots.acquire()
                try:
                    await self._backlog.room()
                    line = await self._next(lines)
                except BaseException:
                    self._slots.release()
                    raise
                self._active_at = time.monotonic()
                self._spawn(line)
        except StopAsyncIteration:
            return
        except _Idle:
            runner = self.conn.runner_id if self.conn is not None else None
            extra = {"action": "idle_connection_closed", "runner_id": runner}
            log.info("closing a connection idle for %.0f s", self._idle_timeout, extra=extra)
            return
        except _Slow:
            runner = self.conn.runner_id if self.conn is not None else None
            extra = {"action": "request_timeout", "runner_id": runner}
            log.info("closing a connection whose request line took too long", extra=extra)
            slow = errors.InvalidRpcRequest(
                f"invalid request: a request line must arrive whole within"
                f" {self._request_timeout:g} s"
            )
            self._outbox.send(rpc.error_frame(slow, None))
            return
        except OSError:  # the peer hung up mid-stream (a reset): the same as its end
            return
        finally:
            await lines.aclose()

    async def _next(self, lines: AsyncIterator[bytes | None]) -> bytes | None:
        """The next line; raises :class:`_Idle` once the stream is idle: nothing sent
        for ``idle_timeout`` while no request is in flight, nothing is unread and no
        tool call of it is open (closing would cancel its foreground children); raises
        :class:`_Slow` once a line has taken ``request_timeout`` to arrive (from its
        first byte; a new connection's first line from the connection)."""
        if self._idle_timeout is None and self._request_timeout is None:
            return await anext(lines)
        if self._partial.since is not None:  # from now: the host may not have read on
            self._partial.since = time.monotonic()
        reading = asyncio.ensure_future(anext(lines))
        try:
            while True:
                # Looked at again at least twice a second: a line may begin, or a call
                # end, while this waits (the bound to reach changes then).
                wait = min(max(self._left(), 0.05), POLL_S)
                done, _ = await asyncio.wait({reading}, timeout=wait)
                if done:
                    return reading.result()
                now = time.monotonic()
                if self._slow(now):
                    raise _Slow
                if self._idle_timeout is None:
                    continue
                if self._tasks or self._backlog.used or self._tools:
                    self._active_at = now  # busy: idle only from its end
                elif now - self._active_at >= self._idle_timeout:
                    raise _Idle
        finally:
            if not reading.done():
                reading.cancel()
                await asyncio.gather(reading, return_exceptions=True)

    def _line_began(self) -> float | None:
        """When the line being waited for began, for ``request_timeout``: its first
        byte; on a connection no runner registered yet, its last activity (its opening,
        or the answer to a registration that failed)."""
        if self._partial.since is not None:
            return self._partial.since
        return self._active_at if self.conn is None and not self._tasks else None

    def _slow(self, now: float) -> bool:
        began = self._line_began()
        limit = self._request_timeout
        return limit is not None and began is not None and now - began >= limit

    def _left(self) -> float:
        """Seconds until the next bound (idle or request) could be reached (inf: none)."""
        now, left = time.monotonic(), math.inf
        if self._idle_timeout is not None:
            left = self._active_at + self._idle_timeout - now
        began = self._line_began()
        if self._request_timeout is not None and began is not None:
            left = min(left, began + self._request_timeout - now)
        return left

    def _spawn(self, line: bytes | None) -> None:
        if line is None:
            task = asyncio.create_task(self._refuse_too_long())
        else:
            task = asyncio.create_task(self._handle(line, self._barrier))
            if _is_lifecycle(line):
                self._barrier = task
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._slots.release()
        self._active_at = time.monotonic()

    async def _settle(self) -> None:
        """Wait for the requests in flight: up to ``release_drain_s`` after the peer's
        end of input, up to :data:`SHUTDOWN_GRACE_S` once the host stops; then cancel
        the rest (answered ``host_closing`` when the host stops)."""
        if not self._stopped.is_set():
            await wait_until(set(self._tasks), self.engine.config.release_drain_s, self._stopped)
        if self._stopped.is_set():
            await wait_until(set(self._tasks), SHUTDOWN_GRACE_S)
        late = set(self._tasks)
        for task in late:
            task.cancel()
        await wait_until(late, SHUTDOWN_GRACE_S)  # their host_closing answers go out
        for task in late:
            task.cancel()  # one whose answer still waits for the peer to read
        await asyncio.gather(*late, return_exceptions=True)
        if self.conn is not None and self.engine.is_open and not self._stopped.is_set():
            with contextlib.suppress(errors.DelegationError):
                await self.engine.disconnect(self.conn)

    async def _refuse_too_long(self) -> None:
        too_long = errors.InvalidRpcRequest("invalid request: message exceeds 4 MiB")
        self._outbox.send(rpc.error_frame(too_long, None))

    async def _handle(self, line: bytes, barrier: asyncio.Task[None] | None) -> None:
        answer = Answer(self._backlog)
        try:
            frame = await self._answer(line, barrier, answer)
        finally:
            answer.release()  # its frame counts instead, from now until the peer reads it
        if frame is not None:
            self._outbox.send(frame)

    async def _answer(
        self, line: bytes, barrier: asyncio.Task[None] | None, room: Room
    ) -> bytes | None:
        envelope, failure = rpc.parse(line)
        try:
            # Registration and tool/run lifecycle messages take effect in the order they
            # arrived, before anything sent after them; child methods run concurrently.
            if barrier is not None:
                await asyncio.wait({barrier})
            if envelope is None:
                return failure
            return await rpc.dispatch(envelope, self._handler(envelope, room))
        except asyncio.CancelledError:
            if not self._stopped.is_set():
                raise
            closing = errors.HostClosing(CLOSING)
            return failure if envelope is None else rpc.refusal(envelope, closing)

    def _handler(self, envelope: rpc.Envelope, room: Room) -> rpc.Handler | None:
        """The handler of ``envelope``'s method: a child method's holds the call's room,
        a follow's knows its request's id."""
        method = envelope.method
        if method in _CHILD_METHODS:
            return functools.partial(self._child, method, room)
        if method == protocol.FOLLOW.name:
            return functools.partial(self._follow, envelope.id)
        return self._lifecycle.get(method)

    async def _follow(self, request_id: object, raw: bytes) -> protocol.Followed:
        return await self._follows.follow(self._connection(), request_id, raw)

    def _connection(self) -> RunnerConnection:
        if self.conn is None:
            raise errors.RunnerNotFound("runner not found: runner.register must come first")
        return self.conn

    async def _register(self, raw: bytes) -> protocol.Registration:
        params = rpc.decode_params(raw, protocol.REGISTER.params)
        if self._runners is not None and not self._runners.claim(self, params.runner_id):
            self._end_reading()  # answered, then closed: it holds no slot
            raise errors.ConnectionLimit(
                f"too many connections: runner {params.runner_id!r} holds"
                f" {self._runners.most} already; try again later"
            )
        self.conn = await self.engine.connect(params.runner_id, params.host_instance_id)
        if self._runners is not None:
            for other in self._runners.others(self, params.runner_id):
                if isinstance(other, Session) and other.fenced_by(self.conn):
                    self._runners.release(other)
        return protocol.Registration(self.conn.id, self.conn.generation)

    def fenced_by(self, newer: RunnerConnection) -> bool:
        """A newer connection of this stream's runner fenced it (the engine ended its tool
        calls with it): it holds no slot any more, and ends once its calls in flight are
        answered, as a peer's hang-up would end it. Whether it was so."""
        conn = self.conn
        if conn is None or conn.runner_id != newer.runner_id:
            return False
        if conn.generation >= newer.generation:
            return False
        self._tools.clear()  # ended by the engine: nothing of it would be cancelled
        extra = {"action": "superseded_connection_closed", "runner_id": conn.runner_id}
        log.info("closing a connection a newer one of its runner fenced", extra=extra)
        self._end_reading()
        return True

    async def _tool_begin(self, raw: bytes) -> protocol.Empty:
        params = rpc.decode_params(raw, protocol.TOOL_BEGIN.params)
        tool = await self.engine.begin_tool(self._connection(), params)
        self._tools[(params.run_id, params.tool_call_id)] = tool
        return protocol.Empty()

    async def _tool_end(self, raw: bytes) -> protocol.Empty:
        params = rpc.decode_params(raw, protocol.TOOL_END.params)
        self._connection()
        tool = self._tools.pop((params.run_id, params.tool_call_id), None)
        if tool is None:
            raise errors.NotOwned("tool call is not open on this connection")
        await self.engine.close_tool(tool)
        return protocol.Empty()

    async def _run_finish(self, raw: bytes) -> protocol.Empty:
        params = rpc.decode_params(raw, protocol.RUN_FINISH.params)
        # Only this runner's grants, leases and children: never another runner's.
        await self.engine.finish_run(params.run_id, params.succeeded, self._connection())
        for key in [k for k in self._tools if k[0] == params.run_id]:
            del self._tools[key]
        return protocol.Empty()

    async def _child(self, method: str, room: Room, raw: bytes) -> Any:
        conn = self._connection()
        params = decode(raw, Params, providers=self.engine.config.providers)
        return await self.engine.call(conn, method, params, room=room)


_CHILD_METHODS = frozenset(method.name for method in protocol.CHILD)
_LIFECYCLE = tuple(f'"{method.name}"'.encode() for method in protocol.LIFECYCLE)
_LIFECYCLE_NAMES = frozenset(method.name for method in protocol.LIFECYCLE)


class _Method(msgspec.Struct):
    method: str = ""  # anything else is an invalid request, answered so


_method = msgspec.json.Decoder(_Method)


class _Idle(Exception):
    """The stream has been idle for its ``idle_timeout``."""


class _Slow(Exception):
    """A request line has taken the stream's ``request_timeout`` to arrive."""


def _is_lifecycle(line: bytes) -> bool:
    """Whether ``line`` is a lifecycle request: a cheap look for a lifecycle method name,
    then, when one is there, the method read. An id that spells one (``"runId":
    "tool.end"``) must not order the stream behind a follow, which may run for hours;
    a line that does not decode is answered with an error, and ordering it costs nothing."""
    if not any(name in line for name in _LIFECYCLE):
        return False
    try:
        return _method.decode(line).method in _LIFECYCLE_NAMES
    except (msgspec.MsgspecError, ValueError, RecursionError):
        return True


async def serve_socket(
    engine: Engine,
    path: str,
    stop: asyncio.Event,
    allowed_uid: int,
    *,
    max_inflight: int = MAX_INFLIGHT,
    max_connections: int = MAX_CONNECTIONS,
    idle_timeout: float | None = IDLE_TIMEOUT_S,
    request_timeout: float | None = REQUEST_TIMEOUT_S,
    max_runner_connections: int = MAX_RUNNER_CONNECTIONS,
    ready: Callable[[str], None] | None = None,
) -> None:
    """Accept runner connections on a Unix socket (mode 0600) until ``stop`` is set,
    then stop every connection and wait until each has been answered and closed. At
    most ``max_connections`` are served at once: the next gets one error line
    (``connection_limit``) and is closed; one runner holds at most
    ``max_runner_connections`` of them (a registration past it is answered
    ``connection_limit`` and its connection closed). A connection idle for
    ``idle_timeout`` seconds (None: never) is closed as if its peer had hung up; one
    whose request line (or first request, from its opening) takes ``request_timeout``
    seconds to arrive whole is answered an error line and closed. ``ready`` is told the
    socket's path once peers may connect."""
    streams = Streams()
    runners = Runners(max_runner_connections)

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        streams.track()
        outbox = SocketOutbox(writer, Backlog())
        drain = SHUTDOWN_GRACE_S  # a refusal's one line, or a host stopping
        try:
            if not allowed_peer(writer.get_extra_info("socket"), allowed_uid):
                refused = errors.AuthorityError("peer is not allowed on this socket")
                await _refuse(reader, outbox, refused)
            elif len(streams.sessions) >= max_connections:
                log.info("connection refused", extra={"action": "connection_limit"})
                await _refuse(reader, outbox, errors.ConnectionLimit())
            elif not streams.stopping:
                session = Session(
                    engine,
                    outbox,
                    max_inflight=max_inflight,
                    idle_timeout=idle_timeout,
                    request_timeout=request_timeout,
                    runners=runners,
                )
                streams.sessions.add(session)
                try:
                    await session.run(reader.read)
                finally:
                    streams.sessions.discard(session)
                    runners.release(session)
                if not streams.stopping:
                    drain = engine.config.release_drain_s
        finally:
            await outbox.close(drain)

    remove_stale_socket(path)
    sock = listening_socket(path)
    # Lines are framed by serve_io.frames, which reads CHUNK at a time: the reader's
    # buffer only needs that much (it stops reading the socket at twice its limit).
    server = await asyncio.start_unix_server(accept, sock=sock, limit=CHUNK)
    if ready is not None:  # peers may connect from now on
        ready(os.path.abspath(path))
    try:
        await stop.wait()
    finally:
        server.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        await asyncio.sleep(0)  # connections accepted before the close start their task
        streams.stop()
        await streams.wait()
        await server.wait_closed()


async def _refuse(reader: asyncio.StreamReader, outbox: SocketOutbox, error: Exception) -> None:
    """Answer a connection with one error line, then its end. What the peer sent is read
    and dropped meanwhile (for :data:`SHUTDOWN_GRACE_S` at most): closing on unread
    input would reset the connection, and the peer might never see the line."""
    outbox.send(rpc.error_frame(error, None))
    outbox.write_eof()
    with contextlib.suppress(TimeoutError, OSError):
        async with asyncio.timeout(SHUTDOWN_GRACE_S):
            while await reader.read(CHUNK):
                pass


async def serve_stdio(
    engine: Engine, stop: asyncio.Event, *, max_inflight: int = MAX_INFLIGHT
) -> None:
    """Serve one runner connection on stdin/stdout until end of input or ``stop``."""
    read, close_input = await open_stdin(CHUNK)
    outbox = ThreadOutbox(os.dup(sys.stdout.fileno()), Backlog())
    session = Session(engine, outbox, max_inflight=max_inflight)
    running = asyncio.create_task(session.run(read))
    stopper = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({running, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if not running.done():
            session.stop()
        await running
    finally:
        stopper.cancel()
        close_input()
        drain = SHUTDOWN_GRACE_S if stop.is_set() else engine.config.release_drain_s
        await outbox.close(drain)


async def serve(
    engine: Engine,
    *,
    socket_path: str | None,
    allowed_uid: int | None = None,
    max_inflight: int = MAX_INFLIGHT,
    max_connections: int = MAX_CONNECTIONS,
    idle_timeout: float | None = IDLE_TIMEOUT_S,
    request_timeout: float | None = REQUEST_TIMEOUT_S,
    max_runner_connections: int = MAX_RUNNER_CONNECTIONS,
    ready: Callable[[str], None] | None = None,
) -> None:
    """Run the host until SIGTERM/SIGINT (or end of input on stdio), then close gracefully.
    ``max_connections`` bounds the streams of a socket at once, and
    ``max_runner_connections`` one runner's of them; ``idle_timeout`` closes a socket's
    idle streams, ``request_timeout`` its slow ones (see :func:`serve_socket`).

    A host whose database file was replaced while in use (design §18) stops as well:
    its close then raises ``DatabaseReplaced`` (the command's one line, exit 1)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    if socket_path is not None:
        # Refused before the engine opens, but removed only once it holds the database:
        # a host refused with host_conflict must not unlink the live host's socket.
        check_socket_path(socket_path)
    async with engine:
        log.info("serving", extra={"action": "serve_started"})
        failed = asyncio.create_task(engine.failed())
        failed.add_done_callback(lambda done: None if done.cancelled() else stop.set())
        try:
            if socket_path is not None:
                uid = os.getuid() if allowed_uid is None else allowed_uid
                await serve_socket(
                    engine,
                    socket_path,
                    stop,
                    uid,
                    max_inflight=max_inflight,
                    max_connections=max_connections,
                    idle_timeout=idle_timeout,
                    request_timeout=request_timeout,
                    max_runner_connections=max_runner_connections,
                    ready=ready,
                )
            else:
                await serve_stdio(engine, stop, max_inflight=max_inflight)
        finally:
            failed.cancel()
    log.info("stopped", extra={"action": "serve_stopped", "signalled": stop.is_set()})
