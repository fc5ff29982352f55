"""The launcher every command child starts through (design §10, §17, §23); it then becomes
the child.

    python -I -S child_launcher.py SPEC_JSON PROGRAM [ARG ...]

It runs in the child process, between the host's fork and the program's exec, and does
in order what only the child itself can do soundly:

1. joins the child's own control groups (``cgroups``: the host made them, with its
   process and memory limits), so that everything it becomes is counted;
2. ties its life to the host: ``PR_SET_PDEATHSIG`` (SIGKILL), then checks that the host
   is still its parent (it may have died before the signal was armed);
3. changes into the child's working directory and checks, **after** the change, that
   the directory it is in really is the one the engine confined to the workspace: a
   directory swapped for a symlink at any moment before cannot move it out, since the
   check reads where the process is, not where a path leads;
4. where the host found namespaces allowed, makes a PID namespace and an IPC namespace
   (and, for a host that is not root, a user namespace mapping only its own uid and
   gid) and forks: the fork
   is the namespace's first process and becomes the program, with a ``/proc`` of its
   own in a private mount namespace; this launcher stays outside as its *keeper*
   (:func:`keep`), dies with the host, and the program dies with it (a second
   ``PR_SET_PDEATHSIG``); when the program ends, the kernel kills every process left
   in its namespace, ``setsid`` and double forks included;
5. for a root host (``uid``), gives the program a user of its own: in its mount
   namespace, the directories it may write (its working directory, ``read_write``)
   are remounted *idmapped*, so that what root owns there is the child user's, and the
   root-owned directories on the way to what it may read that others may not enter
   (``/root`` above a Python installed there) likewise, read-only; it then runs as that
   user (:func:`give_away`), so a file only root may read (``/etc/shadow``, a disk
   device) is closed to it by its mode;
6. confines itself with Landlock where the kernel has it: read-write only beneath its
   working directory and its private temp dir, read-only beneath the configured system
   directories except the ``hidden`` files beneath them (the database's credentials),
   nothing else; TCP connect only to the ``net_connect`` ports and no bind (ABI 4+);
   and scopes abstract Unix sockets and signals to itself (ABI 6+);
7. installs the host's seccomp filter (``seccomp``, :mod:`delegation.runners.seccomp_filter`):
   only TCP and UDP sockets and Unix socket pairs, ``listen`` only where allowed, no
   setuid or setgid bit set, no parent-death signal but SIGKILL, no io_uring, no
   keyring, no user namespace, no foreign system calls; filters are inherited and
   cannot be removed;
8. gives up every capability for good (bounding and ambient sets cleared, the
   securebits that keep uid 0 from regaining them locked, ``no_new_privs``): a child
   of a root host is as powerless towards the host as an ordinary user's;
9. waits on the go-ahead descriptor until the host has recorded its pid durably;
10. sets the program's resource limits where no control group holds its memory
    (``rlimits``: ``RLIMIT_DATA`` and ``RLIMIT_AS``), last, so that a small limit
    bounds the program and never this launcher's own work;
11. executes the program; the PATH lookup uses the child's own environment.

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
import stat
import struct
import sys
from typing import Any, NoReturn

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
_CLONE_NEWIPC = 0x08000000
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

# Mounts made idmapped (include/uapi/linux/mount.h); the same numbers on x86_64 and aarch64.
_OPEN_TREE, _MOVE_MOUNT, _MOUNT_SETATTR = 428, 429, 442
_OPEN_TREE_CLONE, _AT_FDCWD, _AT_EMPTY_PATH, _MOVE_MOUNT_F_EMPTY_PATH = 1, -100, 0x1000, 4
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NOSUID, _MOUNT_ATTR_NODEV, _MOUNT_ATTR_IDMAP = 1, 2, 4, 0x100000

# Resource limits (include/uapi/asm-generic/resource.h).
_RLIMITS = {"data": 2, "nproc": 6, "as": 9}  # RLIMIT_DATA, RLIMIT_NPROC, RLIMIT_AS


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
    libc: ctypes.CDLL,
    read_write: list[str],
    read_only: list[Any],
    ports: list[int],
) -> int:
    """Confine this process (and so the program and all it starts); returns the ABI
    version used, 0 where the kernel has no Landlock. ``read_only`` holds directories
    (or files) to read beneath, or rules ``[path, access, follow]`` the host carved
    around what must stay hidden (:mod:`delegation.runners.child_view`). From ABI 4 on,
    TCP may connect only to ``ports`` and bind nowhere."""
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
        for path in read_write:
            _allow(libc, add, ruleset, path, handled)
        for rule in read_only:
            path, access, follow = (rule, _READ_ONLY, True) if isinstance(rule, str) else rule
            _allow(libc, add, ruleset, path, access & handled, follow)
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


def _allow(
    libc: ctypes.CDLL, add: int, ruleset: int, path: str, access: int, follow: bool = True
) -> None:
    flags = os.O_PATH | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError:
        return  # a configured directory this system does not have
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):  # a file, or a symlink opened as itself
            access &= _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | _FS_TRUNCATE | _FS_IOCTL_DEV
        if not access:
            return  # a file carved beside the way: READ_DIR means nothing for it
        # struct landlock_path_beneath_attr { u64 allowed_access; s32 parent_fd } (packed)
        rule = ctypes.create_string_buffer(struct.pack("=Qi", access, fd), 12)
        if libc.syscall(add, ruleset, _LANDLOCK_RULE_PATH_BENEATH, rule, 0) != 0:
            refuse(f"cannot allow {path}: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


def install_filter(libc: ctypes.CDLL, program: bytes) -> None:
    """Install the host's seccomp filter (classic BPF, :mod:`seccomp_filter`) for this
    process and all it starts; ``no_new_privs`` first, as an unprivileged filter needs."""
    buffer = ctypes.create_string_buffer(program, len(program))
    # struct sock_fprog { unsigned short len; struct sock_filter *filter; }
    prog = struct.pack("@HP", len(program) // 8, ctypes.addressof(buffer))  # native alignment
    fprog = ctypes.create_string_buffer(prog, len(prog))
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        refuse(f"cannot set no_new_privs: {os.strerror(ctypes.get_errno())}")
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, fprog, 0, 0) != 0:
        refuse(f"cannot install the socket filter: {os.strerror(ctypes.get_errno())}")


def wait_go(fd: int) -> None:
    """Block until the host has recorded this process (one byte), or died (EOF)."""
    try:
        go = os.read(fd, 1)
    finally:
        os.close(fd)
    if go != b"1":
        os._exit(REFUSED)


def unshare(libc: ctypes.CDLL, mode: str) -> None:
    """Enter a new PID namespace (its first process is this one's next child) and IPC
    namespace and, in ``"user"`` mode, a user namespace where this process keeps its own
    uid and gid.

    The user namespace is what lets a host that is not root do this; its powers there
    are dropped (:func:`drop_capabilities`) before the program runs."""
    uid, gid = os.geteuid(), os.getegid()
    # An IPC namespace of its own: no System V segment, semaphore or queue (nor POSIX
    # message queue) of one child is another's, and what it made there goes with it.
    flags = _CLONE_NEWPID | _CLONE_NEWIPC | (_CLONE_NEWUSER if mode == "user" else 0)
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


def fork_first(libc: ctypes.CDLL) -> int:
    """Fork after :func:`unshare`: the fork returns, as the namespace's first process,
    tied to this launcher's life; the launcher itself stays outside as its keeper and
    never returns. Returns the end of a pipe that reads EOF once the keeper has died,
    for :func:`tied_to_keeper` (a change of user clears the parent-death signal)."""
    alive_read, alive_write = os.pipe()  # the keeper holds the write end while it lives
    pid = os.fork()
    if pid:
        os.close(alive_read)
        keep(pid)
    os.close(alive_write)
    tied_to_keeper(libc, alive_read)
    return alive_read


def tied_to_keeper(libc: ctypes.CDLL, alive: int) -> None:
    """Arm the parent-death signal for the keeper, then check it still lives."""
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        refuse(f"cannot set the parent-death signal: {os.strerror(ctypes.get_errno())}")
    if select.select([alive], [], [], 0)[0]:  # EOF: the keeper died before that
        os._exit(REFUSED)


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
    if code < 0:  # die of the same signal (SIGKILL, the OOM killer's, has no handler)
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
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


def drop_capabilities(libc: ctypes.CDLL, user: tuple[int, int] | None = None) -> None:
    """Give up every capability for good: the bounding set (so no exec brings them back,
    not even to uid 0), the ambient set, the securebits that would re-grant them to
    uid 0 (locked), then the effective, permitted and inheritable sets. ``user`` (uid,
    gid), for a root host: become that user, with no supplementary group, on the way.

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
    if user is not None:  # NO_SETUID_FIXUP (locked above) keeps CAP_SETUID for this
        try:
            os.setgroups([])
            os.setresgid(user[1], user[1], user[1])
            os.setresuid(user[0], user[0], user[0])
        except OSError as exc:
            refuse(f"cannot become the child's user {user[0]}: {exc.strerror}")
    header = (ctypes.c_uint32 * 2)(_CAP_VERSION_3, 0)
    if libc.capset(header, (ctypes.c_uint32 * 6)()) != 0 or _capabilities() != 0:
        refuse(f"cannot give up capabilities: {os.strerror(ctypes.get_errno())}")


# --- a root host's child gets a user of its own -----------------------------------


def give_away(libc: ctypes.CDLL, user: tuple[int, int], cwd: str, spec: dict[str, Any]) -> None:
    """In this (private) mount namespace, make what the child may write its user's and
    what it may read reachable for it, before it becomes ``user`` (uid, gid), as the host
    planned it (:mod:`delegation.runners.child_view`):

    * its working directory (``.``, checked by :func:`enter`) and each ``idmapped``
      path (its private temp dir and ``read_write`` paths) is mounted over itself
      *idmapped*: root's files there are ``user``'s, and what it creates is root's on
      disk, as a root child's was; the working directory must be, a device file or a
      file system without idmapped mounts stays as it is;
    * each ``closed`` directory (root's, which ``user`` could not enter on the way to a
      root: ``/root`` above a Python installed there) is mounted over itself idmapped and
      read-only, so that ``user`` may enter it; Landlock keeps it from everything there
      but its roots, and each read-only root ``beneath`` one is mounted back over it as
      it is, so that its files keep their modes (a file only root may read stays so).

    Then the process stands in its cwd's new mount, checked as :func:`enter` checks."""
    mapping = _idmapping(libc, user)
    try:
        here = _clone(libc, ".", mapping)
        if here[0] < 0:
            refuse(f"cannot give the workspace to the child's user {user[0]}: {_NO_IDMAP}")
        mounts = [(p, _clone(libc, p, mapping)) for p in spec["idmapped"]]
        mounts += [(p, _clone(libc, p, None, read_only=True)) for p in spec["beneath"]]
        mounts += [(p, _clone(libc, p, mapping, read_only=True)) for p in spec["closed"]]
        for path, clone in [*sorted(mounts, key=lambda m: m[0].count("/")), (cwd, here)]:
            _mount(libc, clone, path)  # outer first: an inner one goes over it
        os.fchdir(here[0])
        if os.getcwd() != cwd:
            refuse(OUTSIDE)
        os.close(here[0])
    finally:
        os.close(mapping)


_NO_IDMAP = (
    "its file system has no idmapped mounts (child_uid = 0 under [command] runs children as root)"
)


def _idmapping(libc: ctypes.CDLL, user: tuple[int, int]) -> int:
    """A user namespace mapping 0 to ``user`` (its fd): the idmapping of the mounts."""
    ready_read, ready_write = os.pipe()
    done_read, done_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_read)
        os.close(done_write)
        code = 0 if libc.unshare(_CLONE_NEWUSER) == 0 else 1
        os.write(ready_write, b"1")
        os.read(done_read, 1)
        os._exit(code)
    os.close(ready_write)
    os.close(done_read)
    try:
        os.read(ready_read, 1)
        for name, text in (("uid_map", f"0 {user[0]} 1"), ("setgroups", "deny"),
                           ("gid_map", f"0 {user[1]} 1")):  # fmt: skip
            with open(f"/proc/{pid}/{name}", "w") as file:
                file.write(text)
        return os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        refuse(f"cannot map the child's user {user[0]}: {exc.strerror}")
        raise
    finally:
        os.close(ready_read)
        os.close(done_write)
        os.waitpid(pid, 0)


def _clone(
    libc: ctypes.CDLL, path: str, mapping: int | None, *, read_only: bool = False
) -> tuple[int, bool]:
    """A detached copy of the mount at ``path`` (idmapped by ``mapping``, read-only):
    its fd and whether it is a directory; fd -1 where it cannot be had (no such path,
    a device file, no idmapped mounts)."""
    try:
        kind = os.stat(path).st_mode
    except OSError:
        return -1, False
    if not (stat.S_ISDIR(kind) or stat.S_ISREG(kind)):
        return -1, False
    fd = libc.syscall(_OPEN_TREE, _AT_FDCWD, path.encode(), _OPEN_TREE_CLONE | os.O_CLOEXEC)
    if fd < 0:
        return -1, False
    attr = _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV | (_MOUNT_ATTR_RDONLY if read_only else 0)
    attr |= _MOUNT_ATTR_IDMAP if mapping is not None else 0
    # struct mount_attr { u64 attr_set, attr_clr, propagation, userns_fd }
    packed = ctypes.create_string_buffer(struct.pack("=QQQQ", attr, 0, 0, mapping or 0), 32)
    if libc.syscall(_MOUNT_SETATTR, fd, b"", _AT_EMPTY_PATH, packed, ctypes.c_size_t(32)):
        os.close(fd)
        return -1, False
    return int(fd), stat.S_ISDIR(kind)


def _mount(libc: ctypes.CDLL, clone: tuple[int, bool], path: str) -> None:
    fd, _ = clone
    if fd < 0:
        return
    flags = _MOVE_MOUNT_F_EMPTY_PATH
    if libc.syscall(_MOVE_MOUNT, fd, b"", _AT_FDCWD, path.encode(), flags) != 0:
        refuse(f"cannot mount {path} for the child's user: {os.strerror(ctypes.get_errno())}")


# --- limits -------------------------------------------------------------------------


def join_cgroups(procs: list[str]) -> None:
    """Move this process into each control group (a ``cgroup.procs`` file): all it
    starts is counted there, against the limits the host set."""
    for path in procs:
        try:
            with open(path, "w") as file:
                file.write(str(os.getpid()))
        except OSError as exc:
            refuse(f"cannot join the child's control group {path}: {exc.strerror}")


def set_limits(limits: dict[str, int]) -> None:
    """Set resource limits (``data``, ``as``, ``nproc``: soft and hard)."""
    import resource  # the standard library's; only where limits are asked for

    for name, value in limits.items():
        try:
            resource.setrlimit(_RLIMITS[name], (value, value))
        except (OSError, ValueError) as exc:
            refuse(f"cannot set the child's {name} limit: {exc}")


def _capabilities() -> int:
    """This process's effective and permitted capabilities, OR-ed (from capget)."""
    libc = _libc()
    header = (ctypes.c_uint32 * 2)(_CAP_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()
    if libc.capget(header, data) != 0:
        refuse(f"cannot read capabilities: {os.strerror(ctypes.get_errno())}")
    return data[0] | data[1] | data[3] | data[4]


def probe() -> None:
    """Print (as JSON) what this machine allows a child: ``namespaces``, the first of
    :data:`NAMESPACE_MODES` whose namespaces and ``/proc`` a fork could make (or null),
    and ``idmap``, whether a root host may mount a directory idmapped for its child's
    user there (:func:`give_away`, tried on the temp directory given, if any)."""
    libc = _libc()
    modes = NAMESPACE_MODES if os.geteuid() == 0 else NAMESPACE_MODES[1:]
    found: dict[str, object] = {"namespaces": None, "idmap": False}
    for mode in modes:
        pid = os.fork()
        if pid == 0:
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # refusals are expected here
            unshare(libc, mode)
            if os.fork() == 0:
                own_proc(libc)
                if mode == "root" and len(sys.argv) > 2:
                    os.chdir(sys.argv[2])
                    fd, _ = _clone(libc, ".", _idmapping(libc, (65534, 65534)))
                    os._exit(3 if fd >= 0 else 0 if os.getpid() == 1 else 1)
                os._exit(0 if os.getpid() == 1 else 1)
            _, status = os.wait()
            os._exit(os.waitstatus_to_exitcode(status))
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if code in (0, 3):
            found = {"namespaces": mode, "idmap": code == 3}
            break
    print(json.dumps(found))


def main(argv: list[str]) -> None:
    if argv[1:2] == ["--probe"]:
        probe()
        return
    spec = json.loads(argv[1])
    program = argv[2:]
    libc = _libc()
    join_cgroups(spec.get("cgroups", []))
    tie_to_parent(libc, spec["parent"])
    enter(spec["cwd"])
    user = spec.get("user")
    if spec.get("namespaces"):
        unshare(libc, spec["namespaces"])
        # Its process count is its user namespace's from here: nothing of the host's.
        set_limits({"nproc": spec["nproc"]} if spec.get("nproc") else {})
        tie_to_parent(libc, spec["parent"])  # a change of credentials may disarm it
        alive = fork_first(libc)
        own_proc(libc)
        if user is not None:
            give_away(libc, (user[0], user[1]), spec["cwd"], spec)
    if spec.get("landlock", True):
        # The cwd's rule is for the directory checked above, which "." is whatever its
        # path leads to now: reopening the path would follow a symlink swapped in since.
        writable = ["." if path == spec["cwd"] else path for path in spec["read_write"]]
        landlock(libc, writable, spec["read_only"], spec.get("net_connect", []))
    if spec.get("seccomp"):
        install_filter(libc, bytes.fromhex(spec["seccomp"]))
    if spec.get("namespaces"):
        drop_capabilities(libc, (user[0], user[1]) if user else None)
        tied_to_keeper(libc, alive)  # again: becoming the child's user disarmed it
        os.close(alive)
    else:
        drop_capabilities(libc)
    wait_go(spec["go_fd"])
    # The program's memory limits last: under a small max_memory this launcher, a Python
    # process, could not have done the above (a refusal, not a crash, if it cannot set them).
    set_limits(spec.get("rlimits", {}))
    try:
        os.execvp(program[0], program)
    except OSError as exc:
        refuse(f"command {program[0]!r} could not start: {exc}")


if __name__ == "__main__":
    main(sys.argv)
