"""What a peer that sends requests and reads nothing costs a host (design §9).

``python -m tools.serve_flood [--requests N]`` starts ``delegation serve
--socket`` on a fresh database in a temporary directory, sends N cheap requests on
one connection without reading a single answer, checks that another connection is
still answered, and prints the host's resident memory before and at its peak.

Operations tooling: nothing in the library imports it (the tests do).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

BATCH = 512  # requests per send: small, so the count of what went through stays current
STALL_S = 1.0


def stop_process(proc: subprocess.Popen[Any], grace_s: float = 10) -> None:
    """End a tool's child process: SIGTERM, and SIGKILL if it is still there after
    ``grace_s`` seconds."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def memory_mb(pid: int, field: str = "VmRSS") -> float:
    """A memory figure of a live process from /proc (VmRSS now, VmHWM at its peak)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise LookupError(f"no {field} for process {pid}")


@contextlib.contextmanager
def host(directory: Path, *extra: str) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """A ``delegation serve --socket`` process on a fresh database in ``directory``;
    what it logs goes to ``directory / "host.log"``."""
    path = directory / "host.sock"
    command = [sys.executable, "-m", "delegation.cli", "serve", "--socket", str(path)]
    with (directory / "host.log").open("wb") as log:
        proc = subprocess.Popen([*command, "--db", str(directory / "flood.db"), *extra], stderr=log)
        try:
            deadline = time.monotonic() + 30
            while not path.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the host did not start")
                time.sleep(0.02)
            yield proc, path
        finally:
            stop_process(proc)


class Flood:
    """Writes ``requests`` requests (``frame(n)``, cheap ones by default) through
    ``send``, on a thread of its own, until they are all sent or the host stops
    reading; never reads an answer."""

    def __init__(
        self,
        send: Callable[[bytes], object],
        requests: int,
        stall_s: float = STALL_S,
        frame: Callable[[int], bytes] | None = None,
    ) -> None:
        self.requests = requests
        self.stall_s = stall_s
        self._frame = frame or _cheap
        self.sent = 0
        self.stalled = False
        self._thread = threading.Thread(target=self._send, args=(send,), daemon=True)
        self._thread.start()

    def _send(self, send: Callable[[bytes], object]) -> None:
        while self.sent < self.requests:
            count = min(BATCH, self.requests - self.sent)
            try:
                send(b"".join(self._frame(self.sent + n) for n in range(count)))
            except OSError:  # the host hung up
                return
            self.sent += count

    def wait(self, timeout: float) -> None:
        """Until every request is sent, or none went through for ``stall_s`` seconds
        (then ``stalled``: the host stopped reading), or ``timeout``."""
        deadline = time.monotonic() + timeout
        last, since = self.sent, time.monotonic()
        while self._thread.is_alive() and time.monotonic() < deadline:
            self._thread.join(0.05)
            if self.sent != last:
                last, since = self.sent, time.monotonic()
            elif time.monotonic() - since > self.stall_s:
                self.stalled = True
                return


def flood_socket(
    path: Path, requests: int, stall_s: float = STALL_S
) -> tuple[Flood, socket.socket]:
    """A :class:`Flood` on a connection of its own; shut the socket down to end it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(path))
    return Flood(sock.sendall, requests, stall_s), sock


def hang_up(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked sending on it
    sock.close()


def _cheap(request_id: int) -> bytes:
    """A request answered without touching the database: a read before registering."""
    return b'{"jsonrpc":"2.0","id":%d,"method":"child.read","params":{}}\n' % request_id


def round_trip(path: Path, timeout: float) -> dict[str, object]:
    """Register on a connection of its own; the answer (raises if none comes)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        params = {"runnerId": "bystander", "hostInstanceId": "h1"}
        frame = {"jsonrpc": "2.0", "id": 1, "method": "runner.register", "params": params}
        sock.sendall(json.dumps(frame).encode() + b"\n")
        answer = b""
        while not answer.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("the host closed the connection without answering")
            answer += chunk
    result: dict[str, object] = json.loads(answer)
    return result


def measure(
    requests: int, stall_s: float = STALL_S, timeout: float = 600.0
) -> dict[str, float | int | bool]:
    """Flood a fresh host with ``requests`` unread requests; its memory figures."""
    with tempfile.TemporaryDirectory() as tmp:
        with host(Path(tmp)) as (proc, path):
            round_trip(path, 30)  # warm: the engine is open and a session has been served
            before = memory_mb(proc.pid)
            flood, sock = flood_socket(path, requests, stall_s)
            flood.wait(timeout)
            answered = "result" in round_trip(path, 30)
            figures = {
                "requests": requests,
                "sent": flood.sent,
                "stalled": flood.stalled,
                "bystander_answered": answered,
                "rss_before_mb": round(before, 1),
                "rss_after_mb": round(memory_mb(proc.pid), 1),
                "rss_peak_mb": round(memory_mb(proc.pid, "VmHWM"), 1),
            }
            hang_up(sock)
        figures["host_log_lines"] = len((Path(tmp) / "host.log").read_bytes().splitlines())
        return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument(
        "--stall-s",
        type=float,
        default=STALL_S,
        help="how long no request may go through before the host counts as not reading",
    )
    args = parser.parse_args(argv)
    figures = measure(args.requests, args.stall_s)
    for key, value in figures.items():
        print(f"{key:>20}: {value}")
    print(f"{'growth_mb':>20}: {figures['rss_peak_mb'] - figures['rss_before_mb']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
