"""Persistence: the only package that imports SQLAlchemy."""

from __future__ import annotations

import sqlite3
from typing import Any, cast

from sqlalchemy import Connection


def dbapi(conn: Connection) -> sqlite3.Connection:
    """The sqlite3 connection under ``conn``, in the same transaction.

    Hot paths run their few plain statements here: SQLAlchemy's per-statement result
    machinery costs more than an indexed lookup. Everything else uses Core.
    """
    return cast(sqlite3.Connection, conn.connection.dbapi_connection)


def run(conn: Connection, sql: str, params: tuple[Any, ...] = ()) -> sqlite3.Cursor:
    return dbapi(conn).execute(sql, params)
