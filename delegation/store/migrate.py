"""Alembic, driven from the package: the only way the schema changes."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, inspect

from delegation import errors

_PACKAGE = Path(__file__).resolve().parent.parent


def script_location() -> Path:
    """The migrations: shipped inside the wheel, or at the top of a source checkout."""
    for candidate in (_PACKAGE / "_migrations", _PACKAGE.parent / "migrations"):
        if (candidate / "env.py").is_file():
            return candidate
    raise FileNotFoundError("delegation's migrations are missing from this installation")


def config(connection: Connection | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(script_location()))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def head() -> str:
    heads = ScriptDirectory.from_config(config()).get_heads()
    return heads[0]


def current(connection: Connection) -> str | None:
    return MigrationContext.configure(connection).get_current_revision()


def check(connection: Connection) -> None:
    """Refuse a file this code must not migrate; only reads.

    Raises:
        errors.SchemaMismatch: another application's tables without a delegation
            revision, or a revision this code does not know (a newer delegation's).
    """
    revision = current(connection)
    if revision is None:
        others = [t for t in inspect(connection).get_table_names() if t != "alembic_version"]
        if others:
            raise errors.SchemaMismatch(
                f"not a delegation database: it holds other tables ({', '.join(others[:5])})"
            )
        return
    known = [script.revision for script in ScriptDirectory.from_config(config()).walk_revisions()]
    if revision not in known:
        raise errors.SchemaMismatch(
            f"database schema {revision} is not one this delegation knows (its newest is"
            f" {known[0]}): it was written by a newer delegation, or is not a delegation database"
        )


def upgrade(connection: Connection, revision: str = "head") -> None:
    """Migrate the database behind ``connection`` (committed on return)."""
    command.upgrade(config(connection), revision)
    connection.commit()


def downgrade(connection: Connection, revision: str) -> None:
    command.downgrade(config(connection), revision)
    connection.commit()
