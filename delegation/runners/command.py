"""The ``command`` runner: each profile runs as a subprocess that speaks in lines.

Every run guarantees:

* **argv** is the profile's template filled from fixed placeholders (``{message}``,
  ``{profile}``, ``{conversation_id}``, ``{run_id}``, ``{cwd}``; ``{{`` for a literal
  brace), executed without a shell in the child's ``cwd``, leading a new process group.
* **The environment is built from scratch**: the allowlisted names of the host's
  (PATH, HOME, LANG, LC_ALL, TZ, TMPDIR, configured extras), then
  ``DELEGATION_CONVERSATION_ID``, ``DELEGATION_RUN_ID``, ``DELEGATION_PROFILE`` and,
  on a resume, ``DELEGATION_RECOVERY_ATTEMPT`` and ``DELEGATION_LAST_SEQUENCE``.
* **stdin** gets the message, then each steer as one line (its line breaks become
  spaces); it stays open until stdout ends. A resumed child gets the steers earlier
  attempts were handed first, in order, right after the message (SPEC §11's
  ``Recovery.delivered_steers``): it keeps the heading it was steered to. A profile
  with ``close_stdin`` gets the message and then the end of stdin: its steers stay
  queued, never written (logged ``steers_not_delivered`` when the run ends).
* **A profile's ``timeout_s``** is the run's ``max_run_s``: the engine cancels a child
  running longer with "child deadline exceeded" (``EngineConfig.max_run_s``, if smaller,
  applies instead).
* **stdout**: a JSON object line that decodes as an :class:`Event` is that event (the
  engine assigns its sequence; a ``result`` event is the output); any other non-blank
  line is a ``text`` event.
* **A non-zero exit** is the run's error, with the code and stderr's tail.
* **Cancellation** sends SIGTERM to the group, SIGKILL after ``grace_s``, and
  re-raises once the process is reaped.

* **Containment** (SPEC §10, :mod:`delegation.runners.containment`): the host is made
  non-dumpable; the command starts through a launcher that ties it to the host's life,
  checks its working directory after the ``chdir``, confines it with Landlock (its cwd
  and a private ``TMPDIR`` read-write, ``read_only`` directories read-only) and refuses
  it Unix sockets; its pid is recorded durably before its program runs. A confinement
  that would reach the database's directory, or let it write the host's own code or
  this runner's TOML (``ctx.protected``, SPEC §17), is refused before anything starts.
  The private ``TMPDIR`` is removed when the run ends; one a killed host left is removed
  at the next boot (:mod:`delegation.tmpdirs`).

A resume after a host restart runs the command again from the start, with its message,
the steers it had been given and ``DELEGATION_RECOVERY_ATTEMPT`` and
``DELEGATION_LAST_SEQUENCE`` in its environment: a CLI agent that can resume its own
session (keyed, say, by ``DELEGATION_RUN_ID``) does so. Hazard:
``{message}`` is caller input; a template should put it after ``--``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from delegation import errors, tmpdirs
from delegation import os_processes as processes
from delegation.codec import decode
from delegation.runners.command_config import (
    DATABASE_CREDENTIALS,
    PLACEHOLDERS,
    CommandConfigError,
    ProfileOptions,
    check_env_names,
    check_grace,
    check_profile,
    settings,
)
from delegation.runners.containment import (
    DEFAULT_NET_CONNECT,
    DEFAULT_READ_ONLY,
    DEFAULT_READ_WRITE,
    Containment,
    ContainmentRefused,
    check_paths,
    check_ports,
    refusal,
)
from delegation.runs import ChildContext, Recovery
from delegation.wire import Event, Identity, Preset, Request

__all__ = [
    "DATABASE_CREDENTIALS",
    "DEFAULT_ENV_ALLOW",
    "PLACEHOLDERS",
    "CommandConfigError",
    "CommandFailed",
    "CommandRun",
    "CommandRunner",
    "ProfileOptions",
    "UnknownProfile",
    "child_env",
    "parse_line",
    "steer_line",
]

log = logging.getLogger("delegation.runners.command")

DEFAULT_ENV_ALLOW = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR")
DEFAULT_GRACE_S = 5.0
STDERR_TAIL_BYTES = 64 * 1024
ERROR_TAIL_CHARS = 4096
MAX_LINE_BYTES = 8 * 1024 * 1024  # one stdout line; a result line is kept whole
FLUSH_EVERY = 256  # events between commits awaited, so a chatty command cannot outrun SQLite
_CHUNK = 64 * 1024
_POLL_S = 0.01
_PIPES_S = 1.0


class UnknownProfile(LookupError):
    """No command is configured for the requested profile (raised by ``prepare``)."""


class CommandFailed(RuntimeError):
    """The command could not start or exited non-zero; ``stderr`` keeps its tail."""

    def __init__(self, message: str, stderr: str = "") -> None:
        super().__init__(message)
        self.stderr = stderr


class CommandRunner:
    """Runs each profile's argv template as a subprocess (see the module docstring).

    ``profiles`` maps a preset name to its argv template, or to a mapping of ``argv``
    and the profile's options, ``timeout_s`` and ``close_stdin``
    (:mod:`delegation.runners.command_config`); ``env_allow`` adds names to
    :data:`DEFAULT_ENV_ALLOW`; ``grace_s`` is the wait between SIGTERM and SIGKILL;
    ``read_only`` and ``read_write`` add directories (or files) a child may read, or
    read and write, to the defaults of :mod:`delegation.runners.containment`;
    ``net_connect`` replaces the TCP ports a child may connect to (default ``[443]``).
    Everything is checked and frozen here: a bad template, name, option or grace raises
    :class:`CommandConfigError` now, never at run time.
    """

    def __init__(
        self,
        profiles: Mapping[str, Sequence[str] | Mapping[str, Any]],
        *,
        env_allow: Iterable[str] = (),
        grace_s: float = DEFAULT_GRACE_S,
        read_only: Sequence[str] = (),
        read_write: Sequence[str] = (),
        net_connect: Sequence[int] = DEFAULT_NET_CONNECT,
    ) -> None:
        if not isinstance(profiles, Mapping) or not profiles:
            raise CommandConfigError("the command runner needs at least one profile")
        checked = {name: check_profile(name, value) for name, value in profiles.items()}
        self.profiles: Mapping[str, tuple[str, ...]] = MappingProxyType(
            {name: argv for name, (argv, _) in checked.items()}
        )
        self.options: Mapping[str, ProfileOptions] = MappingProxyType(
            {name: options for name, (_, options) in checked.items()}
        )
        self.env_allow: tuple[str, ...] = tuple(
            dict.fromkeys([*DEFAULT_ENV_ALLOW, *check_env_names(env_allow)])
        )
        self.grace_s = check_grace(grace_s)
        try:
            extra_ro, extra_rw, ports = (
                check_paths(read_only, "read_only"),
                check_paths(read_write, "read_write"),
                check_ports(net_connect, "net_connect"),
            )
        except ValueError as exc:
            raise CommandConfigError(str(exc)) from None
        self.containment = Containment(
            read_only=tuple(dict.fromkeys([*DEFAULT_READ_ONLY, *extra_ro])),
            read_write=tuple(dict.fromkeys([*DEFAULT_READ_WRITE, *extra_rw])),
            net_connect=ports,
        )

    def protect_paths(self, paths: Iterable[str]) -> None:
        """Directories no child may reach, beyond ``ctx.protected`` (the engine's own set,
        which each run checks whatever wraps this runner); kept for v2 callers."""
        self.containment.protect(paths)

    @classmethod
    def from_file(cls, path: Path | str) -> CommandRunner:
        """A runner from the ``[command]`` table of a TOML file; no child may write the
        file (its ``env_allow`` decides what the next host start hands children).

        Raises:
            CommandConfigError: the file is not TOML or its settings are invalid.
            OSError: the file cannot be read.
        """
        path = Path(path)
        try:
            document = tomllib.loads(path.read_text(encoding="utf-8"))
            runner = cls(**settings(document))
        except (tomllib.TOMLDecodeError, CommandConfigError) as exc:
            raise CommandConfigError(f"{path}: {exc}") from exc
        runner.containment.protect_host([str(path)])
        return runner

    async def prepare(
        self, request: Request, preset: Preset, identity: Identity, recovery: Recovery | None
    ) -> CommandRun:
        """Freeze one run's argv template, placeholder values and environment.

        Reads the host's environment, starts nothing. Raises :class:`UnknownProfile`
        when no command is configured for ``preset.name``.
        """
        template = self.profiles.get(preset.name)
        if template is None:
            raise UnknownProfile(f"the command runner has no profile {preset.name!r}")
        values = {
            "message": request.message,
            "profile": preset.name,
            "conversation_id": identity.conversation_id,
            "run_id": identity.run_id,
        }
        env = child_env(self.env_allow, identity, recovery)
        message = request.message if request.message.endswith("\n") else request.message + "\n"
        if recovery is not None:
            message += "".join(steer_line(steer) for steer in recovery.delivered_steers)
        options = self.options[preset.name]
        return CommandRun(
            template,
            MappingProxyType(values),
            MappingProxyType(env),
            message,
            self.grace_s,
            self.containment,
            max_run_s=options.timeout_s,
            close_stdin=options.close_stdin,
        )


def child_env(
    allow: Iterable[str],
    identity: Identity,
    recovery: Recovery | None,
    source: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The command's whole environment: the ``allow``ed names present in ``source``
    (default: the host's environment), then the ``DELEGATION_*`` variables."""
    host = os.environ if source is None else source
    env = {name: host[name] for name in allow if name in host}
    env["DELEGATION_CONVERSATION_ID"] = identity.conversation_id
    env["DELEGATION_RUN_ID"] = identity.run_id
    env["DELEGATION_PROFILE"] = identity.profile
    if recovery is not None:
        env["DELEGATION_RECOVERY_ATTEMPT"] = str(recovery.attempt)
        env["DELEGATION_LAST_SEQUENCE"] = str(recovery.last_sequence)
    return env


@dataclass(frozen=True, slots=True)
class CommandRun:
    """One prepared run; calling it with the child's context executes the command."""

    template: tuple[str, ...]
    values: Mapping[str, str]
    env: Mapping[str, str]
    message: str  # the request's message line, and on a resume the delivered steers' lines
    grace_s: float
    containment: Containment
    # The profile's timeout_s: the engine cancels the child past it, or past
    # EngineConfig.max_run_s if that is smaller (the Run protocol's ``max_run_s``).
    max_run_s: float | None = None
    close_stdin: bool = False  # stdin ends after the message: no steer reaches the command

    def argv(self, cwd: str) -> list[str]:
        """The template filled in; it cannot fail, the template was checked."""
        values = {**self.values, "cwd": cwd}
        return [item.format_map(values) for item in self.template]

    async def __call__(self, ctx: ChildContext) -> None:
        """Admit, run the command to its end, and raise :class:`CommandFailed` on a
        non-zero exit (or when its launcher refused it before the program ran). On
        cancellation the process is stopped and reaped first."""
        await ctx.admit()
        processes.make_undumpable()  # before any child exists: none may read the host
        self.containment.announce()
        tmpdir = tmpdirs.make()  # named for this host: the next boot removes it if we die
        try:
            await self._run(ctx, tmpdir)
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)

    async def _run(self, ctx: ChildContext, tmpdir: str) -> None:
        go_read, go_write = os.pipe()
        try:
            try:
                argv = self.containment.launcher(
                    self.argv(ctx.cwd), ctx.cwd, tmpdir, go_read, protected=ctx.protected
                )
            except ContainmentRefused as exc:
                raise CommandFailed(str(exc)) from None
            env = {**self.env, "TMPDIR": tmpdir}
            process = await _spawn(argv, env, go_read)
        except BaseException:
            os.close(go_write)  # no launcher waits on it
            raise
        finally:
            os.close(go_read)
        finished = False
        try:
            try:
                await ctx.track_process(process.pid)  # durable before the program runs
                os.write(go_write, b"1")
            except BrokenPipeError:
                pass  # the launcher refused already; its exit says why
            finally:
                os.close(go_write)
            code, stderr = await _converse(
                process, ctx, self.message.encode(), close=self.close_stdin
            )
            finished = True
        finally:
            if not finished:
                await _stop(process, self.grace_s)
            if self.close_stdin and ctx.steers_waiting:
                log.warning(
                    "%d steer(s) not delivered: profile %r closes the command's stdin",
                    ctx.steers_waiting,
                    self.values["profile"],
                    extra={"action": "steers_not_delivered", "run_id": ctx.identity.run_id},
                )
        reach = self.containment.refused_reach(stderr, ctx.cwd, tmpdir)
        if reach is not None:  # a bare "Permission denied" is all the child was told
            log.warning(
                "command child %s: %s",
                ctx.identity.conversation_id,
                reach,
                extra={"action": "child_access_refused", "run_id": ctx.identity.run_id},
            )
        if code != 0:
            refused = refusal(code, stderr)
            if refused is not None:
                raise CommandFailed(refused, stderr)
            raise CommandFailed(_failure(self.template[0], code, stderr), stderr)


# --- the process ------------------------------------------------------------------


async def _spawn(argv: list[str], env: Mapping[str, str], go_fd: int) -> asyncio.subprocess.Process:
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


async def _converse(
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
    emitted = 0
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
        ctx.emit(event)
        emitted += 1
        if emitted % FLUSH_EVERY == 0:
            await ctx.flush()


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


async def _stop(process: asyncio.subprocess.Process, grace_s: float) -> None:
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


def _failure(program: str, code: int, stderr: str) -> str:
    how = f"exited with code {code}"
    if code < 0:
        with contextlib.suppress(ValueError):
            how += f" (killed by {signal.Signals(-code).name})"
    quoted = stderr[-ERROR_TAIL_CHARS:].strip()
    return f"command {program!r} {how}" + (f": {quoted}" if quoted else "")
