"""What other tests use of engine/test_versions.py, kept here so that no test module imports
another: Versioned, answered_on, asks, engine, until_done, waiting_on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from delegation import ChildContext, Engine, EngineConfig, Event
from tests.harness.support import ScriptRunner, open_harness
from tests.harness.waits import HOLD_S, until


async def asks(ctx: ChildContext) -> None:
    await ctx.admit()
    word = await ctx.ask("word", "say a word")
    ctx.emit(Event(kind="result", text=f"heard {word}"))


class Versioned(ScriptRunner):
    """A scripted runner that declares a version (and the older ones it resumes)."""

    def __init__(self, version: str | None, resumes: tuple[str, ...] = (), **kw: Any) -> None:
        super().__init__(**kw)
        self.version = version
        self.resumes = resumes


def engine(db_url: str, runner: Any, **config: Any) -> Engine:
    settings = EngineConfig(**{"release_drain_s": 2.0, "hold_s": HOLD_S, **config})
    return Engine(db_url, runner=runner, config=settings)


async def waiting_on(
    db_url: str, workspace: Path, version: str | None, request_id: str = "q1"
) -> str:
    """A child of ``version`` that asks and is suspended; its host closed."""
    runner = Versioned(version, script=asks)
    async with engine(db_url, runner) as e:
        h = await open_harness(e, runner, workspace)
        started = await h.start(request_id, lease_id="lease-1")
        cid = started.conversation_id

        async def waiting() -> bool:
            found = await e.get_child(cid)
            return found is not None and found.state == "waiting"

        await until(waiting)
        record = await e.get_child(cid)
        assert record is not None and (record.version, record.attempt_version) == (version,) * 2
    return cid


async def answered_on(
    db_url: str, workspace: Path, cid: str, runner: Versioned, **config: Any
) -> Any:
    """Open a host of ``runner``'s version, answer the child, and wait until it settles:
    done, or pinned."""
    async with engine(db_url, runner, **config) as e:
        await e.answer_input(cid, "word", text="hello")

        async def settled() -> bool:
            found = await e.get_child(cid)
            return found is not None and (found.terminal or found.pinned_version is not None)

        await until(settled)
        return await e.get_child(cid)


async def until_done(e: Engine, cid: str) -> Any:
    async def done() -> bool:
        found = await e.get_child(cid)
        return found is not None and found.terminal

    await until(done)
    return await e.get_child(cid)
