"""``delegation rewind CHILD --run RUN [--step NAME]`` and ``Operator.rewind`` (design
§35): judged when given (refused at once, exit 1, nothing recorded), applied by the
host that owns the database within a second, idempotent by its request id; ``show``
prints the lineage both ways. On SQLite and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import pytest

from delegation import Engine, Operator, errors
from tests.harness import rows
from tests.harness.operators import operator
from tests.harness.rewinds import LEASE, Steps, counts
from tests.harness.support import ScriptRunner
from tests.harness.waits import hosted


async def test_an_operator_rewinds_a_live_hosts_child_and_show_prints_the_lineage(
    db_url: str, workspace: Path
) -> None:
    steps = Steps()
    async with hosted(db_url, workspace, steps.run) as h:
        started = await h.start(lease_id=LEASE)
        cid = started.conversation_id
        source = await h.wait_done(cid)
        code, out, err = await operator(
            "rewind", cid, "--run", source.run_id, "--step", "d", "--json", db=db_url
        )
        assert code == 0, err
        said = json.loads(out)
        assert (said["action"], said["runId"], said["applied"]) == ("rewind", source.run_id, True)
        rewound = said["rewoundAs"]
        done = await h.wait_done(cid, child_run_id=rewound)
        assert done.state == "done"
        assert steps.calls == Counter({"a": 1, "b": 1, "c": 1, "d": 2, "e": 2})
        code, out, err = await operator("show", cid, "--run", rewound, "--json", db=db_url)
        shown = json.loads(out)
        assert (shown["rewoundFrom"], shown["rewoundStep"]) == (source.run_id, "d")
        code, out, err = await operator("show", cid, "--run", source.run_id, "--json", db=db_url)
        shown = json.loads(out)
        assert shown["rewoundAs"] == [rewound] and "rewoundFrom" not in shown
        code, out, err = await operator("show", cid, "--run", source.run_id, db=db_url)
        assert code == 0 and "rewoundAs" in out and rewound in out
        # From the Python door (blocking: in a thread, beside this host's loop), after
        # every step: the same request id is the same one.
        with Operator(db_url) as op:
            first = await asyncio.to_thread(op.rewind, cid, rewound, request_id="again-1")
            again = await asyncio.to_thread(op.rewind, cid, rewound, request_id="again-1")
        assert first.fields["rewoundAs"] == again.fields["rewoundAs"] != rewound
        await h.wait_done(cid, child_run_id=first.fields["rewoundAs"])
    assert steps.calls == Counter({"a": 1, "b": 1, "c": 1, "d": 2, "e": 2})  # all replayed
    plain = await operator("show", cid, "--run", source.run_id, "--json", db=db_url)
    assert "rewoundFrom" not in json.loads(plain[1])


async def test_every_refusal_of_an_operator_rewind_records_nothing(
    db_url: str, workspace: Path
) -> None:
    steps = Steps()
    async with hosted(db_url, workspace, steps.run) as h:
        leased = await h.start("q1", lease_id=LEASE)
        source = await h.wait_done(leased.conversation_id)
        foreground = await h.start("q2")
        ended = await h.wait_done(foreground.conversation_id)
    cid = source.conversation_id
    before = counts(db_url)
    wrong = [
        ((cid, "--run", source.run_id, "--step", "nope"), "rewind_step_unknown"),
        ((ended.conversation_id, "--run", ended.run_id), "rewind_no_authority"),
        ((cid, "--run", "r-nobody"), "rewind_run_unknown"),
        (("c-nobody", "--run", source.run_id), "child_not_found"),
    ]
    for given, reason in wrong:
        code, out, err = await operator("rewind", *given, "--json", db=db_url)
        assert (code, json.loads(out)["reason"]) == (1, reason), (given, out, err)
    assert counts(db_url) == before
    assert rows.scalar(db_url, "SELECT count(*) FROM controls") == 0
    # With no host running a valid rewind is recorded, and the next host applies it.
    code, out, err = await operator(
        "rewind", cid, "--run", source.run_id, "--step", "c", "--wait", "0", db=db_url
    )
    assert code == 0 and "is recorded" in out, (out, err)
    with Operator(db_url) as op, pytest.raises(errors.RewindStepUnknown):
        op.rewind(cid, source.run_id, "zz")
    async with hosted(db_url, workspace, steps.run) as h:
        with Operator(db_url) as op:
            (control,) = [c for c in op.controls(cid) if c.action == "rewind"]
            applied = await asyncio.to_thread(op.wait, control.id, 10)
        done = await h.wait_done(cid, child_run_id=applied.fields["rewoundAs"])
        assert done.state == "done"
    # Two first runs (the leased child, the foreground one), and the rewind from c.
    assert steps.calls == Counter({"a": 2, "b": 2, "c": 3, "d": 3, "e": 3})


async def test_two_postgresql_hosts_apply_one_operator_rewind_once(
    postgres_db: str, workspace: Path
) -> None:
    """Every host of a PostgreSQL database applies an operator's rewind of an ended
    conversation (no live host owns it): both try, one execution is made."""
    steps = Steps()
    second = Engine(postgres_db, runner=ScriptRunner(script=steps.run))
    async with hosted(postgres_db, workspace, steps.run) as h, second:
        started = await h.start(lease_id=LEASE)
        source = await h.wait_done(started.conversation_id)
        cid = source.conversation_id
        with Operator(postgres_db) as op:
            outcome = await asyncio.to_thread(op.rewind, cid, source.run_id, "b", wait=10)
        await h.wait_done(cid, child_run_id=outcome.fields["rewoundAs"])
        executions = rows.scalar(
            postgres_db, "SELECT count(*) FROM children WHERE conversation_id = :c", {"c": cid}
        )
        assert executions == 2
        assert steps.calls == Counter({"a": 1, "b": 2, "c": 2, "d": 2, "e": 2})
