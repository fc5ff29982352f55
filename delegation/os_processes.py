"""Operating-system processes of child runs (design §10): who they are, and ending them.

A process is named by its pid, its start time (clock ticks after boot, from
``/proc/PID/stat``) and the kernel's boot id, so that a recorded process is never
confused with a later one that got the same pid. Linux only; elsewhere nothing is
recorded and nothing is killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("delegation.os_processes")

_PR_SET_DUMPABLE = 4
_GONE_WAIT_S = 2.0


@dataclass(frozen=True, slots=True)
class ProcessId:
    """One process, for as long as the machine runs: (pid, start ticks, boot id)."""

    pid: int
    start: int
    boot: str


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _fields(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` from the state on (field 3), or None when the
    process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": comm may hold spaces


def _stat(pid: int) -> tuple[str, int] | None:
    """The state letter and start ticks of a live process, or None."""
    fields = _fields(pid)
    return None if fields is None else (fields[0], int(fields[19]))  # fields 3 and 22


def identify(pid: int) -> ProcessId | None:
    """The identity of a live process (None if it is gone or /proc is missing)."""
    stat = _stat(pid)
    return None if stat is None else ProcessId(pid, stat[1], boot_id())


def alive(process: ProcessId) -> bool:
    """Whether that very process still runs (a zombie has ended)."""
    if process.boot != boot_id():
        return False
    stat = _stat(process.pid)
    return stat is not None and stat[1] == process.start and stat[0] not in ("Z", "X")


def kill_group(process: ProcessId) -> bool:
    """SIGKILL a recorded process and its process group (it led one), if they are still
    the recorded ones; wait briefly until the leader and every process left in its
    group are gone (a killed process runs on until the kernel delivers the signal: a
    resume must not overlap it). Returns whether anything was signalled.

    The group is signalled when its leader is this very process, or when no process
    has the leader's pid any more: Linux gives out no pid still in use as a process
    group id, so a group with that id can then only be what is left of this one.
    """
    if process.boot != boot_id():
        return False  # the machine restarted: every process of that boot is gone
    stat = _stat(process.pid)
    if stat is not None and stat[1] != process.start:
        return False  # another process has the pid now; the old group is gone
    signalled = False
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
        signalled = True
    if stat is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(process.pid, signal.SIGKILL)
            signalled = True
    deadline = time.monotonic() + _GONE_WAIT_S
    while (alive(process) or (signalled and _group_alive(process.pid))) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.005)
    return signalled


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group ``pgid`` has not ended yet (a zombie has)."""
    for entry in Path("/proc").iterdir():
        fields = _fields(entry.name) if entry.name.isdigit() else None  # None: gone meanwhile
        if fields is not None and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True  # pgrp is field 5
    return False


_undumpable = False


def make_undumpable() -> bool:
    """Make this process non-dumpable (once): a process of the same user can then no
    longer read its ``/proc/PID/environ`` or memory, nor trace it. Returns False where
    the system does not offer it (not Linux)."""
    global _undumpable
    if _undumpable:
        return True
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        ok = bool(libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        ok = False
    if not ok:
        log.warning(
            "cannot make the host non-dumpable", extra={"action": "host_dumpable_unchanged"}
        )
    _undumpable = ok
    return ok
