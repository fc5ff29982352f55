"""PostgreSQL's connections through psycopg 3: settings, our own ``BEGIN``, the NUL-safe
text dumper, and the host's lock sessions."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, make_url

from delegation import errors
from delegation.store import passwords
from delegation.store.failures import unavailable
from delegation.store.lifecycle import INSTANCE_LOCKS
from delegation.store.sql import dbapi

log = logging.getLogger("delegation.store")

_IDLE = 0  # psycopg.pq.TransactionStatus.IDLE


def libpq(url: str) -> str:
    """A PostgreSQL URL (as :func:`normalize` gives it) as psycopg's connection string:
    libpq's keywords, the ones SQLAlchemy's psycopg dialect passes for the same URL (its
    arguments as given, several hosts as ``host=h1,h2 port=p1,p2``)."""
    from psycopg.conninfo import make_conninfo

    parsed = make_url(url)
    keywords: dict[str, Any] = parsed.translate_connect_args(username="user", database="dbname")
    for key, value in parsed.query.items():
        if not isinstance(value, str):  # normalize refuses an argument given twice
            raise ValueError(f"{key}= given more than once")
        keywords[key] = value
    return make_conninfo("", **keywords)


# A server cut off without a word (a partition drops packets: no reset, no error) must
# not hold a host's statement, its lock's session or its watch for the kernel's quarter
# of an hour: libpq gives up on a connection whose sent data goes unacknowledged for
# tcp_user_timeout, probes an idle one (keepalives: 10 s idle, then 3 probes 3 s apart),
# and waits 5 s (connect_timeout) for a new one. A URL's own values of these are kept.
TCP_DEFAULTS = {
    "connect_timeout": "5",
    "keepalives": "1",
    "keepalives_idle": "10",
    "keepalives_interval": "3",
    "keepalives_count": "3",
    "tcp_user_timeout": "10000",
}


def tcp_args(url: str, application: str) -> dict[str, str]:
    """libpq's arguments for a connection of ``url``: its ``application_name`` and the
    :data:`TCP_DEFAULTS` the URL does not set itself."""
    given = make_url(url).query
    return {"application_name": application} | {
        key: value for key, value in TCP_DEFAULTS.items() if key not in given
    }


def conninfo(url: str, application: str) -> str:
    """libpq's connection string for a psycopg connection of ours (:func:`tcp_args`)."""
    from psycopg.conninfo import make_conninfo

    return make_conninfo(libpq(url), **tcp_args(url, application))


def _nul_safe(dbapi_connection: Any, _record: Any = None) -> None:
    """PostgreSQL's text cannot hold NUL, which SQLite's can: on this connection a NUL
    in a string parameter is sent as U+FFFD, so that a peer's text never fails a write
    (and with it a batch of events) that SQLite would have taken. An id with a NUL is
    refused before it is stored (``valid_id``), so it only ever misses in a lookup."""
    from psycopg.adapt import Dumper
    from psycopg.pq import Format

    class NulSafe(Dumper):
        format = Format.TEXT

        def dump(self, obj: str) -> bytes:
            return obj.replace("\x00", "\ufffd").encode()

    dbapi_connection.adapters.register_dumper(str, NulSafe)


def nul_safe_engine(engine: Engine) -> Engine:
    event.listen(engine, "connect", _nul_safe)
    return engine


# A session left in a transaction this long is ended by the server: its host is stopped
# (SIGSTOP) or starved, and its locks must not hold the hosts taking over from it.
IDLE_IN_TRANSACTION_MS = "5000"


def session_settings(settings: Mapping[str, str]) -> str:
    """One statement setting these server settings for the session (names and values
    are the engine's own constants, never a peer's)."""
    return "; ".join(f"SET {name} = '{value}'" for name, value in settings.items())


def with_settings(engine: Engine, statement: str) -> Engine:
    """``engine``, whose every new session first runs ``statement`` (its settings)."""
    if statement:

        @event.listens_for(engine, "connect")
        def _settings(dbapi_connection: Any, _record: Any = None) -> None:
            dbapi_connection.execute(statement)
            if not dbapi_connection.autocommit:  # kept by the session, not its first transaction
                dbapi_connection.commit()

    return engine


def make_engine(
    url: str, application: str, *, begin: str, options: dict[str, str], pool_size: int = 1
) -> Engine:
    """Connections in autocommit mode; a transaction SQLAlchemy starts is ``begin``.

    ``options`` are set on each new session with ``SET`` (one round trip when a pooled
    connection is made), not as libpq's startup ``options``, which a pooler such as
    PgBouncer refuses or drops."""
    engine = nul_safe_engine(
        create_engine(
            url,
            isolation_level="AUTOCOMMIT",
            pool_size=pool_size,
            max_overflow=0,
            pool_pre_ping=False,
            connect_args=tcp_args(url, application),
        )
    )
    with_settings(engine, session_settings(options))

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        raw = dbapi(conn)
        if raw.info.transaction_status == _IDLE:  # the writer may have begun it already
            raw.execute(begin)

    return engine


def reader_engine(url: str) -> Engine:
    """The engine of the loop's reads: each ``read`` one ``REPEATABLE READ, READ ONLY``
    snapshot, each ``read_now`` statement its own read-only transaction.

    Read-only per transaction, not per session: a session that starts read-only (a
    startup option) is one ``target_session_attrs=read-write`` refuses on every host.
    The session's default is set once it is open instead, so that ``read_now``'s
    statements, in autocommit, cost no round trip more.

    A host stopped in a read (SIGSTOP) would keep its snapshot and its tables' share
    locks, and a migration's lock would queue behind them and every other host's
    statements behind that: the server ends such a session, as a writer's."""
    begin = "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY"
    idle = {"idle_in_transaction_session_timeout": IDLE_IN_TRANSACTION_MS}
    engine = make_engine(url, "delegation-reader", begin=begin, options=idle)
    event.listen(engine, "connect", _read_only_transactions)
    return engine


def in_transaction(raw: Any) -> bool:
    return bool(raw.info.transaction_status != _IDLE)


def _read_only_transactions(dbapi_connection: Any, _record: Any = None) -> None:
    dbapi_connection.execute("SET default_transaction_read_only = on")


def connect_error(url: str, exc: BaseException) -> errors.DelegationError:
    """An outage is the retryable refusal (design §19; its cause says what libpq said);
    a server that refuses who connects is a StoreError naming the database."""
    if unavailable(exc):
        return errors.StoreUnavailable()
    shown = passwords.redacted(url)
    return errors.StoreError(f"cannot reach the PostgreSQL database {shown}: {exc}")


def connect(url: str, application: str) -> Any:
    import psycopg

    try:
        return psycopg.connect(conninfo(url, application), autocommit=True)
    except psycopg.Error as exc:
        raise connect_error(url, exc) from exc


POOLED_TRANSACTIONS = (
    "PostgreSQL is reached through a pooler in transaction or statement mode (PgBouncer's"
    " pool_mode=transaction): the engine needs one server session per connection, for its"
    " advisory locks and LISTEN; use pool_mode=session, or connect to the server itself"
)


def refuse_pooled_transactions(held: Any, url: str, looks: int = 3) -> None:
    """Refuse a pooler that hands a client's server session to another client between
    transactions (PgBouncer's transaction and statement modes): a host's advisory lock
    would be held by whichever client used that session last, and a ``LISTEN`` would hear
    nothing. Found by what no session pooler and no server does: a second connection
    lands on the server session (``pg_backend_pid()``) the first one just used, or the
    first one is moved to another session between its statements.

    Raises:
        errors.StoreError: such a pooler (one line saying so).
    """
    other = connect(url, "delegation-probe")
    try:
        for _ in range(looks):
            first = held.execute("SELECT pg_backend_pid()").fetchone()[0]
            second = other.execute("SELECT pg_backend_pid()").fetchone()[0]
            again = held.execute("SELECT pg_backend_pid()").fetchone()[0]
            if second == first or again != first:
                raise errors.StoreError(POOLED_TRANSACTIONS)
    finally:
        other.close()


def release_instance_lock(conn: Any, instance_id: str | None) -> None:
    """Unlock, then close: the server drops a closed session's locks only once its
    backend has noticed, and a host looking right after must find the lock free."""
    try:
        if instance_id is not None:
            conn.execute(
                "SELECT pg_advisory_unlock(%s, hashtext(%s))", (INSTANCE_LOCKS, instance_id)
            )
    except Exception:  # the server is gone: so is the lock
        log.debug("instance lock not released explicitly", exc_info=True)
    finally:
        conn.close()
