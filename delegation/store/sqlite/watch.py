"""SQLite's watch: ``PRAGMA data_version`` on one open read-only connection changes
whenever another connection commits to the file; asking it is a few microseconds and
reads no table, so a watcher asks it every ``interval`` seconds and reads tables only
when it moved."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from delegation.store.watch import Watch


class FileWatch(Watch):
    """Commits to a SQLite file, seen through ``PRAGMA data_version``."""

    def __init__(self, path: Path | str, interval: float = 0.05) -> None:
        self.interval = interval
        uri = Path(path).resolve().as_uri() + "?mode=ro"
        self._conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
        self._version = self._read()

    def _read(self) -> int:
        (version,) = self._conn.execute("PRAGMA data_version").fetchone()
        return int(version)

    def ask(self) -> bool:
        version = self._read()
        moved, self._version = version != self._version, version
        return moved

    def close(self) -> None:
        self._conn.close()
