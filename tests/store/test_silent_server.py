"""A server that goes silent (design §19, §25): a network cut drops its packets, so no
reset and no error ever comes. The host must not wait on it for the kernel's quarter of
an hour: libpq's TCP timeouts (``connect.TCP_DEFAULTS``) end the connection, the call is
refused ``store_unavailable`` within seconds, and once the network is whole the host
writes again by itself. The server is reached through a proxy on a loopback address of
its own (tests/harness/pgproxy.py), which a firewall rule silences (tests/harness/netcut.py).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from delegation import Engine, EngineConfig, errors
from delegation.store.postgres.connect import TCP_DEFAULTS, tcp_args
from tests.harness import netcut
from tests.harness.pgproxy import proxied
from tests.harness.support import ScriptRunner, open_harness, wait_terminal


def test_a_urls_own_tcp_settings_are_kept() -> None:
    url = "postgresql+psycopg://u@h/db?keepalives_idle=60&tcp_user_timeout=0"
    args = tcp_args(url, "delegation-writer")
    assert args["application_name"] == "delegation-writer"
    assert "keepalives_idle" not in args and "tcp_user_timeout" not in args
    assert args["connect_timeout"] == TCP_DEFAULTS["connect_timeout"]
    assert tcp_args("postgresql+psycopg://u@h/db", "x") == {"application_name": "x", **TCP_DEFAULTS}


@pytest.mark.timeout(180)
async def test_a_silent_server_is_given_up_in_seconds_and_written_again_after(
    postgres_db: str, workspace: Path
) -> None:
    netcut.require_nft()
    at = netcut.address(200)
    runner = ScriptRunner()
    # A host that gives up on its server before its own cut-off: host_timeout_s is above
    # the TCP timeouts (as README says of an HA manager's failover time).
    config = EngineConfig(host_timeout_s=60.0, host_heartbeat_s=1.0)
    with proxied(postgres_db, at) as (url, _proxy):
        async with Engine(url, runner=runner, config=config) as engine:
            h = await open_harness(engine, runner, workspace)
            first = await h.start("q1")
            await wait_terminal(engine, first.conversation_id, timeout=20)
            with netcut.silenced(at):
                began = time.monotonic()
                with pytest.raises(errors.StoreUnavailable):
                    await asyncio.wait_for(h.start("q2"), 60)
                given_up_s = time.monotonic() - began
            print(f"a silent server was given up after {given_up_s:.1f} s")
            assert given_up_s < 45  # TCP's own would be about 15 minutes
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 60
            while True:  # the host writes again by itself
                try:
                    again = await h.start("q3")
                    break
                except errors.StoreUnavailable:
                    assert loop.time() < deadline, "the host did not write again"
                    await asyncio.sleep(0.5)
            record = await wait_terminal(engine, again.conversation_id, timeout=30)
    assert record.state == "done"
