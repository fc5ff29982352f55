"""The scripted demo runner journals its steps (design §15): a child resumed after its
host closed repeats none of the steps it had finished, and ends with all of them."""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from pathlib import Path

from delegation import Engine, EngineConfig
from delegation.clock import ManualClock
from delegation.runners.scripted import ScriptedRunner
from tests.harness import rows as db
from tests.harness.restarts import LEASE
from tests.harness.support import open_harness


async def test_a_resumed_scripted_child_continues_from_its_last_finished_step(
    db_url: str, workspace: Path, clock: ManualClock
) -> None:
    config = EngineConfig(release_drain_s=1.0)
    first = ScriptedRunner(steps=8, delay=0.05)
    async with Engine(db_url, runner=first, config=config, clock=clock) as engine:
        h = await open_harness(engine, first, workspace)
        started = await h.start(message="review the diff", lease_id=LEASE)
        conversation = started.conversation_id
        deadline = asyncio.get_running_loop().time() + 30
        while not any("step 3/8" in e.text for e in await engine.events(conversation)):
            assert asyncio.get_running_loop().time() < deadline, "step 3 never committed"
            await asyncio.sleep(0.02)
    # Closed mid-run: the child resumes at the next boot.
    again = ScriptedRunner(steps=8, delay=0.01)
    async with Engine(db_url, runner=again, config=config, clock=clock) as engine:
        conn = await engine.connect(h.conn.runner_id, h.conn.host_instance_id)
        assert conn.generation > h.conn.generation
        deadline = asyncio.get_running_loop().time() + 30
        while True:
            record = await engine.get_child(conversation)
            assert record is not None
            if record.terminal:
                break
            assert asyncio.get_running_loop().time() < deadline, "the child never finished"
            await asyncio.sleep(0.02)
        assert (record.state, record.error) == ("done", "")
        assert record.output == "finished 8 steps on review the diff"
        texts = [e.text for e in await engine.events(conversation)]
    thought = Counter(m.group(1) for t in texts if (m := re.match(r"step (\d)/8", t)))
    assert thought == Counter({str(n): 1 for n in range(1, 9)})  # each step once
    (picked,) = [t for t in texts if t.startswith("picking up after step")]
    finished_before = int(picked.split()[4])
    assert 3 <= finished_before < 8
    # What it says it picked up after is where its thinking went on.
    went_on = f"step {finished_before + 1}/8: thinking about review the diff"
    assert texts.index(picked) < texts.index(went_on)
    sql = "SELECT name FROM steps WHERE child_id = :c ORDER BY ordinal"
    assert [r[0] for r in db.rows(db_url, sql, {"c": record.id})] == [
        f"step {n}" for n in range(1, 9)
    ]


def test_the_steps_a_message_asks_for() -> None:
    """Issue 29: "task 0 in 30 steps" ran 0 steps (the first number was taken)."""
    from delegation.runners.scripted import steps_asked

    assert steps_asked("task 0 in 30 steps", 6) == 30
    assert steps_asked("review the diff in 8 steps", 6) == 8
    assert steps_asked("count to 12", 6) == 12
    assert steps_asked("compare 3 files with 4 others", 6) == 6
    assert steps_asked("no number here", 6) == 6
    assert steps_asked("do it in 0 steps", 6) == 1
    assert steps_asked("in 99999999 steps", 6) == 1000
