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
  attempts were handed first, in order, right after the message (design §11's
  ``Recovery.delivered_steers``): it keeps the heading it was steered to. A profile
  with ``close_stdin`` gets the message and then the end of stdin: its steers stay
  queued, never written (logged ``steers_not_delivered`` when the run ends).
* **A profile's ``timeout_s``** is the run's ``max_run_s``: the engine cancels a child
  running longer with "cancelled: child deadline exceeded" (``EngineConfig.max_run_s``, if smaller,
  applies instead).
* **stdout**: a JSON object line that decodes as an :class:`Event` is that event (the
  engine assigns its sequence; a ``result`` event is the output); any other non-blank
  line is a ``text`` event. A line of one of the engine's kinds (``recovery``,
  ``input-required``, ``rewind``) is dropped, logged ``event_kind_refused``.
* **A non-zero exit** is the run's error, with the code and stderr's tail.
* **Cancellation** sends SIGTERM to the group, SIGKILL after ``grace_s``, and
  re-raises once the process is reaped.

* **Containment** (design §10, :mod:`delegation.runners.containment`): the host is made
  non-dumpable; the command starts through a launcher that ties it to the host's life,
  checks its working directory after the ``chdir``, confines it with Landlock (its cwd
  and a private ``TMPDIR`` read-write, ``read_only`` directories read-only) and refuses
  it Unix sockets; its pid is recorded durably before its program runs. A confinement
  that would reach the database's directory, or let it write the host's own code or
  this runner's TOML (``ctx.protected``, design §17), is refused before anything starts.
  The private ``TMPDIR`` is removed when the run ends; one a killed host left is removed
  at the next boot (:mod:`delegation.runners.tmpdirs`).

A resume after a host restart runs the command again from the start, with its message,
the steers it had been given and ``DELEGATION_RECOVERY_ATTEMPT`` and
``DELEGATION_LAST_SEQUENCE`` in its environment: a CLI agent that can resume its own
session (keyed, say, by ``DELEGATION_RUN_ID``) does so. Its lines are emits (design
§26): those that are, in order, the events its execution committed are not written
again; from the first that differs, every line is. Hazard:
``{message}`` is caller input; a template should put it after ``--``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from delegation import os_processes as processes
from delegation.run.context import ChildContext, Recovery
from delegation.run.protection import Protected, host_code, host_imports
from delegation.runners import limits, tmpdirs
from delegation.runners.command_config import (
    DATABASE_CREDENTIALS,
    PLACEHOLDERS,
    CommandConfigError,
    ProfileOptions,
    check_env_names,
    check_flag,
    check_grace,
    check_id,
    check_profile,
    check_resumes,
    check_runner_version,
    settings,
)
from delegation.runners.command_process import (
    CommandFailed,
    converse,
    failure,
    parse_line,
    remove_groups,
    spawn,
    steer_line,
    stop,
    watch_limits,
)
from delegation.runners.containment import (
    DEFAULT_CHILD_USER,
    DEFAULT_NET_CONNECT,
    DEFAULT_READ_ONLY,
    DEFAULT_READ_WRITE,
    Containment,
    ContainmentRefused,
    check_paths,
    check_ports,
    refusal,
)
from delegation.runners.limits import ChildLimits
from delegation.wire import Identity, Preset, Request

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


class UnknownProfile(LookupError):
    """No command is configured for the requested profile (raised by ``prepare``)."""


class CommandRunner:
    """Runs each profile's argv template as a subprocess (see the module docstring).

    ``profiles`` maps a preset name to its argv template, or to a mapping of ``argv``
    and the profile's options, ``timeout_s`` and ``close_stdin``
    (:mod:`delegation.runners.command_config`); ``env_allow`` adds names to
    :data:`DEFAULT_ENV_ALLOW`; ``grace_s`` is the wait between SIGTERM and SIGKILL;
    ``read_only`` and ``read_write`` add directories (or files) a child may read, or
    read and write, to the defaults of :mod:`delegation.runners.containment`;
    ``net_connect`` replaces the TCP ports a child may connect to (default ``[443]``);
    ``listen`` lets a child listen (on an ephemeral port: Landlock still refuses it
    every bind); ``max_processes`` (256) and ``max_memory`` (2 GiB; bytes, or text as
    ``"2 GiB"``) bound each child (:mod:`delegation.runners.limits`); ``child_uid`` and
    ``child_gid`` (65534) are the user a root host's children run as (0: root);
    ``version`` names the code its profiles run and ``resumes`` the older versions it
    can continue (design §34: the engine records it on every child; None: unversioned).
    Everything is checked and frozen here: a bad template, name, option or grace, or a
    ``read_write`` path that holds or lies in the host's code (or holds a directory it
    imports from), raises :class:`CommandConfigError` now, never at run time.
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
        listen: bool = False,
        max_processes: int = limits.DEFAULT_MAX_PROCESSES,
        max_memory: int | str = limits.DEFAULT_MAX_MEMORY,
        child_uid: int = DEFAULT_CHILD_USER[0],
        child_gid: int = DEFAULT_CHILD_USER[1],
        version: str | None = None,
        resumes: Sequence[str] = (),
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
        self.version = check_runner_version(version)
        self.resumes = check_resumes(resumes)
        try:
            extra_ro, extra_rw, ports = (
                check_paths(read_only, "read_only"),
                check_paths(read_write, "read_write"),
                check_ports(net_connect, "net_connect"),
            )
            processes, memory = limits.check_count(max_processes), limits.parse_size(max_memory)
        except ValueError as exc:
            raise CommandConfigError(str(exc)) from None
        self.containment = Containment(
            read_only=tuple(dict.fromkeys([*DEFAULT_READ_ONLY, *extra_ro])),
            read_write=tuple(dict.fromkeys([*DEFAULT_READ_WRITE, *extra_rw])),
            net_connect=ports,
            listen=check_flag("listen", listen),
            max_processes=processes,
            max_memory=memory,
            child_user=(check_id("child_uid", child_uid), check_id("child_gid", child_gid)),
        )
        self._check_reach()

    def _check_reach(self, protected: Protected | None = None) -> None:
        """Refuse ``read_write`` paths that would let a child write the host's code or a
        directory it imports from (and, given ``protected``, anything else the engine
        protects), when the host starts rather than at each child."""
        own = Protected.of(host=host_code(), imports=host_imports())
        try:
            self.containment.check(own if protected is None else own | protected)
        except ContainmentRefused as exc:
            raise CommandConfigError(f"read_write: {exc}") from None

    def check_confinement(self, protected: Protected) -> None:
        """The engine's check at open: this runner's own roots against what it protects
        (its database, credentials, code).

        Raises:
            CommandConfigError: as the constructor does.
        """
        self._check_reach(protected)

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
        try:
            runner.containment.check()
        except ContainmentRefused as exc:
            raise CommandConfigError(f"{path}: read_write: {exc}") from None
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
        non-zero exit (or when its launcher refused it before the program ran, or when
        it reached a limit and was ended). On cancellation the process is stopped and
        reaped first."""
        await ctx.admit()
        processes.make_undumpable()  # before any child exists: none may read the host
        if not self.containment.announced:
            self.containment.announce()
            await asyncio.get_running_loop().run_in_executor(None, limits.remove_stale)
        tmpdir = tmpdirs.make()  # named for this host: the next boot removes it if we die
        try:
            bounds = self.containment.bounds()
        except OSError as exc:
            shutil.rmtree(tmpdir, ignore_errors=True)
            raise CommandFailed(f"cannot make the child's limits: {exc}") from None
        try:
            await self._run(ctx, tmpdir, bounds)
        finally:
            shutil.rmtree(tmpdir, ignore_errors=True)
            await remove_groups(bounds)

    async def _run(self, ctx: ChildContext, tmpdir: str, bounds: ChildLimits) -> None:
        go_read, go_write = os.pipe()
        try:
            try:
                argv = self.containment.launcher(
                    self.argv(ctx.cwd), ctx.cwd, tmpdir, go_read, ctx.protected, bounds
                )
            except ContainmentRefused as exc:
                raise CommandFailed(str(exc)) from None
            env = {**self.env, "TMPDIR": tmpdir}
            process = await spawn(argv, env, go_read)
        except BaseException:
            os.close(go_write)  # no launcher waits on it
            raise
        finally:
            os.close(go_read)
        finished = False
        watcher = asyncio.create_task(watch_limits(process, bounds))
        try:
            try:
                await ctx.track_process(process.pid)  # durable before the program runs
                os.write(go_write, b"1")
            except BrokenPipeError:
                pass  # the launcher refused already; its exit says why
            finally:
                os.close(go_write)
            code, stderr = await converse(
                process, ctx, self.message.encode(), close=self.close_stdin
            )
            finished = True
        finally:
            watcher.cancel()
            if not finished:
                await stop(process, self.grace_s)
            if self.close_stdin and ctx.steers_waiting:
                log.warning(
                    "%d steer(s) not delivered: profile %r closes the command's stdin",
                    ctx.steers_waiting,
                    self.values["profile"],
                    extra={"action": "steers_not_delivered", "run_id": ctx.identity.run_id},
                )
        # Done by now if it killed the child: that kill is what ended the conversation.
        exceeded = watcher.result() if watcher.done() and not watcher.cancelled() else None
        if exceeded is None and code != 0:  # the kernel may have ended it first (OOM)
            exceeded = bounds.exceeded(process.pid)
        if exceeded is not None:
            log.warning(
                "command child %s: %s",
                ctx.identity.conversation_id,
                exceeded,
                extra={"action": "child_limit_reached", "run_id": ctx.identity.run_id},
            )
            raise CommandFailed(exceeded, stderr)
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
            raise CommandFailed(failure(self.template[0], code, stderr), stderr)
