"""Read-only inspection of a delegation database, for people and scripts (the CLI).

Opening an :class:`Engine` would take the database over as a new host instance;
an :class:`Inspector` only reads (SQLite's read-only mode; PostgreSQL's read-only
snapshots), so it is safe to use while a host is running on the same database.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import TracebackType

from delegation import queries
from delegation.records import ChildRecord, LeaseRecord
from delegation.store import controls, migrate, stores
from delegation.store.controls import ControlRecord
from delegation.wire import Event


class Inspector:
    """Synchronous read models over a database file: children, events, leases."""

    def __init__(self, url: str = "sqlite:///delegation.db") -> None:
        self.url = url
        self._db = stores.reader(url)

    def __enter__(self) -> Inspector:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._db.close()

    def check(self) -> None:
        """Raise ``errors.SchemaMismatch`` unless this is a delegation database whose
        revision this code knows (maybe an older one)."""
        self._db.read(migrate.check)

    def revision(self) -> str | None:
        """The schema revision the file is at (None before the first migration)."""
        return self._db.read(migrate.current)

    def get_child(self, conversation_id: str, run_id: str | None = None) -> ChildRecord | None:
        return self._db.read(lambda c: queries.find_child(c, conversation_id, run_id))

    def list_children(
        self,
        *,
        state: str | None = None,
        lease_id: str | None = None,
        parent_run_id: str | None = None,
        parent_conversation_id: str | None = None,
        limit: int = 100,
    ) -> list[ChildRecord]:
        filters = {
            "state": state,
            "lease_id": lease_id,
            "parent_run_id": parent_run_id,
            "parent_conversation_id": parent_conversation_id,
            "limit": limit,
        }
        return self._db.read(lambda c: queries.list_children(c, **filters))

    def events(
        self, conversation_id: str, run_id: str | None = None, after: int = 0, limit: int = 128
    ) -> list[Event]:
        return self._db.read(
            lambda c: queries.child_events(c, conversation_id, run_id, after, limit)
        )

    def leases(self, runner_id: str | None = None) -> list[LeaseRecord]:
        return self._db.read(lambda c: queries.leases(c, runner_id))

    def control(self, control_id: int) -> ControlRecord | None:
        """An operator's control request (``delegation cancel``/``steer``), by id."""
        return self._db.read(lambda c: controls.get(c, control_id))

    def follow(
        self, conversation_id: str, run_id: str | None = None, after: int = 0
    ) -> Iterator[Event]:
        """Every committed event after ``after`` as it commits, from any process; ends
        once the execution is terminal. It watches the database for commits (SQLite:
        ``PRAGMA data_version``; PostgreSQL: ``LISTEN``, see :mod:`delegation.watch`)
        and reads tables only after one."""
        watch = stores.open_watch(self.url, 0.05)
        try:
            while True:
                # The state first: a terminal state commits after the run's last event,
                # so a drain that starts after seeing it cannot miss one.
                current = self.get_child(conversation_id, run_id)
                if current is None:
                    return
                for event in self.all_events(conversation_id, current.run_id, after):
                    yield event
                    after = event.sequence
                if current.terminal:
                    return
                watch.wait_sync()
        finally:
            watch.close()

    def all_events(
        self, conversation_id: str, run_id: str | None = None, after: int = 0
    ) -> Iterator[Event]:
        """Every committed event after ``after``, oldest first, read page by page."""
        while page := self.events(conversation_id, run_id, after):
            yield from page
            after = page[-1].sequence
