"""A replay sees exactly what the first run saw (design §20): ``ctx.step`` returns the
recorded value decoded on the first run too, a bad step name is a ``ValueError``, and
a run's error carries no credential. Each failed on the code before.

Restarts are graceful (a second ``Engine`` on the same database, the child leased).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from typing import Any

import msgspec
import pytest

from delegation import ChildContext, EngineConfig, Event
from delegation.clock import ManualClock
from delegation.usecases.redaction import redact_secrets
from tests.harness.restarts import LEASE, restarted, until_event
from tests.harness.support import Harness, ScriptRunner


@dataclasses.dataclass
class Point:
    x: int
    y: int


class Pair(msgspec.Struct):
    a: int
    b: tuple[int, int]


# What a step returns, and what a run and its replay both see.
VALUES: list[tuple[str, Any, Any]] = [
    ("int keys", {1: "a", 2: "b"}, {"1": "a", "2": "b"}),
    ("a tuple", (1, 2, 3), [1, 2, 3]),
    ("a set", {7}, [7]),
    ("a dataclass", Point(1, 2), {"x": 1, "y": 2}),
    ("nan", math.nan, None),
    ("nested", {"t": (1, {2: 3})}, {"t": [1, {"2": 3}]}),
    ("bytes", b"\x00\xff", b"\x00\xff"),
]


async def _resumed(
    harness: Harness,
    db_url: str,
    config: EngineConfig,
    clock: ManualClock,
    steps: list[tuple[str, Any, Any]],
) -> tuple[list[Any], list[Any]]:
    """What a run's steps returned on the first run and on the replay after a restart."""
    seen: dict[bool, list[Any]] = {False: [], True: []}
    done = asyncio.Event()

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        replay = ctx.recovery is not None
        for name, value, as_type in steps:

            async def give(value: Any = value) -> Any:
                return value

            seen[replay].append(await ctx.step(name, give, type=as_type))
        ctx.emit(Event(kind="text", text="stepped"))
        if not replay:
            await asyncio.Event().wait()  # the host closes here
        done.set()
        ctx.emit(Event(kind="result", text="ok"))

    harness.runner.script = run
    started = await harness.start(lease_id=LEASE)
    await until_event(harness.engine, started.conversation_id, "stepped")
    await harness.engine.close()
    async with restarted(harness, db_url, ScriptRunner(script=run), config, clock):
        await asyncio.wait_for(done.wait(), 10)
    return seen[False], seen[True]


async def test_a_run_and_its_replay_see_equal_values(
    harness: Harness, db_url: str, config: EngineConfig, clock: ManualClock
) -> None:
    """The first run got the live value: ``{1: 'a'}`` there, ``{'1': 'a'}`` on a replay."""
    steps = [(name, value, None) for name, value, _ in VALUES]
    first, replay = await _resumed(harness, db_url, config, clock, steps)
    expected = [seen for _, _, seen in VALUES]
    assert first == expected
    assert replay == expected
    assert [type(v) for v in first] == [type(v) for v in replay]


async def test_a_type_gives_typed_values_both_times(
    harness: Harness, db_url: str, config: EngineConfig, clock: ManualClock
) -> None:
    steps: list[tuple[str, Any, Any]] = [
        ("pair", Pair(1, (2, 3)), Pair),
        ("keys", {1: "a"}, dict[int, str]),
        ("tuple", (1, 2), tuple[int, ...]),
        ("set", {5}, set[int]),
    ]
    first, replay = await _resumed(harness, db_url, config, clock, steps)
    assert first == replay == [Pair(1, (2, 3)), {1: "a"}, (1, 2), {5}]


async def test_a_value_that_does_not_encode_or_decode_records_nothing(harness: Harness) -> None:
    outcomes: list[str] = []

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        for name, value, as_type in (
            ("object", object(), None),
            ("not a pair", {"a": "x"}, Pair),
        ):
            try:
                await ctx.step(name, lambda value=value: value, type=as_type)
            except TypeError as exc:
                outcomes.append(f"{name}: {exc}")
        # Nothing was recorded under those names: they may be run again.
        outcomes.append(repr(await ctx.step("object", lambda: "now fine")))
        ctx.emit(Event(kind="result", text="ok"))

    harness.runner.script = run
    started = await harness.start()
    record = await harness.wait_done(started.conversation_id)
    assert record.error == ""
    assert outcomes[0].startswith("object: a step's result must be bytes or encodable")
    assert outcomes[1].startswith("not a pair: a step's result does not decode as")
    assert outcomes[2] == "'now fine'"


@pytest.mark.parametrize("name", ["\ud800", "a\udfffb", "x" * 1025])
async def test_a_step_name_that_is_not_text_is_a_value_error(harness: Harness, name: str) -> None:
    """A lone surrogate ended the child with internal_error."""
    caught: list[BaseException] = []

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        try:
            await ctx.step(name, lambda: 1)
        except ValueError as exc:
            caught.append(exc)
        ctx.emit(Event(kind="result", text="ok"))

    harness.runner.script = run
    started = await harness.start()
    record = await harness.wait_done(started.conversation_id)
    assert record.error == "" and record.state == "done"
    assert len(caught) == 1 and "step name" in str(caught[0])


async def test_a_run_error_reaches_the_peer_without_its_credentials(harness: Harness) -> None:
    """A provider's exception quoting its request URL reached the peer verbatim."""

    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        raise RuntimeError(
            "401 from https://api.example.com/v1/models/x:generate?key=AIzaSyA1b2C3d4E5f6G7h8I9"
            "j0KlMnOpQrStUv&alt=sse (Authorization: Bearer sk-proj-0123456789abcdefABCDEF)"
        )

    harness.runner.script = run
    started = await harness.start()
    record = await harness.wait_done(started.conversation_id)
    assert record.error == (
        "401 from https://api.example.com/v1/models/x:generate?[redacted]"
        " (Authorization: Bearer [redacted])"
    )
    read = await harness.read(started.conversation_id)
    assert read.error == record.error


@pytest.mark.parametrize(
    ("text", "redacted"),
    [
        ("GET https://h/p?api_key=abc&x=1 (403)", "GET https://h/p?[redacted] (403)"),
        ('{"api_key": "s3cr3t-value"}', '{"api_key": "[redacted]"}'),
        ("password=hunter2 refused", "password=[redacted] refused"),
        (
            "Incorrect API key provided: sk-ant-abcdefgh1234",
            "Incorrect API key provided: [redacted]",
        ),
        ("github ghp_abcdefghijklmnop1234 bad", "github [redacted] bad"),
        ("token AKIAABCDEFGHIJKLMNOP here", "token [redacted] here"),
        ("opaque Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z", "opaque [redacted]"),
        # Not credentials: kept as they are.
        ("child c-0123456789abcdef0123456789abcdef failed", None),
        ("model request 3 timed out after 30 s", None),
        ("see https://docs.example.com/errors#rate-limit", None),
    ],
)
def test_what_looks_like_a_credential_is_redacted(text: str, redacted: str | None) -> None:
    assert redact_secrets(text) == (text if redacted is None else redacted)
