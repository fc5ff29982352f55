"""A database of its own for a soak on a PostgreSQL server (``--url``).

The soak never touches a database that holds anything: it connects to the one the URL
names only to ``CREATE DATABASE delegation_soak_<random>`` (so the role needs
``CREATEDB``, or to be a superuser), runs every host on that new database, and drops it
(``WITH (FORCE)``) at the end, whatever happened, unless asked to keep it.
"""

from __future__ import annotations

import sys
import time
import uuid
from types import TracebackType
from typing import Any

from delegation.store import passwords, stores


class SoakDatabase:
    """``with SoakDatabase(url) as soak_url:`` a new, empty database beside ``url``'s."""

    def __init__(self, url: str, *, keep: bool = False) -> None:
        try:
            self.server = stores.normalize(url)
        except ValueError as exc:
            raise SystemExit(f"--url: {exc}") from exc
        if stores.store_name(self.server) != "postgresql":
            raise SystemExit(
                "--url takes a PostgreSQL URL (postgresql+psycopg://USER@HOST/DB); without"
                " it the soak runs on a temporary SQLite file"
            )
        self.keep = keep
        self.name = f"delegation_soak_{uuid.uuid4().hex[:12]}"
        self.url = stores.with_database(self.server, self.name)
        self._admin: Any = None

    def __enter__(self) -> str:
        import psycopg
        from psycopg import sql

        shown = passwords.redacted(self.server)
        try:
            self._admin = self._connect()
        except psycopg.Error as exc:
            raise SystemExit(f"cannot reach {shown}: {exc}") from exc
        try:
            self._admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.name)))
        except psycopg.Error as exc:
            self._admin.close()
            raise SystemExit(
                f"the soak creates a database of its own: {shown} needs a role with"
                f" CREATEDB ({exc})"
            ) from exc
        return self.url

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        import psycopg

        try:
            if not self.keep:
                try:
                    self._drop()
                except psycopg.OperationalError:  # a server restart ended the session
                    self._admin.close()
                    self._admin = self._connect(patience_s=10.0)
                    self._drop()
        except psycopg.Error as exc:  # the server is gone: say what is left on it
            print(f"soak: database {self.name} not dropped: {exc}", file=sys.stderr)
        finally:
            self._admin.close()

    def _drop(self) -> None:
        from psycopg import sql

        force = self._admin.info.server_version >= 130000  # PostgreSQL 13
        drop = sql.SQL("DROP DATABASE IF EXISTS {}" + (" WITH (FORCE)" if force else ""))
        self._admin.execute(drop.format(sql.Identifier(self.name)))

    def _connect(self, *, patience_s: float = 0.0) -> Any:
        """An admin session on the server; refused ones are tried again for
        ``patience_s`` (while a restart, ``--db-restart-command``, brings it back)."""
        import psycopg

        deadline = time.monotonic() + patience_s
        while True:
            try:
                return psycopg.connect(
                    stores.libpq(self.server), autocommit=True, application_name="delegation-soak"
                )
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
