"""A TCP proxy in front of the test server that can lose a commit's answer.

``cut_answer(marker)`` arms it: the next session whose client sends a statement holding
``marker`` has the server's answer to it read up to its ``ReadyForQuery`` (so the
server has run it, and committed it when it was its own transaction) and then both
ends of that session are closed, the answer never passed on. ``then="COMMIT"`` cuts
the answer to that session's next statement holding ``then`` instead: the commit of
the transaction the marker's statement was in. The client sees its
connection lost in the middle of a statement the server committed: what a restart, a
failover or a cut network does to a commit in flight, made exact.
"""

from __future__ import annotations

import contextlib
import re
import socket
import struct
import threading
from collections.abc import Iterator

from sqlalchemy.engine import make_url

_CHUNK = 65536


class Proxy:
    """Listening on ``port``; passes each session through to ``upstream``."""

    def __init__(self, upstream: tuple[str, int], address: str = "127.0.0.1") -> None:
        self.upstream, self.address = upstream, address
        self._listener = socket.create_server((address, 0))
        self.port: int = self._listener.getsockname()[1]
        self._marker: bytes | None = None
        self._then: bytes | None = None
        self._lock = threading.Lock()
        self.cuts = 0  # answers lost so far
        self._open: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name="pgproxy", daemon=True)
        self._thread.start()

    def cut_answer(self, marker: str, then: str | None = None) -> None:
        with self._lock:
            self._marker, self._then = marker.encode(), None if then is None else then.encode()

    def _take(self, data: bytes) -> bytes | None:
        """Whether ``data`` from a client holds the armed marker (disarmed then): what
        the statement whose answer is cut holds (``data``'s own marker, or ``then``)."""
        with self._lock:
            if self._marker is None or self._marker not in data:
                return None
            marker, self._marker = self._marker, None
            return self._then or marker

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            self._open += [client, server]
            session = _Session(self, client, server)
            threading.Thread(target=session.upstream, daemon=True).start()
            threading.Thread(target=session.downstream, daemon=True).start()

    def close(self) -> None:
        self._listener.close()
        for sock in self._open:
            with contextlib.suppress(OSError):
                sock.close()


class _Session:
    def __init__(self, proxy: Proxy, client: socket.socket, server: socket.socket) -> None:
        self.proxy, self.client, self.server = proxy, client, server
        self.cut = threading.Event()  # the server's next answer is to be lost
        self.cutting: bytes | None = None  # the statement whose answer is to be lost
        # The session's prepared statements, by name: psycopg prepares a statement it
        # ran five times (COMMIT among them), then sends only its name.
        self.prepared: dict[bytes, bytes] = {}

    def upstream(self) -> None:
        with contextlib.suppress(OSError):
            while data := self.client.recv(_CHUNK):
                for name, query in _PARSE.findall(data):
                    if name:
                        self.prepared[name] = query
                self.cutting = self.cutting or self.proxy._take(data)
                if self.cutting is not None and self._holds(data, self.cutting):
                    self.cut.set()  # before the server can answer it
                self.server.sendall(data)
        self._close()

    def _holds(self, data: bytes, statement: bytes) -> bool:
        """Whether ``data`` runs ``statement``: its text, or a prepared one holding it."""
        if statement in data:
            return True
        return any(statement in self.prepared.get(name, b"") for name in _BIND.findall(data))

    def downstream(self) -> None:
        pending = b""
        with contextlib.suppress(OSError):
            while data := self.server.recv(_CHUNK):
                if not self.cut.is_set():
                    self.client.sendall(data)
                    continue
                # The client waits for this answer: it starts at a message boundary.
                pending += data
                if _ready_for_query(pending):
                    self.proxy.cuts += 1
                    break
        self._close()

    def _close(self) -> None:
        for sock in (self.client, self.server):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()


# A Parse message (name, query) and a Bind's statement name, as a client sends them.
_PARSE = re.compile(rb"P....([^\x00]*)\x00([^\x00]*)\x00", re.DOTALL)
_BIND = re.compile(rb"B....[^\x00]*\x00([^\x00]+)\x00", re.DOTALL)


def _ready_for_query(stream: bytes) -> bool:
    """Whether ``stream`` (whole protocol messages from the server) holds ReadyForQuery."""
    at = 0
    while at + 5 <= len(stream):
        kind, length = stream[at : at + 1], struct.unpack("!I", stream[at + 1 : at + 5])[0]
        if kind == b"Z":
            return True
        at += 1 + length
    return False


@contextlib.contextmanager
def proxied(url: str, address: str = "127.0.0.1") -> Iterator[tuple[str, Proxy]]:
    """``url`` reached through a new :class:`Proxy` listening on ``address``, and the
    proxy."""
    parsed = make_url(url)
    proxy = Proxy((parsed.host or "127.0.0.1", parsed.port or 5432), address)
    try:
        yield (
            parsed.set(host=address, port=proxy.port).render_as_string(hide_password=False),
            proxy,
        )
    finally:
        proxy.close()
