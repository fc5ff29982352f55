"""The seccomp filter of a command child (SPEC §23): which sockets it may have.

A child may create ``AF_INET``/``AF_INET6`` sockets of TCP (protocol 0 or 6) or UDP
(protocol 0 or 17), and ``AF_UNIX`` pairs (``socketpair``: a program's own pipes); every
other ``socket()`` is refused with ``EACCES``: ``AF_UNIX`` (a pathname socket's
``connect`` is nothing Landlock bounds: the serve socket, PostgreSQL's peer-auth
socket, a session bus), MPTCP (protocol 262, which Landlock's TCP rules do not see),
SCTP, raw, packet, netlink, vsock and every other family or protocol. ``listen`` is
refused unless the runner's TOML allows it: a ``listen`` without ``bind`` binds an
ephemeral port that Landlock's bind rule never sees. ``io_uring_setup`` fails with
``ENOSYS`` (io_uring makes sockets no filter sees; programs fall back to plain I/O), and
a process making system calls of a foreign architecture (32-bit ARM on aarch64, x32) is
killed or refused; i386 code on x86_64 is filtered as native code is, and its
``socketcall`` (whose arguments are behind a pointer) is refused whole.

The filter is assembled here, on the host's side, and handed to the launcher as bytes:
the launcher only installs it (:mod:`delegation.runners.child_launcher`).
"""

from __future__ import annotations

import platform
import struct
from dataclasses import dataclass

# Architectures (AUDIT_ARCH_*) and their system call numbers.
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_AUDIT_ARCH_I386 = 0x40000003
_X32_BIT = 0x40000000


@dataclass(frozen=True, slots=True)
class _Calls:
    socket: int
    socketpair: int
    listen: int
    socketcall: int | None = None  # i386's multiplexer: refused whole


_NATIVE = {
    "x86_64": _Calls(socket=41, socketpair=53, listen=50),
    "aarch64": _Calls(socket=198, socketpair=199, listen=201),
}
_I386 = _Calls(socket=359, socketpair=360, listen=363, socketcall=102)
_IO_URING_SETUP = 425  # the same number on x86_64, i386 and aarch64

AF_UNIX, AF_INET, AF_INET6 = 1, 2, 10
SOCK_STREAM, SOCK_DGRAM = 1, 2
_SOCK_TYPE_MASK = 0xF  # SOCK_NONBLOCK and SOCK_CLOEXEC sit above it
IPPROTO_TCP, IPPROTO_UDP = 6, 17
_EACCES, _ENOSYS = 13, 38

# Offsets in struct seccomp_data: nr, arch, then args[6] as u64 (their low halves here,
# on these little-endian machines: the kernel reads an int argument as its low half).
_NR, _ARCH, _ARGS = 0, 4, 16
_RET_ALLOW, _RET_ERRNO, _RET_KILL = 0x7FFF0000, 0x00050000, 0x80000000
# Classic BPF: LD|W|ABS, JMP|JEQ|K, JMP|JGE|K, ALU|AND|K, RET|K.
_CODES = {"ld": 0x20, "jeq": 0x15, "jge": 0x35, "and": 0x54, "ret": 0x06}

Instruction = tuple[str, int, str, str]  # ("[label:]op", k, jump if true, if false)


def available(machine: str | None = None) -> bool:
    """Whether this filter knows the machine's architecture."""
    return (machine or platform.machine()) in _NATIVE


def _dispatch(calls: _Calls) -> list[Instruction]:
    """The system call number of one architecture, to the checks below."""
    refused_whole = [("jeq", calls.socketcall, "deny", "")] if calls.socketcall else []
    return [
        ("ld", _NR, "", ""),
        *refused_whole,
        ("jeq", _IO_URING_SETUP, "nosys", ""),
        ("jeq", calls.socket, "socket", ""),
        ("jeq", calls.socketpair, "pair", ""),
        ("jeq", calls.listen, "listen", ""),
        ("ret", _RET_ALLOW, "", ""),
    ]


def program(machine: str | None = None, *, listen: bool = False) -> list[Instruction]:
    """The filter as instructions, for ``machine`` (default: this one's).

    Raises:
        ValueError: an architecture this filter does not know.
    """
    machine = machine or platform.machine()
    if machine not in _NATIVE:
        raise ValueError(f"no socket filter for this architecture ({machine})")
    compat = _AUDIT_ARCH_I386 if machine == "x86_64" else 0
    return [
        ("ld", _ARCH, "", ""),
        ("jeq", _AUDIT_ARCH[machine], "", "other"),
        ("ld", _NR, "", ""),
        ("jge", _X32_BIT, "deny", ""),  # x32 system calls
        *_dispatch(_NATIVE[machine])[1:],
        ("other:jeq", compat, "", "kill"),
        *_dispatch(_I386),
        ("socket:ld", _ARGS, "", ""),  # the family
        ("jeq", AF_INET, "inet", ""),
        ("jeq", AF_INET6, "inet", "deny"),
        ("inet:ld", _ARGS + 8, "", ""),  # the type, without its flags
        ("and", _SOCK_TYPE_MASK, "", ""),
        ("jeq", SOCK_STREAM, "stream", ""),
        ("jeq", SOCK_DGRAM, "dgram", "deny"),
        ("stream:ld", _ARGS + 16, "", ""),  # the protocol: TCP, not MPTCP or SCTP
        ("jeq", 0, "allow", ""),
        ("jeq", IPPROTO_TCP, "allow", "deny"),
        ("dgram:ld", _ARGS + 16, "", ""),  # UDP, not ICMP (ping) or UDP-Lite
        ("jeq", 0, "allow", ""),
        ("jeq", IPPROTO_UDP, "allow", "deny"),
        ("pair:ld", _ARGS, "", ""),
        ("jeq", AF_UNIX, "allow", "deny"),
        ("listen:ret", _RET_ALLOW if listen else _RET_ERRNO | _EACCES, "", ""),
        ("allow:ret", _RET_ALLOW, "", ""),
        ("deny:ret", _RET_ERRNO | _EACCES, "", ""),
        ("nosys:ret", _RET_ERRNO | _ENOSYS, "", ""),
        ("kill:ret", _RET_KILL, "", ""),  # SECCOMP_RET_KILL_PROCESS
    ]


def assemble(instructions: list[Instruction]) -> bytes:
    """Classic BPF (``struct sock_filter`` after ``struct sock_filter``, native order).

    Raises:
        ValueError: a jump backwards or farther than BPF's 255 instructions.
    """
    labels = {op.split(":")[0]: pc for pc, (op, *_) in enumerate(instructions) if ":" in op}
    out = bytearray()
    for pc, (op, k, if_true, if_false) in enumerate(instructions):
        jumps = [labels[to] - pc - 1 if to else 0 for to in (if_true, if_false)]
        if not all(0 <= jump < 256 for jump in jumps):
            raise ValueError(f"instruction {pc}: a jump BPF cannot make")
        out += struct.pack("=HBBI", _CODES[op.split(":")[-1]], *jumps, k)
    return bytes(out)


def compiled(machine: str | None = None, *, listen: bool = False) -> bytes:
    """The filter, ready for ``PR_SET_SECCOMP`` (see :func:`program`)."""
    return assemble(program(machine, listen=listen))
