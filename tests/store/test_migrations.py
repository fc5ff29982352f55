"""The schema as the migrations build it (STYLE habit 10, design §4).

1. Parity: ``migrate.upgrade`` to head gives exactly the schema of ``tables.metadata``.
   Alembic's ``compare_metadata`` must report nothing, and because it cannot see CHECK
   constraints, partial-index ``WHERE`` clauses or foreign-key actions on SQLite, the
   DDL stored in ``sqlite_master`` is also compared clause by clause with the DDL the
   metadata compiles to.
2. The revision walk: upgrade one revision at a time, downgrade to base, upgrade again;
   each revision has the same schema every time it is reached.
3. The constraints hold: raw SQL on a migrated file is refused by the named CHECK,
   UNIQUE or FOREIGN KEY constraint, and accepted when the row is valid.
4. The PRAGMAs the engine sets are in force on its own connections.
5. The statements that scan many children use the index meant for them.
"""

from __future__ import annotations

import asyncio
import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import CheckConstraint, Connection, MetaData, create_engine, event, text
from sqlalchemy import Engine as SAEngine
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.schema import CreateIndex, CreateTable

from delegation import Engine, EngineConfig
from delegation.clock import ManualClock
from delegation.store import children, migrate
from delegation.store.sqlite.spelling import SQLITE
from delegation.store.tables import NAMING_CONVENTION, metadata
from delegation.usecases import maintenance, queries
from tests.harness.support import ScriptRunner, hold, open_harness

# The SQLite side of the migrations, through SQLite itself: its DDL in sqlite_master, raw
# SQL through the stdlib driver, its PRAGMAs and query plans (PostgreSQL's side is
# tests/store/test_postgres_schema.py).
pytestmark = pytest.mark.sqlite_only

# --- helpers: a fresh file, and the schema as sqlite_master holds it ----------------------


@pytest.fixture
def fresh(tmp_path: Path) -> Iterator[Connection]:
    """A connection to a brand-new, empty SQLite file (not the migrated template)."""
    engine = create_engine(f"sqlite:///{tmp_path / 'fresh.db'}")
    try:
        with engine.connect() as conn:
            yield conn
    finally:
        engine.dispose()


def _squash(sql: str) -> str:
    """``sql`` in one spelling: whitespace runs as one space, identifiers unquoted
    (SQLite's RENAME TABLE writes the new name quoted where other tables refer to it,
    revision 0010; the quotes mean nothing there)."""
    return " ".join(_QUOTED.sub(r"\1", sql).split())


_QUOTED = re.compile(r'"(\w+)"')


# Alembic's autogenerate wrote the server defaults of the migration from SQLite's
# reflection, which wraps literals in parentheses: the migration says DEFAULT ('')
# where the metadata compiles to DEFAULT ''. SQLite treats the two identically, so
# exactly this one spelling (a parenthesised string or number literal) is unwrapped.
_PAREN_DEFAULT = re.compile(r"DEFAULT \(('(?:[^']|'')*'|-?\d+(?:\.\d+)?)\)")


def _clause(sql: str) -> str:
    return _PAREN_DEFAULT.sub(r"DEFAULT \1", _squash(sql))


def _table_ddl(sql: str) -> tuple[str, frozenset[str], str]:
    """``CREATE TABLE name (...) tail`` as (head, set of column/constraint clauses, tail).

    A set, because autogenerate sorted the constraints by name while the metadata
    keeps them in declaration order; SQLite gives the order no meaning.
    """
    head, rest = sql.strip().split("(", 1)
    body, tail = rest.rsplit(")", 1)
    clauses = frozenset(_clause(part) for part in _top_level(body))
    # A table rebuilt by a batch migration is stored as CREATE TABLE "name".
    return _squash(head).replace('"', ""), clauses, _squash(tail)


def _top_level(body: str) -> list[str]:
    """The comma-separated clauses of a table body (commas inside parentheses or quotes
    are not separators): ``ALTER TABLE … ADD COLUMN`` appends its column on the line
    of the last one."""
    parts, depth, quoted, start = [], 0, False, 0
    for i, char in enumerate(body):
        if char == "'":
            quoted = not quoted
        elif not quoted and char in "()":
            depth += 1 if char == "(" else -1
        elif not quoted and depth == 0 and char == ",":
            parts.append(body[start:i])
            start = i + 1
    return [*parts, body[start:]]


def _schema_drift(conn: Connection, md: MetaData) -> list[str]:
    """Every difference between the stored DDL and the DDL ``md`` compiles to."""
    dialect = sqlite_dialect.dialect()
    stored: dict[tuple[str, str], str | None] = {
        (kind, name): sql
        for kind, name, sql in conn.exec_driver_sql(
            "SELECT type, name, sql FROM sqlite_master"
            " WHERE name NOT LIKE 'sqlite_%' AND name != 'alembic_version'"
        )
    }
    expected: dict[tuple[str, str], str] = {}
    for table in md.sorted_tables:
        expected[("table", table.name)] = str(CreateTable(table).compile(dialect=dialect))
        for index in table.indexes:
            assert index.name is not None
            expected[("index", index.name)] = str(CreateIndex(index).compile(dialect=dialect))
    drift = [f"only in the database: {key}" for key in stored.keys() - expected.keys()]
    drift += [f"missing from the database: {key}" for key in expected.keys() - stored.keys()]
    for key in sorted(stored.keys() & expected.keys()):
        have, want = stored[key], expected[key]
        assert have is not None
        if key[0] == "table":
            h_head, h_clauses, h_tail = _table_ddl(have)
            w_head, w_clauses, w_tail = _table_ddl(want)
            if (h_head, h_tail) != (w_head, w_tail):
                drift.append(f"{key}: {h_head} ... {h_tail} != {w_head} ... {w_tail}")
            drift += [f"{key}: only in the database: {c}" for c in h_clauses - w_clauses]
            drift += [f"{key}: only in the metadata: {c}" for c in w_clauses - h_clauses]
        elif _squash(have) != _squash(want):
            drift.append(f"{key}: {_squash(have)} != {_squash(want)}")
    return drift


def _snapshot(conn: Connection) -> frozenset[tuple[str, str, str]]:
    """The schema objects of the application (alembic's own table left out)."""
    rows = conn.exec_driver_sql(
        "SELECT type, name, coalesce(sql, '') FROM sqlite_master"
        " WHERE name NOT LIKE 'sqlite_%' AND name != 'alembic_version'"
    )
    return frozenset((kind, name, _canonical(kind, sql)) for kind, name, sql in rows)


def _canonical(kind: str, sql: str) -> str:
    """DDL in a form that ignores what SQLite gives no meaning (clause order, quoting)."""
    if kind != "table":
        return _squash(sql)
    head, clauses, tail = _table_ddl(sql)
    return " | ".join([head, *sorted(clauses), tail])


def _tables(snapshot: frozenset[tuple[str, str, str]]) -> set[str]:
    return {name for kind, name, _ in snapshot if kind == "table"}


def _revisions() -> list[str]:
    """Every revision, base first; the history must be one straight line."""
    script = ScriptDirectory.from_config(migrate.config())
    revisions = list(reversed(list(script.walk_revisions())))
    previous = None
    for revision in revisions:
        assert revision.down_revision == previous, "migration history must be linear"
        previous = revision.revision
    return [r.revision for r in revisions]


def _copy(md: MetaData) -> MetaData:
    clone = MetaData(naming_convention=NAMING_CONVENTION)
    for table in md.sorted_tables:
        table.to_metadata(clone)
    return clone


# --- 1. parity ----------------------------------------------------------------------------


def test_upgraded_schema_has_no_autogenerate_diff(fresh: Connection) -> None:
    migrate.upgrade(fresh)
    context = MigrationContext.configure(
        fresh, opts={"compare_type": True, "compare_server_default": True}
    )
    assert compare_metadata(context, metadata) == []


def test_upgraded_schema_matches_metadata_ddl(fresh: Connection) -> None:
    migrate.upgrade(fresh)
    assert _schema_drift(fresh, metadata) == []
    kinds = {kind for kind, _, _ in _snapshot(fresh)}
    assert kinds == {"table", "index"}  # no views or triggers the metadata does not know


def test_ddl_comparison_sees_drift_autogenerate_cannot(fresh: Connection) -> None:
    """The second parity check is not vacuous: each drift below is reported by it."""
    migrate.upgrade(fresh)

    def check_removed(md: MetaData) -> None:
        table = md.tables["children"]
        (check,) = [
            c
            for c in table.constraints
            if isinstance(c, CheckConstraint) and c.name == "ck_children_finished_iff_terminal"
        ]
        table.constraints.discard(check)

    def check_changed(md: MetaData) -> None:
        table = md.tables["events"]
        (check,) = [c for c in table.constraints if isinstance(c, CheckConstraint)]
        check.sqltext = text("sequence >= 0")

    def partial_where_changed(md: MetaData) -> None:
        (index,) = [i for i in md.tables["children"].indexes if i.name == "ix_children_one_active"]
        index.dialect_options["sqlite"]["where"] = text("state IN ('prepared', 'admitted')")

    def on_delete_dropped(md: MetaData) -> None:
        (fk,) = md.tables["children"].c.grant_id.foreign_keys
        assert fk.constraint is not None
        fk.constraint.ondelete = None

    def default_changed(md: MetaData) -> None:
        md.tables["children"].c.recovery_attempts.server_default = None

    for mutate in (
        check_removed,
        check_changed,
        partial_where_changed,
        on_delete_dropped,
        default_changed,
    ):
        drifted = _copy(metadata)
        mutate(drifted)
        assert _schema_drift(fresh, drifted), mutate.__name__


# --- 2. the revision walk -----------------------------------------------------------------


def test_upgrade_downgrade_upgrade_walks_every_revision(fresh: Connection) -> None:
    revisions = _revisions()
    assert revisions[-1] == migrate.head()
    assert migrate.current(fresh) is None
    assert _snapshot(fresh) == frozenset()

    at: dict[str | None, frozenset[tuple[str, str, str]]] = {None: frozenset()}
    for revision in revisions:
        migrate.upgrade(fresh, revision)
        assert migrate.current(fresh) == revision
        at[revision] = _snapshot(fresh)
    assert _tables(at[migrate.head()]) == set(metadata.tables)

    for revision, below in reversed(list(zip(revisions, [None, *revisions[:-1]], strict=True))):
        assert migrate.current(fresh) == revision
        migrate.downgrade(fresh, below or "base")
        assert migrate.current(fresh) == below
        assert _snapshot(fresh) == at[below], f"downgrade of {revision} left other tables"
    assert _tables(_snapshot(fresh)) == set()

    for revision in revisions:
        migrate.upgrade(fresh, revision)
        assert migrate.current(fresh) == revision
        assert _snapshot(fresh) == at[revision]
    assert migrate.current(fresh) == migrate.head()
    assert _schema_drift(fresh, metadata) == []


def test_upgrade_at_head_is_a_no_op(fresh: Connection) -> None:
    migrate.upgrade(fresh)
    before = _snapshot(fresh)
    migrate.upgrade(fresh)
    assert _snapshot(fresh) == before
    assert migrate.current(fresh) == migrate.head()


def test_engine_instances_keep_their_rows_through_the_rename(tmp_path: Path) -> None:
    """Revision 0010 renames host_instances on a file with rows: every row stays, the
    tables that refer to an instance still do, and the reference is still enforced."""
    path = tmp_path / "at_0009.db"
    engine = create_engine(f"sqlite:///{path}")
    try:
        with engine.connect() as conn:
            migrate.upgrade(conn, "0009")
    finally:
        engine.dispose()
    raw = sqlite3.connect(path, isolation_level=None)
    raw.execute("PRAGMA foreign_keys=ON")
    instance = {"id": "h-1", "started_at": T0, "closed_at": T0 + 5, "taken_by": "h-2"}
    _insert(raw, "host_instances", instance)
    _insert(raw, "runners", _row("runners", 0, runner_id="r-1"))
    _insert(raw, "connections", _row("connections", 0))
    _insert(raw, "grants", _row("grants", 0))
    _insert(raw, "children", _row("children", 0, state="running", **STATE_FIELDS["running"]))
    raw.close()

    engine = create_engine(f"sqlite:///{path}")
    try:
        with engine.connect() as conn:
            migrate.upgrade(conn)
            assert migrate.current(conn) == migrate.head()
            assert _schema_drift(conn, metadata) == []
    finally:
        engine.dispose()
    raw = sqlite3.connect(path, isolation_level=None)
    raw.execute("PRAGMA foreign_keys=ON")
    try:
        names = ", ".join(instance)
        assert raw.execute(f"SELECT {names} FROM engine_instances").fetchall() == [
            tuple(instance.values())
        ]
        assert not raw.execute(
            "SELECT 1 FROM sqlite_master WHERE name = 'host_instances'"
        ).fetchall()
        assert raw.execute("SELECT engine_instance_id FROM children").fetchall() == [("h-1",)]
        assert raw.execute("SELECT engine_instance_id FROM connections").fetchall() == [("h-1",)]
        with pytest.raises(sqlite3.IntegrityError, match=FOREIGN_KEY):
            _insert(raw, "connections", _row("connections", 1, engine_instance_id="h-9"))
    finally:
        raw.close()


def test_the_children_rebuild_keeps_every_row_that_refers_to_a_child(tmp_path: Path) -> None:
    """Revision 0014 rebuilds ``children`` on SQLite (its CHECK gains ``waiting``). An
    Engine migrates with foreign keys on, and dropping the old table then deleted every
    event, step and steer of every child (ON DELETE CASCADE)."""
    path = tmp_path / "at_0013.db"
    engine = create_engine(f"sqlite:///{path}")
    try:
        with engine.connect() as conn:
            migrate.upgrade(conn, "0013")
    finally:
        engine.dispose()
    raw = sqlite3.connect(path, isolation_level=None)
    raw.execute("PRAGMA foreign_keys=ON")
    _insert(raw, "engine_instances", {"id": "h-1", "started_at": T0})
    _insert(raw, "runners", _row("runners", 0, runner_id="r-1"))
    _insert(raw, "connections", _row("connections", 0))
    _insert(raw, "grants", _row("grants", 0))
    _insert(raw, "children", _row("children", 0, state="running", **STATE_FIELDS["running"]))
    (child_id,) = raw.execute("SELECT id FROM children").fetchone()
    raw.execute("INSERT INTO events (child_id, sequence, body) VALUES (?, 1, ?)", (child_id, b"{}"))
    raw.execute(
        "INSERT INTO steps (child_id, name, ordinal, value, recorded_at) VALUES (?, 's', 1, ?, ?)",
        (child_id, b"1", T0),
    )
    raw.close()
    before = _counts(path)

    async def open_and_close() -> None:
        async with Engine(f"sqlite:///{path}", runner=ScriptRunner()):
            pass

    asyncio.run(open_and_close())  # migrates to head, foreign keys on
    assert _counts(path) == before and before["events"] == before["steps"] == 1
    raw = sqlite3.connect(path)
    try:
        assert raw.execute("PRAGMA foreign_key_check").fetchall() == []
        assert raw.execute("SELECT wakes, inputs_open, wake_at FROM children").fetchall() == [
            (0, 0, None)
        ]
    finally:
        raw.close()


def _counts(path: Path) -> dict[str, int]:
    raw = sqlite3.connect(path)
    try:
        return {
            table: raw.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
            for table in ("children", "events", "steps", "grants", "connections")
        }
    finally:
        raw.close()


# --- 3. constraints, through raw SQL -----------------------------------------------------

T0 = 1_800_000_000.0


@pytest.fixture
def raw(db_path: Path) -> Iterator[sqlite3.Connection]:
    """The migrated template, through the stdlib driver, with foreign keys on (as the
    engine has them), seeded with one host instance, runner, connection and tool grant."""
    conn = sqlite3.connect(db_path, isolation_level=None)
    conn.execute("PRAGMA foreign_keys=ON")
    _insert(conn, "engine_instances", {"id": "h-1", "started_at": T0})
    _insert(
        conn,
        "runners",
        {"runner_id": "r-1", "host_instance_id": "host-a", "generation": 1, "updated_at": T0},
    )
    _insert(conn, "connections", _row("connections", 0))
    _insert(conn, "grants", _row("grants", 0))
    try:
        yield conn
    finally:
        conn.close()


def _insert(conn: sqlite3.Connection, table: str, values: dict[str, Any]) -> int:
    names = ", ".join(values)
    marks = ", ".join(f":{name}" for name in values)
    cursor = conn.execute(f"INSERT INTO {table} ({names}) VALUES ({marks})", values)
    assert cursor.lastrowid is not None
    return cursor.lastrowid


def _row(table: str, n: int, **changes: Any) -> dict[str, Any]:
    """A valid row of ``table``; ``n`` keeps its unique columns apart from other rows."""
    rows: dict[str, dict[str, Any]] = {
        "runners": {
            "runner_id": f"runner-{n}",
            "host_instance_id": "host-a",
            "generation": 1,
            "updated_at": T0,
        },
        "connections": {
            "id": f"k-{n}",
            "runner_id": "r-1",
            "generation": 1,
            "host_instance_id": "host-a",
            "engine_instance_id": "h-1",
            "opened_at": T0,
        },
        "grants": {
            "id": f"g-{n}",
            "kind": "tool",
            "runner_id": "r-1",
            "connection_id": "k-0",
            "run_id": "parent-run",
            "tool_call_id": f"call-{n}",
            "extension_id": "ext",
            "presets": b"[]",
            "created_at": T0,
        },
        "lease": {
            "id": f"g-lease-{n}",
            "kind": "lease",
            "runner_id": "r-1",
            "lease_id": f"lease-{n}",
            "run_id": "parent-run",
            "extension_id": "ext",
            "presets": b"[]",
            "created_at": T0,
            "expires_at": T0 + 3600,
        },
        "children": {
            "conversation_id": f"c-{n}",
            "run_id": f"run-{n}",
            "grant_id": "g-0",
            "request_id": f"q-{n}",
            "runner_id": "r-1",
            "runner_host_instance_id": "host-a",
            "parent_conversation_id": "parent-conv",
            "parent_run_id": "parent-run",
            "extension_id": "ext",
            "profile": "worker",
            "generation": 7,
            "request": b"{}",
            "preset": b"{}",
            "cwd": "/w",
            "depth": 1,
            "state": "prepared",
            "created_at": T0,
            "updated_at": T0,
        },
        "events": {"child_id": 1, "sequence": n + 1, "body": b"{}"},
        "steers": {
            "child_id": 1,
            "request_id": f"s-{n}",
            "message": "left",
            "outcome": "injected",
            "created_at": T0,
        },
    }
    return {**rows[table], **changes}


def _table_of(kind: str) -> str:
    return "grants" if kind == "lease" else kind


# A child row valid in each state: the columns its state's CHECKs require.
STATE_FIELDS: dict[str, dict[str, Any]] = {
    "prepared": {},
    "admitted": {"admitted_at": T0 + 1},
    "running": {"admitted_at": T0 + 1, "engine_instance_id": "h-1"},
    "done": {"admitted_at": T0 + 1, "finished_at": T0 + 2},
    "cancelled": {
        "finished_at": T0 + 2,
        "cancel_requested_at": T0 + 1,
        "cancel_reason": "cancelled: lease released",
    },
}

CHECK = "CHECK constraint failed: "
FOREIGN_KEY = "FOREIGN KEY constraint failed"

VIOLATIONS = [
    # children (design §4)
    pytest.param("children", {"state": "bogus"}, CHECK + "ck_children_state", id="state-unknown"),
    pytest.param(
        "children",
        {"state": "done"},
        CHECK + "ck_children_finished_iff_terminal",
        id="done-without-finished_at",
    ),
    pytest.param(
        "children",
        {"state": "cancelled"},
        CHECK + "ck_children_finished_iff_terminal",
        id="cancelled-without-finished_at",
    ),
    pytest.param(
        "children",
        {"finished_at": T0},
        CHECK + "ck_children_finished_iff_terminal",
        id="prepared-with-finished_at",
    ),
    pytest.param(
        "children",
        {"state": "admitted"},
        CHECK + "ck_children_admitted_has_time",
        id="admitted-without-admitted_at",
    ),
    pytest.param(
        "children",
        {"state": "running", "engine_instance_id": "h-1"},
        CHECK + "ck_children_admitted_has_time",
        id="running-without-admitted_at",
    ),
    pytest.param(
        "children",
        {"admitted_at": T0},
        CHECK + "ck_children_prepared_not_admitted",
        id="prepared-with-admitted_at",
    ),
    pytest.param(
        "children",
        {"state": "running", "admitted_at": T0},
        CHECK + "ck_children_running_has_owner",
        id="running-without-owner",
    ),
    pytest.param(
        "children",
        {"cancel_requested_at": T0},
        CHECK + "ck_children_cancel_has_reason",
        id="cancel-without-reason",
    ),
    pytest.param(
        "children",
        {"cancel_reason": "why"},
        CHECK + "ck_children_cancel_has_reason",
        id="reason-without-cancel",
    ),
    pytest.param(
        "children",
        {"recovery_attempts": -1},
        CHECK + "ck_children_attempts_non_negative",
        id="negative-recovery-attempts",
    ),
    pytest.param(
        "children", {"depth": 0}, CHECK + "ck_children_depth_positive", id="child-depth-zero"
    ),
    pytest.param(
        "children", {"followup": 2}, CHECK + "ck_children_followup_bool", id="followup-not-bool"
    ),
    pytest.param(
        "children",
        {"state": "running", "admitted_at": T0, "engine_instance_id": "h-gone"},
        FOREIGN_KEY,
        id="child-owner-unknown",
    ),
    pytest.param("children", {"grant_id": "g-gone"}, FOREIGN_KEY, id="child-grant-unknown"),
    pytest.param(
        "children",
        {"run_id": "run-0"},
        "UNIQUE constraint failed: children.run_id",
        id="run-id-reused",
    ),
    pytest.param(
        "children",
        {"request_id": "q-0"},
        "UNIQUE constraint failed: children.grant_id, children.request_id",
        id="request-id-reused-in-grant",
    ),
    # grants (design §3)
    pytest.param(
        "grants",
        {"lease_id": "lease-x"},
        CHECK + "ck_grants_tool_has_no_lease",
        id="tool-with-lease-id",
    ),
    pytest.param(
        "lease", {"lease_id": None}, CHECK + "ck_grants_lease_has_id", id="lease-without-id"
    ),
    pytest.param(
        "grants",
        {"tool_call_id": None},
        CHECK + "ck_grants_tool_complete",
        id="tool-without-call",
    ),
    pytest.param(
        "grants", {"presets": None}, CHECK + "ck_grants_tool_complete", id="tool-without-presets"
    ),
    pytest.param(
        "grants",
        {"connection_id": None},
        CHECK + "ck_grants_tool_complete",
        id="tool-without-connection",
    ),
    pytest.param(
        "lease",
        {"expires_at": None},
        CHECK + "ck_grants_live_lease_complete",
        id="live-lease-without-expiry",
    ),
    pytest.param(
        "lease",
        {"presets": None},
        CHECK + "ck_grants_live_lease_complete",
        id="live-lease-without-presets",
    ),
    pytest.param(
        "grants",
        {"revoked_at": T0},
        CHECK + "ck_grants_tool_never_revoked",
        id="tool-revoked",
    ),
    pytest.param("grants", {"depth": 0}, CHECK + "ck_grants_depth_positive", id="grant-depth-zero"),
    # ck_grants_kind is implied by tool_has_no_lease and lease_has_id together, so any
    # unknown kind trips one of the three: only a CHECK failure can be asserted.
    pytest.param("grants", {"kind": "other"}, CHECK, id="grant-kind-unknown"),
    pytest.param("grants", {"connection_id": "k-gone"}, FOREIGN_KEY, id="grant-connection-unknown"),
    pytest.param(
        "lease",
        {"lease_id": "lease-0"},
        "UNIQUE constraint failed: grants.runner_id, grants.lease_id",
        id="lease-id-reused-by-runner",
    ),
    # events (design §4: sequences start at 1, never repeat)
    pytest.param(
        "events", {"sequence": 0}, CHECK + "ck_events_sequence_positive", id="event-sequence-0"
    ),
    pytest.param(
        "events",
        {"sequence": -3},
        CHECK + "ck_events_sequence_positive",
        id="event-sequence-negative",
    ),
    pytest.param(
        "events",
        {"sequence": 1},
        "UNIQUE constraint failed: events.child_id, events.sequence",
        id="event-sequence-repeated",
    ),
    pytest.param("events", {"child_id": 999}, FOREIGN_KEY, id="event-child-unknown"),
    # steers (design §5)
    pytest.param(
        "steers", {"outcome": "queued"}, CHECK + "ck_steers_outcome", id="steer-outcome-unknown"
    ),
    pytest.param(
        "steers",
        {"outcome": "promptRequired", "delivered_at": T0},
        CHECK + "ck_steers_only_injected_delivered",
        id="prompt-required-delivered",
    ),
    pytest.param(
        "steers",
        {"request_id": "s-0"},
        "UNIQUE constraint failed: steers.child_id, steers.request_id",
        id="steer-request-id-reused",
    ),
    pytest.param("steers", {"child_id": 999}, FOREIGN_KEY, id="steer-child-unknown"),
    # runners and connections
    pytest.param(
        "runners",
        {"generation": 0},
        CHECK + "ck_runners_generation_positive",
        id="runner-generation-zero",
    ),
    pytest.param(
        "connections",
        {"generation": 0},
        CHECK + "ck_connections_generation_positive",
        id="connection-generation-zero",
    ),
    pytest.param(
        "connections", {"runner_id": "r-gone"}, FOREIGN_KEY, id="connection-runner-unknown"
    ),
]


@pytest.mark.parametrize(("kind", "changes", "message"), VIOLATIONS)
def test_constraint_refuses_invalid_row(
    raw: sqlite3.Connection, kind: str, changes: dict[str, Any], message: str
) -> None:
    table = _table_of(kind)
    _insert(raw, "children", _row("children", 0))  # child 1: the parent of events, steers
    if kind in ("lease", "events", "steers"):
        _insert(raw, table, _row(kind, 0))  # the row a "reused" case collides with
    # Control: the same row without the change is accepted.
    _insert(raw, table, _row(kind, 1))
    before = raw.execute(f"SELECT count(*) FROM {table}").fetchone()
    with pytest.raises(sqlite3.IntegrityError, match=re.escape(message)):
        _insert(raw, table, _row(kind, 2, **changes))
    assert raw.execute(f"SELECT count(*) FROM {table}").fetchone() == before


@pytest.mark.parametrize("state", list(STATE_FIELDS))
def test_child_row_valid_in_every_state(raw: sqlite3.Connection, state: str) -> None:
    child_id = _insert(raw, "children", _row("children", 1, state=state, **STATE_FIELDS[state]))
    stored = raw.execute("SELECT state FROM children WHERE id = ?", (child_id,)).fetchone()
    assert stored == (state,)


def test_revoked_lease_tombstone_needs_no_expiry_or_presets(raw: sqlite3.Connection) -> None:
    _insert(raw, "grants", _row("lease", 1, expires_at=None, presets=None, revoked_at=T0))


def test_same_lease_id_under_another_runner_is_a_different_lease(raw: sqlite3.Connection) -> None:
    _insert(raw, "runners", _row("runners", 2))
    _insert(raw, "grants", _row("lease", 1))
    _insert(raw, "grants", _row("lease", 2, lease_id="lease-1", runner_id="runner-2"))


ACTIVE = ["prepared", "admitted", "running"]
TERMINAL = ["done", "cancelled"]


def _execution(n: int, state: str, conversation: str = "c-shared") -> dict[str, Any]:
    return _row("children", n, conversation_id=conversation, state=state, **STATE_FIELDS[state])


@pytest.mark.parametrize("second", ACTIVE)
@pytest.mark.parametrize("first", ACTIVE)
def test_two_active_executions_of_one_conversation_fail(
    raw: sqlite3.Connection, first: str, second: str
) -> None:
    _insert(raw, "children", _execution(1, first))
    with pytest.raises(
        sqlite3.IntegrityError,
        match=re.escape("UNIQUE constraint failed: children.conversation_id"),
    ):
        _insert(raw, "children", _execution(2, second))
    _insert(raw, "children", _execution(3, second, conversation="c-other"))


@pytest.mark.parametrize("active", ACTIVE)
@pytest.mark.parametrize("finished", TERMINAL)
def test_finished_executions_do_not_block_an_active_one(
    raw: sqlite3.Connection, finished: str, active: str
) -> None:
    _insert(raw, "children", _execution(1, finished))
    _insert(raw, "children", _execution(2, "done"))
    _insert(raw, "children", _execution(3, active))
    count = raw.execute("SELECT count(*) FROM children WHERE conversation_id = 'c-shared'")
    assert count.fetchone() == (3,)


def test_finished_execution_cannot_become_active_beside_an_active_one(
    raw: sqlite3.Connection,
) -> None:
    done = _insert(raw, "children", _execution(1, "done"))
    _insert(raw, "children", _execution(2, "admitted"))
    with pytest.raises(sqlite3.IntegrityError, match="UNIQUE constraint failed"):
        raw.execute(
            "UPDATE children SET state = 'admitted', finished_at = NULL WHERE id = ?", (done,)
        )


def test_deleting_a_child_cascades_to_events_and_steers(raw: sqlite3.Connection) -> None:
    child = _insert(raw, "children", _row("children", 0))
    _insert(raw, "events", _row("events", 0, child_id=child))
    _insert(raw, "steers", _row("steers", 0, child_id=child))
    raw.execute("DELETE FROM children WHERE id = ?", (child,))
    assert raw.execute("SELECT count(*) FROM events").fetchone() == (0,)
    assert raw.execute("SELECT count(*) FROM steers").fetchone() == (0,)


def test_deleting_a_grant_keeps_its_children(raw: sqlite3.Connection) -> None:
    _insert(raw, "grants", _row("lease", 1))
    child = _insert(raw, "children", _row("children", 1, grant_id="g-lease-1"))
    raw.execute("DELETE FROM grants WHERE id = 'g-lease-1'")
    stored = raw.execute("SELECT grant_id FROM children WHERE id = ?", (child,)).fetchone()
    assert stored == (None,)


# --- 4. PRAGMAs on the engine's own connections -------------------------------------------

PRAGMAS = ("journal_mode", "synchronous", "foreign_keys", "busy_timeout")


def _read_pragmas(conn: Connection) -> dict[str, Any]:
    return {name: conn.exec_driver_sql(f"PRAGMA {name}").scalar() for name in PRAGMAS}


async def _engine_pragmas(path: Path, config: EngineConfig) -> list[dict[str, Any]]:
    """The PRAGMAs as a reader and the writer see them, on an Engine-opened file.

    PRAGMAs are per connection, so they must be read through the engine's own pools
    (``Engine._db`` is the Database; no public handle reaches a raw connection).
    """
    async with Engine(f"sqlite:///{path}", runner=ScriptRunner(), config=config) as engine:
        reader = await engine._db.read(_read_pragmas)
        writer = await engine._db.write(_read_pragmas)
    # The writer waits for another process's lock itself (``Database._begin``): an
    # inline commit on the loop's thread must never sit in SQLite's busy handler.
    assert writer.pop("busy_timeout") == 0
    return [reader, {**writer, "busy_timeout": reader["busy_timeout"]}]


async def test_engine_pragmas_default_to_durable(tmp_path: Path) -> None:
    # A fresh file, not the template (which is already WAL), so WAL is the engine's doing.
    for seen in await _engine_pragmas(tmp_path / "fresh.db", EngineConfig()):
        assert seen == {
            "journal_mode": "wal",
            "synchronous": 2,  # FULL
            "foreign_keys": 1,
            "busy_timeout": 5000,
        }


@pytest.mark.parametrize(("mode", "level"), [("NORMAL", 1), ("normal", 1), ("EXTRA", 3)])
async def test_engine_synchronous_is_configurable(tmp_path: Path, mode: str, level: int) -> None:
    config = EngineConfig(synchronous=mode, busy_timeout_ms=1234)
    for seen in await _engine_pragmas(tmp_path / "fresh.db", config):
        assert seen == {
            "journal_mode": "wal",
            "synchronous": level,
            "foreign_keys": 1,
            "busy_timeout": 1234,
        }


def test_unknown_synchronous_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="synchronous"):
        EngineConfig(synchronous="SOMETIMES")


# --- 5. the statements that scan many children use the index meant for them --------------


def _plans(db_path: Path, work: Any, marker: str) -> list[str]:
    """Run ``work`` on the migrated file and explain every statement it issued that
    contains ``marker`` (SQLite's trace gives them with their values bound)."""
    engine = create_engine(f"sqlite:///{db_path}")
    issued: list[str] = []
    try:
        with engine.connect() as conn:
            dbapi_conn = conn.connection.dbapi_connection
            assert dbapi_conn is not None
            dbapi_conn.set_trace_callback(issued.append)
            work(conn)
            dbapi_conn.set_trace_callback(None)
            chosen = [sql for sql in issued if marker in sql]
            assert chosen, f"no statement with {marker!r} was issued"
            return [
                " | ".join(row[3] for row in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {sql}"))
                for sql in chosen
            ]
    finally:
        engine.dispose()


def test_retention_walks_the_finished_index_in_order(db_path: Path) -> None:
    """Not the state index plus a sort of every finished child, once per batch."""
    for plan in _plans(db_path, lambda c: maintenance.purge(c, T0, 60.0), "finished_at <"):
        assert "ix_children_finished" in plan, plan
        assert "TEMP B-TREE" not in plan, plan


def test_children_of_a_lease_are_found_through_the_lease_index(db_path: Path) -> None:
    """The index is partial (``lease_id IS NOT NULL``); ``lease_id = ?`` implies it."""
    for plan in _plans(
        db_path, lambda c: queries.active_under_lease(c, "r-1", "lease-1"), "lease_id"
    ):
        assert "ix_children_lease" in plan, plan


async def test_no_statement_of_a_host_lifetime_scans_every_child(
    db_url: str, db_path: Path, workspace: Path
) -> None:
    """Starts, a lease, a tool's end, a restart that resumes, expiry and retention: every
    statement they issue on ``children`` goes through an index. Finished children are
    kept for a week, so a full scan would grow with everything the host ever ran."""
    issued: set[str] = set()

    def trace(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.set_trace_callback(issued.add)

    clock = ManualClock(T0)
    config = EngineConfig(release_drain_s=1.0, lease_lifetime_s=60.0, retention_s=600.0)
    runner = ScriptRunner(script=hold(asyncio.Event()))
    event.listen(SAEngine, "connect", trace)
    try:
        async with Engine(db_url, runner=runner, config=config, clock=clock) as engine:
            h = await open_harness(engine, runner, workspace)
            await h.start("q1")
            leased = await h.start("q2", lease_id="lease-1")
            await engine.close_tool(h.tool)  # cancels the foreground child
            running = await engine.list_children(state="running")
            assert leased.conversation_id in [c.conversation_id for c in running]
        async with Engine(db_url, runner=runner, config=config, clock=clock) as engine:
            clock.advance(120.0)  # past the lease: its child is cancelled
            await engine.expire_due()
            for _ in range(500):
                record = await engine.get_child(leased.conversation_id)
                if record is not None and record.state == "cancelled":
                    break
                await asyncio.sleep(0.01)
            clock.advance(1_000.0)  # past retention: both are purged
            assert await engine.purge() == 2
    finally:
        event.remove(SAEngine, "connect", trace)

    scans: list[str] = []
    with sqlite3.connect(db_path) as conn:
        for sql in sorted(issued):
            if not re.search(r"\bchildren\b", sql) or not re.match(
                r"\s*(SELECT|UPDATE|INSERT|DELETE|WITH)\b", sql, re.IGNORECASE
            ):
                continue
            if sql.startswith("DELETE FROM engine_instances"):
                continue  # retention's housekeeping: per expired host instance, not per child
            for *_, detail in conn.execute(f"EXPLAIN QUERY PLAN {sql}"):
                if re.fullmatch(r"SCAN (children|c)", detail):
                    scans.append(f"{detail}: {sql}")
    assert any("INDEXED BY ix_children_one_active" in sql for sql in issued), "no boot ran"
    assert scans == [], "\n".join(scans)


def test_the_active_term_is_the_one_active_index_own(raw: sqlite3.Connection) -> None:
    """Queries for unfinished children repeat this term so SQLite may use the index."""
    (ddl,) = raw.execute(
        "SELECT sql FROM sqlite_master WHERE name = 'ix_children_one_active'"
    ).fetchone()
    assert ddl.endswith(f"WHERE {children.ACTIVE_TERM}")
    assert SQLITE.active == "children INDEXED BY ix_children_one_active"
