"""A child that asks io_uring, not socket(2), for an AF_UNIX socket and connects it.

    python uring_socket.py SOCKET_PATH

Prints ``connected``, ``denied (ERRNO) at STEP`` or ``no io_uring``.
"""

from __future__ import annotations

import ctypes
import mmap
import socket
import struct
import sys

_SETUP, _ENTER = 425, 426
_OP_SOCKET = 45


def uring_socket(domain: int, kind: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    params = ctypes.create_string_buffer(120)
    ring = libc.syscall(_SETUP, 4, params)
    if ring < 0:
        raise OSError(ctypes.get_errno(), "io_uring_setup")
    raw = params.raw
    sq_entries, cq_entries = struct.unpack_from("=II", raw, 0)
    sq = struct.unpack_from("=7I", raw, 40)  # head tail mask entries flags dropped array
    cq = struct.unpack_from("=6I", raw, 80)  # head tail mask entries overflow cqes
    sq_map = mmap.mmap(ring, sq[6] + sq_entries * 4, offset=0)
    cq_map = mmap.mmap(ring, cq[5] + cq_entries * 16, offset=0x8000000)
    sqes = mmap.mmap(ring, sq_entries * 64, offset=0x10000000)
    sqe = bytearray(64)
    struct.pack_into("=BBHiQQIIQ", sqe, 0, _OP_SOCKET, 0, 0, domain, kind, 0, 0, 0, 7)
    sqes[0:64] = bytes(sqe)
    tail = struct.unpack_from("=I", sq_map, sq[1])[0]
    mask = struct.unpack_from("=I", sq_map, sq[2])[0]
    struct.pack_into("=I", sq_map, sq[6] + (tail & mask) * 4, 0)
    struct.pack_into("=I", sq_map, sq[1], tail + 1)
    if libc.syscall(_ENTER, ring, 1, 1, 1, None, 0) < 0:
        raise OSError(ctypes.get_errno(), "io_uring_enter")
    head = struct.unpack_from("=I", cq_map, cq[0])[0]
    cmask = struct.unpack_from("=I", cq_map, cq[2])[0]
    _, res, _ = struct.unpack_from("=QiI", cq_map, cq[5] + (head & cmask) * 16)
    if res < 0:
        raise OSError(-res, "IORING_OP_SOCKET")
    return res


def main() -> None:
    try:
        fd = uring_socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock = socket.socket(fileno=fd)
        sock.settimeout(5)
        sock.connect(sys.argv[1])
        print("connected", flush=True)
    except OSError as exc:
        print(f"denied ({exc.errno}) at {exc.strerror}", flush=True)


if __name__ == "__main__":
    main()
