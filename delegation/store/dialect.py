"""What the writer (:class:`delegation.store.database.Database`) asks of a dialect: the
few things SQLite and PostgreSQL do differently. The writer holds no SQL of either;
each dialect (``store/sqlite/``, ``store/postgres/``) holds its own spellings, error
codes, connection setup and watch.

A dialect's capabilities are plain attributes, read once when the store is made and
kept on it as flags its callers read (``shared``, ``writes_alone``, ``starts_as_seen``).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

from sqlalchemy import Engine

from delegation.store.watch import Watch


class Engines(NamedTuple):
    writer: Engine
    reader: Engine
    unflushed: Engine | None = None  # lone ``durable=False`` commits (writes_alone)


class Dialect(Protocol):
    # Several hosts may open the database (design §12): instances, fences, locks.
    shared: bool
    # A lone ``one_write`` job may commit as its statement's own transaction.
    writes_alone: bool
    # A start may check the rows it read in its insert (row versions).
    starts_as_seen: bool

    def open(self) -> Engines:
        """Take the database for this host, migrate it to head, and make the engines
        (on failure, whatever it made is given back)."""
        ...

    def close(self) -> None:
        """Give back what :meth:`open` took (last, once no connection is open)."""
        ...

    def try_begin(
        self, raw: Any, *, relaxed: bool, instance: str | None
    ) -> tuple[bool, str | None]:
        """Begin a write transaction without waiting for a lock: whether it began, and
        who took ``instance`` over (the fence, read as it began)."""
        ...

    def begin(self, raw: Any, *, relaxed: bool, instance: str | None) -> str | None:
        """Begin a write transaction, waiting up to the busy timeout; the fence."""
        ...

    def in_transaction(self, raw: Any) -> bool: ...

    def changes(self, raw: Any) -> int | None:
        """Rows changed on ``raw`` so far; None: not known (a failed job is redone)."""
        ...

    def lost(self, raw: Any) -> bool:
        """Whether the server dropped the driver's connection ``raw``."""
        ...

    def announce(self, raw: Any, child_ids: set[int]) -> None:
        """Tell other processes, in the open transaction, whose events it commits."""
        ...

    def ready_to_claim(self, instance_id: str) -> None:
        """Check ``instance_id`` and reach the server for its lock (before the queue of
        an earlier instance is dropped)."""
        ...

    def hold(self, previous: str | None, instance_id: str) -> None:
        """Hold ``instance_id``'s lock for this host's life, letting ``previous`` go."""
        ...

    def keep_lock(self, instance_id: str | None) -> None:
        """Hold the instance's lock again if the connection that held it was lost."""
        ...

    def verify(self) -> None:
        """Before each commit, and at the engine's periodic check: raise
        ``DatabaseReplaced`` once the database is no longer the one :meth:`open` took
        (SQLite: its path names another file); cheap (one ``stat``)."""
        ...

    def let_go(self) -> None:
        """The database was replaced: give up, without a write, what keeps the one
        now there from a new host (SQLite: this host's -wal and -shm at its path)."""
        ...

    def watch(self, interval: float) -> Watch: ...

    def protected_paths(self) -> list[str]: ...

    def secret_paths(self) -> list[str]: ...
