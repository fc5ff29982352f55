"""One set of Alembic migrations serves both dialects (design §12): on a real PostgreSQL
server, the migrated schema is the models' schema, and every revision walks down and up."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect
from sqlalchemy.exc import IntegrityError

from delegation.store import migrate
from delegation.store.tables import metadata


def test_the_migrated_schema_is_the_models_on_postgresql(postgres_url: str) -> None:
    engine = create_engine(postgres_url)
    try:
        with engine.connect() as conn:
            migrate.upgrade(conn)
            assert migrate.current(conn) == migrate.head()
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            assert compare_metadata(context, metadata) == []
            columns = {c["name"]: c for c in inspect(conn).get_columns("children")}
            assert str(columns["created_at"]["type"]) == "DOUBLE PRECISION", "not float4"
            assert str(columns["generation"]["type"]) == "BIGINT", "a uint64 wire integer"
            partial = conn.exec_driver_sql(
                "SELECT indexdef FROM pg_indexes WHERE indexname = 'ix_children_one_active'"
            ).scalar_one()
            # Without its WHERE, one conversation could never be resumed.
            assert "UNIQUE" in partial and "WHERE" in partial
    finally:
        engine.dispose()


def test_every_revision_walks_down_and_up_on_postgresql(postgres_url: str) -> None:
    engine = create_engine(postgres_url)
    try:
        with engine.connect() as conn:
            migrate.upgrade(conn)
            migrate.downgrade(conn, "base")
            assert migrate.current(conn) is None
            assert set(inspect(conn).get_table_names()) <= {"alembic_version"}
            migrate.upgrade(conn)
            assert migrate.current(conn) == migrate.head()
    finally:
        engine.dispose()


def test_engine_instances_keep_their_rows_through_the_rename_on_postgresql(
    postgres_url: str,
) -> None:
    """Revision 0010 on a database with rows: they stay, and are still referred to."""
    engine = create_engine(postgres_url)
    try:
        with engine.connect() as conn:
            migrate.downgrade(conn, "base")
            migrate.upgrade(conn, "0009")
            conn.exec_driver_sql(
                "INSERT INTO host_instances (id, started_at, taken_by) VALUES ('h-1', 1, 'h-2')"
            )
            conn.exec_driver_sql(
                "INSERT INTO runners (runner_id, host_instance_id, generation, updated_at)"
                " VALUES ('r-1', 'host-a', 1, 1)"
            )
            conn.exec_driver_sql(
                "INSERT INTO connections (id, runner_id, generation, host_instance_id,"
                " engine_instance_id, opened_at) VALUES ('k-1', 'r-1', 1, 'host-a', 'h-1', 1)"
            )
            conn.commit()
            migrate.upgrade(conn)
            assert migrate.current(conn) == migrate.head()
            assert conn.exec_driver_sql(
                "SELECT id, started_at, taken_by FROM engine_instances"
            ).all() == [("h-1", 1.0, "h-2")]
            assert "host_instances" not in inspect(conn).get_table_names()
            keys = inspect(conn).get_foreign_keys("connections")
            assert "engine_instances" in {fk["referred_table"] for fk in keys}
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            assert compare_metadata(context, metadata) == []
            with pytest.raises(IntegrityError):
                conn.exec_driver_sql(
                    "INSERT INTO connections (id, runner_id, generation, host_instance_id,"
                    " engine_instance_id, opened_at) VALUES ('k-2', 'r-1', 1, 'host-a', 'h-9', 1)"
                )
            conn.rollback()
    finally:
        engine.dispose()
