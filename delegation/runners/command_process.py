"""A command child's process, on the host's side (:mod:`delegation.runners.command`):
spawned through its launcher, conversed with in lines (the message and steers on stdin,
events on stdout, stderr's tail kept), watched against its limits, and stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Mapping

from delegation import errors
from delegation.codec import decode
from delegation.run.context import ChildContext
from delegation.run.emits import is_engine_kind
from delegation.runners.limits import ChildLimits
from delegation.wire import Event

log = logging.getLogger("delegation.runners.command")

STDERR_TAIL_BYTES = 64 * 1024
ERROR_TAIL_CHARS = 4096
MAX_LINE_BYTES = 8 * 1024 * 1024  # one stdout line; a result line is kept whole
FLUSH_EVERY = 256  # events between commits awaited, so a chatty command cannot outrun SQLite
_CHUNK = 64 * 1024
_POLL_S = 0.01
_LIMITS_POLL_S = 0.2
_PIPES_S = 1.0


class CommandFailed(RuntimeError):
    """The command could not start or exited non-zero; ``stderr`` keeps its tail."""

    def __init__(self, message: str, stderr: str = "") -> None:
        super().__init__(message)
        self.stderr = stderr


async def watch_limits(process: asyncio.subprocess.Process, bounds: ChildLimits) -> str | None:
    """Wait until the child reaches a limit (:meth:`ChildLimits.exceeded`), then kill
    its process group (its keeper: its namespace ends with it) and say which."""
    loop = asyncio.get_running_loop()
    while process.returncode is None:
        await asyncio.sleep(_LIMITS_POLL_S)
        exceeded = await loop.run_in_executor(None, bounds.exceeded, process.pid)
        if exceeded is not None:
            _signal_group(process, signal.SIGKILL)
            return exceeded
    return None


async def remove_groups(bounds: ChildLimits) -> None:
    """Remove the child's control groups once its last process has left them (the
    kernel ends what was left in its namespace a moment after its program)."""
    for _ in range(50):
        if bounds.remove():
            return
        await asyncio.sleep(0.02)


async def spawn(argv: list[str], env: Mapping[str, str], go_fd: int) -> asyncio.subprocess.Process:
    try:
        return await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd="/",  # the launcher changes into the child's cwd and checks it there
            env=dict(env),
            limit=MAX_LINE_BYTES,
            start_new_session=True,  # its own process group: a stop reaches its children too
            pass_fds=(go_fd,),
        )
    except (OSError, ValueError) as exc:
        raise CommandFailed(f"command {argv[0]!r} could not start: {exc}") from exc


async def converse(
    process: asyncio.subprocess.Process, ctx: ChildContext, message: bytes, *, close: bool
) -> tuple[int, str]:
    """Feed stdin (the message, then steers; or, ``close``, the message and its end) and
    read stdout and stderr until the command exits; its code and stderr.

    The command's end is its process's exit: a descendant that left its process group
    (where no PID namespace ends it) may hold stdout open for ever, so once the process
    has exited its pipes get :data:`_PIPES_S` to drain, and its group is killed."""
    stdin, stdout, stderr = _pipes(process)
    tail = bytearray()
    feeder = asyncio.create_task(_feed(stdin, ctx, message, close))
    collector = asyncio.create_task(_collect(stderr, tail))
    reader = asyncio.create_task(_read_events(stdout, ctx))
    exited = asyncio.create_task(_exited(process))
    tasks = (feeder, collector, reader, exited)
    try:
        await asyncio.wait((reader, exited), return_when=asyncio.FIRST_COMPLETED)
        await asyncio.wait((reader,), timeout=_PIPES_S if exited.done() else None)
        if reader.done():
            reader.result()  # a line over the limit fails the run
        feeder.cancel()
        stdin.close()
        await exited
        _signal_group(process, signal.SIGKILL)  # nothing of its group outlives it
        await asyncio.wait((collector,), timeout=_PIPES_S)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    _release(process)
    assert process.returncode is not None
    return process.returncode, tail.decode("utf-8", "replace")


async def _exited(process: asyncio.subprocess.Process) -> None:
    """Return once the process has exited; ``process.wait()`` also waits for every pipe
    to close, which a descendant may put off for ever. Linux's pidfd says when it exits;
    elsewhere this waits for ``wait()``."""
    try:
        fd = os.pidfd_open(process.pid) if process.returncode is None else -1
    except ProcessLookupError:
        fd = -1  # reaped already: its return code is on its way
    except (AttributeError, OSError):
        await process.wait()  # no pidfd here
        return
    if fd >= 0:
        loop = asyncio.get_running_loop()
        ended = loop.create_future()

        def readable() -> None:
            if not ended.done():
                ended.set_result(None)

        loop.add_reader(fd, readable)
        try:
            await ended
        finally:
            loop.remove_reader(fd)
            os.close(fd)
    while process.returncode is None:  # set once the child watcher has reaped it
        await asyncio.sleep(_POLL_S)


async def _read_events(stdout: asyncio.StreamReader, ctx: ChildContext) -> None:
    emitted = forged = 0
    try:
        while True:
            try:
                line = await stdout.readline()
            except ValueError as exc:  # asyncio's LimitOverrunError, re-raised by readline
                raise CommandFailed(f"command wrote a line over {MAX_LINE_BYTES} bytes") from exc
            if not line:
                return
            event = parse_line(line)
            if event is None:
                continue
            if is_engine_kind(event.kind):  # a run may not forge the engine's (design §26)
                forged += 1
                if forged == 1:  # one note a run, however many: a flood is one line
                    _dropped(ctx, f"an event of the engine's kind {event.kind!r}")
                continue
            ctx.emit(event)
            emitted += 1
            if emitted % FLUSH_EVERY == 0:
                await ctx.flush()
    finally:
        if forged > 1:
            _dropped(ctx, f"{forged} events of the engine's kinds in all")


def _dropped(ctx: ChildContext, what: str) -> None:
    log.warning(
        "command child %s wrote %s: dropped",
        ctx.identity.conversation_id,
        what,
        extra={"action": "event_kind_refused", "run_id": ctx.identity.run_id},
    )


def parse_line(line: bytes) -> Event | None:
    """The event one stdout line stands for, or None for a blank line."""
    text = line.decode("utf-8", "replace").rstrip("\r\n")
    if not text.strip():
        return None
    if text.lstrip().startswith("{"):
        try:
            event = decode(text, Event)
        except errors.DelegationError:
            pass  # a JSON line that is not an event is still something the command said
        else:
            if event.kind.strip():
                return event  # its sequence is replaced by the engine's in ctx.emit
    return Event(kind="text", text=text)


async def _feed(
    stdin: asyncio.StreamWriter, ctx: ChildContext, message: bytes, close: bool
) -> None:
    """Write the message, then every steer as one line, until stdin breaks; or, with
    ``close``, the message and then the end of stdin (steers stay queued, untaken)."""
    line = message
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        while not stdin.is_closing():  # closing: the command stopped reading
            stdin.write(line)
            await stdin.drain()
            if close:
                stdin.close()  # the command reads to its end: give it one
                return
            steer = await ctx.wait_steer(None)  # no timeout: never None
            line = steer_line(str(steer)).encode()


def steer_line(steer: str) -> str:
    """A steer as the one stdin line a command reads: its line breaks become spaces."""
    return " ".join(steer.splitlines()) + "\n"


async def _collect(stderr: asyncio.StreamReader, tail: bytearray) -> None:
    while chunk := await stderr.read(_CHUNK):
        tail += chunk
        del tail[:-STDERR_TAIL_BYTES]


async def stop(process: asyncio.subprocess.Process, grace_s: float) -> None:
    """SIGTERM the process group, SIGKILL it after ``grace_s``; return once reaped.

    A second cancellation while waiting skips to SIGKILL; the process is reaped anyway.
    """
    stdin, stdout, stderr = _pipes(process)
    _signal_group(process, signal.SIGTERM)
    # wait() also waits for every pipe to close: keep reading so none stays paused.
    drains = [asyncio.create_task(_collect(s, bytearray())) for s in (stdout, stderr)]
    stdin.close()
    try:
        async with asyncio.timeout(grace_s):
            await process.wait()
    except TimeoutError:
        pass
    finally:
        _signal_group(process, signal.SIGKILL)  # also whatever of the group outlived SIGTERM
        while process.returncode is None:  # set once the child watcher has reaped it
            await asyncio.sleep(_POLL_S)
        # A descendant that left the group may hold the pipes open: wait only so long.
        await asyncio.wait(drains, timeout=_PIPES_S)
        for drain in drains:
            drain.cancel()
        await asyncio.gather(*drains, return_exceptions=True)
        _release(process)


def _release(process: asyncio.subprocess.Process) -> None:
    """Close the pipes of an exited process: a descendant that still holds one must not
    keep it open in this process (asyncio's ``Process`` has no public close)."""
    if process.returncode is not None:
        getattr(process, "_transport").close()  # noqa: B009


def _pipes(
    process: asyncio.subprocess.Process,
) -> tuple[asyncio.StreamWriter, asyncio.StreamReader, asyncio.StreamReader]:
    if process.stdin is None or process.stdout is None or process.stderr is None:
        raise RuntimeError("the command was started without pipes")
    return process.stdin, process.stdout, process.stderr


def _signal_group(process: asyncio.subprocess.Process, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)  # the group id is the leader's pid (start_new_session)


def failure(program: str, code: int, stderr: str) -> str:
    how = f"exited with code {code}"
    if code < 0:
        with contextlib.suppress(ValueError):
            how += f" (killed by {signal.Signals(-code).name})"
    quoted = stderr[-ERROR_TAIL_CHARS:].strip()
    return f"command {program!r} {how}" + (f": {quoted}" if quoted else "")
