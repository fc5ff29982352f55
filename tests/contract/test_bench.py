"""``python -m delegation.bench --quick --json`` runs every scenario and prints the shape
the benchmark issue pins. No timing is asserted: figures are for people to read."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tools import bench_base

ROOT = Path(__file__).resolve().parents[2]
RATIOS = (
    "start_seq", "start_concurrent", "events_100", "events_1", "steps_seq", "rewind_copy",
    "admit_queued",
)  # fmt: skip
NUMBERS = ("recover_10k_s", "expire_5k_s", "rss_growth_mb")


def quick_report(*args: str, timeout: float) -> dict[str, Any]:
    """The one JSON line of ``python -m delegation.bench --quick --json ARGS``."""
    proc = subprocess.run(
        [sys.executable, "-m", "delegation.bench", "--quick", "--json", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    report: dict[str, Any] = json.loads(lines[0])
    return report


def check_every_scenario(report: dict[str, Any]) -> None:
    """Every scenario has its figures, whatever the store (no timing is asserted)."""
    assert set(report) == {
        *RATIOS, "read_page", *NUMBERS, "follow_latency", "waiting_100k", "machine"
    }  # fmt: skip
    for name in RATIOS:
        figures = report[name]
        assert set(figures) == {"engine", "raw", "ratio"}, name
        assert figures["engine"] > 0
        assert figures["raw"] > 0
        assert abs(figures["ratio"] - figures["engine"] / figures["raw"]) < 0.01
    page = report["read_page"]
    assert set(page) == {"engine_ms", "raw_ms", "ratio"}
    assert page["engine_ms"] > 0
    assert page["raw_ms"] > 0
    for name in NUMBERS:
        assert isinstance(report[name], int | float), name
    assert report["recover_10k_s"] > 0
    assert report["expire_5k_s"] > 0
    # From commit to a follow consumer, in the host's process and in another one.
    latency = report["follow_latency"]
    assert set(latency) == {"in_process", "other_process"}
    for figures in latency.values():
        assert set(figures) == {"median_ms", "p99_ms"}
        assert 0 <= figures["median_ms"] <= figures["p99_ms"]
    # Waiting children (design §21): what they cost the host, and an answer's resume.
    waiting = report["waiting_100k"]
    assert waiting["children"] == 1_000  # --quick
    # None of the 900 children added holds a task (a few of the engine's own may come
    # and go between the two counts).
    assert waiting["tasks_held"] < 10
    assert {"rss_growth_mb", "bytes_per_child", "suspended_per_s"} <= set(waiting)
    for name in ("resume_ms", "start_ms"):
        assert 0 < waiting[name]["median"] <= waiting[name]["p99"], name


@pytest.mark.sqlite_only  # the bench on SQLite, beside its raw sqlite3 baseline
def test_quick_bench_prints_one_json_line_with_every_scenario() -> None:
    report = quick_report(timeout=300)
    check_every_scenario(report)
    assert {"cores", "python", "sqlite"} <= set(report["machine"])


def test_quick_bench_on_postgres_has_every_scenario(postgres_server: str) -> None:
    """``--url``: every scenario on the server, beside raw psycopg on the same server,
    each on a database of its own that is dropped afterwards. No timing is asserted."""
    report = quick_report("--url", postgres_server, timeout=600)
    check_every_scenario(report)
    machine = report["machine"]
    assert machine["store"] == "postgresql"
    assert machine["postgresql"][:2].isdigit()  # the server's version
    assert {"fsync", "synchronous_commit"} <= set(machine["settings"])
    # Nothing is left on the server: every scenario's database was dropped.
    import psycopg

    with psycopg.connect(postgres_server.replace("+psycopg", "")) as conn:
        left = conn.execute(
            "SELECT datname FROM pg_database WHERE datname LIKE 'delegation\\_bench\\_%'"
        ).fetchall()
    assert left == []


def test_bench_refuses_a_url_of_another_store() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "delegation.bench", "--quick", "--url", "sqlite:///x.db"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert "PostgreSQL" in proc.stderr


@pytest.mark.sqlite_only  # the bench on SQLite, beside its raw sqlite3 baseline
def test_bench_table_for_people() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "delegation.bench", "--quick", "--only", "events_1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "events_1" in proc.stdout
    assert "raw sqlite3" in proc.stdout
    assert "machine:" in proc.stdout


@pytest.mark.sqlite_only  # a tool of SQLite's start
def test_the_start_floor_times_the_engine_and_the_bare_start_on_the_same_schema() -> None:
    """The bare start writes the engine's own statements on a file the engine made: a
    schema they no longer fit fails it here. No timing is asserted."""
    proc = subprocess.run(
        [sys.executable, "-m", "tools.start_floor", "--starts", "20", "--runs",
         "1", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    names = {f"{who}_{what}_us" for who in ("engine", "floor") for what in ("wall", "cpu")}
    assert set(report) == {*names, "engine_to_floor"}
    assert all(report[name] > 0 for name in names)


async def test_a_held_child_costs_the_collector_few_objects(tmp_path: Path) -> None:
    """Every object a running child keeps alive is walked by each full collection, and
    their growth is what triggers collections at all: a host holding thousands of
    children pays for each one, on every start. Not a timing: a count of objects."""
    runner = bench_base.Runner()
    runner.hold = True
    engine = await bench_base.Bench(tmp_path).engine(tmp_path / "footprint.db", runner)
    try:
        starter = await bench_base.starter_of(engine)
        for i in range(100):  # the first tool, caches, statements
            await starter.start(f"warm-{i}")
        gc.collect()
        before = len(gc.get_objects())
        held = 300
        for i in range(held):
            await starter.start(f"q{i}")
        gc.collect()
        per_child = (len(gc.get_objects()) - before) / held
    finally:
        await engine.close()
    # 28 today: the task and its coroutines, the context, the engine's _Local (which
    # is also the context's hooks), the plan and record. Closures per child were 49.
    assert per_child <= 35, per_child


def test_bench_table_on_postgres_names_the_server(postgres_server: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "delegation.bench", "--quick", "--only", "events_1",
         "--url", postgres_server],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    header = proc.stdout.splitlines()[0]
    assert header.startswith("store: PostgreSQL "), header
    assert "synchronous_commit=" in header
    assert "raw psycopg" in proc.stdout
    assert "events_1" in proc.stdout


def test_quick_bench_of_several_hosts_on_postgres(postgres_server: str) -> None:
    """``--hosts``: starts/s and events/s with 1, 2 and 3 host processes on one database,
    and the takeover of a killed host. Every figure is reported and positive; no rate is
    asserted, only that the takeover came within the contract's bound; a lease expiry
    across three hosts cancelled every child (the bench raises otherwise)."""
    report = quick_report("--url", postgres_server, "--hosts", timeout=110)
    assert set(report) == {
        "hosts_1", "hosts_2", "hosts_3", "takeover", "admit_queued", "expire_3_hosts", "machine"
    }  # fmt: skip
    expired = report["expire_3_hosts"]
    assert expired["children"] == 300
    assert 0 < expired["s"]["min"] <= expired["s"]["median"] <= expired["s"]["max"]
    # One queue admitted by 1 and by 3 hosts (design §22).
    assert set(report["admit_queued"]) == {"hosts_1", "hosts_3"}
    assert all(rate > 0 for rate in report["admit_queued"].values())
    for n in (1, 2, 3):
        row = report[f"hosts_{n}"]
        assert row["starts_per_s"] > 0
        assert row["events_per_s"] > 0
        for per_host in (row["starts_by_host"], row["events_by_host"]):
            assert len(per_host) == n  # every host reported its count
            assert all(rate > 0 for rate in per_host), per_host
    takeover = report["takeover"]
    assert takeover["runs"] == 1
    assert takeover["live_hosts"] >= 1
    assert takeover["children"] >= 1
    noticed, taken, streaming = (takeover[k] for k in ("noticed_s", "taken_s", "streaming_s"))
    for spread in (taken, streaming):
        assert 0 < spread["min"] <= spread["median"] <= spread["max"]
    # A heartbeat begun just before the kill may take it over: noticed at 0 s.
    assert 0 <= noticed["median"] <= taken["median"] <= streaming["median"]
    assert taken["max"] <= 10 + 2  # host_timeout_s + 2 s (design §12), at the default heartbeat
    assert report["machine"]["store"] == "postgresql"
    import psycopg

    with psycopg.connect(postgres_server.replace("+psycopg", "")) as conn:
        left = conn.execute(
            "SELECT datname FROM pg_database WHERE datname LIKE 'delegation\\_bench\\_%'"
        ).fetchall()
    assert left == []
