"""EngineConfig: every limit and timing of the engine, with the defaults of design §6."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypedDict

import msgspec

from delegation import errors
from delegation.options import PROVIDERS

# The kinds of admission scope (design §22) and how many IDs each names, "/"-separated.
SCOPE_KINDS: Mapping[str, int] = {"runner": 1, "extension": 2, "preset": 3, "parent": 1}


def parse_scope(scope: str) -> tuple[str, tuple[str, ...]]:
    """``runner:R``, ``extension:R/E``, ``preset:R/E/P`` or ``parent:C``: its kind and
    its IDs (which hold no ``/``).

    Raises:
        ValueError: not one of those spellings.
    """
    kind, sep, rest = scope.partition(":") if isinstance(scope, str) else ("", "", "")
    parts = tuple(rest.split("/"))
    if (
        not sep
        or kind not in SCOPE_KINDS
        or len(parts) != SCOPE_KINDS[kind]
        or any(not p or p != p.strip() or "\x00" in p for p in parts)
    ):
        raise ValueError(
            f"admission scope {scope!r} is not runner:R, extension:R/E, preset:R/E/P or parent:C"
        )
    return kind, parts


class _PolicyTypes(TypedDict):
    """The types of an AdmissionPolicy's fields, as msgspec checks them."""

    concurrency: int | None
    rate: tuple[int, float] | None
    max_queued: int
    queue_timeout_s: float | None
    max_priority: int | None


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    """How many children of a scope run at once and how fast they start (design §22).

    ``concurrency``: children admitted or running at once (None: no limit). ``rate``:
    ``(n, seconds)``, at most n admissions per that many seconds (None: no limit).
    ``max_queued``: children waiting their turn at most; a start past it is refused
    (``queue_full``). ``queue_timeout_s``: a child waiting longer ends cancelled
    ("cancelled: admission wait timed out"; None: it waits as long as it takes).
    ``max_priority``: the highest priority (0-9) a child of the scope may ask; a start
    asking more is refused (``priority_above_cap``; None: 9, no cap).

    A value of the wrong type (``concurrency="3"``, ``rate="5/s"``) raises
    :class:`errors.MalformedInput` naming the field, as the wire words it; a value out of
    range raises ``ValueError``.
    """

    concurrency: int | None = None
    rate: tuple[int, float] | None = None
    max_queued: int = 1024
    queue_timeout_s: float | None = None
    max_priority: int | None = None

    def __post_init__(self) -> None:
        values = {name: getattr(self, name) for name in _PolicyTypes.__annotations__}
        try:
            msgspec.convert(values, _PolicyTypes)
        except msgspec.ValidationError as exc:
            raise errors.MalformedInput(f"malformed admission policy: {exc}") from None
        c = self.concurrency
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or not 1 <= c < 2**31):
            raise ValueError("admission concurrency must be a positive whole number, or None")
        if self.rate is not None:
            try:
                n, per = self.rate
            except (TypeError, ValueError):
                raise ValueError("admission rate must be (n, seconds), or None") from None
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n < 2**31:
                raise ValueError("admission rate must admit a positive whole number n")
            if not _seconds(per):
                raise ValueError("admission rate's seconds must be a positive number")
            object.__setattr__(self, "rate", (n, float(per)))
        m = self.max_queued
        if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m < 2**31:
            raise ValueError("admission max_queued must be a whole number, zero or more")
        if self.queue_timeout_s is not None and not _seconds(self.queue_timeout_s):
            raise ValueError("admission queue_timeout_s must be a positive number, or None")
        p = self.max_priority
        if p is not None and not 0 <= p <= 9:
            raise ValueError("admission max_priority must be a whole number from 0 to 9, or None")


def _seconds(value: object) -> bool:
    return (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and 0 < value < 10**9
    )


VERSION_POLICIES = ("resume", "refuse", "pin")
MAX_VERSION_BYTES = 128


def check_version(version: object) -> str:
    """``version`` if it may name a runner version: nonempty text of at most 128 bytes,
    printable, with no white space at either end.

    Raises:
        ValueError: it may not.
    """
    if (
        not isinstance(version, str)
        or not version
        or version != version.strip()
        or not version.isprintable()
        or len(version.encode("utf-8", "surrogatepass")) > MAX_VERSION_BYTES
    ):
        raise ValueError(
            f"a runner version must be printable text of 1 to {MAX_VERSION_BYTES} bytes"
            f" without surrounding spaces, not {version!r}"
        )
    return version


@dataclass(frozen=True, slots=True)
class EngineConfig:
    lease_lifetime_s: float = 3600.0
    release_drain_s: float = 5.0
    max_recovery_attempts: int = 3
    retention_s: float = 604800.0
    retention_sweep_s: float = 3600.0  # how often the retention purge runs
    events_per_read: int = 128
    # A page (child.read, start, cancel, follow) stops before the event that would take
    # its encoded answer past this many bytes; it always holds at least one event.
    max_page_bytes: int = 4 * 1024 * 1024
    # Caps (design §3.8).
    max_children_per_grant: int = 64
    max_leases_per_runner: int = 1024  # live leases; tombstones do not count
    # Per (runner, extension): the newest are kept, the oldest dropped (design §18).
    max_tombstones_per_extension: int = 1024
    max_steers_per_child: int = 128
    max_presets_per_extension: int = 32
    max_depth: int = 8
    max_event_field_bytes: int = 32 * 1024
    max_steer_chars: int = 10_000
    # The step journal (design §15): one step's encoded result, and steps per execution.
    max_step_bytes: int = 1024 * 1024
    max_steps: int = 10_000
    providers: tuple[str, ...] = field(default=PROVIDERS)
    # SQLite: durability first. NORMAL may lose the last commits on power loss.
    synchronous: str = "FULL"
    busy_timeout_ms: int = 5000
    # Several hosts on one PostgreSQL database (design §12): a host heartbeats this often,
    # and one without a heartbeat for host_timeout_s (the database's clock) is dead.
    host_heartbeat_s: float = 2.0
    host_timeout_s: float = 10.0
    # A child running longer than this since its run was prepared is cancelled with "child
    # deadline exceeded" (None: no limit; a resumed child counts from its first admission).
    max_run_s: float | None = None
    # A child that waits (design §21): how long its run waits in memory before the engine
    # suspends it (``waiting``, holding no task), and the bounds of what waits: open input
    # requests of one execution, events kept for one conversation (payloads are at most
    # ``max_step_bytes``).
    hold_s: float = 30.0
    max_open_inputs: int = 16
    max_buffered_events: int = 1024
    # Admission (design §22): policies by scope (``runner:R``, ``extension:R/E``,
    # ``preset:R/E/P``, ``parent:C``), written to the database at open; and how long a
    # start waits for its child's turn before it answers ``queued: true``.
    admission: Mapping[str, AdmissionPolicy] = field(default_factory=dict)
    start_wait_s: float = 5.0
    # Versions (design §34): the runner version this host runs (None: the runner's own
    # ``version``, else ``$DELEGATION_RUNNER_VERSION``, else unversioned), the older
    # versions it can continue (the runner's ``resumes`` when empty), and what a resume
    # does with a child another version ran: ``resume``, ``refuse`` or ``pin``.
    runner_version: str | None = None
    runner_resumes: tuple[str, ...] = ()
    on_version_change: str = "resume"

    def __post_init__(self) -> None:
        for scope, policy in self.admission.items():
            parse_scope(scope)
            if not isinstance(policy, AdmissionPolicy):
                raise ValueError(f"admission policy of {scope!r} must be an AdmissionPolicy")
        if not 0 <= self.start_wait_s < 10**9:
            raise ValueError("start_wait_s must be zero or more seconds")
        if self.synchronous.upper() not in {"OFF", "NORMAL", "FULL", "EXTRA"}:
            raise ValueError(f"unknown SQLite synchronous mode {self.synchronous!r}")
        numbers = (
            self.lease_lifetime_s,
            self.release_drain_s,
            self.retention_s,
            self.retention_sweep_s,
            self.events_per_read,
            self.max_page_bytes,
            self.max_children_per_grant,
            self.max_leases_per_runner,
            self.max_tombstones_per_extension,
            self.max_steers_per_child,
            self.max_presets_per_extension,
            self.max_depth,
            self.max_event_field_bytes,
            self.max_step_bytes,
            self.max_steps,
            self.host_heartbeat_s,
            self.host_timeout_s,
            self.max_open_inputs,
            self.max_buffered_events,
        )
        if self.max_run_s is not None and not 0 < self.max_run_s < 10**9:
            raise ValueError("max_run_s must be positive (seconds), or None for no limit")
        if not 0 <= self.hold_s < 10**9:
            raise ValueError("hold_s must be zero or more seconds (0: suspend at once)")
        if any(n <= 0 for n in numbers) or self.max_recovery_attempts < 0:
            raise ValueError("engine limits and timings must be positive")
        if self.on_version_change not in VERSION_POLICIES:
            raise ValueError(
                f"on_version_change must be one of {', '.join(VERSION_POLICIES)},"
                f" not {self.on_version_change!r}"
            )
        for version in (self.runner_version, *self.runner_resumes):
            if version is not None:
                check_version(version)
        if self.host_timeout_s <= 2 * self.host_heartbeat_s:
            raise ValueError("host_timeout_s must be more than two heartbeats (host_heartbeat_s)")
