"""Database faults for a soak on PostgreSQL (``--db-restarts``): what a server restart
or a failover does to its clients, again and again while the hosts work.

A thread ends every session of the soak's database at random moments (one to four
seconds apart): ``pg_terminate_backend``, which a restart does to every client at once
(the role needs to be a superuser, or to have ``pg_signal_backend``). The hosts must
notice, connect again and go on; the soak's checks then hold them to everything they
acknowledged, as after a host's kill.
"""

from __future__ import annotations

import random
import threading
from types import TracebackType
from typing import Any

from delegation.store.stores import libpq

_END_SESSIONS = (
    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
)


class DatabaseFaults:
    """``with DatabaseFaults(url, seed):`` sessions ended now and then; ``count`` of them."""

    def __init__(self, url: str, seed: int, *, every_s: tuple[float, float] = (1.0, 4.0)) -> None:
        self.url, self.every_s = url, every_s
        self.rng = random.Random(seed ^ 0x5EED)
        self.count = 0  # times every session was ended
        self.ended = 0  # sessions ended in all
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-db-faults", daemon=True)

    def __enter__(self) -> DatabaseFaults:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psycopg

        while not self._stop.wait(self.rng.uniform(*self.every_s)):
            try:
                with psycopg.connect(libpq(self.url), autocommit=True) as admin:
                    row: Any = admin.execute(_END_SESSIONS).fetchone()
            except psycopg.Error:
                continue  # the server itself away: the next round tries again
            self.count += 1
            self.ended += int(row[0]) if row else 0
