"""How the command runner contains its children (design §10, §17, §23), on the host's side.

What each command child gets is decided here and carried out in the child itself by
:mod:`delegation.runners.child_launcher`, the launcher it starts through:

* the host is made non-dumpable before its first child starts;
* the child leads its own process group, dies with the host (``PR_SET_PDEATHSIG``),
  and its pid is recorded durably before its program runs, so a boot after a crash
  kills what is left of it before resuming;
* its working directory is checked after the ``chdir``, in the child;
* with Landlock (Linux 5.13+), it may write only beneath its working directory and a
  private temp dir (and ``read_write``), read only beneath ``read_only``, and nothing
  else: not the files of the database's credentials beneath those (carved out,
  :mod:`delegation.runners.child_view`); the directory of the host's database is refused
  as any of these, and the host's own code, the directories it imports from and its
  configuration (``ctx.protected``, the runner's TOML) as any it may write (design §17,
  :mod:`delegation.run.protection`); from ABI 4 on, TCP may connect only to
  ``net_connect`` ports and bind none;
* where namespaces are allowed (as root, or with unprivileged user namespaces), it is
  the first process of its own PID namespace with its own ``/proc``: it sees no other
  process, and every process it starts dies with it;
* a child of a root host runs as a user of its own (``child_uid``, default 65534),
  with what it may write mounted idmapped for it, so files only root may read are
  closed to it (where the mounts can be made; else it stays uid 0, logged once);
* a seccomp filter lets it create only TCP and UDP sockets and Unix socket pairs,
  ``listen`` only where the TOML allows, set no setuid or setgid bit and no
  parent-death signal but SIGKILL (:mod:`delegation.runners.seccomp_filter`);
* it has at most ``max_processes`` processes and ``max_memory`` bytes
  (:mod:`delegation.runners.limits`);
* it holds no capability, even when the host is root.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import platform
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from delegation.run.protection import NOTHING, Protected
from delegation.runners import child_launcher, child_view, limits, seccomp_filter
from delegation.runners.limits import ChildLimits

log = logging.getLogger("delegation.runners.command")

# What a program needs to start and run, read-only. The host's own Python is there so
# that ``python3`` children work wherever the host's interpreter lives.
DEFAULT_READ_ONLY: tuple[str, ...] = tuple(
    dict.fromkeys(
        [
            "/usr",
            "/bin",
            "/sbin",
            "/lib",
            "/lib32",
            "/lib64",
            "/libx32",
            "/etc",
            "/proc",
            "/sys",
            "/dev",
            sys.base_prefix,
            sys.prefix,
        ]
    )
)
# Device files programs write to; /dev itself stays read-only.
DEFAULT_READ_WRITE: tuple[str, ...] = (
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/tty",
    "/dev/random",
    "/dev/urandom",
)
# TCP ports a child may connect to: HTTPS, for agents that call their model.
DEFAULT_NET_CONNECT: tuple[int, ...] = (443,)
# The user a root host's children run as: nobody, who owns no file of the host.
DEFAULT_CHILD_USER = (65534, 65534)
LAUNCHER = (sys.executable, "-I", "-S", child_launcher.__file__)


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 where it has none."""
    calls = {"x86_64": 444, "aarch64": 444}.get(platform.machine())
    if calls is None or sys.platform != "linux":
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    version = libc.syscall(calls, None, ctypes.c_size_t(0), 1)
    return max(int(version), 0)


def socket_filter_available() -> bool:
    return sys.platform == "linux" and seccomp_filter.available()


@functools.cache
def _probe() -> dict[str, object]:
    """What this machine lets a child have, found once per process by trying it in a
    throwaway launcher (a few milliseconds): whether it works depends on the kernel,
    its settings and the container around it."""
    if sys.platform != "linux":
        return {}
    try:
        probe = subprocess.run(
            [*LAUNCHER, "--probe", tempfile.gettempdir()],
            capture_output=True,
            timeout=30,
            check=False,
            cwd="/",
        )
        found = json.loads(probe.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def namespace_mode() -> str | None:
    """How this machine lets a child have its own PID namespace and ``/proc``:
    ``"root"``, ``"user"`` (an unprivileged user namespace), or None where it does not."""
    mode = _probe().get("namespaces")
    return mode if mode in child_launcher.NAMESPACE_MODES else None


def idmap_available() -> bool:
    """Whether a root host may mount a directory idmapped for its child's user here."""
    return _probe().get("idmap") is True


class ContainmentRefused(RuntimeError):
    """A child's confinement would give it the host's database, code or configuration."""


@dataclass
class Containment:
    """The confinement settings of one command runner."""

    read_only: tuple[str, ...] = DEFAULT_READ_ONLY
    read_write: tuple[str, ...] = DEFAULT_READ_WRITE
    protected: Protected = field(default_factory=Protected)  # beyond what the engine protects
    net_connect: tuple[int, ...] = DEFAULT_NET_CONNECT
    landlock: int = field(default_factory=landlock_abi)
    socket_filter: bool = field(default_factory=socket_filter_available)
    namespaces: str | None = field(default_factory=namespace_mode)
    listen: bool = False  # may a child listen (on a port Landlock lets it bind)
    max_processes: int = limits.DEFAULT_MAX_PROCESSES
    max_memory: int = limits.DEFAULT_MAX_MEMORY
    child_user: tuple[int, int] = DEFAULT_CHILD_USER  # a root host's children's; 0: root
    idmap: bool = field(default_factory=idmap_available)
    cgroups: dict[str, str] | None = field(default_factory=limits.group_roots)
    announced: bool = False

    @property
    def user(self) -> tuple[int, int] | None:
        """The (uid, gid) a child runs as when not the host's: a root host's children,
        where namespaces and idmapped mounts let its workspace be given to it."""
        if os.geteuid() != 0 or self.child_user[0] == 0:
            return None
        return self.child_user if self.namespaces == "root" and self.idmap else None

    def announce(self) -> None:
        """Say once, in the host's log, what is not enforced on this kernel."""
        if self.announced:
            return
        self.announced = True
        if not self.landlock:
            log.warning(
                "Landlock is not available: command children are not confined to their"
                " working directory (the other protections still hold)",
                extra={"action": "landlock_unavailable"},
            )
        elif self.landlock < 4:
            log.warning(
                "Landlock ABI %d has no network rules: command children can reach any"
                " TCP port (the other protections still hold)",
                self.landlock,
                extra={"action": "landlock_network_unavailable"},
            )
        if not self.socket_filter:
            log.warning(
                "no socket filter on %s: command children can connect to Unix sockets",
                platform.machine(),
                extra={"action": "socket_filter_unavailable"},
            )
        if not self.namespaces:
            log.warning(
                "namespaces are not allowed here: command children see every process and"
                " a descendant that leaves their process group can outlive them",
                extra={"action": "namespaces_unavailable"},
            )
        if os.geteuid() == 0 and self.user is None:
            why = (
                "child_uid = 0"
                if self.child_user[0] == 0
                else "no mount namespace here"
                if self.namespaces != "root"
                else "no idmapped mounts here"
            )
            log.warning(
                "command children of this root host run as uid 0 (%s): a file only root"
                " may read is readable to them where Landlock lets them in (/etc is)",
                why,
                extra={"action": "root_files_readable"},
            )
        if self.cgroups is None:
            held = (
                "each child's processes by RLIMIT_NPROC in its user namespace"
                if self.namespaces == "user"
                else "no kernel limit on a child's processes (one reaching max_processes is ended)"
            )
            log.warning(
                "no control groups for command children: %s; each process's memory by"
                " RLIMIT_DATA and RLIMIT_AS (what it maps, shared and memfd memory too), not"
                " the child's processes together, nor memory-backed files it keeps unmapped",
                held,
                extra={"action": "cgroups_unavailable"},
            )

    def protect(self, paths: Iterable[str]) -> None:
        """Directories no child may reach, as the host's database directory."""
        self.protected |= Protected.of(database=paths)

    def protect_host(self, paths: Iterable[str]) -> None:
        """The host's own files (its configuration): no child may write them."""
        self.protected |= Protected.of(host=paths)

    def check(self, protected: Protected = NOTHING) -> None:
        """Refuse a configuration whose own roots (``read_write``, ``read_only``) reach
        what is protected, once, when a host starts: not only per child.

        Raises:
            ContainmentRefused: as :meth:`launcher` would for every child.
        """
        refused = (self.protected | protected).refusal(self.read_write, self.read_only)
        if refused is not None:
            raise ContainmentRefused(refused)

    def refused_reach(self, stderr: str, cwd: str, tmpdir: str) -> str | None:
        """What the host's log says of a child (run in ``cwd`` with ``tmpdir``) whose
        stderr reports an access refused (:data:`DENIED`); None when it reports none,
        or where Landlock confines nothing.

        The paths its stderr names beside the refusal are placed against what Landlock
        let the child reach: outside every root, or beneath a read-only one. A path
        beneath a writable root was refused by its file mode, not Landlock: not named.
        Where no path beyond its reach is named, the message lists its roots instead.
        """
        lines = [line for line in stderr.splitlines() if DENIED in line]
        if not lines or not self.landlock:
            return None
        writable = [cwd, tmpdir, *self.read_write]
        rw = [os.path.realpath(root) for root in writable]
        ro = [os.path.realpath(root) for root in self.read_only]
        named: dict[str, str] = {}
        for path in (path for line in lines for path in _PATH.findall(line)):
            real = os.path.realpath(path)
            if not _beneath(real, rw) and len(named) < _NAMED_AT_MOST:
                named.setdefault(path, "read-only for it" if _beneath(real, ro) else "outside it")
        if named:
            said = ", ".join(f"{path} ({where})" for path, where in named.items())
            return f"its confinement refused what its stderr names: {said}"
        ports = ", ".join(map(str, self.net_connect)) if self.landlock >= 4 else "any"
        return (
            f"its stderr says {DENIED!r} and names no path beyond its reach: it may write"
            f" beneath {', '.join(writable)}; read beneath {', '.join(self.read_only)};"
            f" connect to TCP ports {ports or 'none'}"
            + ("; create only TCP and UDP sockets" if self.socket_filter else "")
        )

    def launcher(
        self,
        argv: Sequence[str],
        cwd: str,
        tmpdir: str,
        go_fd: int,
        protected: Protected = NOTHING,
        bounds: ChildLimits | None = None,
    ) -> list[str]:
        """The argv that starts ``argv`` through the launcher, confined as configured
        (``bounds``: the child's control groups, if it has any).

        Raises:
            ContainmentRefused: an allowed directory holds the database's directory, or
                one it may write holds or lies inside the host's code or the database's
                credentials, or holds a directory the host imports from (``protected``,
                with this runner's own).
        """
        guarded = self.protected | protected
        writable = [cwd, tmpdir, *self.read_write]
        refused = guarded.refusal(writable, self.read_only)
        if refused is not None:
            raise ContainmentRefused(refused)
        user = self.user
        plan = child_view.user_plan(writable, self.read_only, user) if user else {}
        read_only = child_view.read_rules(self.read_only, guarded.hidden(), plan.get("closed", ()))
        spec: dict[str, object] = {
            "parent": os.getpid(),
            "cwd": cwd,
            "read_write": writable,
            "read_only": read_only,
            "net_connect": list(self.net_connect),
            "landlock": bool(self.landlock),
            "seccomp": seccomp_filter.compiled(
                listen=self.listen, ipc=self.namespaces is not None
            ).hex()
            if self.socket_filter
            else None,
            "namespaces": self.namespaces,
            "go_fd": go_fd,
            "cgroups": bounds.procs if bounds is not None else [],
        }
        if user is not None:
            spec["user"] = list(user)
            spec["idmapped"] = [tmpdir, *self.read_write]
            spec.update(plan)
        if bounds is None or not bounds.groups:
            # What each process maps, shared and memfd mappings too (RLIMIT_DATA counts
            # private memory only): SPEC §31.
            spec["rlimits"] = {"data": self.max_memory, "as": self.max_memory}
            if self.namespaces == "user":  # counted in its own user namespace only
                spec["nproc"] = self.max_processes + 1  # and its keeper
        return [*LAUNCHER, json.dumps(spec), *argv]

    def bounds(self) -> ChildLimits:
        """A child's limits: control groups of its own where the host can make them.

        Raises:
            OSError: the groups could not be made.
        """
        return ChildLimits.make(self.cgroups, self.max_processes, self.max_memory)


def refusal(code: int, stderr: str) -> str | None:
    """The launcher's reason when it refused before the program ran, else None."""
    if code != child_launcher.REFUSED:
        return None
    for line in stderr.splitlines():
        if line.startswith(child_launcher.MARKER):
            return line[len(child_launcher.MARKER) :]
    return "child process ended before its program started"


# What a refusal by Landlock (or the socket filter) reads as in a program's message:
# strerror(EACCES). The kernel tells the program no more than that, and nothing of it
# reaches the host: Landlock's own audit records (ABI 7) need the audit subsystem on
# and a reader of it with CAP_AUDIT_READ, which a host cannot count on.
DENIED = "Permission denied"
# An absolute path in a message: up to a blank, a quote, a colon or a bracket.
_PATH = re.compile(r"(?<![\w.~-])/[^\s\x00-\x1f\x7f'\"`:,;()\[\]{}<>]{0,4095}")
_NAMED_AT_MOST = 5


def _beneath(path: str, roots: Sequence[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def check_paths(paths: object, name: str) -> tuple[str, ...]:
    """A TOML list of absolute directories."""
    if isinstance(paths, str) or not isinstance(paths, list | tuple):
        raise ValueError(f"{name} must be a list of absolute paths, not {paths!r}")
    for path in paths:
        if not isinstance(path, str) or not os.path.isabs(path) or "\0" in path:
            raise ValueError(f"{name} must list absolute paths, not {path!r}")
    return tuple(paths)


def check_ports(ports: object, name: str) -> tuple[int, ...]:
    """A TOML list of TCP port numbers (1-65535)."""
    if not isinstance(ports, list | tuple):
        raise ValueError(f"{name} must be a list of TCP ports, not {ports!r}")
    for port in ports:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"{name} must list TCP ports (1-65535), not {port!r}")
    return tuple(dict.fromkeys(ports))
