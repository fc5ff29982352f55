"""What only the PostgreSQL store has: a server that can drop a connection, NOTIFY."""

from __future__ import annotations

import asyncio
from pathlib import Path

from sqlalchemy import create_engine, text

from delegation import Engine, EngineConfig, errors
from tests.support import ScriptRunner, open_harness


def _terminate(url: str, application: str) -> int:
    """End the server's backends of ``application`` on this database, as a server
    restart or an administrator would."""
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            sql = (
                "SELECT COUNT(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE datname = current_database() AND application_name = :name"
            )
            return int(conn.execute(text(sql), {"name": application}).scalar_one())
    finally:
        admin.dispose()


async def test_a_dropped_connection_fails_one_call_at_most_then_the_store_connects_again(
    postgres_db: str, workspace: Path
) -> None:
    runner = ScriptRunner()
    async with Engine(postgres_db, runner=runner, config=EngineConfig()) as engine:
        h = await open_harness(engine, runner, workspace)
        first = await h.start("q1")
        await h.wait_done(first.conversation_id)
        assert _terminate(postgres_db, "delegation-writer") == 1
        assert _terminate(postgres_db, "delegation-reader") == 1
        failures = 0
        for attempt in range(3):
            try:
                child = await h.start(f"q-after-{attempt}")
                done = await h.wait_done(child.conversation_id)
                assert done.state == "done"
                break
            except errors.StoreError:
                failures += 1
                await asyncio.sleep(0.05)
        assert failures <= 2, "the store connected again"
        again = await engine.get_child(first.conversation_id)
        assert again is not None and again.state == "done"
