"""One set of Alembic migrations serves both dialects (SPEC §12): on a real PostgreSQL
server, the migrated schema is the models' schema, and every revision walks down and up."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

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
