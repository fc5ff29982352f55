"""How many processes and how much memory a command child may have (design §23).

Each child has at most ``max_processes`` processes (default 256) and ``max_memory``
bytes (2 GiB), set in the runner's TOML. How the kernel holds it depends on the host:

* **Control groups** (:data:`CGROUPS`): a root host on cgroup v1 with the ``pids`` and
  ``memory`` controllers gives each child a group of its own in both, beneath the
  host's own groups: ``pids.max`` is ``max_processes`` plus its keeper,
  ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes`` where swap is
  counted) is ``max_memory`` for the child's processes together. The launcher joins
  them before anything else. They are named like the child's private temp dir, for
  the host that made them: the next engine open removes those a killed host left.
* **Resource limits** (:data:`RLIMITS`) otherwise: in a user namespace of its own (an
  ordinary user's host where they are allowed) ``RLIMIT_NPROC`` counts the child's own
  processes; without one it would count every process of the host's user, so none is
  set. ``RLIMIT_DATA`` bounds each process's data (heap and private mappings) and
  ``RLIMIT_AS`` all it maps (shared and ``memfd`` mappings too: SPEC §31), each process
  alone, not the child's processes together; what a process keeps in a memory-backed file
  it no longer maps (a ``memfd``, a file on ``tmpfs``) only a control group counts.

Either way the host watches each child (:meth:`ChildLimits.exceeded`): one whose
process count reaches ``max_processes`` (a fork bomb), or whose group the kernel's OOM
killer acted in, is ended with an error that says which.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import signal
from dataclasses import dataclass, field
from pathlib import Path

from delegation import os_processes as processes
from delegation.runners import tmpdirs

log = logging.getLogger("delegation.runners.command")

DEFAULT_MAX_PROCESSES = 256
DEFAULT_MAX_MEMORY = 2 * 1024**3
CGROUPS, RLIMITS = "cgroups", "rlimits"
_CONTROLLERS = ("pids", "memory")
_SIZE = re.compile(r"\s*(\d+)\s*([KMGT]?)(i?B?)\s*\Z", re.IGNORECASE)


def parse_size(value: object, name: str = "max_memory") -> int:
    """A size in bytes: an integer, or a string such as ``"2 GiB"``, ``"512M"``.

    Raises:
        ValueError: anything else, or a size under 1 MiB.
    """
    size: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and (match := _SIZE.match(value)):
        size = int(match[1]) * 1024 ** " KMGT".index(match[2].upper() or " ")
    if size is None or not 2**20 <= size <= 2**62:
        raise ValueError(
            f"{name} must be a size in bytes of at least 1 MiB (an integer, or text as"
            f' "2 GiB"), not {value!r}'
        )
    return size


def check_count(value: object, name: str = "max_processes") -> int:
    """A process count: an integer from 2 (a program and one process of its) up."""
    if isinstance(value, bool) or not isinstance(value, int) or not 2 <= value <= 4_194_304:
        raise ValueError(f"{name} must be a whole number from 2 to 4194304, not {value!r}")
    return value


def _mounts() -> dict[str, str]:
    """Where each cgroup v1 controller of :data:`_CONTROLLERS` is mounted."""
    found: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split(" - ", 1)
            if len(fields) != 2 or not fields[1].startswith("cgroup "):
                continue
            options = fields[1].split()[2].split(",") if len(fields[1].split()) > 2 else []
            for name in _CONTROLLERS:
                if name in options:
                    found.setdefault(name, fields[0].split()[4])
    return found


def _own_groups() -> dict[str, str]:
    """This process's group in each cgroup v1 hierarchy, by controller."""
    found: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for name in controllers.split(","):
                found[name] = path
    return found


def group_roots() -> dict[str, str] | None:
    """The directories beneath which a root host makes its children's groups, by
    controller; None where it cannot (not root, no cgroup v1 ``pids`` and ``memory``,
    or not writable)."""
    if os.geteuid() != 0:
        return None
    mounts, own = _mounts(), _own_groups()
    roots = {}
    for name in _CONTROLLERS:
        if name not in mounts or name not in own:
            return None
        root = os.path.join(mounts[name], own[name].lstrip("/"))
        if not os.access(root, os.W_OK):
            return None
        roots[name] = root
    return roots


@dataclass
class ChildLimits:
    """One child's limits: its groups (if any) and how the host watches it."""

    max_processes: int
    max_memory: int
    groups: dict[str, str] = field(default_factory=dict)  # controller -> its directory
    _oom_kills: int = 0

    @classmethod
    def make(cls, roots: dict[str, str] | None, max_processes: int, max_memory: int) -> ChildLimits:
        """A child's groups beneath ``roots`` with its limits set (none without roots).

        Raises:
            OSError: a group could not be made or limited (what was made is removed).
        """
        limits = cls(max_processes, max_memory)
        if roots is None:
            return limits
        name = tmpdirs.prefix(processes.identify(os.getpid())) + secrets.token_hex(4)
        try:
            for controller, root in roots.items():
                path = os.path.join(root, name)
                os.mkdir(path, 0o755)
                limits.groups[controller] = path
            _write(limits.groups["pids"], "pids.max", max_processes + 1)  # and its keeper
            memory = limits.groups["memory"]
            _write(memory, "memory.limit_in_bytes", max_memory)
            if os.path.exists(os.path.join(memory, "memory.memsw.limit_in_bytes")):
                _write(memory, "memory.memsw.limit_in_bytes", max_memory)
            limits._oom_kills = _oom_kills(memory)
        except OSError:
            limits.remove()
            raise
        return limits

    @property
    def procs(self) -> list[str]:
        """The ``cgroup.procs`` files the launcher joins."""
        return [os.path.join(path, "cgroup.procs") for path in self.groups.values()]

    def exceeded(self, keeper: int) -> str | None:
        """What limit the child (its keeper's pid) has reached, or None."""
        if self.groups:
            if _events(self.groups["pids"]).get("max", 0) > 0:
                return f"child exceeded its process limit (max_processes {self.max_processes})"
            if _oom_kills(self.groups["memory"]) > self._oom_kills:
                return f"child exceeded its memory limit (max_memory {self.max_memory} bytes)"
            return None
        if len(_descendants(keeper)) >= self.max_processes:
            return f"child exceeded its process limit (max_processes {self.max_processes})"
        return None

    def remove(self) -> bool:
        """Kill what is left in the child's groups (a process that got out of its
        namespace's or process group's reach cannot get out of these), and remove them
        once they are empty; whether all are gone."""
        for controller, path in list(self.groups.items()):
            _kill_all(path)
            with contextlib.suppress(FileNotFoundError):
                try:
                    os.rmdir(path)
                except OSError:
                    continue  # processes still leaving: the next boot's sweep takes it
            del self.groups[controller]
        return not self.groups


def _kill_all(group: str) -> None:
    """SIGKILL every process in a group."""
    with contextlib.suppress(OSError, ValueError):
        for pid in Path(group, "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                os.kill(int(pid), signal.SIGKILL)


def _write(group: str, name: str, value: int) -> None:
    with open(os.path.join(group, name), "w") as file:
        file.write(str(value))


def _events(group: str) -> dict[str, int]:
    with contextlib.suppress(OSError, ValueError):
        text = Path(group, "pids.events").read_text()
        return {key: int(value) for key, value in (line.split() for line in text.splitlines())}
    return {}


def _oom_kills(group: str) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(group, "memory.oom_control").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    return 0


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux ``/proc/PID/task/TID/children``)."""
    found: list[int] = []
    queue = [pid]
    while queue and len(found) < 1_000_000:
        parent = queue.pop()
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{parent}/task"):
                with contextlib.suppress(OSError, ValueError):
                    kids = [
                        int(p)
                        for p in Path(f"/proc/{parent}/task/{task}/children").read_text().split()
                    ]
                    found += kids
                    queue += kids
    return found


def remove_stale() -> list[str]:
    """Remove the groups of children whose host has ended (killing what is left in
    them); the paths removed."""
    roots = group_roots()
    removed: list[str] = []
    for root in (roots or {}).values():
        with contextlib.suppress(OSError):
            for name in os.listdir(root):
                if name.startswith(tmpdirs.PREFIX) and tmpdirs.made_by_ended_host(name):
                    _kill_all(os.path.join(root, name))  # nothing of a dead host's child lives on
                    with contextlib.suppress(OSError):
                        os.rmdir(os.path.join(root, name))
                        removed.append(os.path.join(root, name))
    if removed:
        log.info(
            "removed %d control groups of hosts that ended",
            len(removed),
            extra={"action": "stale_cgroups_removed"},
        )
    return removed
