"""One live host per SQLite file (design §9): an exclusive ``flock`` on the database file.

The lock is held on an open file description of the database file itself for the
engine's whole life. The kernel releases it when that description is closed, and so
when the process dies in any way (``kill -9`` too): a new host opens at once after a
crash, never after a timeout. SQLite's own locks are POSIX record locks, which on a
local Linux file system are independent of ``flock``, so this lock never blocks
SQLite's readers (the inspection commands) nor is released by SQLite closing one of
its own descriptors of the file.

The file's write-ahead log (``-wal``) is held the same way once SQLite made it, and a
host that finds the log beside a file held (a live host's) is refused like one that
finds the file held: when the file is replaced under a live host (a restore renamed
over it), its path names a file nobody holds, yet the log beside it is still the live
host's, and SQLite would read that host's commits into the new file.

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
import time
from pathlib import Path

from delegation import errors

# The database and its -wal and -shm hold every message, prompt, event and steer.
FILE_MODE = 0o600
_SIDE_FILES = ("-wal", "-shm", "-journal")

# The files this process holds, by (device, inode). Closing *any* descriptor of a file
# drops every POSIX lock the process holds on it, SQLite's included: a refused second
# open in this process must never close a descriptor of a file a live engine here uses.
_HELD: dict[tuple[int, int], HostLock] = {}
_LOGS: dict[tuple[int, int], HostLock] = {}  # the -wal files this process holds
_HELD_GUARD = threading.Lock()
_LOG_TRIES = 50  # 1 ms apart (see _lock_log)


class HostLock:
    """The exclusive lock of one host on one database file."""

    def __init__(self, fd: int, path: Path, key: tuple[int, int]) -> None:
        self._fd: int | None = fd
        self.path = path
        self._key = key
        self._parked: list[int] = []  # refused opens of this file in this process
        self._log: int | None = None  # the held -wal's descriptor (see hold_log)
        self._sides: dict[str, tuple[int, int]] = {}  # -wal and -shm as SQLite made them

    @classmethod
    def acquire(cls, path: Path) -> HostLock:
        """Create the file (mode 0600) if it is missing and lock it exclusively.

        Nothing else is changed: a refused host has written no byte, created no file
        (the file existed) and changed no mode; modes are restricted by
        :meth:`restrict_modes`, once the file is known to be ours.

        Raises:
            errors.HostConflict: another live host holds the file, or the -wal beside it.
            errors.DatabaseReadOnly: the file may not be written (its mode has no write
                bit, which root would write through, or opening it for writing is
                refused: permissions, a read-only mount).
            errors.StoreError: its directory is missing, or the file cannot be opened.
        """
        if not path.parent.is_dir():
            raise errors.StoreError(f"database directory {path.parent} does not exist")
        _refuse_a_held_log(path)  # before the file is opened, or made
        fd = _open(path)
        with _HELD_GUARD:
            info = os.fstat(fd)
            key = (info.st_dev, info.st_ino)
            holder = _HELD.get(key)
            if holder is not None:  # a live engine of this process: never close this fd now
                holder._parked.append(fd)
                raise errors.HostConflict()
            if stat.S_ISREG(info.st_mode) and not info.st_mode & 0o222:
                os.close(fd)  # never made writable (root could write it anyway)
                raise errors.DatabaseReadOnly()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)  # another process holds it: nothing of ours uses the file
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise errors.HostConflict() from None
                raise errors.StoreError(f"cannot lock {path}: {exc.strerror}") from exc
            lock = _HELD[key] = cls(fd, path, key)
        return lock

    def hold_log(self) -> None:
        """Hold the file's -wal too, for as long as the file (once SQLite made it, and
        before anything is written to it): a host that finds it held beside a file is
        refused (see the module). The -shm's identity is kept for :meth:`let_go`.

        Raises:
            errors.HostConflict: another host holds it (the file was replaced meanwhile).
        """
        wal = Path(f"{self.path}-wal")
        try:
            fd = os.open(wal, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise errors.StoreError(f"cannot open {wal}: {exc.strerror}") from exc
        info = os.fstat(fd)
        if not _lock_log(fd):
            os.close(fd)  # SQLite holds no lock of its own on a -wal: closing drops none
            raise errors.HostConflict()
        with _HELD_GUARD:
            self._log = fd
            self._sides["-wal"] = (info.st_dev, info.st_ino)
            _LOGS[self._sides["-wal"]] = self
        with contextlib.suppress(OSError):
            shm = os.stat(f"{self.path}-shm")
            self._sides["-shm"] = (shm.st_dev, shm.st_ino)

    def replaced(self) -> bool:
        """Whether the path no longer names the file this lock holds (one ``stat``): a
        file renamed over it, or the file removed."""
        try:
            info = os.stat(self.path)
        except OSError as exc:
            return exc.errno in (errno.ENOENT, errno.ENOTDIR)  # else: cannot tell
        return (info.st_dev, info.st_ino) != self._key

    def let_go(self) -> None:
        """The file was replaced (call it once this host's runs stopped): give its path
        up to the file now there, without a write. SQLite's own connections, seeing
        their file moved, neither checkpoint nor remove the -wal and -shm by name when
        they close (``databaseIsUnmoved``): this host's own would stay beside the new
        file, and the next host would read this host's log into it. They are removed
        from the path here, if they are still this host's (never a new host's)."""
        if self._fd is None or not self.replaced():
            return
        for suffix, key in self._sides.items():
            side = Path(f"{self.path}{suffix}")
            with contextlib.suppress(OSError):
                info = side.stat()
                if (info.st_dev, info.st_ino) == key:
                    side.unlink()

    def release(self) -> None:
        """Give the file back (closing the descriptor releases the lock); call it once
        nothing of this host uses the file any more."""
        with _HELD_GUARD:
            fd, self._fd = self._fd, None
            if fd is None:
                return
            if _HELD.get(self._key) is self:
                del _HELD[self._key]
            log, self._log = self._log, None
            if _LOGS.get(self._sides.get("-wal", (-1, -1))) is self:
                del _LOGS[self._sides["-wal"]]
            parked, self._parked = self._parked, []
        for descriptor in (*parked, *([] if log is None else [log]), fd):
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
    allows beyond that is masked off too).

    Raises:
        errors.DatabaseReadOnly: the file exists and cannot be opened for writing.
    """
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EROFS, errno.EPERM) and path.exists():
            raise errors.DatabaseReadOnly() from exc
        raise errors.StoreError(f"cannot open {path}: {exc.strerror}") from exc


def _refuse_a_held_log(path: Path) -> None:
    """Refuse a file whose -wal a live host holds (see the module); a -wal nobody
    holds (a crashed host's) is SQLite's to recover.

    Raises:
        errors.HostConflict: a live host, of this process or another, holds the -wal.
    """
    wal = Path(f"{path}-wal")
    try:
        info = wal.stat()
    except OSError:
        return  # none (or none this process may see: SQLite says why)
    with _HELD_GUARD:
        if (info.st_dev, info.st_ino) in _LOGS:
            raise errors.HostConflict()
    try:
        fd = os.open(wal, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:  # shared: opening hosts testing at once never refuse one another
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise errors.HostConflict() from None
    finally:
        os.close(fd)  # SQLite holds no lock of its own on a -wal: closing drops none


def _lock_log(fd: int) -> bool:
    """Lock a -wal exclusively: whether it is held. A host's open may meet another's
    test of it (``_refuse_a_held_log``, held for microseconds): tried for up to 50 ms."""
    for _ in range(_LOG_TRIES):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
        time.sleep(0.001)
    return False
