"""Database faults for a soak on PostgreSQL: what a server restart or a failover does to
its clients, again and again while the hosts work.

``--db-restarts`` (:class:`DatabaseFaults`): a thread ends every session of the soak's
database at random moments (one to four seconds apart): ``pg_terminate_backend``, which
a restart does to every client at once (the role needs to be a superuser, or to have
``pg_signal_backend``). The server itself stays up: a client connects again at once.

``--db-restart-command CMD`` (:class:`ServerRestarts`): a thread restarts the server
itself, two to four seconds after the last restart came back, by running ``CMD``
through the shell (``pg_ctl restart -m fast`` as the data directory's owner, a
``systemctl restart``, a ``docker restart``: whatever restarts that server and returns
once it accepts connections again). For the second or so it takes, every connection is
refused. The soak only has a URL; how to restart its server is the caller's to say.

The hosts must notice, connect again and go on; the soak's checks then hold them to
everything they acknowledged, as after a host's kill, and no child may end with a store
error (``store_error_ended``, design §32: a blink ends no child).
"""

from __future__ import annotations

import random
import subprocess
import threading
import time
from types import TracebackType
from typing import Any, Self

from delegation.store.stores import libpq

_END_SESSIONS = (
    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
)


class _NowAndThen:
    """A thread that strikes at random moments, ``every_s`` apart (the pause after the
    last strike ended), from ``with`` to the end of the block; ``strike`` is the fault."""

    def __init__(self, name: str, rng: random.Random, every_s: tuple[float, float]) -> None:
        self.rng, self.every_s = rng, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()  # a strike under way ends first

    def _run(self) -> None:
        while not self._stop.wait(self.rng.uniform(*self.every_s)):
            self.strike()

    def strike(self) -> None:
        raise NotImplementedError


class DatabaseFaults(_NowAndThen):
    """``with DatabaseFaults(url, seed):`` sessions ended now and then; ``count`` of them."""

    def __init__(self, url: str, seed: int, *, every_s: tuple[float, float] = (1.0, 4.0)) -> None:
        super().__init__("soak-db-faults", random.Random(seed ^ 0x5EED), every_s)
        self.url = url
        self.count = 0  # times every session was ended
        self.ended = 0  # sessions ended in all

    def strike(self) -> None:
        import psycopg

        try:
            with psycopg.connect(libpq(self.url), autocommit=True) as admin:
                row: Any = admin.execute(_END_SESSIONS).fetchone()
        except psycopg.Error:
            return  # the server itself away: the next round tries again
        self.count += 1
        self.ended += int(row[0]) if row else 0


class ServerRestarts(_NowAndThen):
    """``with ServerRestarts(command, seed):`` the server restarted now and then by
    ``command`` (a shell command line), the server left up at the end; ``count``
    restarts that succeeded, the longest one's seconds in ``longest_s``, and the
    commands that failed in ``failed`` (with ``last_failure``, the end of what the last
    one wrote)."""

    def __init__(
        self, command: str, seed: int, *, every_s: tuple[float, float] = (2.0, 4.0)
    ) -> None:
        super().__init__("soak-db-server", random.Random(seed ^ 0x4E57A27), every_s)
        self.command = command
        self.count = self.failed = 0
        self.longest_s = 0.0
        self.last_failure = ""

    def report(self) -> dict[str, Any]:
        """What the report says of the restarts."""
        found: dict[str, Any] = {
            "db_server_restarts": self.count,
            "db_server_restart_max_s": round(self.longest_s, 2),
            "db_server_restart_failures": self.failed,
        }
        if self.last_failure:
            found["db_server_restart_failure"] = self.last_failure
        return found

    def strike(self) -> None:
        started = time.monotonic()
        done = subprocess.run(self.command, shell=True, capture_output=True, text=True, check=False)
        if done.returncode == 0:
            self.count += 1
            self.longest_s = max(self.longest_s, time.monotonic() - started)
        else:
            self.failed += 1
            said = (done.stderr or done.stdout).strip().splitlines()
            self.last_failure = f"exit {done.returncode}: {said[-1] if said else ''}"
