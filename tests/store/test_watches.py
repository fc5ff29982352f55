"""Poison-proof watches (design §18): whatever any login sends on the ``delegation``
channel, operator control, cross-host steer and ``follow`` keep working and ``events
--follow`` prints no traceback; a bad notice is logged once per watch; a watch loop that
fails is restarted.

The poison comes from a login of its own with no rights on any table, as on a real
server any role that may connect can send it (``NOTIFY`` needs no privilege).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import make_url

from delegation import ChildContext, Engine, EngineConfig, Event, errors
from delegation.engine.notices import keep_running
from delegation.store.postgres.connect import libpq
from delegation.store.postgres.watch import PostgresWatch
from tests.harness import rows
from tests.harness.operators import operator
from tests.harness.support import ScriptRunner, open_harness

ROOT = Path(__file__).resolve().parents[2]

# Payloads no host ever sends: digits Python's isdigit() takes but int() refuses (or
# that are not ASCII), signs, empty ids, spaces, other notations, ids past 64 bits, the
# longest payload NOTIFY carries, and a valid id beside a bad one.
POISON = (
    "²",
    "١٢",
    "①",
    "abc",
    "-1",
    ",,,",
    "1,,2",
    " 7",
    "+7",
    "0x10",
    "1e3",
    "1_000",
    "ÿ",
    "1" * 20,
    "9" * 7999,
    "7,²",
    "c,c",
)


@contextlib.contextmanager
def stranger(url: str) -> Iterator[str]:
    """A login that may connect and nothing else (no rights on any table): its URL."""
    name = f"stranger_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(libpq(url), autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
    try:
        yield make_url(url).set(username=name, password=None).render_as_string(False)
    finally:
        with psycopg.connect(libpq(url), autocommit=True) as admin:
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def notify(url: str, payloads: tuple[str, ...]) -> None:
    """``NOTIFY delegation, '<payload>'`` for each payload, each its own transaction."""
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        for payload in payloads:
            conn.execute(sql.SQL("NOTIFY delegation, {}").format(sql.Literal(payload)))


def poison(url: str) -> None:
    """Send every payload of :data:`POISON` as a login with no table rights."""
    with stranger(url) as login:
        with (
            psycopg.connect(libpq(login), autocommit=True) as conn,
            pytest.raises(psycopg.errors.InsufficientPrivilege),
        ):
            conn.execute("SELECT 1 FROM children")
        notify(login, POISON)


def bad_notices(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "action", "") == "watch_bad_notice"]


# --- the watch itself --------------------------------------------------------------------


def test_a_watch_skips_every_bad_payload_and_says_so_once(
    postgres_db: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="delegation")
    watch = PostgresWatch(postgres_db, interval=0.01)
    try:
        poison(postgres_db)
        poison(postgres_db)  # a flood: still one line
        # A valid notice sent after the poison is read after it: once the watch names
        # its children on their own, it has been through every bad one.
        anything = False
        for _ in range(600):
            notify(postgres_db, ("5,7",))
            assert watch.wait_sync(60)
            moved = watch.moved()
            if moved is None:
                anything = True  # a bad notice: any child may have moved
            elif {5, 7} <= moved:
                break
        else:
            raise AssertionError("the valid notice never came through")
        assert anything, "a bad notice counts as 'something may have moved'"
        notify(postgres_db, ("12,9223372036854775807", "c"))
        for _ in range(600):
            assert watch.wait_sync(60)
            if (moved := watch.moved()) and 12 in moved:
                break
        # A "5,7" of the loop above may arrive only now (each turn sent one more).
        assert moved is not None and moved - {5, 7} == {12, 9223372036854775807}
        assert len(bad_notices(caplog)) == 1, "logged once per watch, not per notice"
    finally:
        watch.close()


# --- a host after the poison -------------------------------------------------------------


async def _events(follower: AsyncIterator[Event]) -> list[Event]:
    return [event async for event in follower]


async def test_operator_control_steer_and_follow_work_after_a_poisoned_notice(
    postgres_db: str, workspace: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two hosts on one database; the stranger's NOTIFY reaches both watches and the
    ``events --follow`` of a third process. Then an operator steers and cancels A's
    child (A's control watcher), B steers it across hosts, and B's ``follow`` and the
    CLI's both end with the cancel."""
    caplog.set_level(logging.WARNING, logger="delegation")
    heard: list[str] = []

    async def listen(ctx: ChildContext) -> None:
        await ctx.admit()
        ctx.emit(Event(kind="text", text="listening"))
        while (message := await ctx.wait_steer()) is not None:
            heard.append(message)
            ctx.emit(Event(kind="text", text=f"heard {message}"))

    runner = ScriptRunner(listen)
    config = EngineConfig(release_drain_s=5.0)
    async with (
        Engine(postgres_db, runner=runner, config=config) as a,
        Engine(postgres_db, runner=ScriptRunner(), config=config) as b,
    ):
        h = await open_harness(a, runner, workspace)
        child = await h.start("q1", lease_id="L1")
        conversation = child.conversation_id
        on_b = asyncio.create_task(_events(b.follow(conversation)))
        cli = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "delegation.cli", "events", conversation, "--follow",
            "--json", "--db", postgres_db, cwd=ROOT, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert cli.stdout is not None
        first = json.loads(await asyncio.wait_for(cli.stdout.readline(), 60))
        assert first["text"] == "listening"  # its watch listens from here on

        await asyncio.to_thread(poison, postgres_db)

        code, out, err = await operator("steer", conversation, "go left", "--json", db=postgres_db)
        assert code == 0, err
        assert json.loads(out)["applied"] is True, "A's control watcher died"
        steered = await b.steer_child(conversation, "go right")
        assert steered.outcome == "injected"
        for _ in range(600):
            if "go right" in heard:
                break
            await asyncio.sleep(0.1)
        assert heard == ["go left", "go right"], "B's steer never reached A's child"
        code, out, err = await operator("cancel", conversation, "--wait", "--json", db=postgres_db)
        assert code == 0, err
        assert (json.loads(out)["applied"], json.loads(out)["state"]) == (True, "cancelled")

        followed = await asyncio.wait_for(on_b, 60)
        assert [e.text for e in followed] == ["listening", "heard go left", "heard go right"]
        out_b, err_b = await asyncio.wait_for(cli.communicate(), 60)
        assert "Traceback" not in err_b.decode(), err_b.decode()
        assert cli.returncode == 0, err_b.decode()
        lines = [json.loads(line) for line in out_b.decode().splitlines()]
        assert lines[-1]["end"]["state"] == "cancelled"
        assert [line["text"] for line in lines[:-1]] == ["heard go left", "heard go right"]
    assert len(bad_notices(caplog)) == 2, "each host's watch logs the poison once"


# --- a loop that fails ---------------------------------------------------------------------


async def test_a_watch_loop_that_fails_is_logged_and_restarted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="delegation")
    runs: list[int] = []

    async def body() -> None:
        runs.append(len(runs))
        if len(runs) < 3:
            raise ValueError(f"failure {len(runs)}")
        raise errors.StoreUnavailable()  # the third run fails the same way

    task = asyncio.create_task(keep_running("test loop", body, pause=0.01))
    for _ in range(600):
        if len(runs) >= 4:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(runs) >= 4, "each failure was followed by a new run"
    restarted = [r for r in caplog.records if getattr(r, "action", "") == "watch_loop_restarted"]
    assert len(restarted) >= 3
    assert restarted[0].exc_info is not None and "failure 1" in str(restarted[0].exc_info[1])
    assert getattr(restarted[0], "loop", "") == "test loop"


# --- a closed watch --------------------------------------------------------------------------


def test_a_closed_watch_connects_no_more(postgres_db: str) -> None:
    """A watch asked after its close (a late thread) is refused: it used to take its
    closed connection for a lost one and open a session that nothing would close."""
    watch = PostgresWatch(postgres_db, interval=0.01)
    watch.close()
    with pytest.raises(errors.StoreError, match="database watch is closed"):
        watch.ask()
    assert watch.changed() is True  # logged and guessed, as any failed question
    rows.no_sessions_of(postgres_db, "delegation-watch")
