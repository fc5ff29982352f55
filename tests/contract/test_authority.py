"""The authority matrix (design §3, §5): every refused call has no effect.

Each case starts from the harness (one runner, one open tool call), optionally a
seed child (a foreground child of the tool, or a child under lease ``L1``), runs the
actions that set the scene, and then makes ONE call that differs from a call that
would succeed (see ``test_baseline_calls_succeed``) by the defect the case names.
For every refusal we check the exact error class, the exact message the design quotes, the
JSON-RPC code, that ``prepare`` was never called, and that no table row changed:
the database (on either store) is read before and after through a separate read-only
connection (tests/harness/rows.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from delegation import (
    CANCEL_METHOD,
    READ_METHOD,
    RELEASE_METHOD,
    START_METHOD,
    STEER_METHOD,
    ChildContext,
    DelegationError,
    Engine,
    Params,
    Preset,
    Request,
    Result,
    RunnerConnection,
    SteerResult,
    authority,
    encode,
    errors,
)
from delegation.clock import ManualClock
from delegation.errors import (
    BadContextMode,
    BadSteer,
    ChildNotOwned,
    CwdOutsideWorkspace,
    ForkRequiresTool,
    InvalidCwd,
    LeaseMismatch,
    LeaseNotActivated,
    LeaseOwnerMismatch,
    MalformedInput,
    NotOwned,
    PresetStale,
    ReleaseOwnerRequired,
    RequestIdReused,
    RequestIncomplete,
    ResumeMismatch,
    RunnerNotFound,
    StaleConnection,
    SteerNotOwned,
)
from tests.harness.authority_cases import snapshot
from tests.harness.support import PRESET, Harness

NOT_OWNED = "child requires active tool ownership or an unexpired retained lease"
STEER_NOT_OWNED = "child steering requires current owned authority"
STALE = "runner connection generation is stale"
NO_RUNNER = "runner not found"
PRESET_STALE = "execution preset absent or stale"
LEASE_MISMATCH = "child lease mismatch"
BAD_CWD = "invalid child working directory"
CWD_OUTSIDE = "child working directory exceeds parent workspace"
RELEASE_OWNER = "child lease release requires its exact owner"
OWNER_MISMATCH = "child lease owner mismatch"
CHILD_NOT_OWNED = "child run is not owned by this capability"
INCOMPLETE = "child requestId, profile and message are required"
CONTEXT_MODE = "child contextMode must be fresh or fork"
REUSED = "requestId was already used with different child input"
NOT_ACTIVATED = "child retained authority requires successful initial admission from an active tool"
FORK_TOOL = "child fork requires the current active parent tool"
BAD_STEER = "child steer requires requestId and a nonempty bounded message"
RESUME_MISMATCH = "the child task cannot resume with a different parent, host or execution preset"

LEASE = "L1"
TOMBSTONE = "L9"
HELPER = Preset(name="helper", extension_id=PRESET.extension_id, generation=8)
CHILD_METHODS = (READ_METHOD, CANCEL_METHOD, STEER_METHOD)


# --- the database, seen from outside ------------------------------------------------


# --- runs ---------------------------------------------------------------------------


async def hold_forever(ctx: ChildContext) -> None:
    """Admit, then do nothing until cancelled: no write after admission."""
    await ctx.admit()
    await asyncio.Event().wait()


async def fail_before_admission(ctx: ChildContext) -> None:
    raise RuntimeError("boom")


# --- the scene ----------------------------------------------------------------------


@dataclass
class World:
    h: Harness
    clock: ManualClock
    db_url: str
    conn: RunnerConnection
    seed: Result | None = None
    lease_id: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def engine(self) -> Engine:
        return self.h.engine

    async def plant(self, kind: str) -> None:
        """Start the seed child: none, a held foreground child, or a held leased child."""
        self.h.runner.script = hold_forever
        if kind == "none":
            return
        if kind == "lease":
            self.lease_id = LEASE
            self.seed = await self.h.start("q-seed", lease_id=LEASE)
        else:
            assert kind == "tool"
            self.seed = await self.h.start("q-seed")
        assert not self.seed.done

    async def quiesce(self) -> None:
        """Wait until the seed child is no longer stopping (its last write committed)."""
        if self.seed is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while True:
            record = await self.engine.get_child(self.seed.conversation_id, self.seed.run_id)
            assert record is not None
            if record.terminal or record.cancel_requested_at is None:
                return
            assert loop.time() < deadline, f"seed child did not stop: {record}"
            await asyncio.sleep(0.01)

    def params(
        self, method: str, *, request: Mapping[str, Any] | None = None, **changes: Any
    ) -> Params:
        """The params of a call that succeeds in this scene, with ``changes`` applied."""
        base: dict[str, Any] = {
            "run_id": self.h.tool.run_id,
            "tool_call_id": self.h.tool.tool_call_id,
            "extension_id": self.h.tool.extension_id,
            "generation": PRESET.generation,
            "lease_id": self.lease_id,
        }
        if method == START_METHOD:
            fields: dict[str, Any] = {
                "request_id": "q-new",
                "profile": PRESET.name,
                "message": "do the task",
                "lease_id": self.lease_id,
                **(request or {}),
            }
            base["request"] = Request(**fields)
        elif method in CHILD_METHODS:
            assert self.seed is not None
            base["child_id"] = self.seed.conversation_id
            if method == STEER_METHOD:
                base.update(request_id="s-1", message="turn left")
        else:
            assert method == RELEASE_METHOD
            base["lease_id"] = self.lease_id or LEASE
        base.update(changes)
        return Params(**base)


Action = Callable[[World], Awaitable[None]]


async def reconnect(w: World) -> None:
    """The same runner registers again: ``w.conn`` is now the superseded connection."""
    fresh = await w.engine.connect(w.conn.runner_id, w.conn.host_instance_id)
    assert fresh.generation == w.conn.generation + 1
    w.extra["fresh"] = fresh


async def disconnect(w: World) -> None:
    await w.engine.disconnect(w.conn)


async def ghost_runner(w: World) -> None:
    w.conn = RunnerConnection("conn-ghost", "ghost-runner", "host-a", 1)


async def other_runner(w: World) -> None:
    w.conn = await w.engine.connect("runner-2", "host-b")


async def close_tool(w: World) -> None:
    await w.engine.close_tool(w.h.tool)


async def release_lease(w: World) -> None:
    released = await w.engine.call(w.h.conn, RELEASE_METHOD, w.h.params(lease_id=LEASE))
    assert isinstance(released, Result) and released.done


async def expire_lease(w: World) -> None:
    """Move the clock one tick past the lease's deadline."""
    (lease,) = [x for x in await w.engine.leases("runner-1") if x.lease_id == LEASE]
    assert lease.expires_at is not None
    w.clock.set(math.nextafter(lease.expires_at, math.inf))


async def tombstone(w: World) -> None:
    """Release a lease that never existed: a tombstone that fences its leaseId."""
    released = await w.engine.call(w.h.conn, RELEASE_METHOD, w.h.params(lease_id=TOMBSTONE))
    assert isinstance(released, Result) and released.done
    w.lease_id = TOMBSTONE


async def two_preset_tool(w: World) -> None:
    """A second tool call whose extension has presets at generations 7 and 8."""
    await w.engine.open_tool(
        w.h.conn,
        run_id=w.h.tool.run_id,
        conversation_id=w.h.tool.conversation_id,
        tool_call_id="call-2",
        extension_id=PRESET.extension_id,
        presets=[PRESET, HELPER],
        workspace=w.h.workspace,
    )


async def sibling_seed(w: World) -> None:
    """The seed becomes a child of another tool call of the same run."""
    await w.engine.open_tool(
        w.h.conn,
        run_id=w.h.tool.run_id,
        conversation_id=w.h.tool.conversation_id,
        tool_call_id="call-2",
        extension_id=PRESET.extension_id,
        presets=[PRESET],
        workspace=w.h.workspace,
    )
    w.seed = await w.h.start("q-sibling", tool_call_id="call-2")


async def never_admitted_lease(w: World) -> None:
    """Lease L1 exists (created by a start whose child failed before admission); its
    tool call has ended."""
    w.h.runner.script = fail_before_admission
    with pytest.raises(DelegationError, match="child admission failed: boom"):
        await w.h.start("q-failed", lease_id=LEASE)
    w.h.runner.script = hold_forever
    await close_tool(w)
    w.lease_id = LEASE


async def escape_link(w: World) -> None:
    outside = Path(w.h.workspace).parent / "outside"
    outside.mkdir()
    (Path(w.h.workspace) / "escape").symlink_to(outside, target_is_directory=True)


@dataclass(frozen=True)
class Case:
    id: str
    method: str
    error: type[DelegationError]
    message: str
    seed: str = "none"
    actions: tuple[Action, ...] = ()
    changes: Mapping[str, Any] = field(default_factory=dict)
    request: Mapping[str, Any] = field(default_factory=dict)


async def refused(
    w: World, conn: RunnerConnection, method: str, params: Params | bytes | str, case: Case
) -> DelegationError:
    """Make the call; check the refusal is exact and that it had no effect."""
    before = snapshot(w.db_url)
    assert before["children"] or before["grants"], "the snapshot must see the store"
    prepared = list(w.h.runner.prepared)
    with pytest.raises(DelegationError) as info:
        await w.engine.call(conn, method, params)
    error = info.value
    assert type(error) is case.error, f"{type(error).__name__}: {error}"
    assert str(error) == case.message
    assert error.rpc_code == -32602
    await asyncio.sleep(0.02)  # nothing may trail the refusal either
    assert w.h.runner.prepared == prepared
    assert snapshot(w.db_url) == before
    return error


async def scene(case: Case, harness: Harness, clock: ManualClock, db_url: str) -> World:
    world = World(harness, clock, db_url, harness.conn)
    await world.plant(case.seed)
    for action in case.actions:
        await action(world)
    await world.quiesce()
    return world


# --- the matrix ---------------------------------------------------------------------

# (id, seed for start, seed for read/cancel/steer, actions, param changes, error kind)
# kind "owned" is NotOwned, or SteerNotOwned for child.steer (design §3.3).
AUTHORITY_VARIANTS: list[tuple[str, str, str, tuple[Action, ...], dict[str, Any], str]] = [
    ("wrong-run", "none", "tool", (), {"run_id": "other-run"}, "owned"),
    ("wrong-tool-call", "none", "tool", (), {"tool_call_id": "call-2"}, "owned"),
    ("no-tool-call-no-lease", "none", "tool", (), {"tool_call_id": ""}, "owned"),
    ("wrong-extension", "none", "tool", (), {"extension_id": "other-ext"}, "owned"),
    ("wrong-process-generation", "none", "tool", (), {"generation": 8}, "owned"),
    ("zero-generation", "none", "tool", (), {"generation": 0}, "owned"),
    ("closed-tool", "none", "tool", (close_tool,), {}, "owned"),
    ("another-runners-tool", "none", "tool", (other_runner,), {}, "owned"),
    ("lease-wrong-run", "lease", "lease", (), {"run_id": "other-run"}, "owned"),
    ("lease-wrong-extension", "lease", "lease", (), {"extension_id": "other-ext"}, "owned"),
    ("lease-wrong-generation", "lease", "lease", (), {"generation": 8}, "owned"),
    ("lease-zero-generation", "lease", "lease", (), {"generation": 0}, "owned"),
    ("another-runners-lease", "lease", "lease", (other_runner,), {}, "owned"),
    ("released-lease", "lease", "lease", (release_lease,), {}, "owned"),
    ("released-lease-tool-closed", "lease", "lease", (release_lease, close_tool), {}, "owned"),
    ("expired-lease", "lease", "lease", (expire_lease,), {}, "owned"),
    ("expired-lease-tool-closed", "lease", "lease", (close_tool, expire_lease), {}, "owned"),
    ("tombstoned-unknown-lease", "none", "tool", (tombstone,), {}, "owned"),
    ("stale-connection", "none", "tool", (reconnect,), {}, "stale"),
    ("stale-connection-under-lease", "lease", "lease", (reconnect,), {}, "stale"),
    ("unknown-runner", "none", "tool", (ghost_runner,), {}, "no-runner"),
    ("disconnected-runner", "none", "tool", (disconnect,), {}, "no-runner"),
    ("disconnected-runner-under-lease", "lease", "lease", (disconnect,), {}, "no-runner"),
]

KINDS: dict[str, tuple[type[DelegationError], str]] = {
    "stale": (StaleConnection, STALE),
    "no-runner": (RunnerNotFound, NO_RUNNER),
}


def _expected(kind: str, method: str) -> tuple[type[DelegationError], str]:
    if kind == "owned":
        return (SteerNotOwned, STEER_NOT_OWNED) if method == STEER_METHOD else (NotOwned, NOT_OWNED)
    return KINDS[kind]


def _authority_cases() -> list[Case]:
    cases = []
    for name, start_seed, child_seed, actions, changes, kind in AUTHORITY_VARIANTS:
        for method in (START_METHOD, *CHILD_METHODS):
            error, message = _expected(kind, method)
            seed = start_seed if method == START_METHOD else child_seed
            cases.append(Case(f"{method}:{name}", method, error, message, seed, actions, changes))
    return cases


START_CASES = [
    Case("unknown-preset", START_METHOD, PresetStale, PRESET_STALE, request={"profile": "ghost"}),
    Case(
        "preset-at-another-generation",
        START_METHOD,
        PresetStale,
        PRESET_STALE,
        actions=(two_preset_tool,),
        changes={"tool_call_id": "call-2", "generation": 8},
    ),
    Case(
        "lease-in-params-only",
        START_METHOD,
        LeaseMismatch,
        LEASE_MISMATCH,
        changes={"lease_id": LEASE},
    ),
    Case(
        "lease-in-request-only",
        START_METHOD,
        LeaseMismatch,
        LEASE_MISMATCH,
        request={"lease_id": LEASE},
    ),
    Case(
        "different-leases",
        START_METHOD,
        LeaseMismatch,
        LEASE_MISMATCH,
        changes={"lease_id": LEASE},
        request={"lease_id": "L2"},
    ),
    Case(
        "existing-lease-mismatch",
        START_METHOD,
        LeaseMismatch,
        LEASE_MISMATCH,
        seed="lease",
        request={"lease_id": "L2"},
    ),
    Case("nonexistent-cwd", START_METHOD, InvalidCwd, BAD_CWD, request={"cwd": "missing"}),
    Case("dotdot-cwd", START_METHOD, CwdOutsideWorkspace, CWD_OUTSIDE, request={"cwd": ".."}),
    Case(
        "symlink-escape-cwd",
        START_METHOD,
        CwdOutsideWorkspace,
        CWD_OUTSIDE,
        actions=(escape_link,),
        request={"cwd": "escape"},
    ),
    Case("absolute-root-cwd", START_METHOD, CwdOutsideWorkspace, CWD_OUTSIDE, request={"cwd": "/"}),
    Case("blank-message", START_METHOD, RequestIncomplete, INCOMPLETE, request={"message": " "}),
    Case(
        "requestid-reused",
        START_METHOD,
        RequestIdReused,
        REUSED,
        seed="tool",
        request={"request_id": "q-seed", "message": "another task"},
    ),
    Case(
        "lease-never-admitted-tool-gone",
        START_METHOD,
        LeaseNotActivated,
        NOT_ACTIVATED,
        actions=(never_admitted_lease,),
    ),
    Case(
        "fork-without-live-tool",
        START_METHOD,
        ForkRequiresTool,
        FORK_TOOL,
        seed="lease",
        actions=(close_tool,),
        request={"context_mode": "fork"},
    ),
]


def _locate_cases() -> list[Case]:
    cases = []
    for method in CHILD_METHODS:
        for name, seed, actions, changes in [
            ("unknown-child", "tool", (), {"child_id": "c-ghost"}),
            ("no-child-id", "tool", (), {"child_id": ""}),
            ("unknown-child-run", "tool", (), {"child_run_id": "r-ghost"}),
            ("child-of-another-tool-call", "tool", (sibling_seed,), {}),
            ("leased-child-without-lease-id", "lease", (), {"lease_id": ""}),
        ]:
            cases.append(
                Case(
                    f"{method}:{name}",
                    method,
                    ChildNotOwned,
                    CHILD_NOT_OWNED,
                    seed,
                    actions,
                    changes,
                )
            )
    return cases


RELEASE_CASES = [
    Case(
        "no-lease-id",
        RELEASE_METHOD,
        ReleaseOwnerRequired,
        RELEASE_OWNER,
        "lease",
        changes={"lease_id": ""},
    ),
    Case(
        "no-extension",
        RELEASE_METHOD,
        ReleaseOwnerRequired,
        RELEASE_OWNER,
        "lease",
        changes={"extension_id": ""},
    ),
    Case(
        "zero-generation",
        RELEASE_METHOD,
        ReleaseOwnerRequired,
        RELEASE_OWNER,
        "lease",
        changes={"generation": 0},
    ),
    Case(
        "unknown-lease-zero-generation",
        RELEASE_METHOD,
        ReleaseOwnerRequired,
        RELEASE_OWNER,
        changes={"lease_id": "L-new", "generation": 0},
    ),
    Case(
        "wrong-extension",
        RELEASE_METHOD,
        LeaseOwnerMismatch,
        OWNER_MISMATCH,
        "lease",
        changes={"extension_id": "other-ext"},
    ),
    Case(
        "wrong-generation",
        RELEASE_METHOD,
        LeaseOwnerMismatch,
        OWNER_MISMATCH,
        "lease",
        changes={"generation": 8},
    ),
    Case(
        "tombstone-wrong-extension",
        RELEASE_METHOD,
        LeaseOwnerMismatch,
        OWNER_MISMATCH,
        actions=(tombstone,),
        changes={"extension_id": "other-ext"},
    ),
    Case(
        "released-lease-wrong-generation",
        RELEASE_METHOD,
        LeaseOwnerMismatch,
        OWNER_MISMATCH,
        "lease",
        (release_lease,),
        changes={"generation": 8},
    ),
    Case("stale-connection", RELEASE_METHOD, StaleConnection, STALE, "lease", (reconnect,)),
    Case("unknown-runner", RELEASE_METHOD, RunnerNotFound, NO_RUNNER, "lease", (ghost_runner,)),
    Case("disconnected-runner", RELEASE_METHOD, RunnerNotFound, NO_RUNNER, "lease", (disconnect,)),
]


def _named(cases: list[Case]) -> list[Case]:
    return [dataclasses.replace(c, id=f"{c.method}:{c.id}") for c in cases]


MATRIX = _authority_cases() + _named(START_CASES) + _locate_cases() + _named(RELEASE_CASES)


@pytest.mark.parametrize("case", MATRIX, ids=lambda c: c.id)
async def test_refused_call_has_no_effect(
    case: Case, harness: Harness, clock: ManualClock, db_url: str
) -> None:
    w = await scene(case, harness, clock, db_url)
    params = w.params(case.method, request=case.request, **case.changes)
    await refused(w, w.conn, case.method, params, case)
    if case.method == START_METHOD and case.seed == "none" and not case.actions:
        assert harness.runner.prepared == []


# The positive controls: the same scenes without the defect succeed, so each refusal
# above is caused by the one thing its case changes.
@pytest.mark.parametrize("seed", ["tool", "lease"])
@pytest.mark.parametrize("method", [START_METHOD, *CHILD_METHODS, RELEASE_METHOD])
async def test_baseline_calls_succeed(
    method: str, seed: str, harness: Harness, clock: ManualClock, db_url: str
) -> None:
    w = World(harness, clock, db_url, harness.conn)
    await w.plant(seed)
    before = snapshot(db_url)
    result = await w.engine.call(w.conn, method, w.params(method))
    if method == STEER_METHOD:
        assert result == SteerResult(outcome="injected")
    else:
        assert isinstance(result, Result)
    if method == READ_METHOD:
        assert result.conversation_id == w.seed.conversation_id  # type: ignore[union-attr]
    else:
        assert snapshot(db_url) != before  # the snapshot sees writes
    expected_prepares = 2 if method == START_METHOD else 1
    assert len(harness.runner.prepared) == expected_prepares


@pytest.mark.parametrize(
    ("name", "actions", "changes", "request_changes"),
    [
        (
            "preset-at-its-generation",
            (two_preset_tool,),
            {"tool_call_id": "call-2", "generation": 8},
            {"profile": "helper"},
        ),
        ("lease-after-tool-closed", (close_tool,), {}, {}),
        ("another-runners-same-lease-id", (), {}, {}),
        ("lease-after-reconnect", (reconnect,), {}, {}),
        ("lease-after-disconnect-and-register", (disconnect, reconnect), {}, {}),
    ],
)
async def test_near_misses_succeed(
    name: str,
    actions: tuple[Action, ...],
    changes: dict[str, Any],
    request_changes: dict[str, Any],
    harness: Harness,
    clock: ManualClock,
    db_url: str,
) -> None:
    """Controls for the subtler cases: the right generation of a multi-generation
    tool, a lease that outlives its tool, and leaseIds scoped per runner."""
    w = World(harness, clock, db_url, harness.conn)
    await w.plant("lease" if name != "preset-at-its-generation" else "none")
    for action in actions:
        await action(w)
    if name == "another-runners-same-lease-id":
        # runner-2 opens its own tool and creates its own lease L1: no clash with runner-1's.
        conn2 = await w.engine.connect("runner-2", "host-b")
        await w.engine.open_tool(
            conn2,
            run_id="run-2",
            conversation_id="conv-2",
            tool_call_id="call-1",
            extension_id=PRESET.extension_id,
            presets=[PRESET],
            workspace=w.h.workspace,
        )
        params = w.params(START_METHOD, run_id="run-2")
        result = await w.engine.call(conn2, START_METHOD, params)
    else:
        conn = w.extra.get("fresh", w.conn)
        result = await w.engine.call(
            conn, START_METHOD, w.params(START_METHOD, request=request_changes, **changes)
        )
    assert isinstance(result, Result) and not result.done
    assert harness.runner.prepared[-1].identity.run_id == result.run_id


# --- check order (design §3, §5: connection, grant and ownership, Request validation,
# preset, lease match, idempotent replay, activation and fork rules, ...) ------------

ORDER_CASES = [
    # start
    Case(
        "stale+wrong-extension",
        START_METHOD,
        StaleConnection,
        STALE,
        actions=(reconnect,),
        changes={"extension_id": "x"},
    ),
    Case(
        "stale+blank-message",
        START_METHOD,
        StaleConnection,
        STALE,
        actions=(reconnect,),
        request={"message": ""},
    ),
    Case(
        "unknown-runner+zero-generation",
        START_METHOD,
        RunnerNotFound,
        NO_RUNNER,
        actions=(ghost_runner,),
        changes={"generation": 0},
    ),
    Case(
        "disconnected+unknown-preset",
        START_METHOD,
        RunnerNotFound,
        NO_RUNNER,
        actions=(disconnect,),
        request={"profile": "ghost"},
    ),
    Case(
        "wrong-run+blank-message",
        START_METHOD,
        NotOwned,
        NOT_OWNED,
        changes={"run_id": "x"},
        request={"message": ""},
    ),
    Case(
        "zero-generation+unknown-preset",
        START_METHOD,
        NotOwned,
        NOT_OWNED,
        changes={"generation": 0},
        request={"profile": "ghost"},
    ),
    Case(
        "closed-tool+escaping-cwd",
        START_METHOD,
        NotOwned,
        NOT_OWNED,
        actions=(close_tool,),
        request={"cwd": ".."},
    ),
    Case(
        "released-lease+lease-mismatch",
        START_METHOD,
        NotOwned,
        NOT_OWNED,
        "lease",
        (release_lease,),
        request={"lease_id": "L2"},
    ),
    Case(
        "expired-lease+unknown-preset",
        START_METHOD,
        NotOwned,
        NOT_OWNED,
        "lease",
        (expire_lease,),
        request={"profile": "ghost"},
    ),
    Case(
        "tombstone+blank-message",
        START_METHOD,
        NotOwned,
        NOT_OWNED,
        actions=(tombstone,),
        request={"message": ""},
    ),
    Case(
        "other-runner+unknown-preset",
        START_METHOD,
        NotOwned,
        NOT_OWNED,
        actions=(other_runner,),
        request={"profile": "ghost"},
    ),
    Case(
        "blank-message+unknown-preset",
        START_METHOD,
        RequestIncomplete,
        INCOMPLETE,
        request={"message": "", "profile": "ghost"},
    ),
    Case(
        "bad-context-mode+lease-mismatch",
        START_METHOD,
        BadContextMode,
        CONTEXT_MODE,
        request={"context_mode": "branch", "lease_id": LEASE},
    ),
    Case(
        "unknown-preset+lease-mismatch",
        START_METHOD,
        PresetStale,
        PRESET_STALE,
        request={"profile": "ghost", "lease_id": LEASE},
    ),
    Case(
        "unknown-preset+escaping-cwd",
        START_METHOD,
        PresetStale,
        PRESET_STALE,
        request={"profile": "ghost", "cwd": ".."},
    ),
    Case(
        "unknown-preset+requestid-reused",
        START_METHOD,
        PresetStale,
        PRESET_STALE,
        "tool",
        request={"profile": "ghost", "request_id": "q-seed"},
    ),
    Case(
        "lease-mismatch+nonexistent-cwd",
        START_METHOD,
        LeaseMismatch,
        LEASE_MISMATCH,
        request={"lease_id": LEASE, "cwd": "missing"},
    ),
    Case(
        "lease-mismatch+requestid-reused",
        START_METHOD,
        LeaseMismatch,
        LEASE_MISMATCH,
        "tool",
        request={"lease_id": LEASE, "request_id": "q-seed"},
    ),
    Case(
        "requestid-reused+fork-without-tool",
        START_METHOD,
        RequestIdReused,
        REUSED,
        "lease",
        (close_tool,),
        request={"request_id": "q-seed", "context_mode": "fork"},
    ),
    # read / cancel / steer
    *[
        c
        for m in CHILD_METHODS
        for c in (
            Case(
                f"{m}:stale+unknown-child",
                m,
                StaleConnection,
                STALE,
                "tool",
                (reconnect,),
                {"child_id": "c-ghost"},
            ),
            Case(
                f"{m}:unknown-runner+wrong-run",
                m,
                RunnerNotFound,
                NO_RUNNER,
                "tool",
                (ghost_runner,),
                {"run_id": "x"},
            ),
            Case(
                f"{m}:wrong-extension+unknown-child",
                m,
                *_expected("owned", m),
                "tool",
                (),
                {"extension_id": "x", "child_id": "c-ghost"},
            ),
            Case(
                f"{m}:expired-lease+unknown-child",
                m,
                *_expected("owned", m),
                "lease",
                (expire_lease,),
                {"child_id": "c-ghost"},
            ),
        )
    ],
    Case(
        "steer:stale+empty-message",
        STEER_METHOD,
        StaleConnection,
        STALE,
        "tool",
        (reconnect,),
        {"message": ""},
    ),
    Case(
        "steer:wrong-run+empty-message",
        STEER_METHOD,
        SteerNotOwned,
        STEER_NOT_OWNED,
        "tool",
        (),
        {"run_id": "x", "message": ""},
    ),
    Case(
        "steer:unknown-child+invalid-request-id",
        STEER_METHOD,
        ChildNotOwned,
        CHILD_NOT_OWNED,
        "tool",
        (),
        {"child_id": "c-ghost", "request_id": "a/b"},
    ),
    Case("steer:empty-message", STEER_METHOD, BadSteer, BAD_STEER, "tool", (), {"message": "  "}),
    # release
    Case(
        "release:stale+no-lease-id",
        RELEASE_METHOD,
        StaleConnection,
        STALE,
        "lease",
        (reconnect,),
        {"lease_id": ""},
    ),
    Case(
        "release:unknown-runner+zero-generation",
        RELEASE_METHOD,
        RunnerNotFound,
        NO_RUNNER,
        "lease",
        (ghost_runner,),
        {"generation": 0},
    ),
    Case(
        "release:disconnected+wrong-extension",
        RELEASE_METHOD,
        RunnerNotFound,
        NO_RUNNER,
        "lease",
        (disconnect,),
        {"extension_id": "x"},
    ),
    Case(
        "release:no-extension+existing-lease",
        RELEASE_METHOD,
        ReleaseOwnerRequired,
        RELEASE_OWNER,
        "lease",
        (),
        {"extension_id": "", "generation": 8},
    ),
]


@pytest.mark.parametrize("case", ORDER_CASES, ids=lambda c: c.id)
async def test_the_earlier_check_answers(
    case: Case, harness: Harness, clock: ManualClock, db_url: str
) -> None:
    w = await scene(case, harness, clock, db_url)
    params = w.params(case.method, request=case.request, **case.changes)
    await refused(w, w.conn, case.method, params, case)


# --- params as JSON -----------------------------------------------------------------


def _start_json() -> dict[str, Any]:
    return {
        "runId": "parent-run",
        "toolCallId": "call-1",
        "extensionId": PRESET.extension_id,
        "generation": PRESET.generation,
        "request": {"requestId": "q-json", "profile": PRESET.name, "message": "do the task"},
    }


def _mutated(mutate: Callable[[dict[str, Any]], None]) -> str:
    doc = _start_json()
    mutate(doc)
    return json.dumps(doc)


MALFORMED: list[tuple[str, str]] = [
    ("apiKey-top-level", _mutated(lambda d: d.update(apiKey="sk-secret"))),
    ("apiKey-in-request", _mutated(lambda d: d["request"].update(apiKey="sk-secret"))),
    (
        "apiKey-in-options",
        _mutated(lambda d: d["request"].update(options={"model": "m", "apiKey": "sk"})),
    ),
    (
        "baseUrl-in-options",
        _mutated(lambda d: d["request"].update(options={"baseUrl": "http://x"})),
    ),
    ("null-options", _mutated(lambda d: d["request"].update(options=None))),
    ("null-request", _mutated(lambda d: d.update(request=None))),
    ("null-option-field", _mutated(lambda d: d["request"].update(options={"model": None}))),
    (
        "wrong-case-field",
        _mutated(lambda d: d["request"].update(RequestID=d["request"].pop("requestId"))),
    ),
    ("negative-generation", _mutated(lambda d: d.update(generation=-1))),
    ("empty-objects-trailing", "{} {}"),
    ("valid-then-trailing-object", json.dumps(_start_json()) + " {}"),
    ("valid-then-trailing-garbage", json.dumps(_start_json()) + "x"),
]


@pytest.mark.parametrize("as_bytes", [True, False], ids=["bytes", "str"])
@pytest.mark.parametrize(("name", "text"), MALFORMED, ids=[m[0] for m in MALFORMED])
async def test_malformed_json_params_are_refused(
    name: str, text: str, as_bytes: bool, harness: Harness, clock: ManualClock, db_url: str
) -> None:
    w = World(harness, clock, db_url, harness.conn)
    before = snapshot(db_url)
    with pytest.raises(DelegationError) as info:
        await w.engine.call(w.conn, START_METHOD, text.encode() if as_bytes else text)
    assert type(info.value) is MalformedInput
    assert str(info.value).startswith("malformed child input")
    assert info.value.rpc_code == -32602
    await asyncio.sleep(0.02)
    assert harness.runner.prepared == []
    assert snapshot(db_url) == before


@pytest.mark.parametrize("method", [START_METHOD, *CHILD_METHODS, RELEASE_METHOD])
async def test_unknown_credential_field_is_refused_for_every_method(
    method: str, harness: Harness, clock: ManualClock, db_url: str
) -> None:
    w = World(harness, clock, db_url, harness.conn)
    await w.plant("lease")
    doc = json.loads(encode(w.params(method)))
    doc["apiKey"] = "sk-secret"
    before = snapshot(db_url)
    with pytest.raises(MalformedInput) as info:
        await w.engine.call(w.conn, method, json.dumps(doc).encode())
    assert type(info.value) is MalformedInput
    assert info.value.rpc_code == -32602
    await asyncio.sleep(0.02)
    assert len(harness.runner.prepared) == 1
    assert snapshot(db_url) == before
    del doc["apiKey"]
    await w.engine.call(w.conn, method, json.dumps(doc))  # the control succeeds


@pytest.mark.parametrize("as_bytes", [True, False], ids=["bytes", "str"])
async def test_wellformed_json_params_start_a_child(as_bytes: bool, harness: Harness) -> None:
    text = json.dumps(_start_json())
    result = await harness.engine.call(
        harness.conn, START_METHOD, text.encode() if as_bytes else text
    )
    assert isinstance(result, Result)
    assert len(harness.runner.prepared) == 1


# --- connections ----------------------------------------------------------------------


async def test_old_handle_is_stale_after_the_runner_reconnects(
    harness: Harness, clock: ManualClock, db_url: str
) -> None:
    w = World(harness, clock, db_url, harness.conn)
    first = await harness.start("q1")
    await harness.wait_done(first.conversation_id)
    old = harness.conn
    fresh = await harness.engine.connect("runner-1", "host-a")
    assert fresh.generation == old.generation + 1
    case = Case("stale", START_METHOD, StaleConnection, STALE)
    await refused(w, old, START_METHOD, harness.start_params("q2"), case)
    await refused(w, old, READ_METHOD, harness.params(child_id=first.conversation_id), case)

    await harness.engine.open_tool(
        fresh,
        run_id="parent-run",
        conversation_id="parent-conv",
        tool_call_id="call-2",
        extension_id=PRESET.extension_id,
        presets=[PRESET],
        workspace=harness.workspace,
    )
    started = await harness.engine.call(
        fresh, START_METHOD, harness.start_params("q2", tool_call_id="call-2")
    )
    assert isinstance(started, Result)
    assert len(harness.runner.prepared) == 2
    await harness.wait_done(started.conversation_id)
    # ... and the old handle stays refused, even for the new tool call.
    params = harness.start_params("q3", tool_call_id="call-2")
    await refused(w, old, START_METHOD, params, case)


async def test_disconnected_runner_is_not_found_until_it_registers_again(
    harness: Harness, clock: ManualClock, db_url: str
) -> None:
    w = World(harness, clock, db_url, harness.conn)
    old = harness.conn
    await harness.engine.disconnect(old)
    gone = Case("gone", START_METHOD, RunnerNotFound, NO_RUNNER)
    await refused(w, old, START_METHOD, harness.start_params("q1"), gone)
    await refused(w, old, RELEASE_METHOD, harness.params(lease_id=LEASE), gone)
    assert harness.runner.prepared == []

    fresh = await harness.engine.connect("runner-1", "host-a")
    assert fresh.generation == old.generation + 1
    await harness.engine.open_tool(
        fresh,
        run_id="parent-run",
        conversation_id="parent-conv",
        tool_call_id="call-2",
        extension_id=PRESET.extension_id,
        presets=[PRESET],
        workspace=harness.workspace,
    )
    started = await harness.engine.call(
        fresh, START_METHOD, harness.start_params("q1", tool_call_id="call-2")
    )
    assert isinstance(started, Result)
    await harness.wait_done(started.conversation_id)
    stale = Case("stale", START_METHOD, StaleConnection, STALE)
    await refused(w, old, START_METHOD, harness.start_params("q2", tool_call_id="call-2"), stale)


# --- leases ---------------------------------------------------------------------------


async def test_lease_is_valid_at_its_deadline_and_expired_one_tick_after(
    harness: Harness, clock: ManualClock, db_url: str
) -> None:
    engine = harness.engine
    created_at = clock.now()
    first = await harness.start("q1", lease_id=LEASE)
    await harness.wait_done(first.conversation_id)
    (lease,) = await engine.leases("runner-1")
    assert lease.lease_id == LEASE
    assert lease.expires_at == created_at + engine.config.lease_lifetime_s
    await engine.close_tool(harness.tool)  # from now on only the lease grants authority

    clock.set(lease.expires_at)
    second = await harness.start("q2", lease_id=LEASE)
    await harness.wait_done(second.conversation_id)
    read = await harness.read(first.conversation_id, lease_id=LEASE)
    assert read.done
    assert len(harness.runner.prepared) == 2

    clock.set(math.nextafter(lease.expires_at, math.inf))
    w = World(harness, clock, db_url, harness.conn)
    owned = Case("expired", START_METHOD, NotOwned, NOT_OWNED)
    await refused(w, harness.conn, START_METHOD, harness.start_params("q3", lease_id=LEASE), owned)
    await refused(w, harness.conn, START_METHOD, harness.start_params("q2", lease_id=LEASE), owned)
    child = harness.params(child_id=first.conversation_id, lease_id=LEASE)
    await refused(w, harness.conn, READ_METHOD, child, owned)
    await refused(w, harness.conn, CANCEL_METHOD, child, owned)
    steer = harness.params(
        child_id=first.conversation_id, lease_id=LEASE, request_id="s1", message="hi"
    )
    steered = Case("expired", STEER_METHOD, SteerNotOwned, STEER_NOT_OWNED)
    await refused(w, harness.conn, STEER_METHOD, steer, steered)
    assert len(harness.runner.prepared) == 2


async def test_released_lease_is_a_tombstone_that_refuses_starts(
    harness: Harness, clock: ManualClock, db_url: str
) -> None:
    engine = harness.engine
    harness.runner.script = hold_forever
    first = await harness.start("q1", lease_id=LEASE)
    released = await engine.call(harness.conn, RELEASE_METHOD, harness.params(lease_id=LEASE))
    assert isinstance(released, Result) and released.done
    record = await engine.get_child(first.conversation_id)
    assert record is not None and record.state == "cancelled"

    w = World(harness, clock, db_url, harness.conn)
    owned = Case("released", START_METHOD, NotOwned, NOT_OWNED)
    # The tool call is still live, yet the tombstone is selected and refuses.
    await refused(w, harness.conn, START_METHOD, harness.start_params("q2", lease_id=LEASE), owned)
    child = harness.params(child_id=first.conversation_id, lease_id=LEASE)
    await refused(w, harness.conn, READ_METHOD, child, owned)

    # Releasing a lease that never existed fences its leaseId too.
    await engine.call(harness.conn, RELEASE_METHOD, harness.params(lease_id=TOMBSTONE))
    fenced = harness.start_params("q3", lease_id=TOMBSTONE)
    await refused(w, harness.conn, START_METHOD, fenced, owned)
    assert len(harness.runner.prepared) == 1
    # Control: a fresh leaseId under the same live tool works.
    started = await harness.start("q4", lease_id="L-fresh")
    assert not started.done
    assert len(harness.runner.prepared) == 2


# --- working directory ------------------------------------------------------------------

CWD_OK = [
    ("", "."),
    (".", "."),
    ("sub", "sub"),
    ("sub/", "sub"),
    ("sub/../sub", "sub"),
    ("./sub/.", "sub"),
    ("inside-link", "sub"),
    # How Linux names a removed directory it resolved: this one is there.
    ("sub/kept (deleted)", "sub/kept (deleted)"),
]
CWD_REFUSED = [
    ("..", CwdOutsideWorkspace, CWD_OUTSIDE),
    ("../outside", CwdOutsideWorkspace, CWD_OUTSIDE),
    ("sub/../..", CwdOutsideWorkspace, CWD_OUTSIDE),
    ("../workspace2", CwdOutsideWorkspace, CWD_OUTSIDE),
    ("/", CwdOutsideWorkspace, CWD_OUTSIDE),
    ("{outside}", CwdOutsideWorkspace, CWD_OUTSIDE),
    ("escape", CwdOutsideWorkspace, CWD_OUTSIDE),
    ("escape/deeper", CwdOutsideWorkspace, CWD_OUTSIDE),
    ("sub/escape-from-sub", CwdOutsideWorkspace, CWD_OUTSIDE),
    ("missing", InvalidCwd, BAD_CWD),
    ("sub/missing", InvalidCwd, BAD_CWD),
    ("note.txt", InvalidCwd, BAD_CWD),
    ("dangling", InvalidCwd, BAD_CWD),
    ("sub\x00", InvalidCwd, BAD_CWD),
]


def _build_tree(workspace: Path) -> Path:
    outside = workspace.parent / "outside"
    (outside / "deeper").mkdir(parents=True)
    (workspace.parent / "workspace2").mkdir()
    (workspace / "note.txt").write_text("not a directory")
    (workspace / "sub" / "kept (deleted)").mkdir()
    (workspace / "inside-link").symlink_to(workspace / "sub", target_is_directory=True)
    (workspace / "escape").symlink_to(outside, target_is_directory=True)
    (workspace / "sub" / "escape-from-sub").symlink_to("../../outside", target_is_directory=True)
    (workspace / "dangling").symlink_to(workspace / "nowhere")
    return outside


@pytest.mark.parametrize(("cwd", "resolved"), CWD_OK)
async def test_cwd_inside_the_workspace_is_resolved(
    cwd: str, resolved: str, harness: Harness, workspace: Path
) -> None:
    _build_tree(workspace)
    started = await harness.start("q1", cwd=cwd)
    record = await harness.engine.get_child(started.conversation_id)
    assert record is not None
    assert record.cwd == str((workspace / resolved).resolve())


@pytest.mark.parametrize(("cwd", "error", "message"), CWD_REFUSED)
async def test_cwd_outside_or_missing_is_refused(
    cwd: str,
    error: type[DelegationError],
    message: str,
    harness: Harness,
    clock: ManualClock,
    db_url: str,
    workspace: Path,
) -> None:
    outside = _build_tree(workspace)
    cwd = cwd.format(outside=outside)
    w = World(harness, clock, db_url, harness.conn)
    case = Case(cwd, START_METHOD, error, message)
    await refused(w, harness.conn, START_METHOD, harness.start_params("q1", cwd=cwd), case)
    assert harness.runner.prepared == []


# --- resume (design §3.6): a foreign conversation is refused as such --------------------


async def _foreign_child(harness: Harness, workspace: str) -> Result:
    """A finished child of another parent conversation (same runner and extension)."""
    await harness.engine.open_tool(
        harness.conn,
        run_id="run-b",
        conversation_id="conv-b",
        tool_call_id="call-b",
        extension_id=PRESET.extension_id,
        presets=[PRESET],
        workspace=workspace,
    )
    foreign = await harness.start("q-b", run_id="run-b", tool_call_id="call-b")
    await harness.wait_done(foreign.conversation_id)
    return foreign


@pytest.mark.parametrize("where", ["same-workspace", "other-workspace", "unknown-conversation"])
async def test_resume_of_a_foreign_conversation_is_a_resume_mismatch(
    where: str, harness: Harness, clock: ManualClock, db_url: str, tmp_path: Path
) -> None:
    """Whatever the foreign conversation's saved cwd, the answer is the resume refusal:
    an unknown conversation and another parent's one are indistinguishable."""
    if where == "unknown-conversation":
        target = "c-unknown"
    else:
        other = tmp_path / "other-workspace"
        other.mkdir()
        foreign_ws = harness.workspace if where == "same-workspace" else str(other)
        target = (await _foreign_child(harness, foreign_ws)).conversation_id
    w = World(harness, clock, db_url, harness.conn)
    case = Case(where, START_METHOD, ResumeMismatch, RESUME_MISMATCH)
    prepared = len(harness.runner.prepared)
    await refused(w, harness.conn, START_METHOD, harness.start_params("q-a", resume=target), case)
    assert len(harness.runner.prepared) == prepared


@pytest.mark.parametrize("lease_id", ["bad/../id", "x y", "a\x00b", "..", "x" * 129])
async def test_lease_ids_must_be_valid_ids(harness: Harness, lease_id: str) -> None:
    with pytest.raises(errors.BadLeaseId) as info:
        await harness.start("q-bad-lease", lease_id=lease_id)
    assert str(info.value) == "child leaseId must be a valid ID"
    assert harness.runner.prepared == []
    with pytest.raises(errors.BadLeaseId):
        await harness.engine.call(
            harness.conn, "child.lease.release", harness.params(lease_id=lease_id)
        )
    assert await harness.engine.leases() == []


@pytest.mark.parametrize(
    ("path", "root", "inside"),
    [
        ("/w", "/w", True),
        ("/w/a", "/w", True),
        ("/w/a", "/w/", True),
        ("/w", "/w/", True),
        ("/wx", "/w", False),
        ("/wx/a", "/w/", False),
        ("/", "/", True),
        ("/anything", "/", True),
        ("/", "/w", False),
    ],
)
def test_within_is_the_root_or_below_it(path: str, root: str, inside: bool) -> None:
    assert authority.within(path, root) is inside
