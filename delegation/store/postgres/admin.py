"""What the operator's tools do on a PostgreSQL database beside live hosts: upgrade it,
read its revision, read a snapshot, write a control request (and ``NOTIFY`` the hosts)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from sqlalchemy import Connection, create_engine, text
from sqlalchemy.pool import NullPool

from delegation import errors
from delegation.store import migrate
from delegation.store.failures import translated
from delegation.store.lifecycle import INSTANCE_LOCKS
from delegation.store.postgres.connect import (
    IDLE_IN_TRANSACTION_MS,
    nul_safe_engine,
    session_settings,
    tcp_args,
    with_settings,
)

T = TypeVar("T")

MIGRATION_LOCK = 0x64656C6567617465  # "delegate": an advisory lock key
CHANNEL = "delegation"  # NOTIFY channel: events committed, a control request recorded


def upgrade(
    url: str, *, beside_hosts: bool = False, on_step: migrate.OnStep | None = None
) -> tuple[str | None, str | None]:
    """Migrate the database at ``url`` to head under the migration lock (two hosts
    starting together never migrate at once); the revision before and after. Unless
    ``beside_hosts`` (a host opening), it is refused while a host instance is live.

    Raises:
        errors.HostConflict: a live host uses the database (``delegation db upgrade``).
        errors.SchemaMismatch: not a delegation database, or a newer one's.
    """
    # A host stopped while it migrates must not hold the migration lock, which every
    # other host's boot waits for: the server ends its session.
    idle = session_settings({"idle_in_transaction_session_timeout": IDLE_IN_TRANSACTION_MS})
    engine = with_settings(
        create_engine(url, poolclass=NullPool, connect_args=tcp_args(url, "delegation-migrate")),
        idle,
    )
    try:
        with translated(), engine.connect() as conn:
            conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK})")
            migrate.check(conn)
            before = migrate.current(conn)
            if not beside_hosts and before is not None and live_instances(conn):
                raise errors.HostConflict("database is in use by another live host")
            migrate.upgrade(conn, on_step=on_step)  # commits, and frees the migration lock
            return before, migrate.current(conn)
    finally:
        engine.dispose()


def live_instances(conn: Connection) -> list[str]:
    """Host instances whose lock is held: their host process is alive (paused maybe)."""
    return list(
        conn.execute(
            text(
                "SELECT id FROM engine_instances WHERE closed_at IS NULL AND taken_by IS NULL"
                " AND NOT pg_try_advisory_xact_lock(:locks, hashtext(id))"
            ),
            {"locks": INSTANCE_LOCKS},
        ).scalars()
    )


def revision(url: str) -> str | None:
    """The database's schema revision, checked (``migrate.check``); only reads."""
    return read_once(url, migrate.checked_revision)


class PostgresReadOnly:
    """A read-only view of a PostgreSQL database, safe beside running hosts: each
    :meth:`read` is one ``REPEATABLE READ, READ ONLY`` snapshot."""

    def __init__(self, url: str) -> None:
        self._engine = nul_safe_engine(
            create_engine(
                url,
                pool_size=1,
                max_overflow=0,
                connect_args=tcp_args(url, "delegation-inspect"),
                execution_options={
                    "postgresql_readonly": True,
                    "isolation_level": "REPEATABLE READ",
                },
            )
        )

    def read(self, fn: Callable[[Connection], T]) -> T:
        with translated(reading=True), self._engine.connect() as conn:  # reaching the server too
            return fn(conn)

    def close(self) -> None:
        self._engine.dispose()


def read_once(url: str, fn: Callable[[Connection], T]) -> T:
    """Run ``fn`` in one read-only snapshot of the database at ``url``."""
    reader = PostgresReadOnly(url)
    try:
        return reader.read(fn)
    finally:
        reader.close()


def write_once(url: str, fn: Callable[[Connection], T], *, busy_timeout_ms: int = 5000) -> T:
    """Run ``fn`` in one short write transaction beside a live host, and notify the host
    (``NOTIFY`` is delivered when it commits). See ``database.write_once``."""
    settings = session_settings({"lock_timeout": str(busy_timeout_ms)})
    made = create_engine(url, poolclass=NullPool, connect_args=tcp_args(url, "delegation-write"))
    engine = nul_safe_engine(with_settings(made, settings))
    try:
        with translated(), engine.connect() as conn, conn.begin():
            migrate.at_head(conn, "the database")
            value = fn(conn)
            conn.exec_driver_sql(f"NOTIFY {CHANNEL}")
            return value
    finally:
        engine.dispose()
