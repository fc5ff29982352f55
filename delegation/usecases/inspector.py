"""Read-only inspection of a delegation database, for people and scripts (the CLI).

Opening an :class:`Engine` would take the database over as a new host instance;
an :class:`Inspector` only reads (SQLite's read-only mode; PostgreSQL's read-only
snapshots), so it is safe to use while a host is running on the same database.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterable, Iterator
from dataclasses import dataclass, field
from types import TracebackType

from delegation.records import ChildFilter, ChildRecord, ChildSummary, LeaseRecord, StepRow
from delegation.store import admission as store_admission
from delegation.store import children, controls, migrate, prefixes, rewinds, stores
from delegation.store import events as event_rows
from delegation.store import steps as journal
from delegation.store.controls import ControlRecord
from delegation.store.prefixes import Kind
from delegation.store.sql import Connection
from delegation.usecases import admission, operating, queries
from delegation.usecases.follow import WatchWake, blocking
from delegation.usecases.follow import events as events_of
from delegation.usecases.operating import Outcome
from delegation.wire import Event, InputRequest

MIN_PREFIX = 4  # characters an id prefix needs, so that a slip never matches everything
SHORT = 10  # characters a shortened id keeps at least (c-, then 8 hex digits)
SHOWN = "…"  # what ends a shortened id; a prefix given with it is read without it
CANDIDATES = 5  # ids an ambiguous prefix names
_SCAN = 64
PAGE = 128  # events one read returns at most
# Stored JSON one read of events takes at most (the first event always comes): what a
# follower holds of a child's events is bounded in bytes, not only in events.
PAGE_BYTES = 256 * 1024
WATCH_INTERVAL_S = 0.05  # a commit of another process is seen within this
# Steps one read lists at most: an execution records at most EngineConfig.max_steps
# (10,000 by default), each name at most 1 KiB, so a whole listing stays under 10 MiB.
MAX_STEPS_LISTED = 10_000


@dataclass(frozen=True)
class ChildPage:
    """An execution as one read found it (its columns, never its stored request), and a
    page of its events; ``more``: the page stopped at its byte bound before its count,
    with more committed already."""

    child: ChildSummary | None
    events: list[Event] = field(default_factory=list)
    more: bool = False

    @property
    def done(self) -> bool:
        """Nothing more will come: the execution is terminal, or gone."""
        return self.child is None or self.child.terminal


@dataclass(frozen=True)
class ChildSteps:
    """An execution as one read found it, and the steps it recorded (design §15): each
    one's name, place, size and time, never its value."""

    child: ChildSummary | None
    steps: list[StepRow] = field(default_factory=list)
    count: int = 0  # steps the execution recorded: more than ``steps`` when cut
    # The runner version that recorded each of ``steps``, by ordinal (design §34; an
    # unversioned step is left out).
    versions: dict[int, str] = field(default_factory=dict)

    @property
    def more(self) -> int:
        """How many recorded steps the read left out."""
        return self.count - len(self.steps)


class AmbiguousId(LookupError):
    """A prefix that more than one id begins with."""

    def __init__(self, kind: Kind, prefix: str, candidates: list[str]) -> None:
        super().__init__(kind, prefix, candidates)
        self.kind, self.prefix = kind, prefix
        self.candidates = candidates[:CANDIDATES]
        self.more = len(candidates) > CANDIDATES


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

    def resolve(self, kind: Kind, text: str) -> str:
        """The id of this kind that ``text`` stands for: ``text`` itself when it is one,
        else the one id that begins with it (``text`` of at least ``MIN_PREFIX``
        characters; a trailing ``…``, as tables end a shortened id, is dropped); else
        ``text`` unchanged, which the caller then finds nothing for.

        Raises:
            AmbiguousId: more than one id begins with ``text``.
        """
        found = self._db.read(lambda c: _matching(c, kind, text))
        if len(found) > 1:
            raise AmbiguousId(kind, text.removesuffix(SHOWN), found)
        return found[0] if found else text

    def shortened(self, kind: Kind, ids: Iterable[str]) -> dict[str, str]:
        """Each of ``ids`` as a table shows it: its shortest beginning of at least
        ``SHORT`` characters that no other id of its kind has, ended with ``…``; an id
        that would not get shorter is whole. Read in one transaction."""
        whole = set(ids)
        return self._db.read(lambda c: {i: _shortest(c, kind, i) for i in whole})

    def get_child(self, conversation_id: str, run_id: str | None = None) -> ChildRecord | None:
        return self._db.read(lambda c: queries.find_child(c, conversation_id, run_id))

    def input_requests(self, record: ChildRecord | ChildSummary) -> dict[str, InputRequest]:
        """A child's open input requests, as its Result carries them (design §21)."""
        if not record.inputs_open:
            return {}
        return self._db.read(lambda c: queries.input_requests(c, record))

    def summary(self, conversation_id: str, run_id: str | None = None) -> ChildSummary | None:
        """:meth:`get_child` as a page shows it: its columns, never its stored request."""
        return self._db.read(lambda c: children.summary(c, conversation_id, run_id))

    def by_run(self, run_id: str) -> ChildSummary | None:
        """The execution whose run id is ``run_id`` (run ids are unique), as a page
        shows it."""
        return self._db.read(lambda c: children.summary_of_run(c, run_id))

    def listing(
        self, conversation_id: str | None, before: int | None, limit: int, clip: int
    ) -> list[ChildSummary]:
        """Up to ``limit`` executions (of one conversation, or all) below the id
        ``before``, newest first: the pages of a listing that goes on from its last id."""
        return self._db.read(
            lambda c: children.conversation_summaries(c, conversation_id, before, limit, clip)
        )

    def tail(
        self, conversation_id: str, run_id: str, count: int, max_bytes: int = PAGE_BYTES
    ) -> ChildPage:
        """An execution and its newest ``count`` events (at most ``max_bytes`` of them,
        counted from the newest, which always comes), oldest first, read in one
        transaction."""
        return self._db.read(lambda c: _tail(c, conversation_id, run_id, count, max_bytes))

    def newest(self, child_id: int, count: int, max_bytes: int = PAGE_BYTES) -> list[Event]:
        """The newest ``count`` events of the execution ``child_id`` (a summary's ``id``),
        as :meth:`tail` reads them, without the execution's row."""
        bodies, _ = self._db.read(lambda c: event_rows.tail_within(c, child_id, count, max_bytes))
        return queries.decode_events(bodies)

    def control_by_request(
        self, conversation_id: str, actions: Iterable[str], request_id: str
    ) -> ControlRecord | None:
        """The first control of one of ``actions`` given with ``request_id`` for the
        conversation, if any."""
        return self._db.read(
            lambda c: next(
                (
                    found
                    for action in actions
                    if (found := controls.by_request(c, conversation_id, action, request_id))
                ),
                None,
            )
        )

    def list_children(
        self,
        *,
        state: str | None = None,
        lease_id: str | None = None,
        parent_run_id: str | None = None,
        parent_conversation_id: str | None = None,
        limit: int = 100,
    ) -> list[ChildRecord]:
        wanted = ChildFilter(state, lease_id, parent_run_id, parent_conversation_id, limit)
        return self._db.read(lambda c: queries.list_children(c, wanted))

    def patch_values(self, name: str, limit: int = 100) -> list[tuple[ChildRecord, bool | None]]:
        """The live executions, newest first, with the value each recorded for the patch
        ``name`` (``ctx.patched``, design §34; None: not asked yet)."""
        return self._db.read(lambda c: queries.patch_values(c, name, limit))

    def pinned(self, limit: int = 100) -> list[ChildRecord]:
        """The children pinned to a runner version (design §34), newest first."""
        return self._db.read(lambda c: queries.pinned(c, limit))

    def rewound_as(self, record: ChildRecord, limit: int = 100) -> list[str]:
        """The executions rewound from ``record`` (design §35), oldest first."""
        return self._db.read(lambda c: rewinds.rewound_as(c, record.run_id, limit))

    def drift(self, record: ChildRecord) -> list[str] | None:
        """The recorded steps the execution's newest attempt never asked for, oldest
        first; None while it runs (design §34)."""
        return self._db.read(lambda c: queries.drift(c, record))

    def summaries(
        self,
        *,
        state: str | None = None,
        lease_id: str | None = None,
        limit: int = 100,
        clip: int | None = None,
    ) -> list[ChildSummary]:
        """The children :meth:`list_children` finds, as a list shows them: their
        columns only, error and output cut to ``clip`` characters by the query."""
        return self._db.read(
            lambda c: children.summaries(c, state=state, lease_id=lease_id, limit=limit, clip=clip)
        )

    def events(
        self, conversation_id: str, run_id: str | None = None, after: int = 0, limit: int = PAGE
    ) -> list[Event]:
        return self._db.read(
            lambda c: queries.child_events(c, conversation_id, run_id, after, limit)
        )

    def steps(
        self,
        conversation_id: str,
        run_id: str | None = None,
        limit: int = MAX_STEPS_LISTED,
        *,
        latest: bool = False,
    ) -> ChildSteps:
        """An execution (``run_id``; default the newest) and the steps it recorded,
        oldest first: the first ``limit`` (at most ``MAX_STEPS_LISTED``), or with
        ``latest`` the last ``limit``; read in one transaction (``child`` None: no such
        execution)."""
        limit = max(0, min(limit, MAX_STEPS_LISTED))
        return self._db.read(lambda c: _steps(c, conversation_id, run_id, limit, latest))

    def queue_positions(self, limit: int = 10_000) -> dict[int, int]:
        """The places of the first ``limit`` queued children (design §22), by child id."""
        return self._db.read(lambda c: store_admission.positions(c, limit))

    def admission(self) -> list[admission.ScopeUse]:
        """Every admission policy, with the slots its scope holds and its queue now."""
        return self._db.read(admission.listing)

    def unseen(self, scope: str) -> str | None:
        """What an admission ``scope`` names that this database has never seen (``runner
        'R'``, ``extension 'R/E'``, ``preset 'R/E/P'``), or None: a policy for it holds
        once a runner brings it (design §22), or never, when it was misspelled."""
        return self._db.read(lambda c: store_admission.unseen(c, scope))

    def leases(self, runner_id: str | None = None) -> list[LeaseRecord]:
        return self._db.read(lambda c: queries.leases(c, runner_id))

    def control(self, control_id: int) -> ControlRecord | None:
        """An operator's control request (``delegation cancel``/``steer``), by id."""
        return self._db.read(lambda c: controls.get(c, control_id))

    def controls(self, conversation_id: str | None = None, limit: int = 100) -> list[Outcome]:
        """The newest ``limit`` control requests (of one conversation, or all) and what
        became of each, newest first (design §33)."""
        return self._db.read(lambda c: operating.listed(c, conversation_id, limit))

    def page(
        self,
        conversation_id: str,
        run_id: str | None = None,
        after: int = 0,
        limit: int = PAGE,
        max_bytes: int = PAGE_BYTES,
    ) -> ChildPage:
        """An execution as it is now and up to ``limit`` of its events after ``after``,
        no more than ``max_bytes`` of them (always one), read in one transaction
        (``child`` None: no such execution)."""
        return self._db.read(lambda c: _page(c, conversation_id, run_id, after, limit, max_bytes))

    def event_sizes(self, child_id: int, after: int, limit: int = PAGE) -> list[tuple[int, int]]:
        """The sequence and stored size of up to ``limit`` events of the execution
        ``child_id`` (a summary's ``id``) after ``after``, oldest first (no body read)."""
        return self._db.read(lambda c: event_rows.sizes(c, child_id, after, limit))

    def follow(
        self, conversation_id: str, run_id: str | None = None, after: int = 0
    ) -> Iterator[Event]:
        """Every committed event after ``after`` as it commits, from any process; ends
        once the execution is terminal (or gone). It watches the database for commits
        (SQLite: ``PRAGMA data_version``; PostgreSQL: ``LISTEN``, see
        :mod:`delegation.store.watch`) and reads tables only after one. It runs its own event
        loop: call it where none runs (an async caller uses :mod:`delegation.usecases.follow`)."""
        return blocking(self._follow(conversation_id, run_id, after))

    async def _follow(
        self, conversation_id: str, run_id: str | None, after: int
    ) -> AsyncGenerator[Event, None]:
        watch = stores.open_watch(self.url, WATCH_INTERVAL_S)
        try:
            found = self.get_child(conversation_id, run_id)
            if found is None:
                return
            run_id = found.run_id  # one execution, even once a newer one starts

            async def read(after: int, limit: int) -> ChildPage:
                return self.page(conversation_id, run_id, after, limit)

            async for event in events_of(read, WatchWake(watch), after, PAGE):
                yield event
        finally:
            watch.close()

    def all_events(
        self, conversation_id: str, run_id: str | None = None, after: int = 0
    ) -> Iterator[Event]:
        """Every committed event after ``after``, oldest first, read page by page."""
        while page := self.events(conversation_id, run_id, after):
            yield from page
            after = page[-1].sequence


def _page(
    conn: Connection,
    conversation_id: str,
    run_id: str | None,
    after: int,
    limit: int,
    max_bytes: int,
) -> ChildPage:
    child = children.summary(conn, conversation_id, run_id)
    if child is None:
        return ChildPage(None)
    bodies, more = event_rows.page_within(conn, child.id, after, limit, max_bytes)
    return ChildPage(child, queries.decode_events(bodies), more)


def _tail(
    conn: Connection, conversation_id: str, run_id: str, count: int, max_bytes: int
) -> ChildPage:
    child = children.summary(conn, conversation_id, run_id)
    if child is None:
        return ChildPage(None)
    bodies, more = event_rows.tail_within(conn, child.id, count, max_bytes)
    return ChildPage(child, queries.decode_events(bodies), more)


def _steps(
    conn: Connection, conversation_id: str, run_id: str | None, limit: int, latest: bool
) -> ChildSteps:
    child = children.summary(conn, conversation_id, run_id)
    if child is None:
        return ChildSteps(None)
    read = journal.latest if latest else journal.listing
    found = read(conn, child.id, limit)
    versions = journal.versions(conn, child.id, [step.ordinal for step in found])
    return ChildSteps(child, found, journal.count(conn, child.id), versions)


def _matching(conn: Connection, kind: Kind, text: str) -> list[str]:
    """``[text]`` when it is an id; else the ids it begins (one more than named)."""
    if prefixes.exists(conn, kind, text):
        return [text]
    stem = text.removesuffix(SHOWN)
    if stem != text and prefixes.exists(conn, kind, stem):
        return [stem]
    if len(stem) < MIN_PREFIX:
        return []
    return prefixes.starting_with(conn, kind, stem, CANDIDATES + 1)


def _shortest(conn: Connection, kind: Kind, full: str) -> str:
    length = SHORT
    while length + 1 < len(full):
        found = prefixes.starting_with(conn, kind, full[:length], _SCAN)
        needed = max((_common(full, other) + 1 for other in found if other != full), default=length)
        if len(found) < _SCAN:  # every id it begins: full[:needed] begins no other
            return full[:needed] + SHOWN if needed + 1 < len(full) else full
        length = max(needed, length + 1)
    return full


def _common(a: str, b: str) -> int:
    """How many characters ``a`` and ``b`` begin with alike."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
