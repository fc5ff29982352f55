"""Rows of a delegation database, read from outside the engine, on either store.

The tests look at what the engine committed through these helpers, given the database's
SQLAlchemy URL (``sqlite:///PATH`` or ``postgresql+psycopg://…``), never through a
store's own driver, so the same test can read either store (design §12).

Reading never writes and never disturbs a live host: a SQLite file is opened read-only
(``mode=ro``: a WAL reader, never blocked by a writer, and never the last connection to
checkpoint and remove a live host's WAL); a PostgreSQL connection is a read-only one.
Connections are not pooled, so none is left open between calls; the engines themselves
are cached per URL and disposed of at the end of the session (``dispose``).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, inspect, make_url, text
from sqlalchemy.pool import NullPool

from delegation.store.postgres.connect import tcp_args

Row = tuple[Any, ...]

_engines: dict[str, Engine] = {}


def url_of(db_path: Path) -> str:
    """The URL of a SQLite file (as the ``db_url`` fixture spells it)."""
    return f"sqlite:///{db_path}"


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def _engine(url: str) -> Engine:
    engine = _engines.get(url)
    if engine is None:
        parsed = make_url(url)
        if parsed.get_backend_name() == "sqlite":
            if not parsed.database or parsed.database == ":memory:":
                raise ValueError(f"not a SQLite file: {url}")
            uri = Path(parsed.database).resolve().as_uri() + "?mode=ro"
            engine = create_engine(
                "sqlite://",
                creator=lambda: sqlite3.connect(uri, uri=True),
                poolclass=NullPool,
            )
        else:
            # The engine's own TCP timeouts: a URL listing a node cut off the network
            # (tests/store/test_patroni.py) is not held on it for the kernel's SYN retries.
            engine = create_engine(
                url,
                poolclass=NullPool,
                connect_args=tcp_args(url, "delegation-tests"),
                execution_options={"postgresql_readonly": True},
            )
        _engines[url] = engine
    return engine


def rows(url: str, sql: str, params: Mapping[str, Any] | None = None) -> list[Row]:
    """Every row ``sql`` selects (bind parameters are named: ``:name``)."""
    with _engine(url).connect() as conn:
        return [tuple(row) for row in conn.execute(text(sql), dict(params or {}))]


def scalar(url: str, sql: str, params: Mapping[str, Any] | None = None) -> Any:
    """The first column of the one row ``sql`` selects."""
    ((value, *_),) = rows(url, sql, params)
    return value


def no_sessions_of(url: str, application: str, timeout_s: float = 10.0) -> None:
    """Wait until the server has no session of ``application`` on this database: a
    closed or ended one leaves its backend a moment later, one left open never does."""
    sql = (
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name = :application"
    )
    deadline = time.monotonic() + timeout_s
    while (left := scalar(url, sql, {"application": application})) > 0:
        assert time.monotonic() < deadline, f"{left} session(s) of {application} still open"
        time.sleep(0.05)


# What a live host rewrites by itself, every few seconds: its heartbeat, not a change.
_LIVENESS = {"engine_instances": {"heartbeat_at"}}


def snapshot(url: str) -> dict[str, list[Row]]:
    """Every row of every table (of the application and of Alembic), each sorted,
    without the liveness columns a host rewrites by itself (its heartbeat)."""
    with _engine(url).connect() as conn:
        names = sorted(inspect(conn).get_table_names())
        tables = {}
        for name in names:
            columns = [c["name"] for c in inspect(conn).get_columns(name)]
            kept = ", ".join(f'"{c}"' for c in columns if c not in _LIVENESS.get(name, set()))
            found = conn.exec_driver_sql(f'SELECT {kept} FROM "{name}"')
            tables[name] = sorted((tuple(row) for row in found), key=repr)
        return tables


def dispose() -> None:
    """Dispose of every cached engine (the end of the test session)."""
    while _engines:
        _, engine = _engines.popitem()
        engine.dispose()
