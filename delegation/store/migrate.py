"""Alembic, driven from the package: the only way the schema changes. What a dialect
does around a migration is its record's (:meth:`~delegation.store.registry.Record.migrating`:
SQLite keeps the rows a table's rebuild would delete)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, inspect

from delegation import errors
from delegation.store import registry

_PACKAGE = Path(__file__).resolve().parent.parent

# An upgrade's progress: told the revisions it will apply, (id, what it does) oldest
# first, with 0 before the first, then again with how many are done after each.
OnStep = Callable[[list[tuple[str, str]], int], None]


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


def pending(connection: Connection) -> list[tuple[str, str]]:
    """The revisions an upgrade to head would apply, oldest first: (id, what it does)."""
    script = ScriptDirectory.from_config(config())
    newer = script.iterate_revisions("heads", current(connection) or "base")
    return [(rev.revision, rev.doc or "") for rev in reversed(list(newer))]


def upgrade(connection: Connection, revision: str = "head", on_step: OnStep | None = None) -> None:
    """Migrate the database behind ``connection`` (committed on return), telling
    ``on_step`` of each revision applied."""
    cfg = config(connection)
    if on_step is not None:
        steps, done = pending(connection), itertools.count(1)
        on_step(steps, 0)

        def applied(**_: Any) -> None:  # Alembic's on_version_apply
            on_step(steps, next(done))

        cfg.attributes["on_version_apply"] = applied
    with registry.record(connection.dialect.name).migrating(connection):
        command.upgrade(cfg, revision)
        connection.commit()


def downgrade(connection: Connection, revision: str) -> None:
    with registry.record(connection.dialect.name).migrating(connection):
        command.downgrade(config(connection), revision)
        connection.commit()


def checked_revision(conn: Connection) -> str | None:
    """The database's revision, once :func:`check` found it ours."""
    check(conn)
    return current(conn)


def at_head(conn: Connection, name: str) -> None:
    """Refuse a database that is not delegation's at this code's head revision.

    Raises:
        errors.SchemaMismatch: another application's, a newer one, or an older one.
    """
    check(conn)
    if current(conn) != head():
        raise errors.SchemaMismatch(
            f"{name} is at an older schema; run `delegation db upgrade` first"
        )
