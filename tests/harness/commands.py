"""What other tests use of runners/test_command_runner.py, kept here so that no test module
imports another: GENERATION, hosted, preset, script, texts."""

from __future__ import annotations

import contextlib
import sys
import textwrap
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from delegation import Engine, EngineConfig, Preset
from delegation.runners.command import (
    CommandRunner,
)
from tests.harness.support import Harness, open_harness

GENERATION = 7


def script(source: str) -> list[str]:
    """argv running ``source``; its braces are doubled, so they are not placeholders."""
    literal = textwrap.dedent(source).replace("{", "{{").replace("}", "}}")
    return [sys.executable, "-c", literal]


def preset(name: str) -> Preset:
    return Preset(name=name, extension_id="ext", generation=GENERATION)


@contextlib.asynccontextmanager
async def hosted(
    db_url: str,
    workspace: Path,
    runner: CommandRunner,
    profiles: Sequence[str] = ("worker",),
) -> AsyncIterator[Harness]:
    """A real engine running ``runner``, one connected runner and one open tool call."""
    config = EngineConfig(release_drain_s=2.0)
    async with Engine(db_url, runner=runner, config=config) as engine:
        yield await open_harness(engine, runner, workspace, [preset(name) for name in profiles])


async def texts(h: Harness, conversation_id: str) -> list[str]:
    return [e.text for e in await h.engine.events(conversation_id, limit=1000)]
