"""One live host per SQLite file (SPEC §9): an exclusive ``flock`` on the database file.

The lock is held on an open file description of the database file itself for the
engine's whole life. The kernel releases it when that description is closed, and so
when the process dies in any way (``kill -9`` too): a new host opens at once after a
crash, never after a timeout. SQLite's own locks are POSIX record locks, which on a
local Linux file system are independent of ``flock``, so this lock never blocks
SQLite's readers (the inspection commands) nor is released by SQLite closing one of
its own descriptors of the file.

Where it stops: ``flock`` is advisory and local. On NFS it is emulated with a POSIX
lock over the whole file (which would collide with SQLite's own locking), and two
machines sharing a network file system do not see each other's ``flock`` at all.
SQLite in WAL mode is unsafe on a network file system anyway; run one host per file
on a local disk, or use PostgreSQL for several hosts.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import threading
from pathlib import Path

from delegation import errors

# The database and its -wal and -shm hold every message, prompt, event and steer.
FILE_MODE = 0o600
_SIDE_FILES = ("-wal", "-shm", "-journal")

# The files this process holds, by (device, inode). Closing *any* descriptor of a file
# drops every POSIX lock the process holds on it, SQLite's included: a refused second
# open in this process must never close a descriptor of a file a live engine here uses.
_HELD: dict[tuple[int, int], HostLock] = {}
_HELD_GUARD = threading.Lock()


class HostLock:
    """The exclusive lock of one host on one database file."""

    def __init__(self, fd: int, path: Path, key: tuple[int, int]) -> None:
        self._fd: int | None = fd
        self.path = path
        self._key = key
        self._parked: list[int] = []  # refused opens of this file in this process

    @classmethod
    def acquire(cls, path: Path) -> HostLock:
        """Create the file (mode 0600) if it is missing and lock it exclusively.

        Nothing else is changed: a refused host has written no byte, created no file
        (the file existed) and changed no mode; modes are restricted by
        :meth:`restrict_modes`, once the file is known to be ours.

        Raises:
            errors.HostConflict: another live host holds the file.
            errors.StoreError: its directory is missing, or the file cannot be opened.
        """
        if not path.parent.is_dir():
            raise errors.StoreError(f"database directory {path.parent} does not exist")
        fd = _open(path)
        with _HELD_GUARD:
            info = os.fstat(fd)
            key = (info.st_dev, info.st_ino)
            holder = _HELD.get(key)
            if holder is not None:  # a live engine of this process: never close this fd now
                holder._parked.append(fd)
                raise errors.HostConflict()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)  # another process holds it: nothing of ours uses the file
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise errors.HostConflict() from None
                raise errors.StoreError(f"cannot lock {path}: {exc.strerror}") from exc
            lock = _HELD[key] = cls(fd, path, key)
        return lock

    def release(self) -> None:
        """Give the file back (closing the descriptor releases the lock); call it once
        nothing of this host uses the file any more."""
        with _HELD_GUARD:
            fd, self._fd = self._fd, None
            if fd is None:
                return
            if _HELD.get(self._key) is self:
                del _HELD[self._key]
            parked, self._parked = self._parked, []
        for descriptor in (*parked, fd):
            os.close(descriptor)

    def restrict_modes(self) -> None:
        """Take group and other access away from a file an older version (or another
        tool) created under a permissive umask; SQLite gives its -wal and -shm the
        database file's mode when it creates them. Call it only once the file is known
        to be a delegation database: another application's file keeps its mode."""
        assert self._fd is not None
        if os.fstat(self._fd).st_mode & 0o077:
            with contextlib.suppress(OSError):  # not ours to chmod: it stays readable
                os.fchmod(self._fd, FILE_MODE)
        for suffix in _SIDE_FILES:
            side = Path(f"{self.path}{suffix}")
            with contextlib.suppress(OSError):
                info = side.lstat()  # a symlink's target is not ours to chmod
                if stat.S_ISREG(info.st_mode) and info.st_mode & 0o077:
                    side.chmod(FILE_MODE)


def _open(path: Path) -> int:
    """A descriptor of the database file, created 0600 if missing (whatever the umask
    allows beyond that is masked off too). A file that cannot be opened for writing is
    locked read-only: SQLite then says why it cannot write it."""
    flags = os.O_CLOEXEC
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | flags, FILE_MODE)
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EROFS, errno.EPERM):
            raise errors.StoreError(f"cannot open {path}: {exc.strerror}") from exc
    try:
        return os.open(path, os.O_RDONLY | flags)
    except OSError as exc:
        raise errors.StoreError(f"cannot open {path}: {exc.strerror}") from exc
