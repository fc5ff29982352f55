"""The seccomp filter of a command child (design §23), assembled on the host's side.

**Sockets.** A child may create ``AF_INET``/``AF_INET6`` sockets of TCP (protocol 0 or
6) or UDP (protocol 0 or 17), and ``AF_UNIX`` pairs (``socketpair``: a program's own
pipes); every other ``socket()`` is refused with ``EACCES``: ``AF_UNIX`` (a pathname
socket's ``connect`` is nothing Landlock bounds: the serve socket, PostgreSQL's
peer-auth socket, a session bus), MPTCP (protocol 262, which Landlock's TCP rules do not
see), SCTP, raw, packet, netlink, vsock and every other family or protocol. ``listen``
is refused unless the runner's TOML allows it: a ``listen`` without ``bind`` binds an
ephemeral port that Landlock's bind rule never sees.

**No setuid file.** ``chmod`` and its kin with a setuid or setgid bit fail with
``EPERM``: a root host's child writes its workspace through an idmapped mount, where
what it owns is root's on disk, and a setuid-root file it made there would make any
local user root. (Writing a file clears those bits, so ``chmod`` is the one way in.)

**Its parent-death signal stays SIGKILL.** The program is its PID namespace's first
process and dies with its keeper only by that signal; ``PR_SET_PDEATHSIG`` with any
other signal (0 clears it) fails with ``EPERM``, so a program cannot outlive its host.

**No channel between children, no user namespace** (SPEC §31). The kernel's keyrings
(``add_key``, ``keyctl``, ``request_key``) fail with ``EPERM``: every child of a root
host runs as one unprivileged user, whose keyring outlives each child and would carry
what one tenant's child stored to another's. ``unshare`` and ``clone`` asking for a new
user namespace (``CLONE_NEWUSER``) fail with ``EPERM``, as under Docker's default
profile: it is kernel attack surface a child has no use for. ``clone3``, whose flags
lie behind a pointer no filter may read, fails with ``ENOSYS``: the C library then
falls back to ``clone`` (glibc, musl, Go and Rust all do). Each child has an IPC namespace of
its own where namespaces are allowed (the launcher makes it); where they are not, the
calls that make or open a System V object or a POSIX message queue (``shmget``,
``semget``, ``msgget``, ``mq_open``, i386's ``ipc``) fail with ``EPERM``: every child
would share them, and they outlive it.

``io_uring_setup`` fails with ``ENOSYS`` (io_uring makes sockets no filter sees;
programs fall back to plain I/O), and a process making system calls of a foreign
architecture (32-bit ARM on aarch64, x32) is killed or refused; i386 code on x86_64 is
filtered as native code is, and its ``socketcall`` (whose arguments are behind a
pointer) is refused whole.

The filter is assembled here and handed to the launcher as bytes: the launcher only
installs it (:mod:`delegation.runners.child_launcher`).
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
    fchmod: int
    fchmodat: int
    prctl: int
    keyrings: tuple[int, int, int]  # add_key, request_key, keyctl
    unshare: int
    clone: int
    sysv: tuple[int, ...]  # shmget, semget, msgget, mq_open (and i386's ipc multiplexer)
    chmod: int | None = None  # aarch64 has fchmodat only
    socketcall: int | None = None  # i386's multiplexer: refused whole


_NATIVE = {
    "x86_64": _Calls(
        41,
        53,
        50,
        fchmod=91,
        fchmodat=268,
        prctl=157,
        keyrings=(248, 249, 250),
        unshare=272,
        clone=56,
        sysv=(29, 64, 68, 240),
        chmod=90,
    ),
    "aarch64": _Calls(
        198,
        199,
        201,
        fchmod=52,
        fchmodat=53,
        prctl=167,
        keyrings=(217, 218, 219),
        unshare=97,
        clone=220,
        sysv=(194, 190, 186, 180),
    ),
}
_I386 = _Calls(
    359, 360, 363, fchmod=94, fchmodat=306, prctl=172, keyrings=(286, 287, 288),
    unshare=310, clone=120,
    sysv=(395, 393, 399, 277, 117), chmod=15, socketcall=102,
)  # fmt: skip
# The same numbers on x86_64, i386 and aarch64.
_IO_URING_SETUP, _CLONE3, _FCHMODAT2 = 425, 435, 452

AF_UNIX, AF_INET, AF_INET6 = 1, 2, 10
SOCK_STREAM, SOCK_DGRAM = 1, 2
_SOCK_TYPE_MASK = 0xF  # SOCK_NONBLOCK and SOCK_CLOEXEC sit above it
IPPROTO_TCP, IPPROTO_UDP = 6, 17
S_ISUID_ISGID = 0o6000
PR_SET_PDEATHSIG, SIGKILL = 1, 9
CLONE_NEWUSER = 0x10000000  # the flags are the first argument of clone and unshare alike
_EPERM, _EACCES, _ENOSYS = 1, 13, 38

# Offsets in struct seccomp_data: nr, arch, then args[6] as u64 (their low halves here,
# on these little-endian machines: the kernel reads an int argument as its low half).
_NR, _ARCH, _ARGS = 0, 4, 16
_RET_ALLOW, _RET_ERRNO, _RET_KILL = 0x7FFF0000, 0x00050000, 0x80000000
# Classic BPF: LD|W|ABS, JMP|JEQ|K, JMP|JGE|K, JMP|JSET|K, ALU|AND|K, RET|K.
_CODES = {"ld": 0x20, "jeq": 0x15, "jge": 0x35, "jset": 0x45, "and": 0x54, "ret": 0x06}

Instruction = tuple[str, int, str, str]  # ("[label:]op", k, jump if true, if false)


def available(machine: str | None = None) -> bool:
    """Whether this filter knows the machine's architecture."""
    return (machine or platform.machine()) in _NATIVE


def _arg(n: int) -> int:
    return _ARGS + 8 * n


def _dispatch(calls: _Calls, ipc: bool) -> list[Instruction]:
    """The system call number of one architecture, to the checks below."""
    refused_whole = [("jeq", calls.socketcall, "deny", "")] if calls.socketcall else []
    sysv = [] if ipc else [("jeq", number, "eperm", "") for number in calls.sysv]
    chmod = [("jeq", calls.chmod, "mode1", "")] if calls.chmod else []
    return [
        ("ld", _NR, "", ""),
        *refused_whole,
        ("jeq", _IO_URING_SETUP, "nosys", ""),
        ("jeq", _CLONE3, "nosys", ""),
        *[("jeq", number, "eperm", "") for number in calls.keyrings],
        *sysv,
        ("jeq", calls.unshare, "flags0", ""),
        ("jeq", calls.clone, "flags0", ""),
        ("jeq", calls.socket, "socket", ""),
        ("jeq", calls.socketpair, "pair", ""),
        ("jeq", calls.listen, "listen", ""),
        *chmod,
        ("jeq", calls.fchmod, "mode1", ""),
        ("jeq", calls.fchmodat, "mode2", ""),
        ("jeq", _FCHMODAT2, "mode2", ""),
        ("jeq", calls.prctl, "prctl", ""),
        ("ret", _RET_ALLOW, "", ""),
    ]


def program(
    machine: str | None = None, *, listen: bool = False, ipc: bool = True
) -> list[Instruction]:
    """The filter as instructions, for ``machine`` (default: this one's). ``ipc``: the
    child has an IPC namespace of its own; without one, System V objects and POSIX
    message queues are refused (``EPERM``): they would be shared by every child.

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
        *_dispatch(_NATIVE[machine], ipc)[1:],
        ("other:jeq", compat, "", "kill"),
        *_dispatch(_I386, ipc),
        ("socket:ld", _arg(0), "", ""),  # the family
        ("jeq", AF_INET, "inet", ""),
        ("jeq", AF_INET6, "inet", "deny"),
        ("inet:ld", _arg(1), "", ""),  # the type, without its flags
        ("and", _SOCK_TYPE_MASK, "", ""),
        ("jeq", SOCK_STREAM, "stream", ""),
        ("jeq", SOCK_DGRAM, "dgram", "deny"),
        ("stream:ld", _arg(2), "", ""),  # the protocol: TCP, not MPTCP or SCTP
        ("jeq", 0, "allow", ""),
        ("jeq", IPPROTO_TCP, "allow", "deny"),
        ("dgram:ld", _arg(2), "", ""),  # UDP, not ICMP (ping) or UDP-Lite
        ("jeq", 0, "allow", ""),
        ("jeq", IPPROTO_UDP, "allow", "deny"),
        ("pair:ld", _arg(0), "", ""),
        ("jeq", AF_UNIX, "allow", "deny"),
        ("mode1:ld", _arg(1), "", ""),  # chmod(path, mode), fchmod(fd, mode)
        ("jset", S_ISUID_ISGID, "eperm", "allow"),
        ("mode2:ld", _arg(2), "", ""),  # fchmodat(dirfd, path, mode[, flags])
        ("jset", S_ISUID_ISGID, "eperm", "allow"),
        ("prctl:ld", _arg(0), "", ""),
        ("jeq", PR_SET_PDEATHSIG, "", "allow"),
        ("ld", _arg(1), "", ""),
        ("jeq", SIGKILL, "allow", "eperm"),
        ("flags0:ld", _arg(0), "", ""),  # clone's and unshare's flags
        ("jset", CLONE_NEWUSER, "eperm", "allow"),
        ("listen:ret", _RET_ALLOW if listen else _RET_ERRNO | _EACCES, "", ""),
        ("allow:ret", _RET_ALLOW, "", ""),
        ("deny:ret", _RET_ERRNO | _EACCES, "", ""),
        ("eperm:ret", _RET_ERRNO | _EPERM, "", ""),
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


def compiled(machine: str | None = None, *, listen: bool = False, ipc: bool = True) -> bytes:
    """The filter, ready for ``PR_SET_SECCOMP`` (see :func:`program`)."""
    return assemble(program(machine, listen=listen, ipc=ipc))
