"""``delegation serve``: the engine as a host process speaking JSON-RPC 2.0 (SPEC §8).

Each stream (stdio, or one accepted Unix-socket connection) is one runner
connection: ``runner.register`` must come first, then ``tool.begin``, ``tool.end``,
``run.finish`` and the five child methods. Requests on a stream are served
concurrently and answered with their own id; notifications get no answer. A line
over 4 MiB is refused with an error and the stream goes on.

Everything a peer controls is bounded (SPEC §9): at most ``max_inflight`` requests
of a stream are served at once, and while more than 16 MiB of its answers wait to be
read, the stream is not read further. Other streams are served meanwhile. At
shutdown, reading stops; calls still in flight after a short grace are answered
``host_closing``, and the host closes only once every stream has been answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from delegation import errors, protocol, rpc
from delegation.codec import decode
from delegation.engine import Engine
from delegation.records import RunnerConnection, ToolHandle
from delegation.serve_follow import Follows, follow_limit
from delegation.serve_io import CHUNK as CHUNK  # the read size, for peers in tests
from delegation.serve_io import (
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
from delegation.wire import Params

log = logging.getLogger("delegation.serve")

MAX_INFLIGHT = 64
# At shutdown, calls in flight get this long to end with their own answer.
SHUTDOWN_GRACE_S = 0.5
CLOSING = "the host is closing: the call was not answered; retry it"


class Session:
    """One stream: one runner connection, its open tool calls, its in-flight requests.

    ``write`` hands one answer to the peer and may wait while too many answers are
    unread; ``writable`` (when given) returns once the unread backlog is back under
    its bound, and is awaited before each line is read.
    """

    def __init__(
        self,
        engine: Engine,
        write: Callable[[bytes], Awaitable[None]],
        *,
        writable: Callable[[], Awaitable[None]] | None = None,
        max_inflight: int = MAX_INFLIGHT,
    ) -> None:
        self.engine = engine
        self._write = write
        self._writable = writable
        self.conn: RunnerConnection | None = None
        self._tools: dict[tuple[str, str], ToolHandle] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(max_inflight)
        self._barrier: asyncio.Task[None] | None = None
        self._reading: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()
        self._methods: dict[str, rpc.Handler] = {
            protocol.REGISTER.name: self._register,
            protocol.TOOL_BEGIN.name: self._tool_begin,
            protocol.TOOL_END.name: self._tool_end,
            protocol.RUN_FINISH.name: self._run_finish,
        }
        for method in protocol.CHILD:
            self._methods[method.name] = self._child(method.name)
        self._follows = Follows(engine, write, follow_limit(max_inflight))
        self._methods[protocol.FOLLOW_STOP.name] = self._follows.stop

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
        if self._reading is not None:
            self._reading.cancel()

    async def _read_requests(self, read: Read) -> None:
        lines = frames(read, rpc.MAX_FRAME_BYTES)
        try:
            while True:
                # Bounded: a free slot and a drained backlog before the next line is read.
                await self._slots.acquire()
                try:
                    if self._writable is not None:
                        await self._writable()
                    line = await anext(lines)
                except BaseException:
                    self._slots.release()
                    raise
                self._spawn(line)
        except StopAsyncIteration:
            return
        except OSError:  # the peer hung up mid-stream (a reset): the same as its end
            return
        finally:
            await lines.aclose()

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
        await self._write(rpc.error_frame(too_long, None))

    async def _handle(self, line: bytes, barrier: asyncio.Task[None] | None) -> None:
        envelope, failure = rpc.parse(line)
        try:
            # Registration and tool/run lifecycle messages take effect in the order they
            # arrived, before anything sent after them; child methods run concurrently.
            if barrier is not None:
                await asyncio.wait({barrier})
            frame = failure if envelope is None else await self._dispatch(envelope)
        except asyncio.CancelledError:
            if not self._stopped.is_set():
                raise
            closing = errors.HostClosing(CLOSING)
            frame = failure if envelope is None else rpc.refusal(envelope, closing)
        if frame is not None:
            await self._write(frame)

    def _dispatch(self, envelope: rpc.Envelope) -> Awaitable[bytes | None]:
        """Serve ``envelope``; a follow's handler is told its request's id."""
        methods = self._methods
        if envelope.method == protocol.FOLLOW.name:
            methods = {envelope.method: functools.partial(self._follow, envelope.id)}
        return rpc.dispatch(envelope, methods)

    async def _follow(self, request_id: object, raw: bytes) -> protocol.Followed:
        return await self._follows.follow(self._connection(), request_id, raw)

    def _connection(self) -> RunnerConnection:
        if self.conn is None:
            raise errors.RunnerNotFound("runner not found: runner.register must come first")
        return self.conn

    async def _register(self, raw: bytes) -> protocol.Registration:
        params = rpc.decode_params(raw, protocol.REGISTER.params)
        self.conn = await self.engine.connect(params.runner_id, params.host_instance_id)
        return protocol.Registration(self.conn.id, self.conn.generation)

    async def _tool_begin(self, raw: bytes) -> protocol.Empty:
        params = rpc.decode_params(raw, protocol.TOOL_BEGIN.params)
        tool = await self.engine.open_tool(
            self._connection(),
            run_id=params.run_id,
            conversation_id=params.conversation_id,
            tool_call_id=params.tool_call_id,
            extension_id=params.extension_id,
            presets=params.presets,
            workspace=params.workspace,
            policy=None if params.policy is msgspec.UNSET else params.policy,
        )
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

    def _child(self, method: str) -> rpc.Handler:
        async def handle(raw: bytes) -> Any:
            conn = self._connection()
            params = decode(raw, Params, providers=self.engine.config.providers)
            return await self.engine.call(conn, method, params)

        return handle


_LIFECYCLE = tuple(f'"{method.name}"'.encode() for method in protocol.LIFECYCLE)
_LIFECYCLE_NAMES = frozenset(method.name for method in protocol.LIFECYCLE)


class _Method(msgspec.Struct):
    method: str = ""  # anything else is an invalid request, answered so


_method = msgspec.json.Decoder(_Method)


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


class Streams:
    """The streams one host serves, so that a shutdown can stop them all and wait
    until each has answered (a stream task the event loop would cancel at exit
    instead makes asyncio log a traceback)."""

    def __init__(self) -> None:
        self.sessions: set[Session] = set()
        self.tasks: set[asyncio.Task[Any]] = set()
        self.stopping = False

    def track(self) -> None:
        task = asyncio.current_task()
        if task is not None:
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def stop(self) -> None:
        self.stopping = True
        for session in self.sessions:
            session.stop()

    async def wait(self) -> None:
        while self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)
            await asyncio.sleep(0)  # a connection accepted just before the stop


async def serve_socket(
    engine: Engine,
    path: str,
    stop: asyncio.Event,
    allowed_uid: int,
    *,
    max_inflight: int = MAX_INFLIGHT,
) -> None:
    """Accept runner connections on a Unix socket (mode 0600) until ``stop`` is set,
    then stop every connection and wait until each has been answered and closed."""
    streams = Streams()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        streams.track()
        outbox = SocketOutbox(writer)
        try:
            if not allowed_peer(writer.get_extra_info("socket"), allowed_uid):
                refused = errors.AuthorityError("peer is not allowed on this socket")
                await outbox.send(rpc.error_frame(refused, None))
            elif not streams.stopping:
                session = Session(
                    engine, outbox.send, writable=outbox.writable, max_inflight=max_inflight
                )
                streams.sessions.add(session)
                try:
                    await session.run(reader.read)
                finally:
                    streams.sessions.discard(session)
        finally:
            drain = SHUTDOWN_GRACE_S if streams.stopping else engine.config.release_drain_s
            await outbox.close(drain)

    remove_stale_socket(path)
    sock = listening_socket(path)
    server = await asyncio.start_unix_server(accept, sock=sock, limit=rpc.MAX_FRAME_BYTES)
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


async def serve_stdio(
    engine: Engine, stop: asyncio.Event, *, max_inflight: int = MAX_INFLIGHT
) -> None:
    """Serve one runner connection on stdin/stdout until end of input or ``stop``."""
    read, close_input = await open_stdin(rpc.MAX_FRAME_BYTES)
    outbox = ThreadOutbox(os.dup(sys.stdout.fileno()))
    session = Session(engine, outbox.send, writable=outbox.writable, max_inflight=max_inflight)
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
) -> None:
    """Run the host until SIGTERM/SIGINT (or end of input on stdio), then close gracefully.

    A host whose database file was replaced while in use (SPEC §18) stops as well:
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
                await serve_socket(engine, socket_path, stop, uid, max_inflight=max_inflight)
            else:
                await serve_stdio(engine, stop, max_inflight=max_inflight)
        finally:
            failed.cancel()
    log.info("stopped", extra={"action": "serve_stopped", "signalled": stop.is_set()})
