"""``python -m delegation.bench --url postgresql+psycopg://USER@HOST/DB``: every scenario
on a PostgreSQL server, beside raw psycopg 3 on the same server, in the same run.

What the URL needs: a role that may ``CREATE DATABASE`` (``CREATEDB`` or superuser),
and a database it can connect to (``postgres`` will do). Nothing is written to that
database: each scenario, and each raw baseline, runs on a new database of its own
(``delegation_bench_<random>_<n>``), created from the server's default template and
dropped (``WITH (FORCE)``) as soon as the scenario ends, and at exit whatever happens.
Between scenarios a ``CHECKPOINT`` is asked for (superusers and ``pg_checkpoint``
members; skipped otherwise), so that no scenario pays for the last one's dirty pages.

The engine runs with its production durability: every batch commits at the server's
``synchronous_commit``. The raw baselines do the same shape of work with plain psycopg,
on the server's settings too (nothing is ``SET``):

* commits: one single-row ``INSERT`` per transaction, in autocommit (one round trip
  and one WAL flush per row), into ``rows (id bigserial PRIMARY KEY, child, seq,
  body bytea)`` as on SQLite, with the same body;
* batches: ``executemany`` of 100 rows (psycopg pipelines it) inside ``BEGIN`` …
  ``COMMIT``, into a table shaped like the engine's ``events`` (primary key
  ``(child_id, sequence)``, ``bytea`` body of the same size), the rows spread over as
  many children as the scenario's engine side emits for, so both grow the same index;
* the page: the engine's own ``events`` table, filled once, read with the same indexed
  ``SELECT … LIMIT 128`` on an autocommit connection, alternating with the engine.

The raw tables have no foreign key; the engine's ``events`` does (to ``children``), as
on SQLite, where the raw table has none either.
"""

from __future__ import annotations

import contextlib
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from delegation.store import passwords, stores
from tools.bench_base import Bench, PageReader

ROWS = "CREATE TABLE rows (id bigserial PRIMARY KEY, child bigint, seq bigint, body bytea)"
EVENTS = (
    "CREATE TABLE events (child_id bigint NOT NULL, sequence bigint NOT NULL,"
    " body bytea NOT NULL, PRIMARY KEY (child_id, sequence), CHECK (sequence >= 1))"
)
PAGE = "SELECT body FROM events WHERE child_id = %s AND sequence > %s ORDER BY sequence LIMIT 128"
SETTINGS = ("fsync", "synchronous_commit", "wal_sync_method", "full_page_writes")


class PostgresBench(Bench):
    """Scenarios on new databases of the server ``url`` names (see the module)."""

    def __init__(self, folder: Path, url: str) -> None:
        super().__init__(folder)
        self.server = stores.normalize(url)
        try:
            self._admin = psycopg.connect(
                stores.libpq(self.server), autocommit=True, application_name="delegation-bench"
            )
        except psycopg.Error as exc:
            raise SystemExit(f"cannot reach {passwords.redacted(self.server)}: {exc}") from exc
        self._prefix = f"delegation_bench_{uuid.uuid4().hex[:8]}"
        self._created: list[str] = []
        self._force = self._admin.info.server_version >= 130000  # DROP … WITH (FORCE)

    # --- databases --------------------------------------------------------------

    def new(self) -> str:
        """A new, empty database on the server: its URL."""
        self.count += 1
        name = f"{self._prefix}_{self.count}"
        try:
            self._admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        except psycopg.errors.InsufficientPrivilege as exc:
            raise SystemExit(
                f"the bench creates a database per scenario: {passwords.redacted(self.server)}"
                f" needs a role with CREATEDB ({exc})"
            ) from exc
        self._created.append(name)
        return stores.with_database(self.server, name)

    def url(self, target: Path | str) -> str:
        return str(target)

    def cleanup(self) -> None:
        """Drop every database made so far, then checkpoint (when allowed)."""
        while self._created:
            drop = "DROP DATABASE IF EXISTS {}" + (" WITH (FORCE)" if self._force else "")
            self._admin.execute(sql.SQL(drop).format(sql.Identifier(self._created[-1])))
            self._created.pop()
        with contextlib.suppress(psycopg.errors.InsufficientPrivilege):
            self._admin.execute("CHECKPOINT")

    def close(self) -> None:
        try:
            self.cleanup()
        except psycopg.Error as exc:  # the server is gone: say what may be left on it
            left = ", ".join(self._created) or "none"
            print(f"  databases not dropped ({left}): {exc}", file=sys.stderr)
        finally:
            self._admin.close()

    def describe(self) -> dict[str, Any]:
        settings = {
            name: self._admin.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()
            for name in SETTINGS
        }
        version = self._admin.execute("SHOW server_version").fetchone()
        return {
            "store": "postgresql",
            "postgresql": version[0] if version else "?",
            "server": passwords.redacted(self.server),
            "settings": {k: v[0] for k, v in settings.items() if v is not None},
        }

    # --- raw psycopg baselines --------------------------------------------------

    def _raw(self, ddl: str) -> psycopg.Connection[Any]:
        conn = psycopg.connect(stores.libpq(self.new()), autocommit=True)
        conn.execute(ddl)
        return conn

    def raw_commits(self, n: int) -> float:
        """Single-row INSERT transactions per second (autocommit: one statement each)."""
        body = b'{"requestId":"q","profile":"bench","message":"go"}'
        with self._raw(ROWS) as conn:
            insert = "INSERT INTO rows (child, seq, body) VALUES (%s, %s, %s)"
            started = time.perf_counter()
            for i in range(n):
                conn.execute(insert, (i, 0, body))
            elapsed = time.perf_counter() - started
        return n / elapsed

    def raw_batches(self, n: int, children: int, batch: int = 100) -> float:
        """Rows per second inserted in committed batches of ``batch`` rows, round robin
        over ``children`` children (as that many children emitting side by side)."""
        body = b'{"sequence":1,"kind":"text","text":"event 1"}'
        batches = max(1, n // batch)
        rows = [(k % children + 1, k // children + 1, body) for k in range(batches * batch)]
        with self._raw(EVENTS) as conn, conn.cursor() as cursor:
            insert = "INSERT INTO events (child_id, sequence, body) VALUES (%s, %s, %s)"
            started = time.perf_counter()
            for b in range(batches):
                with conn.transaction():
                    cursor.executemany(insert, rows[b * batch : (b + 1) * batch])
            elapsed = time.perf_counter() - started
        return batches * batch / elapsed

    def fill_events(self, target: Path | str, child_id: int, count: int, body: bytes) -> None:
        """``count`` events of one child, committed, vacuumed and analyzed (so that no
        autovacuum of the fresh rows runs while reads are timed)."""
        with psycopg.connect(stores.libpq(self.url(target)), autocommit=True) as conn:
            conn.execute(
                "INSERT INTO events (child_id, sequence, body)"
                " SELECT %s, n, %s FROM generate_series(1, %s) AS n",
                (child_id, body, count),
            )
            conn.execute("VACUUM ANALYZE events")

    def page_reader(self, target: Path | str) -> PageReader:
        conn = psycopg.connect(stores.libpq(self.url(target)), autocommit=True)

        def read(child_id: int, after: int) -> list[Any]:
            return conn.execute(PAGE, (child_id, after)).fetchall()

        return PageReader(read, conn.close)
