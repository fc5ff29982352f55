"""The soak's own durable record of what leaves the database, and of when a child ended
(issue 36): triggers the soak installs on its database, and a table only it reads.

The checker once learned of purges only from the engine's ``purged`` rows it happened to
see between two reads (0.5 to 4 s apart on a starved machine): a purge row that lived
less than that made a legitimate purge look like a loss, and a real deletion beside a
purge row would have looked legitimate. Triggers see every row as it goes:

* ``child_deleted``: a child row deleted, with its state and ``finished_at``, and
  whether the engine's ``purged`` row for it existed in the same transaction (the
  retention purge writes that row first, then deletes the child);
* ``child_ended``: a child row's ``finished_at`` set, when that happened;
* ``purge_forgotten``: a ``purged`` row deleted (the engine forgets a purge after one
  more period), with its ``purged_at``.

Each row's ``at`` is the database's clock as the statement ran in its transaction, a
moment before the commit: SQLite's (the hosts' own clock, one machine) or the
PostgreSQL server's (whose time the engines stamp, design §12). The record lives in the
database, so a host's crash cannot lose it apart from what it deletes: a deletion and
its record commit together.
"""

from __future__ import annotations

from delegation.store import stores
from delegation.store.sql import Connection

TABLE = "soak_audit"
_COLUMNS = "what, run_id, conversation_id, state, at, finished_at, purge_row, purged_at"

_SQLITE_NOW = "((julianday('now') - 2440587.5) * 86400.0)"
SQLITE = [
    f"CREATE TABLE IF NOT EXISTS {TABLE} (id INTEGER PRIMARY KEY, what TEXT NOT NULL,"
    " run_id TEXT NOT NULL, conversation_id TEXT, state TEXT, at REAL NOT NULL,"
    " finished_at REAL, purge_row INTEGER, purged_at REAL)",
    f"CREATE TRIGGER IF NOT EXISTS soak_child_deleted AFTER DELETE ON children BEGIN"
    f" INSERT INTO {TABLE} ({_COLUMNS}) VALUES ('child_deleted', OLD.run_id,"
    f" OLD.conversation_id, OLD.state, {_SQLITE_NOW}, OLD.finished_at,"
    " EXISTS (SELECT 1 FROM purged p WHERE p.run_id = OLD.run_id),"
    " (SELECT purged_at FROM purged p WHERE p.run_id = OLD.run_id)); END",
    "CREATE TRIGGER IF NOT EXISTS soak_child_ended AFTER UPDATE OF finished_at ON children"
    " WHEN OLD.finished_at IS NULL AND NEW.finished_at IS NOT NULL BEGIN"
    f" INSERT INTO {TABLE} ({_COLUMNS}) VALUES ('child_ended', NEW.run_id,"
    f" NEW.conversation_id, NEW.state, {_SQLITE_NOW}, NEW.finished_at, NULL, NULL); END",
    f"CREATE TRIGGER IF NOT EXISTS soak_purge_forgotten AFTER DELETE ON purged BEGIN"
    f" INSERT INTO {TABLE} ({_COLUMNS}) VALUES ('purge_forgotten', OLD.run_id,"
    f" OLD.conversation_id, NULL, {_SQLITE_NOW}, NULL, NULL, OLD.purged_at); END",
]

_PG_NOW = "extract(epoch from clock_timestamp())"
POSTGRES = [
    f"CREATE TABLE IF NOT EXISTS {TABLE} (id bigserial PRIMARY KEY, what text NOT NULL,"
    " run_id text NOT NULL, conversation_id text, state text, at double precision NOT NULL,"
    " finished_at double precision, purge_row boolean, purged_at double precision)",
    "CREATE OR REPLACE FUNCTION soak_child_deleted() RETURNS trigger LANGUAGE plpgsql AS $$"
    f" BEGIN INSERT INTO {TABLE} ({_COLUMNS}) VALUES ('child_deleted', OLD.run_id,"
    f" OLD.conversation_id, OLD.state, {_PG_NOW}, OLD.finished_at,"
    " EXISTS (SELECT 1 FROM purged p WHERE p.run_id = OLD.run_id),"
    " (SELECT purged_at FROM purged p WHERE p.run_id = OLD.run_id)); RETURN OLD; END $$",
    "CREATE OR REPLACE FUNCTION soak_child_ended() RETURNS trigger LANGUAGE plpgsql AS $$"
    " BEGIN IF OLD.finished_at IS NULL AND NEW.finished_at IS NOT NULL THEN"
    f" INSERT INTO {TABLE} ({_COLUMNS}) VALUES ('child_ended', NEW.run_id,"
    f" NEW.conversation_id, NEW.state, {_PG_NOW}, NEW.finished_at, NULL, NULL); END IF;"
    " RETURN NEW; END $$",
    "CREATE OR REPLACE FUNCTION soak_purge_forgotten() RETURNS trigger LANGUAGE plpgsql AS $$"
    f" BEGIN INSERT INTO {TABLE} ({_COLUMNS}) VALUES ('purge_forgotten', OLD.run_id,"
    f" OLD.conversation_id, NULL, {_PG_NOW}, NULL, NULL, OLD.purged_at); RETURN OLD; END $$",
    "CREATE OR REPLACE TRIGGER soak_child_deleted AFTER DELETE ON children"
    " FOR EACH ROW EXECUTE FUNCTION soak_child_deleted()",
    "CREATE OR REPLACE TRIGGER soak_child_ended AFTER UPDATE OF finished_at ON children"
    " FOR EACH ROW EXECUTE FUNCTION soak_child_ended()",
    "CREATE OR REPLACE TRIGGER soak_purge_forgotten AFTER DELETE ON purged"
    " FOR EACH ROW EXECUTE FUNCTION soak_purge_forgotten()",
]


def install(url: str) -> None:
    """Migrate the soak's database (as its first host would) and add the record to it.

    Raises:
        errors.StoreError: the database cannot be reached or written.
    """
    stores.upgrade(url, apply=True)
    statements = {"sqlite": SQLITE, "postgresql": POSTGRES}[stores.store_name(url)]

    def add(conn: Connection) -> None:
        for statement in statements:
            conn.exec_driver_sql(statement)

    stores.write_once(url, add)
