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
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from delegation import passwords
from delegation.client import Client
from delegation.errors import DelegationError
from delegation.wire import Event, Preset, Result

console = Console(highlight=False)
# The old per-call guard was 20 s; the whole tour takes well under a minute.
TOUR_TIMEOUT_S = 300
STYLE = {"text": "white", "tool": "cyan", "result": "bold green", "recovery": "bold magenta"}


class DemoFailed(Exception):
    pass


async def open_host(db: str, log: Path, steps_delay: float) -> Client:
    """A ``delegation serve --stdio`` subprocess with the scripted runner, and a client.
    The database reaches it in its environment: a password in the URL stays off its
    command line (``serve`` refuses one there)."""
    env = {**os.environ, "DELEGATION_DB": db, "DELEGATION_SCRIPTED_DELAY": str(steps_delay)}
    with log.open("ab") as stderr:
        return await Client.spawn(["--runner", "scripted"], env=env, stderr=stderr)


async def kill(host: Client) -> None:
    """SIGKILL the host mid-stream, then close its client."""
    assert host.process is not None
    host.process.send_signal(signal.SIGKILL)
    await host.process.wait()
    await host.close()


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
    host: Client, params: dict[str, Any], label: str, until: float | None = None
) -> Result:
    """Read a child page by page, printing events, until it ends (or ``until`` passes)."""
    after = params.get("after", 0)
    while True:
        result = await host.read({**params, "after": after})
        show(label, result.events)
        if result.events:
            after = result.events[-1].sequence
        if result.done or (until is not None and time.monotonic() > until):
            params["after"] = after
            return result
        await asyncio.sleep(0.15)


async def tour(db: str, log: Path, fast: bool) -> None:
    delay = 0.15 if fast else 0.4
    tag = f"{int(time.time())}"
    run, conv, ext, lease = f"demo-run-{tag}", f"demo-conv-{tag}", "demo-ext", f"lease-{tag}"
    owner = {"runId": run, "toolCallId": "call-1", "extensionId": ext, "generation": 1}
    preset = Preset(name="scripted", extension_id=ext, generation=1)
    workspace = str(Path.cwd())

    say(f"starting a host on [bold]{passwords.redacted(db)}[/bold] (scripted runner)")
    async with await open_host(db, log, delay) as host:
        registered = await host.register("demo", "host-1")
        say(f"runner registered: connection generation {registered.generation}")
        await host.begin_tool(
            run_id=run, conversation_id=conv, tool_call_id="call-1",
            extension_id=ext, presets=[preset], workspace=workspace,
        )  # fmt: skip
        say("tool call open: starting a [bold]foreground[/bold] child and "
            "a [bold]leased[/bold] one")  # fmt: skip
        fg = await host.start({**owner, "request": {
            "requestId": f"fg-{tag}", "profile": "scripted",
            "message": "review the diff in 8 steps"}})  # fmt: skip
        bg = await host.start({**owner, "leaseId": lease, "request": {
            "requestId": f"bg-{tag}", "profile": "scripted", "leaseId": lease,
            "message": "survey the codebase in 12 steps"}})  # fmt: skip
        say(f"foreground {fg.conversation_id[:14]}…  leased {bg.conversation_id[:14]}… (admitted)")

        bg_handle = {**owner, "leaseId": lease, "childId": bg.conversation_id}
        steer = await host.steer(
            {**bg_handle, "requestId": "steer-1", "message": "durability first"}
        )
        say(f"steered the leased child: {steer.outcome}")
        fg_read = {**owner, "childId": fg.conversation_id}
        await follow(host, fg_read, "fg", until=time.monotonic() + 3 * delay)
        say("cancelling the foreground child")
        await host.cancel(fg_read)
        fg_done = await follow(host, fg_read, "fg")
        say(f"foreground child ended: cancelled={fg_done.cancelled} ({fg_done.error})")
        await host.end_tool(run, "call-1")
        say("tool call ended: the leased child carries on under its lease")

        lease_read = {"runId": run, "extensionId": ext, "generation": 1, "leaseId": lease,
                      "childId": bg.conversation_id}  # fmt: skip
        await follow(host, lease_read, "bg", until=time.monotonic() + 6 * delay)
        console.print("[bold red]» kill -9 the host, mid-stream[/bold red]")
        await kill(host)

    say("starting a new host on the same file")
    async with await open_host(db, log, delay) as host:
        await host.register("demo", "host-1")
        say("runner reconnected with the same hostInstanceId: its lease survived")
        final = await follow(host, lease_read, "bg")
        await host.finish_run(run, succeeded=True)

    events = all_events(db, bg.conversation_id)
    sequences = [e.sequence for e in events]
    if sequences != list(range(1, len(sequences) + 1)):
        raise DemoFailed(f"the event log has a gap: {sequences}")
    if not any(e.kind == "recovery" for e in events) or not final.done or final.error:
        raise DemoFailed("the leased child was not resumed to completion")
    say(f"leased child [bold green]finished after the crash[/bold green]: {final.output}")
    say(f"its event log: {len(events)} events, 1..{len(events)} without a gap, "
        f"{sum(e.kind == 'recovery' for e in events)} recovery event")  # fmt: skip
    # A URL with a password came from DELEGATION_DB, which the commands read as well.
    where = "" if passwords.in_url(db) else f" --db {db.removeprefix('sqlite:///')}"
    say(f"look around: [bold]delegation children{where}[/bold], "
        f"[bold]delegation events {bg.conversation_id}{where}[/bold]")  # fmt: skip


def all_events(db: str, conversation_id: str) -> list[Event]:
    from delegation.inspector import Inspector

    with Inspector(db) as inspector:
        return list(inspector.all_events(conversation_id))


def run_demo(db: str, *, fast: bool = False) -> int:
    """Run the tour on the database at URL ``db``; 0 when every claim it shows held."""
    with tempfile.TemporaryDirectory() as scratch:
        log = Path(scratch) / "host.log"
        started = time.monotonic()
        try:
            asyncio.run(asyncio.wait_for(tour(db, log, fast), TOUR_TIMEOUT_S))
        except (DemoFailed, DelegationError, TimeoutError) as exc:
            console.print(f"[bold red]demo failed:[/bold red] {exc}")
            with contextlib.suppress(OSError):
                console.print(log.read_text()[-4000:], markup=False)
            return 1
        console.print(f"[dim]done in {time.monotonic() - started:.1f} s[/dim]")
        return 0
