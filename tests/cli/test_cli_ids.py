"""Unique id prefixes (design §13): wherever the command line takes an id, a prefix that
only one id begins with stands for it, on both stores; an id itself always wins over
the ids it begins; a prefix more than one id begins with is an error naming them."""

from __future__ import annotations

import itertools
import json
import sqlite3
import types
from pathlib import Path

import pytest

from delegation.store import prefixes, stores
from delegation.usecases import reservation
from delegation.usecases.inspector import AmbiguousId, Inspector
from tests.harness.support import Harness, finish_after_admit
from tests.harness.terminal import Cli, in_process

# The hex of the ids the engine makes, in the order it makes them (conversation, run).
HEX = [
    "ab12cd" + "0" * 26,
    "0123" + "0" * 28,
    "ab12ce" + "0" * 26,
    "0124" + "0" * 28,
    "ff" + "1" * 30,
    "0125" + "0" * 28,
]
A, B, C = (f"c-{HEX[i]}" for i in (0, 2, 4))
RUN_A = f"r-{HEX[1]}"


@pytest.fixture
def made_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's new conversation and run ids come from ``HEX``, in order, then
    from a count."""
    made = itertools.chain(HEX, (f"{n:032x}" for n in itertools.count(1)))
    monkeypatch.setattr(
        reservation, "secrets", types.SimpleNamespace(token_hex=lambda n: next(made))
    )


@pytest.fixture
async def three(made_ids: None, harness: Harness) -> None:
    """Three done children: A and B begin alike (c-ab12c), C does not; A and B are under
    leases ``lease-1`` and ``lease-10``."""
    harness.runner.script = finish_after_admit
    for n, lease in enumerate(("lease-1", "lease-10", ""), start=1):
        child = await harness.start(f"q{n}", lease_id=lease)
        await harness.wait_done(child.conversation_id)


def shown_id(out: str) -> str:
    return str(json.loads(out)["conversationId"])


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], db_url: str) -> Cli:
    return in_process(capsys, db_url)


@pytest.mark.parametrize("given", ["c-ab12cd", "c-ab12cd0", A, "c-ab12cd…", A + "…"])
async def test_a_unique_prefix_stands_for_its_child(three: None, cli: Cli, given: str) -> None:
    code, out, err = cli("show", given, "--json")
    assert (code, err) == (0, "")
    assert shown_id(out) == A


async def test_every_command_that_takes_a_child_takes_a_prefix(three: None, cli: Cli) -> None:
    code, out, _ = cli("events", "c-ab12ce", "--json")
    assert code == 0 and json.loads(out.splitlines()[0])["kind"] == "result"
    code, out, _ = cli("steps", "c-ab12ce", "--json")
    assert code == 0 and json.loads(out)["conversationId"] == B
    code, out, _ = cli("show", "c-ff11", "--run", "r-0125", "--json")
    assert code == 0 and shown_id(out) == C
    code, out, _ = cli("show", "c-ab12cd", "--run", RUN_A[:8], "--json")
    assert code == 0 and json.loads(out)["runId"] == RUN_A
    for command in ("cancel", "steer"):  # each finds the child, which has ended
        argv = [command, "c-ab12cd"] + (["go"] if command == "steer" else [])
        code, out, err = cli(*argv)
        assert (code, out) == (1, "")
        assert err == f"delegation: child {A} has already ended (done)\n"


async def test_a_prefix_of_more_than_one_id_is_an_error_naming_them(three: None, cli: Cli) -> None:
    for command in (("show",), ("events",), ("steps",), ("cancel",), ("steer",)):
        argv = [*command, "c-ab12c"] + (["go"] if command == ("steer",) else [])
        code, out, err = cli(*argv)
        assert (code, out) == (1, ""), command
        assert err == (
            f"delegation: c-ab12c begins more than one conversation id: {A}, {B}; give more of it\n"
        )
    code, out, err = cli("cancel", "c-ab12", "--json")
    assert code == 1 and json.loads(out)["reason"] == "ambiguous_id"


async def test_an_unknown_or_too_short_prefix_finds_no_child(three: None, cli: Cli) -> None:
    assert cli("show", "c-ab99") == (1, "", "delegation: no child c-ab99\n")
    assert cli("show", "C-AB12CD")[2] == "delegation: no child C-AB12CD\n", "case counts"
    code, _, err = cli("show", "c-a")  # one child, but a prefix needs four characters
    assert code == 1
    assert err == "delegation: no child c-a (an id prefix needs at least 4 characters)\n"
    code, _, err = cli("show", "c-ab12cd", "--run", "r-9")
    assert err.endswith(f"no child {A} run r-9 (an id prefix needs at least 4 characters)\n")


async def test_filters_take_a_prefix_and_an_id_wins_over_the_ids_it_begins(
    three: None, cli: Cli
) -> None:
    def listed(*filters: str) -> list[str]:
        code, out, err = cli("children", "--json", *filters)
        assert (code, err) == (0, "")
        return [child["conversationId"] for child in json.loads(out)]

    assert listed("--lease", "lease-1") == [A], "lease-1 is an id: not the prefix of lease-10"
    assert listed("--lease", "lease-10") == [B]
    assert listed("--lease", "lease-9") == [], "an unknown filter matches nothing, as before"
    code, _, err = cli("children", "--lease", "lease-")
    assert code == 1 and "lease- begins more than one lease id: lease-1, lease-10;" in err
    assert listed("--parent", "parent-r") == [C, B, A]
    code, out, _ = cli("leases", "--json", "--runner", "runn")
    assert code == 0 and {lease["runnerId"] for lease in json.loads(out)} == {"runner-1"}


@pytest.mark.parametrize("collation", ["code points", "another"])
async def test_prefixes_are_exact_however_the_store_orders_text(
    made_ids: None, harness: Harness, db_url: str, collation: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``%``, ``_`` and ``!`` in a prefix are characters, not patterns, on the index
    range and (PostgreSQL with another collation) through ``LIKE``."""
    if collation == "another":
        if db_url.startswith("sqlite"):
            pytest.skip("SQLite always compares text by code point")
        monkeypatch.setattr(prefixes, "_code_point_order", lambda conn: False)
    elif not db_url.startswith("sqlite"):  # the test server's database is C.UTF-8
        assert stores.read_once(db_url, prefixes._code_point_order)
    harness.runner.script = finish_after_admit
    leases = ("a%b_c!d", "a%b_c!e", "aXbYcZd", "a%b_c\U0010ffff")
    for n, lease in enumerate(leases):
        await harness.wait_done((await harness.start(f"q{n}", lease_id=lease)).conversation_id)
    with Inspector(db_url) as inspector:
        assert inspector.resolve("lease", "a%b_c!d") == "a%b_c!d"
        assert inspector.resolve("lease", "aXbY") == "aXbYcZd"
        assert inspector.resolve("lease", "a%b_c\U0010ffff") == "a%b_c\U0010ffff"
        with pytest.raises(AmbiguousId) as ambiguous:
            inspector.resolve("lease", "a%b_c!")
        assert ambiguous.value.candidates == ["a%b_c!d", "a%b_c!e"]
        with pytest.raises(AmbiguousId) as ambiguous:
            inspector.resolve("lease", "a%b_")
        assert "aXbYcZd" not in ambiguous.value.candidates
        assert len(ambiguous.value.candidates) == 3


def test_the_next_prefix_in_code_point_order() -> None:
    assert prefixes.following("c-ab") == "c-ac"
    assert prefixes.following("c-a\U0010ffff") == "c-b"
    assert prefixes.following("a\ud7ff") == "a\ue000"
    assert prefixes.following("\U0010ffff") is None


@pytest.mark.sqlite_only  # SQLite's own query plans
def test_every_prefix_lookup_reads_an_index(db_path: Path) -> None:
    with sqlite3.connect(db_path) as conn:
        for kind in prefixes.COLUMNS:
            sql, params = prefixes.query(kind, "c-ab", by_range=True)  # type: ignore[arg-type]
            rows = conn.execute(f"EXPLAIN QUERY PLAN {sql}", (*params, 6))
            plan = " ".join(row[3] for row in rows)
            assert "USING" in plan and "INDEX" in plan, (kind, plan)
            if kind == "lease":  # no index begins with lease_id: the leased children's
                assert "COVERING INDEX ix_children_lease" in plan, plan
                continue
            assert "SEARCH" in plan and "TEMP B-TREE" not in plan, (kind, plan)
