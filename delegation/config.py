"""EngineConfig: every limit and timing of the engine, with the defaults of design §6."""

from __future__ import annotations

from dataclasses import dataclass, field

from delegation.options import PROVIDERS


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

    def __post_init__(self) -> None:
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
        if self.host_timeout_s <= 2 * self.host_heartbeat_s:
            raise ValueError("host_timeout_s must be more than two heartbeats (host_heartbeat_s)")
