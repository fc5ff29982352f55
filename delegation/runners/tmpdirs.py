"""Private temp dirs of command children, named for the host that made them (design §17).

Each command child gets a private ``TMPDIR``, removed when its run ends; a host killed
with SIGKILL cannot remove it. So its name carries the host process's identity:
``delegation-child-NS-PID-START-BOOT-XXXXXXXX`` in the host's temp directory (the pid
namespace, the pid, its start ticks and the boot id's first 8 hex digits; see
:mod:`delegation.os_processes`). At every engine open, :func:`remove_stale` removes those
whose host no longer runs. It leaves alone:

* a directory whose host still runs: several hosts may share the machine;
* one made in another pid namespace (a container sharing ``/tmp``), where this host
  cannot tell whether its maker lives;
* anything that is not a directory of this user: another user's, a symlink;
* the random names of earlier versions (``delegation-child-XXXXXXXX``): nothing says
  whose they are, and a live host's child may be using one.

The contents were written by an untrusted child: removal never follows a symlink in
them (:func:`shutil.rmtree` works by descriptors where the system offers it, as Linux
does; where it does not, nothing is removed). Linux only; elsewhere the names are
random as before and nothing is removed.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import tempfile

from delegation import os_processes as processes

log = logging.getLogger("delegation.tmpdirs")

PREFIX = "delegation-child-"
_NAME = re.compile(r"delegation-child-(\d+)-(\d+)-(\d+)-([0-9a-f]{8})-[a-z0-9_]{8}\Z")


def _pid_namespace() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _boot(boot_id: str) -> str:
    return boot_id.replace("-", "")[:8]


def prefix(host: processes.ProcessId | None) -> str:
    """The name every private temp dir ``host`` (a process of this pid namespace) makes
    starts with."""
    namespace = _pid_namespace()
    if host is None or namespace is None or len(_boot(host.boot)) != 8:
        return PREFIX  # no /proc: nothing can tell later whether its host lives
    return f"{PREFIX}{namespace}-{host.pid}-{host.start}-{_boot(host.boot)}-"


def make() -> str:
    """A new private temp dir (mode 0700) in the temp directory, named for this host."""
    return tempfile.mkdtemp(prefix=prefix(processes.identify(os.getpid())))


def remove_stale(where: str | None = None) -> list[str]:
    """Remove the private temp dirs in ``where`` (default: the temp directory) that a
    host which has ended left behind; the paths removed. Never raises for a
    directory it cannot read or remove: it logs (``action=stale_tmpdir_kept``)."""
    if not shutil.rmtree.avoids_symlink_attacks:
        return []
    root = tempfile.gettempdir() if where is None else where
    try:
        names = [name for name in os.listdir(root) if name.startswith(PREFIX)]
    except OSError:
        return []
    removed = []
    for name in names:
        path = os.path.join(root, name)
        if not _stale(path, name):
            continue
        shutil.rmtree(path, ignore_errors=True)  # a child's odd modes: said below
        if os.path.lexists(path):
            log.warning(
                "cannot remove %s, a private temp dir a killed host left",
                path,
                extra={"action": "stale_tmpdir_kept"},
            )
        else:
            removed.append(path)
    if removed:
        log.info(
            "removed %d private temp dirs of hosts that ended",
            len(removed),
            extra={"action": "stale_tmpdirs_removed"},
        )
    return removed


def _stale(path: str, name: str) -> bool:
    """Whether ``path`` is this user's directory, made by a host of this pid namespace
    that no longer runs."""
    if not made_by_ended_host(name):
        return False
    try:
        found = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(found.st_mode) and found.st_uid == os.geteuid()


def made_by_ended_host(name: str) -> bool:
    """Whether ``name`` (a temp dir's, or a child's control group's) is one a host of
    this pid namespace made, and that host no longer runs."""
    match = _NAME.match(name)
    if match is None or int(match[1]) != _pid_namespace():
        return False
    boot = processes.boot_id()
    if match[4] != _boot(boot):
        return True  # made before the machine restarted
    return not processes.alive(processes.ProcessId(int(match[2]), int(match[3]), boot))
