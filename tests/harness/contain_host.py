"""Host processes for the containment tests (design §10), with the real command runner.

    python tests/harness/contain_host.py attack DB WORKSPACE SOCKET OUTSIDE ordinary|root ns|no-ns
    python tests/harness/contain_host.py orphan DB WORKSPACE ns|no-ns

``attack`` runs as an ordinary user would (``ordinary``: started as root, it first gives
up every capability, so it is root by uid only, as unprivileged as any user towards its
own processes) or as root (``root``), with or without namespaces. It serves ``SOCKET``
like ``delegation serve --socket``, runs ``attack_child.py`` as a command child, and
prints the child's report as one JSON line.
``orphan`` starts a leased child whose command starts a grandchild in its process group,
prints ``STARTED <conversationId>``, and runs until it is killed.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import sys
from pathlib import Path
from typing import Any

from delegation import Engine, EngineConfig, Params, Preset, Request
from delegation.host.serve import serve_socket
from delegation.runners.command import CommandRunner

HERE = Path(__file__).resolve().parent
TREE = (
    "import json, os, subprocess, sys, time\n"
    "grand = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)',"
    " 'grand-' + sys.argv[1].split('-', 1)[1]], start_new_session=SETSID)\n"
    "print(json.dumps({'kind': 'text', 'text': f'pids {os.getpid()} {grand.pid}'}), flush=True)\n"
    "time.sleep(600)\n"
)


def tree_runner(namespaces: bool = True) -> CommandRunner:
    """A profile whose command leaves a grandchild behind: in a PID namespace of its
    own where allowed, a grandchild that leaves for a session of its own (``setsid``);
    unless ``namespaces``, one in its process group (a boot can find that one)."""
    source = TREE.replace("SETSID", str(namespaces)).replace("{", "{{").replace("}", "}}")
    argv = [sys.executable, "-c", source, "child-{conversation_id}"]
    runner = CommandRunner({"tree": argv}, grace_s=0.5)
    if not namespaces:
        runner.containment.namespaces = None
    return runner


def drop_capabilities() -> None:
    """Give up every capability, for good: the bounding set first (so no exec brings
    them back), then the effective, permitted and inheritable sets."""
    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    for cap in range(last + 1):
        libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this pid
    data = (ctypes.c_uint32 * 6)()
    if libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


async def start(engine: Engine, profile: str, workspace: str, lease_id: str = "") -> Any:
    preset = Preset(name=profile, extension_id="ext", generation=1)
    conn = await engine.connect("runner-1", "host-a")
    await engine.open_tool(
        conn,
        run_id="parent-run",
        conversation_id="parent-conv",
        tool_call_id="call-1",
        extension_id="ext",
        presets=[preset],
        workspace=workspace,
    )
    request = Request(request_id="q1", profile=profile, message="go", lease_id=lease_id)
    owner = {"run_id": "parent-run", "tool_call_id": "call-1", "extension_id": "ext"}
    params = Params(**owner, generation=1, lease_id=lease_id, request=request)
    return await engine.call(conn, "child.start", params)


async def attack(db: str, workspace: str, sock: str, outside: str, user: str, ns: str) -> None:
    if user == "ordinary":
        drop_capabilities()
    # Passed as -c: Landlock keeps the child from reading the tests' own directory.
    source = (HERE / "attack_child.py").read_text().replace("{", "{{").replace("}", "}}")
    argv = [sys.executable, "-c", source, db, sock, outside, str(os.getpid())]
    runner = CommandRunner({"attack": argv})
    if ns == "no-ns":
        runner.containment.namespaces = None
    async with Engine(f"sqlite:///{db}", runner=runner) as engine:
        stop = asyncio.Event()
        server = asyncio.create_task(serve_socket(engine, sock, stop, os.getuid()))
        while not os.path.exists(sock):
            await asyncio.sleep(0.01)
        child = await start(engine, "attack", workspace, lease_id="L1")
        while (record := await engine.get_child(child.conversation_id)) and not record.terminal:
            await asyncio.sleep(0.02)
        assert record is not None
        leases = await engine.leases("runner-1")
        print(
            json.dumps(
                {
                    "output": record.output,
                    "error": record.error,
                    "lease_revoked": [lease.revoked_at is not None for lease in leases],
                }
            ),
            flush=True,
        )
        stop.set()
        await server


async def orphan(db: str, workspace: str, mode: str) -> None:
    config = EngineConfig(release_drain_s=1.0)
    runner = tree_runner(mode == "ns")
    async with Engine(f"sqlite:///{db}", runner=runner, config=config) as engine:
        child = await start(engine, "tree", workspace, lease_id="L1")
        while not await engine.events(child.conversation_id):
            await asyncio.sleep(0.02)
        print(f"STARTED {child.conversation_id}", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    if sys.argv[1] == "attack":
        asyncio.run(attack(*sys.argv[2:8]))
    else:
        asyncio.run(orphan(*sys.argv[2:5]))
