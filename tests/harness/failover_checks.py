"""What other tests use of store/test_failover.py, kept here so that no test module imports
another: ACTIVE, BOUND_S, EVENTS, STREAMERS, busy, check_after, check_events,
finite_running, in_flight, settle, writes_again."""

from __future__ import annotations

import json
import time

from tests.harness import rows
from tests.harness.failover_host import Host

STREAMERS = 3  # leased children streaming on each host
EVENTS = 5  # events of each child started every 0.2 s, before it ends
BOUND_S = 20.0  # how long a host is given to write again (design §19: about a second)
ACTIVE = ("admitted", "running")  # an execution in flight: its run has begun


def busy(host: Host, since: float) -> bool:
    """Since ``since``: a start answered, and every streamer flushed an event."""
    streamers = list(host.started())[:STREAMERS]
    flushed = {w[2] for w in host.words("ACK", since)}
    return bool(host.words("STARTED", since)) and set(streamers) <= flushed


def writes_again(host: Host, since: float) -> float:
    """Wait until the host, by itself, is answered starts and flushes again; when it
    first wrote (printed, not asserted)."""
    host.wait(lambda: busy(host, since), BOUND_S, "start answered and every streamer flushed")
    first = host.first_write(since)
    assert first is not None
    print(f"host {host.name} wrote again {first - since:.3f} s after the failover")
    return first


def settle(url: str, host: Host) -> None:
    """No more new children; wait until each one started has ended (the streamers
    stream on) and the database has every ended run finished."""
    host.quiet()
    host.wait(lambda: not finite_running(host), 30, "every short child ended")
    ended = [*host.conversations("ENDED"), *host.conversations("STOPPED")]
    deadline = time.monotonic() + 30
    while (left := in_flight(url, ended)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"children whose run ended are still in flight: {left}"


def finite_running(host: Host) -> set[str]:
    streamers = set(list(host.started())[:STREAMERS])
    over = {*host.conversations("ENDED"), *host.conversations("STOPPED")}
    return set(host.conversations("RAN")) - over - streamers


def in_flight(url: str, conversations: list[str]) -> dict[str, str]:
    """Those of ``conversations`` the database has admitted or running: their states."""
    found = rows.rows(url, "SELECT conversation_id, state FROM children")
    states = {str(conversation): str(state) for conversation, state in found}
    return {c: states[c] for c in conversations if states.get(c) in ACTIVE}


def check_after(url: str, *hosts: Host) -> None:
    """design §19's promises, on the new primary, for every host of the database."""
    children = {
        str(conv): (str(st), str(owner), int(attempts))
        for conv, st, owner, attempts in rows.rows(
            url,
            "SELECT conversation_id, state, engine_instance_id, recovery_attempts FROM children",
        )
    }
    for host in hosts:
        for conversation, lease in host.started().items():
            assert conversation in children, f"acknowledged start of {lease} lost"
        check_events(url, host)
        ran = host.conversations("RAN")
        assert len(ran) == len(set(ran)), "a run began twice in one host"
        assert not host.words("RESUMED"), "a child was recovered: its host was taken over"
        refused = set(host.refusals()) - {"store_unavailable"}
        assert not refused, f"refused other than store_unavailable: {host.refusals()}"
    live = {c for host in hosts for c in host.conversations("RAN")} - {
        c for host in hosts for first in ("ENDED", "STOPPED") for c in host.conversations(first)
    }
    stuck = {c: v for c, v in children.items() if v[0] in ACTIVE and c not in live}
    assert not stuck, f"children in flight with no run: {stuck}"
    assert all(attempts == 0 for _, _, attempts in children.values()), "a child was recovered"
    ran = [c for host in hosts for c in host.conversations("RAN")]
    assert len(ran) == len(set(ran)), "a child ran on two hosts"


def check_events(url: str, host: Host) -> None:
    """Every event acknowledged is stored as acknowledged; sequences have no gaps."""
    stored: dict[str, dict[int, str]] = {}
    for conversation, sequence, body in rows.rows(
        url,
        "SELECT c.conversation_id, e.sequence, e.body FROM events e"
        " JOIN children c ON c.id = e.child_id",
    ):
        stored.setdefault(str(conversation), {})[int(sequence)] = json.loads(bytes(body)).get(
            "text", ""
        )
    for conversation, sequence, text in host.acked():
        assert stored.get(conversation, {}).get(sequence) == text, (
            f"acknowledged {conversation}#{sequence} {text} lost"
        )
    for conversation, events in stored.items():
        assert sorted(events) == list(range(1, len(events) + 1)), f"{conversation}: a gap"
