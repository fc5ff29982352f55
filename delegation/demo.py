"""``delegation demo``: a guided tour, live in the terminal.

It runs a real host (``delegation serve --stdio`` with the scripted runner) on
``./delegation.db``, speaks to it as a runner would, starts a foreground and a leased
child, steers one, cancels the other, kills the host with SIGKILL in the middle of
the leased child's work, starts a new host on the same file, and shows the leased
child resumed and finishing with a gap-free event log.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console

from delegation.codec import decode
from delegation.wire import Event, Result

console = Console(highlight=False)
STYLE = {"text": "white", "tool": "cyan", "result": "bold green", "recovery": "bold magenta"}


class DemoFailed(Exception):
    pass


class Host:
    """A ``delegation serve --stdio`` subprocess and a JSON-RPC client for it."""

    def __init__(self, db: Path, log: Path) -> None:
        self.db = db
        self.log = log
        self.proc: asyncio.subprocess.Process | None = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def start(self, steps_delay: float) -> None:
        env = {**os.environ, "DELEGATION_SCRIPTED_DELAY": str(steps_delay)}
        with self.log.open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "delegation.cli", "serve", "--stdio",
                "--db", str(self.db), "--runner", "scripted",
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=log, env=env,
            )  # fmt: skip
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc is not None
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            message = msgspec.json.decode(line)
            future = self._waiting.pop(message.get("id"), None)
            if future is not None and not future.done():
                future.set_result(message)
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(DemoFailed("the host went away"))

    async def call(self, method: str, params: dict[str, Any]) -> Any:
        assert self.proc is not None
        assert self.proc.stdin is not None
        request_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        frame = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}
        self.proc.stdin.write(msgspec.json.encode(frame) + b"\n")
        await self.proc.stdin.drain()
        answer = await asyncio.wait_for(future, 20)
        if "error" in answer:
            raise DemoFailed(f"{method}: {answer['error']['message']}")
        return answer["result"]

    async def child(self, method: str, params: dict[str, Any]) -> Result:
        return decode(msgspec.json.encode(await self.call(method, params)), Result)

    async def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()
        if self._reader is not None:
            await self._reader

    async def stop(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 15)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        if self._reader is not None:
            await self._reader


def say(text: str) -> None:
    console.print(f"[bold]»[/bold] {text}")


def show(label: str, events: list[Event]) -> None:
    for event in events:
        body = event.text or f"{event.tool_name}({event.input}) -> {event.tool_output}"
        style = STYLE.get(event.kind, "white")
        console.print(
            f"   [dim]{label} #{event.sequence:<3}[/dim] [{style}]{event.kind:8}[/] {body}"
        )


async def follow(
    host: Host, params: dict[str, Any], label: str, until: float | None = None
) -> Result:
    """Read a child page by page, printing events, until it ends (or ``until`` passes)."""
    after = params.get("after", 0)
    while True:
        result = await host.child("child.read", {**params, "after": after})
        show(label, result.events)
        if result.events:
            after = result.events[-1].sequence
        if result.done or (until is not None and time.monotonic() > until):
            params["after"] = after
            return result
        await asyncio.sleep(0.15)


async def tour(db: Path, log: Path, fast: bool) -> None:
    delay = 0.15 if fast else 0.4
    tag = f"{int(time.time())}"
    run, conv, ext, lease = f"demo-run-{tag}", f"demo-conv-{tag}", "demo-ext", f"lease-{tag}"
    owner = {"runId": run, "toolCallId": "call-1", "extensionId": ext, "generation": 1}
    preset = {"name": "scripted", "extensionId": ext, "generation": 1}
    workspace = str(Path.cwd())

    say(f"starting a host on [bold]{db}[/bold] (scripted runner)")
    host = Host(db, log)
    await host.start(delay)
    registered = await host.call(
        "runner.register", {"runnerId": "demo", "hostInstanceId": "host-1"}
    )
    say(f"runner registered: connection generation {registered['generation']}")
    await host.call("tool.begin", {
        "runId": run, "conversationId": conv, "toolCallId": "call-1",
        "extensionId": ext, "presets": [preset], "workspace": workspace,
    })  # fmt: skip
    say("tool call open: starting a [bold]foreground[/bold] child and a [bold]leased[/bold] one")
    fg = await host.child(
        "child.start",
        {
            **owner,
            "request": {
                "requestId": f"fg-{tag}",
                "profile": "scripted",
                "message": "review the diff in 8 steps",
            },
        },
    )
    bg = await host.child("child.start", {**owner, "leaseId": lease, "request": {
        "requestId": f"bg-{tag}", "profile": "scripted", "leaseId": lease,
        "message": "survey the codebase in 12 steps"}})  # fmt: skip
    say(f"foreground {fg.conversation_id[:14]}…  leased {bg.conversation_id[:14]}… (admitted)")

    steer = await host.call(
        "child.steer",
        {
            **owner,
            "leaseId": lease,
            "childId": bg.conversation_id,
            "requestId": "steer-1",
            "message": "durability first",
        },
    )
    say(f"steered the leased child: {steer['outcome']}")
    fg_read = {**owner, "childId": fg.conversation_id}
    await follow(host, fg_read, "fg", until=time.monotonic() + 3 * delay)
    say("cancelling the foreground child")
    await host.child("child.cancel", fg_read)
    fg_done = await follow(host, fg_read, "fg")
    say(f"foreground child ended: cancelled={fg_done.cancelled} ({fg_done.error})")
    await host.call("tool.end", {"runId": run, "toolCallId": "call-1"})
    say("tool call ended: the leased child carries on under its lease")

    lease_read = {"runId": run, "extensionId": ext, "generation": 1, "leaseId": lease,
                  "childId": bg.conversation_id}  # fmt: skip
    await follow(host, lease_read, "bg", until=time.monotonic() + 6 * delay)
    console.print("[bold red]» kill -9 the host, mid-stream[/bold red]")
    await host.kill()

    say("starting a new host on the same file")
    host = Host(db, log)
    await host.start(delay)
    await host.call("runner.register", {"runnerId": "demo", "hostInstanceId": "host-1"})
    say("runner reconnected with the same hostInstanceId: its lease survived")
    final = await follow(host, lease_read, "bg")
    await host.call("run.finish", {"runId": run, "succeeded": True})
    await host.stop()

    events = all_events(db, bg.conversation_id)
    sequences = [e.sequence for e in events]
    if sequences != list(range(1, len(sequences) + 1)):
        raise DemoFailed(f"the event log has a gap: {sequences}")
    if not any(e.kind == "recovery" for e in events) or not final.done or final.error:
        raise DemoFailed("the leased child was not resumed to completion")
    say(f"leased child [bold green]finished after the crash[/bold green]: {final.output}")
    say(f"its event log: {len(events)} events, 1..{len(events)} without a gap, "
        f"{sum(e.kind == 'recovery' for e in events)} recovery event")  # fmt: skip
    say(f"look around: [bold]delegation children --db {db}[/bold], "
        f"[bold]delegation events {bg.conversation_id} --db {db}[/bold]")  # fmt: skip


def all_events(db: Path, conversation_id: str) -> list[Event]:
    from delegation.inspect import Inspector

    with Inspector(f"sqlite:///{db.resolve()}") as inspector:
        return list(inspector.all_events(conversation_id))


def run_demo(db: Path, *, fast: bool = False) -> int:
    """Run the tour; 0 when every claim it shows held."""
    with tempfile.TemporaryDirectory() as scratch:
        log = Path(scratch) / "host.log"
        started = time.monotonic()
        try:
            asyncio.run(tour(db.resolve(), log, fast))
        except (DemoFailed, TimeoutError) as exc:
            console.print(f"[bold red]demo failed:[/bold red] {exc}")
            with contextlib.suppress(OSError):
                console.print(log.read_text()[-4000:], markup=False)
            return 1
        console.print(f"[dim]done in {time.monotonic() - started:.1f} s[/dim]")
        return 0
