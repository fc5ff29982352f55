"""The loop's reads, on a connection of their own, and a connection made again when
the server dropped it (reads' and the writer's alike)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine

from delegation import errors
from delegation.store.failures import closed, translate, translated
from delegation.store.sql import dbapi

log = logging.getLogger("delegation.store")

T = TypeVar("T")


def healthy(conn: Connection, engine: Engine, lost: Callable[[Any], bool]) -> Connection:
    """``conn``, or a new connection of ``engine`` if the server dropped it (``lost``:
    the dialect's test of the driver's connection): a lost connection fails one batch
    or one read, not all after. A failed connect leaves ``conn`` closed: the next call
    tries again."""
    if not conn.closed and not conn.invalidated and not lost(dbapi(conn)):
        return conn
    if not conn.closed:
        log.warning(
            "a connection to the store was lost; connecting again",
            extra={"action": "store_connection_lost"},
        )
        with contextlib.suppress(Exception):  # gone: only SQLAlchemy's state is left
            conn.rollback()
            conn.invalidate()
        conn.close()
    return engine.connect()


class Reads:
    """Reads run inline on the event loop's thread, on a connection of their own: a WAL
    reader (or a PostgreSQL snapshot) never waits for the writer, and a short query
    costs less than a hop to another thread would."""

    def __init__(self, lost: Callable[[Any], bool]) -> None:
        self.engine: Engine | None = None
        self._lost = lost
        self._conn: Connection | None = None

    def close(self) -> None:
        # The read connection belongs to the loop's thread: closing it from another
        # thread while the loop reads on it corrupts SQLAlchemy's state or crashes.
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
        if self.engine is not None:
            self.engine.dispose()
            self.engine = None

    async def read_now(self, fn: Callable[[Connection], T]) -> T:
        """Like :meth:`read`, for functions that use only the store's plain statements:
        no transaction is opened, so each statement sees the newest commit. A caller
        that reads a child's row before its events still gets a consistent page: every
        event is committed before the state that follows it."""
        conn = await self._turn()
        try:  # translated(reading=True), inline (see _turn)
            try:
                return fn(conn)
            finally:
                if conn.in_transaction():  # a Core statement autobegan one: left open, it
                    conn.rollback()  # would pin this snapshot and refuse the next read()
        except errors.DelegationError:
            raise
        except Exception as exc:
            raise translate(exc, reading=True) from exc

    async def read(self, fn: Callable[[Connection], T]) -> T:
        """Run ``fn`` in one read transaction (a consistent snapshot)."""
        conn = await self._turn()
        with translated(reading=True), conn.begin():  # BEGIN itself can fail (a dropped connection)
            return fn(conn)

    async def _turn(self) -> Connection:
        """The loop's read connection, after one turn of the loop (so that a caller
        polling in a tight loop never starves the other tasks)."""
        await asyncio.sleep(0)
        engine, conn = self.engine, self._conn
        if engine is None:  # closed, perhaps while this read yielded
            raise closed()
        # What ``translated()`` does, inline, here and in read_now: a generator's context
        # manager, entered twice a read, cost every child.read about 3 µs; a try, nothing.
        try:  # a server away: StoreUnavailable, and the next read tries again
            if conn is None:
                self._conn = conn = engine.connect()
            elif conn.closed or conn.invalidated or self._lost(dbapi(conn)):
                self._conn = conn = healthy(conn, engine, self._lost)
        except errors.DelegationError:
            raise
        except Exception as exc:
            raise translate(exc) from exc
        return conn
