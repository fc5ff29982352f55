"""``delegation serve``: the engine as a host process speaking JSON-RPC 2.0 (SPEC §8).

Each stream (stdio, or one accepted Unix-socket connection) is one runner
connection: ``runner.register`` must come first, then ``tool.begin``, ``tool.end``,
``run.finish`` and the five child methods. Requests on a stream are served
concurrently and answered with their own id; notifications get no answer. A line
over 4 MiB is refused with an error and the stream goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import stat
import struct
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec

from delegation import errors, rpc
from delegation.codec import decode
from delegation.engine import Engine
from delegation.records import RunnerConnection, ToolHandle
from delegation.wire import METHODS, Params, Preset

log = logging.getLogger("delegation.serve")

CHUNK = 64 * 1024


class Register(msgspec.Struct, forbid_unknown_fields=True, frozen=True, rename="camel"):
    runner_id: str
    host_instance_id: str


class ToolBegin(msgspec.Struct, forbid_unknown_fields=True, frozen=True, rename="camel"):
    run_id: str
    conversation_id: str
    tool_call_id: str
    extension_id: str
    presets: list[Preset]
    workspace: str


class ToolEnd(msgspec.Struct, forbid_unknown_fields=True, frozen=True, rename="camel"):
    run_id: str
    tool_call_id: str


class RunFinish(msgspec.Struct, forbid_unknown_fields=True, frozen=True, rename="camel"):
    run_id: str
    succeeded: bool


class Registered(msgspec.Struct, frozen=True, rename="camel"):
    connection_id: str
    generation: int


class Empty(msgspec.Struct, frozen=True):
    pass


async def frames(
    read: Callable[[int], Awaitable[bytes]], limit: int
) -> AsyncIterator[bytes | None]:
    """Lines of a stream, without their newline; None stands for a line over ``limit``
    (its bytes are skipped up to the next newline, and the stream goes on)."""
    buffer = bytearray()
    skipping = False
    while True:
        chunk = await read(CHUNK)
        if not chunk:
            if buffer and not skipping:
                yield bytes(buffer)
            return
        buffer += chunk
        while True:
            end = buffer.find(b"\n")
            if end < 0:
                if len(buffer) > limit:
                    if not skipping:
                        yield None
                    skipping = True
                    buffer.clear()
                break
            line = bytes(buffer[:end])
            del buffer[: end + 1]
            if skipping:
                skipping = False
                continue
            if len(line) > limit:
                yield None
            elif line.strip():
                yield line


class Session:
    """One stream: one runner connection, its open tool calls, its in-flight requests."""

    def __init__(self, engine: Engine, write: Callable[[bytes], Awaitable[None]]) -> None:
        self.engine = engine
        self._write = write
        self.conn: RunnerConnection | None = None
        self._tools: dict[tuple[str, str], ToolHandle] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._barrier: asyncio.Task[None] | None = None
        self._methods: dict[str, rpc.Handler] = {
            "runner.register": self._register,
            "tool.begin": self._tool_begin,
            "tool.end": self._tool_end,
            "run.finish": self._run_finish,
        }
        for method in METHODS:
            self._methods[method] = self._child(method)

    async def run(self, read: Callable[[int], Awaitable[bytes]]) -> None:
        """Serve until end of input, then wait for in-flight requests and disconnect."""
        try:
            async for line in frames(read, rpc.MAX_FRAME_BYTES):
                if line is None:
                    too_long = errors.InvalidRpcRequest("invalid request: message exceeds 4 MiB")
                    await self._write(rpc.error_frame(too_long, None))
                    continue
                task = asyncio.create_task(self._handle(line, self._barrier))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                if _is_lifecycle(line):
                    self._barrier = task
        finally:
            if self._tasks:
                _, late = await asyncio.wait(
                    self._tasks, timeout=self.engine.config.release_drain_s
                )
                for task in late:
                    task.cancel()
                await asyncio.gather(*self._tasks, return_exceptions=True)
            if self.conn is not None and self.engine.is_open:
                with contextlib.suppress(errors.DelegationError):
                    await self.engine.disconnect(self.conn)

    async def _handle(self, line: bytes, barrier: asyncio.Task[None] | None) -> None:
        # Registration and tool/run lifecycle messages take effect in the order they
        # arrived, before anything sent after them; child methods run concurrently.
        if barrier is not None:
            await asyncio.wait({barrier})
        envelope, failure = rpc.parse(line)
        frame = failure if envelope is None else await rpc.dispatch(envelope, self._methods)
        if frame is not None:
            await self._write(frame)

    def _connection(self) -> RunnerConnection:
        if self.conn is None:
            raise errors.RunnerNotFound("runner not found: runner.register must come first")
        return self.conn

    async def _register(self, raw: bytes) -> Registered:
        params = rpc.decode_params(raw, Register)
        self.conn = await self.engine.connect(params.runner_id, params.host_instance_id)
        return Registered(self.conn.id, self.conn.generation)

    async def _tool_begin(self, raw: bytes) -> Empty:
        params = rpc.decode_params(raw, ToolBegin)
        tool = await self.engine.open_tool(
            self._connection(),
            run_id=params.run_id,
            conversation_id=params.conversation_id,
            tool_call_id=params.tool_call_id,
            extension_id=params.extension_id,
            presets=params.presets,
            workspace=params.workspace,
        )
        self._tools[(params.run_id, params.tool_call_id)] = tool
        return Empty()

    async def _tool_end(self, raw: bytes) -> Empty:
        params = rpc.decode_params(raw, ToolEnd)
        self._connection()
        tool = self._tools.pop((params.run_id, params.tool_call_id), None)
        if tool is None:
            raise errors.NotOwned("tool call is not open on this connection")
        await self.engine.close_tool(tool)
        return Empty()

    async def _run_finish(self, raw: bytes) -> Empty:
        params = rpc.decode_params(raw, RunFinish)
        self._connection()
        await self.engine.finish_run(params.run_id, params.succeeded)
        for key in [k for k in self._tools if k[0] == params.run_id]:
            del self._tools[key]
        return Empty()

    def _child(self, method: str) -> rpc.Handler:
        async def handle(raw: bytes) -> Any:
            conn = self._connection()
            params = decode(raw, Params, providers=self.engine.config.providers)
            return await self.engine.call(conn, method, params)

        return handle


_LIFECYCLE = (b'"runner.register"', b'"tool.begin"', b'"tool.end"', b'"run.finish"')


def _is_lifecycle(line: bytes) -> bool:
    """A cheap look for a lifecycle method name; a false positive only orders more."""
    return any(name in line for name in _LIFECYCLE)


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


async def _write_to(writer: asyncio.StreamWriter, lock: asyncio.Lock, frame: bytes) -> None:
    async with lock:
        writer.write(frame)
        with contextlib.suppress(ConnectionError):
            await writer.drain()


def _remove_stale_socket(path: str) -> None:
    """Remove a socket a previous host left at ``path``; never remove anything else
    (a mistyped ``--socket`` naming the database must not delete it)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise FileExistsError(f"{path} exists and is not a socket; not replacing it")
    os.unlink(path)


async def serve_socket(engine: Engine, path: str, stop: asyncio.Event, allowed_uid: int) -> None:
    """Accept runner connections on a Unix socket (mode 0600) until ``stop`` is set."""

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lock = asyncio.Lock()
        sock = writer.get_extra_info("socket")
        if sock is None or peer_uid(sock) != allowed_uid:
            refused = errors.AuthorityError("peer is not allowed on this socket")
            await _write_to(writer, lock, rpc.error_frame(refused, None))
            writer.close()
            return
        session = Session(engine, lambda frame: _write_to(writer, lock, frame))
        try:
            await session.run(reader.read)
        finally:
            writer.close()

    _remove_stale_socket(path)
    previous = os.umask(0o177)  # the socket is born 0600: no window for other users
    try:
        server = await asyncio.start_unix_server(accept, path=path, limit=rpc.MAX_FRAME_BYTES)
    finally:
        os.umask(previous)
    os.chmod(path, 0o600)
    async with server:
        await stop.wait()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


async def serve_stdio(engine: Engine, stop: asyncio.Event) -> None:
    """Serve one runner connection on stdin/stdout until end of input or ``stop``."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=rpc.MAX_FRAME_BYTES)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb", buffering=0)
    lock = asyncio.Lock()

    async def write(frame: bytes) -> None:
        async with lock:
            await loop.run_in_executor(None, out.write, frame)

    session = Session(engine, write)
    runner = asyncio.create_task(session.run(reader.read))
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({runner, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if not runner.done():
        runner.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await runner
    out.close()


async def serve(engine: Engine, *, socket_path: str | None, allowed_uid: int | None = None) -> None:
    """Run the host until SIGTERM/SIGINT (or end of input on stdio), then close gracefully."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    if socket_path is not None:
        _remove_stale_socket(socket_path)  # before the engine opens: a refusal changes nothing
    async with engine:
        log.info("serving", extra={"action": "serve_started"})
        if socket_path is not None:
            uid = os.getuid() if allowed_uid is None else allowed_uid
            await serve_socket(engine, socket_path, stop, uid)
        else:
            await serve_stdio(engine, stop)
    log.info("stopped", extra={"action": "serve_stopped"})
