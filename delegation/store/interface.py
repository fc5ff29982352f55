"""What a store must do for the engine (design §12): the one interface every store keeps.

The engine reaches its database only through a :class:`Store`; use cases are plain
functions ``fn(conn) -> T`` that the store runs inside a transaction of its own, using
the store's named operations (``delegation.store.children``, ``grants`` …). The one
implementation is :class:`delegation.store.database.Database`, the writer, composed
with SQLite's dialect or PostgreSQL's (``store/sqlite/``, ``store/postgres/``); which
one a URL names is decided in :mod:`delegation.store.stores`, and nowhere else.

The guarantees a store gives, and the engine relies on:

* **Transactions.** ``submit``/``write`` run ``fn`` in a write transaction. A job that
  raises has written nothing (its neighbours in the same batch are not undone), and
  its exception is what the caller gets. Jobs run in the order they were queued.
* **Answers are commits.** A ``submit`` future resolves only after the transaction
  holding its job committed durably (``durable=False``: durable against a crash of the
  process, made durable to the disk by the next durable commit, which always comes
  before anyone is answered). ``committed`` hooks run on the event loop's thread as
  the commit is known, before the future resolves, even if nobody awaits it.
* **One write.** ``submit(one_write=True)`` promises that ``fn`` writes with at most
  one statement and raises nothing after it (it may read before and after); a server
  store may then run a lone such job as that statement's own transaction (no
  ``BEGIN``/``COMMIT`` round trips), its reads each at their own snapshot, as in a
  READ COMMITTED transaction. Its guarantees are the same as any job's.
* **Events.** ``append_event`` never blocks; an event commits in the next batch, with
  or before any job queued after it (``barrier`` is therefore a flush). An event a
  failed batch could not commit is kept for the next one (never a gap), unless the
  store is closing. An event a constraint refuses (its child is gone) is dropped and
  logged alone: the jobs and events beside it commit.
* **Reads** see committed data only: ``read`` one consistent snapshot, ``read_now``
  the newest commit per statement. Reads never wait for the writer.
* **Notices.** ``on_events``, if set, is called on the loop's thread with the ids of
  the children whose events a batch committed, after the commit. ``on_commit``, if
  set, is called after every write transaction that committed, on the thread that
  committed it, with its duration in seconds (``BEGIN`` to ``COMMIT`` returning) and
  the number of events it committed (telemetry; it must not block, and what it
  raises is logged, never the transaction's failure).
* **Ownership.** ``open`` takes the database for this host (SQLite: the file's lock;
  PostgreSQL: a session advisory lock; refused with ``HostConflict`` while another host
  holds it), migrates it to the head revision, and refuses what it must not touch
  (``SchemaMismatch``); ``aclose`` commits what is queued and gives everything back
  (connections, threads, the lock).
* **Several hosts** (a ``shared`` store): each host instance holds a lock of its own
  that the server frees when the host's process ends, and heartbeats; a batch commits
  only while its instance has not been taken over (the fence, see ``claim``).
* **Lost.** A SQLite file replaced while in use (a restore renamed over it, design §18)
  is noticed before each commit and by ``held``: from then on every batch is refused
  with ``DatabaseReplaced`` (its events dropped), and ``on_lost``, if set, is called
  once on the loop's thread, before the refused jobs' callers hear of it.
* **Errors** are domain errors only: ``DatabaseBusy`` (retry), ``StoreError``,
  ``SchemaMismatch``, ``HostConflict``; never a driver's exception.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from sqlalchemy import Connection

from delegation.store.events import EventRow
from delegation.store.watch import Watch

T = TypeVar("T")


class Store(Protocol):
    """The engine's database: batched writes, committed reads, notices (see above)."""

    url: str
    # Capabilities, set once when the store is made (from its dialect):
    shared: bool  # several hosts may open it (PostgreSQL); SQLite: one host per file
    writes_alone: bool  # a lone ``one_write`` job may commit without BEGIN/COMMIT
    starts_as_seen: bool  # a start may check the row versions it read in its insert
    on_events: Callable[[set[int]], None] | None
    on_commit: Callable[[float, int], None] | None
    on_lost: Callable[[Any], None] | None  # called with the DatabaseReplaced, once
    on_back: Callable[[], None] | None  # a batch committed after the server was away

    def open(self, loop: asyncio.AbstractEventLoop) -> None: ...

    def claim(self, instance_id: str) -> None:
        """Name this host's instance (blocking). On a shared store every later batch is
        fenced on it: refused with ``HostFenced`` once another host took it over."""
        ...

    def alive_until(self, deadline: float) -> None:
        """This host's heartbeat committed: until ``deadline`` (``boot_clock()``) no other
        host can declare it dead, so a shared store may skip its per-batch fence where
        it has a cheaper path (``one_write``)."""
        ...

    def reconnected(self) -> bool:
        """Whether the writer ever connected again after losing its connection: from
        then on a free lock proves no host's death (a restart frees every lock), only
        the heartbeat timeout does."""
        ...

    def keep_lock(self) -> None:
        """Before each heartbeat (blocking; off the loop): hold this host's lock again
        if the connection that held it was lost. Raises ``StoreUnavailable`` while the
        server cannot be reached."""
        ...

    async def aclose(self) -> None: ...

    def close(self) -> None: ...

    def submit(
        self,
        fn: Callable[[Connection], T],
        *,
        durable: bool = True,
        committed: Callable[[T], None] | None = None,
        one_write: bool = False,
    ) -> asyncio.Future[T]: ...

    async def write(self, fn: Callable[[Connection], T]) -> T: ...

    async def barrier(self) -> None: ...

    def append_event(self, row: EventRow) -> None: ...

    async def read(self, fn: Callable[[Connection], T]) -> T: ...

    async def read_now(self, fn: Callable[[Connection], T]) -> T: ...

    def held(self) -> bool:
        """Whether the database is still the one this host opened (see Lost above)."""
        ...

    def let_go(self) -> None:
        """Once lost: give up, without a write, what keeps the database now there from
        a new host (blocking)."""
        ...

    def watch(self, interval: float) -> Watch:
        """Notices of commits other processes make (an operator's control request)."""
        ...

    def protected_paths(self) -> list[str]:
        """What a child process must never reach (SQLite: the file's directory)."""
        ...

    def secret_paths(self) -> list[str]:
        """Files no child process may read (PostgreSQL: libpq's credentials)."""
        ...
