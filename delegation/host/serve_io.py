"""The byte streams under ``delegation serve``: lines in, bounded answers out.

A peer controls how fast it reads. Answers wait in an *outbox*, and each one's bytes
count in the stream's :class:`~delegation.backlog.Backlog` from the moment it is sent
until the peer has taken it (the kernel holds it); the session stops reading a stream,
and computing its pages, while the backlog is full (design §9, §18). Input is read from a
socket, a pipe or a regular file alike (``serve --stdio < requests.jsonl``). The
socket's own checks live here too: who the peer is, and what a stale path holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import secrets
import select
import socket
import stat
import struct
import sys
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Protocol

from delegation.backlog import Backlog

CHUNK = 64 * 1024

Read = Callable[[int], Awaitable[bytes]]


class Partial:
    """When the line a stream is in the middle of began (None: between lines), for a
    bound on how long a request line may take to arrive (design §23, SPEC §31)."""

    __slots__ = ("since",)

    def __init__(self) -> None:
        self.since: float | None = None

    def mark(self, pending: bool) -> None:
        if not pending:
            self.since = None
        elif self.since is None:
            self.since = time.monotonic()


async def frames(
    read: Read, limit: int, partial: Partial | None = None
) -> AsyncGenerator[bytes | None, None]:
    """Lines of a stream, without their newline; None stands for a line over ``limit``
    (its bytes are skipped up to the next newline, and the stream goes on). ``partial``
    is kept told whether part of a line has arrived."""
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
            if partial is not None:
                partial.since = None  # a line ended: what is left began with this chunk
            if skipping:
                skipping = False
                continue
            if len(line) > limit:
                yield None
            elif line.strip():
                yield line
        if partial is not None:
            partial.mark(bool(buffer) or skipping)


class Outbox(Protocol):
    """Where a stream's answers go: ``send`` hands one over, and its bytes count in
    ``backlog`` until the peer has taken them."""

    backlog: Backlog

    def send(self, frame: bytes) -> None: ...


class SocketOutbox:
    """Answers to a socket peer, through the transport's own buffer.

    The buffer's high-water mark is zero, so ``drain`` returns exactly once everything
    written is out of this process; a frame's bytes are freed from the backlog then.
    Once the peer is gone, answers are dropped (and freed): writing to a dead transport
    only makes asyncio log warnings.
    """

    def __init__(self, writer: asyncio.StreamWriter, backlog: Backlog) -> None:
        self.backlog = backlog
        self._writer = writer
        self._unsent = 0
        self._watch: asyncio.Task[None] | None = None
        writer.transport.set_write_buffer_limits(high=0)

    def send(self, frame: bytes) -> None:
        """Hand ``frame`` over: it counts in the backlog until the peer has taken it."""
        if self._writer.transport.is_closing():
            return
        self.backlog.hold(len(frame))
        self._unsent += len(frame)
        self._writer.write(frame)
        if self._watch is not None:
            return
        if self._writer.transport.get_write_buffer_size() == 0:  # the kernel took it all
            self._unsent, unsent = 0, self._unsent
            self.backlog.free(unsent)
        else:
            self._watch = asyncio.create_task(self._sent())

    def write_eof(self) -> None:
        """No more answers: the peer reads the end of the stream after the last one."""
        if not self._writer.transport.is_closing():
            self._writer.write_eof()

    async def _sent(self) -> None:
        """Free the backlog each time the transport's buffer has emptied."""
        try:
            while self._unsent:
                written = self._unsent
                with contextlib.suppress(OSError):  # the peer hung up: nothing is owed
                    await self._writer.drain()
                self._unsent -= written
                self.backlog.free(written)
        finally:
            self._watch = None

    async def close(self, timeout: float) -> None:
        """Hand over what is buffered, then close; a peer that reads nothing for
        ``timeout`` seconds is cut off (its answers are dropped)."""
        self._writer.close()
        try:
            async with asyncio.timeout(timeout):
                await self._writer.wait_closed()
        except TimeoutError:
            self._writer.transport.abort()
        except OSError:
            pass  # it hung up first
        if self._watch is not None:  # woken by the connection's end
            await asyncio.wait({self._watch})


class ThreadOutbox:
    """Answers to a blocking file descriptor (stdout: a pipe, a file or a terminal).

    One daemon thread writes, so a peer that never reads blocks that thread only:
    never the event loop, and never the process's exit. A frame's bytes are freed from
    the backlog once written. ``_pending`` is only touched on the loop's thread.
    """

    def __init__(self, fd: int, backlog: Backlog) -> None:
        self.backlog = backlog
        self._fd = fd
        self._loop = asyncio.get_running_loop()
        self._frames: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._pending = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._broken = False
        threading.Thread(target=self._pump, name="delegation-stdout", daemon=True).start()

    def send(self, frame: bytes) -> None:
        """Hand ``frame`` over: it counts in the backlog until it is written."""
        if self._broken:
            return
        self.backlog.hold(len(frame))
        self._pending += len(frame)
        self._idle.clear()
        self._frames.put(frame)

    async def close(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the backlog to be written, then let the
        thread go (it closes the descriptor once it is done)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        self._frames.put(None)

    def _written(self, size: int) -> None:
        self._pending -= size
        self.backlog.free(size)
        if self._pending == 0:
            self._idle.set()

    def _pump(self) -> None:
        try:
            while (batch := self._next_batch()) is not None:
                if not self._broken:
                    try:
                        _write_all(self._fd, batch)
                    except OSError:  # the reader went away: drop the rest
                        self._broken = True
                with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                    self._loop.call_soon_threadsafe(self._written, len(batch))
        finally:
            os.close(self._fd)

    def _next_batch(self) -> bytes | None:
        """The next frames joined (one write for many small answers); None: stop."""
        first = self._frames.get()
        if first is None:
            return None
        parts = [first]
        size = len(first)
        while size < CHUNK and not self._frames.empty():
            frame = self._frames.get_nowait()
            if frame is None:
                self._frames.put(None)  # stop after this batch
                break
            parts.append(frame)
            size += len(frame)
        return b"".join(parts)


async def wait_until(
    tasks: set[asyncio.Task[None]], timeout: float, interrupt: asyncio.Event | None = None
) -> None:
    """Wait until every task is done, ``timeout`` passes or ``interrupt`` is set."""
    if not tasks:
        return
    waiters: set[asyncio.Future[Any]] = {asyncio.ensure_future(asyncio.wait(tasks))}
    if interrupt is not None:
        waiters.add(asyncio.ensure_future(interrupt.wait()))
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()  # the waiter only: never the tasks it watched
        await asyncio.gather(*waiters, return_exceptions=True)


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def allowed_peer(sock: socket.socket | None, allowed_uid: int) -> bool:
    """Whether the peer on ``sock`` runs as ``allowed_uid``."""
    try:
        return sock is not None and peer_uid(sock) == allowed_uid
    except OSError:  # it hung up before we asked
        return False


def check_socket_path(path: str) -> bool:
    """Whether a socket is at ``path``; anything else there is refused (a mistyped
    ``--socket`` naming the database must not delete it). Changes nothing."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(mode):
        raise FileExistsError(f"{path} exists and is not a socket; not replacing it")
    return True


def remove_stale_socket(path: str) -> None:
    """Remove a socket a previous host left at ``path``; never remove anything else.
    Call it only while holding the database: before, the socket may be a live host's."""
    if check_socket_path(path):
        os.unlink(path)


# sockaddr_un's path holds 108 bytes, its terminating NUL included.
_SUN_PATH_MAX = 107


def listening_socket(path: str) -> socket.socket:
    """A Unix socket listening at ``path``, mode 0600 from birth, that appears at
    ``path`` only once it listens: a peer that waits for the file never finds it
    refusing connections. It is bound under a temporary name beside ``path`` and
    linked into place (where that name would be too long, bound at ``path``)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    staged = os.path.join(os.path.dirname(path), f".{secrets.token_hex(4)}.sock")
    direct = len(os.fsencode(staged)) > _SUN_PATH_MAX
    previous = os.umask(0o177)  # the socket is born 0600: no window for other users
    try:
        sock.bind(path if direct else staged)
        os.chmod(path if direct else staged, 0o600)
        sock.listen(100)
        if not direct:
            os.link(staged, path)  # never over anything at ``path`` (bind refused that too)
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(previous)
        if not direct:
            with contextlib.suppress(OSError):
                os.unlink(staged)
    sock.setblocking(False)
    return sock


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except BlockingIOError:
            # A terminal shared with stdin, which asyncio made non-blocking.
            select.select([], [fd], [])
            continue
        view = view[written:]


async def open_stdin(limit: int) -> tuple[Read, Callable[[], None]]:
    """A ``read`` of standard input and a function that closes it.

    Pipes, sockets and terminals are read by the event loop; a regular file, or a
    device the loop cannot poll (epoll refuses ``/dev/null``), is read in a thread:
    its reads never wait for a peer, so the thread never outlives the host.
    """
    loop = asyncio.get_running_loop()
    fd = sys.stdin.fileno()
    mode = os.fstat(fd).st_mode
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or os.isatty(fd):
        reader = asyncio.StreamReader(limit=limit)
        protocol = asyncio.StreamReaderProtocol(reader)
        transport, _ = await loop.connect_read_pipe(lambda: protocol, sys.stdin)
        return reader.read, transport.close

    async def read(size: int) -> bytes:
        return await loop.run_in_executor(None, os.read, fd, size)

    return read, lambda: None
