"""The launcher every command child starts through (SPEC §10); it then becomes the child.

    python -I -S child_launcher.py SPEC_JSON PROGRAM [ARG ...]

It runs in the child process, between the host's fork and the program's exec, and does
in order what only the child itself can do soundly:

1. ties its life to the host: ``PR_SET_PDEATHSIG`` (SIGKILL), then checks that the host
   is still its parent (it may have died before the signal was armed);
2. changes into the child's working directory and checks, **after** the change, that
   the directory it is in really is the one the engine confined to the workspace: a
   directory swapped for a symlink at any moment before cannot move it out, since the
   check reads where the process is, not where a path leads;
3. where the host found namespaces allowed, makes a PID namespace (and, for a host that
   is not root, a user namespace mapping only its own uid and gid) and forks: the fork
   is the namespace's first process and becomes the program, with a ``/proc`` of its
   own in a private mount namespace; this launcher stays outside as its *keeper*
   (:func:`keep`), dies with the host, and the program dies with it (a second
   ``PR_SET_PDEATHSIG``); when the program ends, the kernel kills every process left
   in its namespace, ``setsid`` and double forks included;
4. confines itself with Landlock where the kernel has it: read-write only beneath its
   working directory and its private temp dir, read-only beneath the configured system
   directories, nothing else; TCP connect only to the ``net_connect`` ports and no
   bind (ABI 4+); and scopes abstract Unix sockets and signals to itself (ABI 6+);
5. installs a seccomp filter that refuses ``socket(AF_UNIX, ...)`` with EACCES, so no
   process of the child, however it forks, can connect to a Unix socket (the serve
   socket, a session bus, a terminal multiplexer); ``socketpair`` still works;
6. gives up every capability for good (bounding and ambient sets cleared, the
   securebits that keep uid 0 from regaining them locked, ``no_new_privs``): a child
   of a root host is as powerless towards the host as an ordinary user's;
7. waits on the go-ahead descriptor until the host has recorded its pid durably;
8. executes the program; the PATH lookup uses the child's own environment.

A refusal exits with :data:`REFUSED` after one line on stderr that starts with
:data:`MARKER`: the program never ran. It uses only the standard library and imports
nothing of delegation, since it starts with ``-I -S`` under the child's environment.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import select
import signal
import struct
import sys
from typing import NoReturn

MARKER = "delegation-contain: "
REFUSED = 125
OUTSIDE = "child working directory exceeds parent workspace"

_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_PR_CAPBSET_DROP, _PR_SET_SECUREBITS, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 24, 28, 47, 4
# NOROOT, NO_SETUID_FIXUP, KEEP_CAPS and NO_CAP_AMBIENT_RAISE, each with its lock bit.
_SECUREBITS_LOCKED = 0b11101111
_CAP_VERSION_3 = 0x20080522
_EPERM, _EINVAL = 1, 22

# Namespaces (include/uapi/linux/sched.h, mount.h).
_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWPID = 0x00020000, 0x10000000, 0x20000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REC, _MS_PRIVATE = 2, 4, 8, 1 << 14, 1 << 18
NAMESPACE_MODES = ("root", "user")  # as root alone; in a user namespace of its own
# Signals whose default action ends a process: one the program does not catch is dropped
# by the kernel, since it is its namespace's init; the keeper makes it a SIGKILL.
_ENDING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

# Landlock (include/uapi/linux/landlock.h).
_LANDLOCK_CREATE_RULESET_VERSION = 1
_LANDLOCK_RULE_PATH_BENEATH = 1
_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1, 2, 4, 8
_FS_ABI1 = (1 << 13) - 1  # execute .. make_sym
_FS_REFER, _FS_TRUNCATE, _FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
_LANDLOCK_RULE_NET_PORT = 2
_NET_BIND_TCP, _NET_CONNECT_TCP = 1, 2
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1, 2
_READ_ONLY = _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR
_SYSCALLS = {  # landlock_create_ruleset, landlock_add_rule, landlock_restrict_self
    "x86_64": (444, 445, 446),
    "aarch64": (444, 445, 446),
}

# seccomp: the architecture, and the socket syscalls to filter there.
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_SOCKET_NR = {"x86_64": 41, "aarch64": 198}
_AUDIT_ARCH_I386 = 0x40000003  # x86_64 runs i386 code too: its socket calls are filtered
_I386_SOCKETCALL, _I386_SOCKET = 102, 359
_X32_BIT = 0x40000000
_AF_UNIX = 1
_EACCES, _ENOSYS = 13, 38
_IO_URING_SETUP = 425  # the same number on x86_64, i386 and aarch64


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def refuse(message: str) -> None:
    sys.stderr.write(f"{MARKER}{message}\n")
    sys.stderr.flush()
    os._exit(REFUSED)


def tie_to_parent(libc: ctypes.CDLL, parent: int) -> None:
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        refuse(f"cannot set the parent-death signal: {os.strerror(ctypes.get_errno())}")
    if os.getppid() != parent:  # the host died before the signal was armed
        os._exit(REFUSED)


def enter(cwd: str) -> None:
    """Change into ``cwd`` and check where that really is: the kernel's own path of the
    directory the process now stands in must be exactly the confined real path."""
    try:
        os.chdir(cwd)
        here = os.getcwd()
    except OSError as exc:
        refuse(f"invalid child working directory: {exc.strerror}")
    if here != cwd:
        refuse(OUTSIDE)


def landlock(
    libc: ctypes.CDLL, read_write: list[str], read_only: list[str], ports: list[int]
) -> int:
    """Confine this process (and so the program and all it starts); returns the ABI
    version used, 0 where the kernel has no Landlock. From ABI 4 on, TCP may connect
    only to ``ports`` and bind nowhere."""
    calls = _SYSCALLS.get(platform.machine())
    if calls is None:
        return 0
    create, add, restrict = calls
    abi = libc.syscall(create, None, ctypes.c_size_t(0), _LANDLOCK_CREATE_RULESET_VERSION)
    if abi < 1:
        return 0
    handled = _FS_ABI1
    if abi >= 2:
        handled |= _FS_REFER
    if abi >= 3:
        handled |= _FS_TRUNCATE
    if abi >= 5:
        handled |= _FS_IOCTL_DEV
    network = _NET_BIND_TCP | _NET_CONNECT_TCP if abi >= 4 else 0
    scoped = _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL if abi >= 6 else 0
    # struct landlock_ruleset_attr { u64 handled_access_fs, handled_access_net, scoped }
    attr = struct.pack("=QQQ", handled, network, scoped)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    buffer = ctypes.create_string_buffer(attr, len(attr))
    ruleset = libc.syscall(create, buffer, ctypes.c_size_t(size), 0)
    if ruleset < 0:
        refuse(f"cannot create a Landlock ruleset: {os.strerror(ctypes.get_errno())}")
    try:
        for paths, access in ((read_write, handled), (read_only, _READ_ONLY)):
            for path in paths:
                _allow(libc, add, ruleset, path, access & handled)
        for port in ports if network else ():
            _allow_port(libc, add, ruleset, port)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            refuse(f"cannot set no_new_privs: {os.strerror(ctypes.get_errno())}")
        if libc.syscall(restrict, ruleset, 0) != 0:
            refuse(f"cannot enforce Landlock: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(ruleset)
    return int(abi)


def _allow_port(libc: ctypes.CDLL, add: int, ruleset: int, port: int) -> None:
    # struct landlock_net_port_attr { u64 allowed_access; u64 port }
    rule = ctypes.create_string_buffer(struct.pack("=QQ", _NET_CONNECT_TCP, port), 16)
    if libc.syscall(add, ruleset, _LANDLOCK_RULE_NET_PORT, rule, 0) != 0:
        refuse(f"cannot allow TCP port {port}: {os.strerror(ctypes.get_errno())}")


def _allow(libc: ctypes.CDLL, add: int, ruleset: int, path: str, access: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return  # a configured directory this system does not have
    try:
        if not os.path.isdir(path):
            access &= _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | _FS_TRUNCATE | _FS_IOCTL_DEV
        # struct landlock_path_beneath_attr { u64 allowed_access; s32 parent_fd } (packed)
        rule = ctypes.create_string_buffer(struct.pack("=Qi", access, fd), 12)
        if libc.syscall(add, ruleset, _LANDLOCK_RULE_PATH_BENEATH, rule, 0) != 0:
            refuse(f"cannot allow {path}: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


def no_unix_sockets(libc: ctypes.CDLL) -> bool:
    """Refuse ``socket(AF_UNIX, ...)`` to this process and all it starts (seccomp), and
    ``io_uring_setup``, whose ``IORING_OP_SOCKET`` makes sockets no filter sees; a
    foreign architecture (other than i386 on x86_64) is killed. Returns False on an
    architecture this filter does not know."""
    machine = platform.machine()
    if machine not in _AUDIT_ARCH:
        return False
    arch, nr, arg0 = 4, 0, 16  # offsets in struct seccomp_data (args[0]: its low half)
    program: list[tuple[str, int, str, str]] = [
        ("ld", arch, "", ""),
        ("jeq", _AUDIT_ARCH[machine], "", "other"),
        ("ld", nr, "", ""),
        ("jge", _X32_BIT, "deny", ""),  # x32 system calls
        ("jeq", _IO_URING_SETUP, "nosys", ""),
        ("jeq", _SOCKET_NR[machine], "", "allow"),
        ("ld", arg0, "", ""),
        ("jeq", _AF_UNIX, "deny", "allow"),
        ("other:jeq", _AUDIT_ARCH_I386 if machine == "x86_64" else 0, "", "kill"),
        ("ld", nr, "", ""),
        ("jeq", _I386_SOCKETCALL, "deny", ""),  # its arguments are behind a pointer
        ("jeq", _IO_URING_SETUP, "nosys", ""),
        ("jeq", _I386_SOCKET, "", "allow"),
        ("ld", arg0, "", ""),
        ("jeq", _AF_UNIX, "deny", "allow"),
        ("allow:ret", 0x7FFF0000, "", ""),  # SECCOMP_RET_ALLOW
        ("deny:ret", 0x00050000 | _EACCES, "", ""),  # SECCOMP_RET_ERRNO | EACCES
        ("nosys:ret", 0x00050000 | _ENOSYS, "", ""),  # no io_uring: programs fall back
        ("kill:ret", 0x80000000, "", ""),  # SECCOMP_RET_KILL_PROCESS (e.g. arm32 compat)
    ]
    filters = _assemble(program)
    buffer = ctypes.create_string_buffer(filters, len(filters))
    # struct sock_fprog { unsigned short len; struct sock_filter *filter; }
    prog = struct.pack("@HP", len(program), ctypes.addressof(buffer))  # native alignment
    fprog = ctypes.create_string_buffer(prog, len(prog))
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        refuse(f"cannot set no_new_privs: {os.strerror(ctypes.get_errno())}")
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, fprog, 0, 0) != 0:
        refuse(f"cannot install the socket filter: {os.strerror(ctypes.get_errno())}")
    return True


def _assemble(program: list[tuple[str, int, str, str]]) -> bytes:
    """Classic BPF from ("[label:]op", k, jump if true, jump if false); "" falls through."""
    codes = {"ld": 0x20, "jeq": 0x15, "jge": 0x35, "ret": 0x06}  # LD|W|ABS, JMP|K, RET|K
    labels = {op.split(":")[0]: pc for pc, (op, *_) in enumerate(program) if ":" in op}
    out = b""
    for pc, (op, k, if_true, if_false) in enumerate(program):
        jt = labels[if_true] - pc - 1 if if_true else 0
        jf = labels[if_false] - pc - 1 if if_false else 0
        out += struct.pack("=HBBI", codes[op.split(":")[-1]], jt, jf, k)
    return out


def wait_go(fd: int) -> None:
    """Block until the host has recorded this process (one byte), or died (EOF)."""
    try:
        go = os.read(fd, 1)
    finally:
        os.close(fd)
    if go != b"1":
        os._exit(REFUSED)


def unshare(libc: ctypes.CDLL, mode: str) -> None:
    """Enter a new PID namespace (its first process is this one's next child) and, in
    ``"user"`` mode, a user namespace where this process keeps its own uid and gid.

    The user namespace is what lets a host that is not root do this; its powers there
    are dropped (:func:`drop_capabilities`) before the program runs."""
    uid, gid = os.geteuid(), os.getegid()
    flags = _CLONE_NEWPID | (_CLONE_NEWUSER if mode == "user" else 0)
    if libc.unshare(flags) != 0:
        refuse(f"cannot make the child's namespaces: {os.strerror(ctypes.get_errno())}")
    if mode == "user":
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                           ("gid_map", f"{gid} {gid} 1")):  # fmt: skip
            with open(f"/proc/self/{name}", "w") as mapping:
                mapping.write(text)


def own_proc(libc: ctypes.CDLL) -> None:
    """In a private mount namespace, mount a ``/proc`` of this PID namespace over the
    host's: the child sees its own processes only."""
    if (
        libc.unshare(_CLONE_NEWNS) != 0
        or libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0
        or libc.mount(b"proc", b"/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None) != 0
    ):
        refuse(f"cannot mount the child's /proc: {os.strerror(ctypes.get_errno())}")


def fork_first(libc: ctypes.CDLL) -> None:
    """Fork after :func:`unshare`: the fork returns, as the namespace's first process,
    tied to this launcher's life; the launcher itself stays outside as its keeper and
    never returns."""
    alive_read, alive_write = os.pipe()  # the keeper holds the write end while it lives
    pid = os.fork()
    if pid:
        os.close(alive_read)
        keep(pid)
    os.close(alive_write)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        refuse(f"cannot set the parent-death signal: {os.strerror(ctypes.get_errno())}")
    if select.select([alive_read], [], [], 0)[0]:  # EOF: the keeper died before that
        os._exit(REFUSED)
    os.close(alive_read)


def keep(child: int) -> NoReturn:
    """The keeper: wait for the program (the namespace's init), pass on what would end
    it, and end as it ended, so the host sees the program's own exit status."""
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):  # the host's pipes end with the program, not with the keeper
        os.dup2(devnull, fd)
    os.close(devnull)
    group = os.getpgid(0)

    def pass_on(sig: int, _frame: object) -> None:
        try:
            caught = _catches(child, sig)
            if caught and os.getpgid(child) != group:  # it left the group: not signalled
                os.kill(child, sig)
            elif not caught:
                os.kill(child, signal.SIGKILL)  # what this signal would have done
        except (OSError, ValueError):
            pass  # it has ended already

    for sig in _ENDING:
        signal.signal(sig, pass_on)
    _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    if code < 0:  # die of the same signal
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` or ignores it (/proc status)."""
    masks = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("SigCgt", "SigIgn"):
                masks[name] = int(value, 16)
    bit = 1 << (sig - 1)
    return bool((masks.get("SigCgt", 0) | masks.get("SigIgn", 0)) & bit)


def drop_capabilities(libc: ctypes.CDLL) -> None:
    """Give up every capability for good: the bounding set (so no exec brings them back,
    not even to uid 0), the ambient set, the securebits that would re-grant them to
    uid 0 (locked), then the effective, permitted and inheritable sets.

    A process without capabilities cannot clear its bounding set; it has nothing to
    give up, and ``no_new_privs`` (set before) keeps it from gaining any."""
    powerless = _capabilities() == 0
    cap = 0
    while libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
        cap += 1
    errno = ctypes.get_errno()
    if errno != _EINVAL and not (errno == _EPERM and powerless):
        refuse(f"cannot clear the capability bounding set: {os.strerror(errno)}")
    if not powerless and libc.prctl(_PR_SET_SECUREBITS, _SECUREBITS_LOCKED, 0, 0, 0) != 0:
        refuse(f"cannot lock the securebits: {os.strerror(ctypes.get_errno())}")
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(_CAP_VERSION_3, 0)
    if libc.capset(header, (ctypes.c_uint32 * 6)()) != 0 or _capabilities() != 0:
        refuse(f"cannot give up capabilities: {os.strerror(ctypes.get_errno())}")


def _capabilities() -> int:
    """This process's effective and permitted capabilities, OR-ed (from capget)."""
    libc = _libc()
    header = (ctypes.c_uint32 * 2)(_CAP_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()
    if libc.capget(header, data) != 0:
        refuse(f"cannot read capabilities: {os.strerror(ctypes.get_errno())}")
    return data[0] | data[1] | data[3] | data[4]


def probe() -> None:
    """Print (as JSON) the namespace mode this machine allows a child, or null: the
    first of :data:`NAMESPACE_MODES` whose namespaces and ``/proc`` a fork could make."""
    libc = _libc()
    modes = NAMESPACE_MODES if os.geteuid() == 0 else NAMESPACE_MODES[1:]
    for mode in modes:
        pid = os.fork()
        if pid == 0:
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # refusals are expected here
            unshare(libc, mode)
            if os.fork() == 0:
                own_proc(libc)
                os._exit(0 if os.getpid() == 1 else 1)
            _, status = os.wait()
            os._exit(os.waitstatus_to_exitcode(status))
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) == 0:
            print(json.dumps(mode))
            return
    print(json.dumps(None))


def main(argv: list[str]) -> None:
    if argv[1:] == ["--probe"]:
        probe()
        return
    spec = json.loads(argv[1])
    program = argv[2:]
    libc = _libc()
    tie_to_parent(libc, spec["parent"])
    enter(spec["cwd"])
    if spec.get("namespaces"):
        unshare(libc, spec["namespaces"])
        tie_to_parent(libc, spec["parent"])  # a change of credentials may disarm it
        fork_first(libc)
        own_proc(libc)
    if spec.get("landlock", True):
        # The cwd's rule is for the directory checked above, which "." is whatever its
        # path leads to now: reopening the path would follow a symlink swapped in since.
        writable = ["." if path == spec["cwd"] else path for path in spec["read_write"]]
        landlock(libc, writable, spec["read_only"], spec.get("net_connect", []))
    if spec.get("seccomp", True) and not no_unix_sockets(libc):
        refuse(f"no socket filter for this architecture ({platform.machine()})")
    drop_capabilities(libc)
    wait_go(spec["go_fd"])
    try:
        os.execvp(program[0], program)
    except OSError as exc:
        refuse(f"command {program[0]!r} could not start: {exc}")


if __name__ == "__main__":
    main(sys.argv)
