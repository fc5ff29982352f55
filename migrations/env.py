"""Alembic environment for delegation, wired to the package's table metadata.

The database URL comes from ``-x db=URL``, else from a connection handed in by
the engine (``config.attributes["connection"]``), else from alembic.ini.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from delegation.store.tables import metadata

config = context.config
target_metadata = metadata


def _url() -> str:
    return context.get_x_argument(as_dictionary=True).get("db") or config.get_main_option(
        "sqlalchemy.url", "sqlite:///delegation.db"
    )


def _run(connection) -> None:  # type: ignore[no-untyped-def]
    # SQLite cannot ALTER most things in place: batch mode rebuilds tables instead.
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=True,
        compare_type=True,
        # Told of each revision applied: ``delegation db upgrade`` shows its progress.
        on_version_apply=config.attributes.get("on_version_apply"),
    )
    with context.begin_transaction():
        context.run_migrations()


def run_offline() -> None:
    context.configure(
        url=_url(),
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = create_engine(_url())
    try:
        with engine.connect() as conn:
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
