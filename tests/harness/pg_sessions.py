"""What other tests use of store/test_postgres_store.py, kept here so that no test module
imports another: _terminate."""

from __future__ import annotations

from sqlalchemy import create_engine, text


def _terminate(url: str, application: str) -> int:
    """End the server's backends of ``application`` on this database, as a server
    restart or an administrator would."""
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            sql = (
                "SELECT COUNT(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE datname = current_database() AND application_name = :name"
            )
            return int(conn.execute(text(sql), {"name": application}).scalar_one())
    finally:
        admin.dispose()
