"""Alembic, driven from the package: the only way the schema changes."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection

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


def upgrade(connection: Connection, revision: str = "head") -> None:
    """Migrate the database behind ``connection`` (committed on return)."""
    command.upgrade(config(connection), revision)
    connection.commit()


def downgrade(connection: Connection, revision: str) -> None:
    command.downgrade(config(connection), revision)
    connection.commit()
