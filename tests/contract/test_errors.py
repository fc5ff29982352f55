"""The error tree of design §2.3: one root, stable reasons, JSON-RPC codes, exact messages."""

from __future__ import annotations

import inspect
import re

import pytest

from delegation import DelegationError, errors

ALL = [
    cls
    for _, cls in inspect.getmembers(errors, inspect.isclass)
    if issubclass(cls, Exception) and cls.__module__.startswith(f"{errors.__name__}.")
]

# Every message docs/design.md quotes, with the class that carries it.
QUOTED = {
    errors.RequestIncomplete: "child requestId, profile and message are required",
    errors.InputTooLarge: "child input exceeds limit",
    errors.BadContextMode: "child contextMode must be fresh or fork",
    errors.BadResume: (
        "child resume requires a valid owned conversation ID and cannot be combined with fork"
    ),
    errors.BadPresetName: "execution preset requires a simple nonempty name",
    errors.PresetPromptTooLarge: "execution preset prompt exceeds limit",
    errors.PresetPromptConflict: (
        "execution preset must use prompt content or a prompt path, not both"
    ),
    errors.StaleConnection: "runner connection generation is stale",
    errors.RunnerNotFound: "runner not found",
    errors.NotOwned: "child requires active tool ownership or an unexpired retained lease",
    errors.SteerNotOwned: "child steering requires current owned authority",
    errors.PresetStale: "execution preset absent or stale",
    errors.LeaseMismatch: "child lease mismatch",
    errors.InvalidCwd: "invalid child working directory",
    errors.CwdOutsideWorkspace: "child working directory exceeds parent workspace",
    errors.LeaseNotActivated: (
        "child retained authority requires successful initial admission from an active tool"
    ),
    errors.ForkRequiresTool: "child fork requires the current active parent tool",
    errors.ResumeMismatch: (
        "the child task cannot resume with a different parent, host or execution preset"
    ),
    errors.ActiveSubmission: "child conversation already has an active submission",
    errors.AmbiguousChild: "childRunId is required for an ambiguous child handle",
    errors.ChildNotOwned: "child run is not owned by this capability",
    errors.FollowupRequiresRunId: "childRunId is required after a child followup",
    errors.SubmissionLimit: "child submission limit exceeded",
    errors.LeaseCapacity: "child lease capacity exceeded",
    errors.SteerLimit: "child steer request limit exceeded",
    errors.NestingLimit: "child nesting limit exceeded",
    errors.RequestIdReused: "requestId was already used with different child input",
    errors.BadSteer: "child steer requires requestId and a nonempty bounded message",
    errors.SteerRequestIdReused: "steer requestId already used with different input",
    errors.ReleaseOwnerRequired: "child lease release requires its exact owner",
    errors.LeaseOwnerMismatch: "child lease owner mismatch",
    errors.ReleaseUnconfirmed: (
        "child lease revoked but cleanup is not yet confirmed; retry release"
    ),
    errors.InputUnknown: "child input request not found",
    errors.InputAnswered: "child input was already answered",
    errors.InputClosed: "child is not waiting for input",
}


def test_every_error_has_one_root() -> None:
    assert len(ALL) > 40
    for cls in ALL:
        assert issubclass(cls, DelegationError), cls


def test_reasons_are_stable_snake_case_and_unique() -> None:
    reasons = [cls.reason for cls in ALL]
    for reason in reasons:
        assert re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)*", reason), reason
    assert len(set(reasons)) == len(reasons), "two classes share a reason"


@pytest.mark.parametrize(
    ("cls", "message"), QUOTED.items(), ids=lambda v: getattr(v, "__name__", "")
)
def test_quoted_messages_are_exact(cls: type[DelegationError], message: str) -> None:
    assert str(cls()) == message
    assert cls().rpc_code == -32602


def test_rpc_codes() -> None:
    assert errors.ParseError().rpc_code == -32700
    assert errors.InvalidRpcRequest().rpc_code == -32600
    assert errors.MethodNotFound().rpc_code == -32601
    assert errors.InternalError().rpc_code == -32603
    assert errors.StoreError().rpc_code == errors.DatabaseBusy().rpc_code == -32603
    faults = errors.ProtocolError | errors.InternalError | errors.StoreError
    refusals = [c for c in ALL if not issubclass(c, faults)] + [errors.ChildPurged]
    assert all(c.rpc_code == -32602 for c in refusals)


def test_admission_failed_carries_the_run_error() -> None:
    assert str(errors.AdmissionFailed("boom")) == "child admission failed: boom"
    assert errors.AdmissionFailed("boom").reason == "admission_failed"


def test_custom_message_keeps_reason() -> None:
    error = errors.InvalidOptions("execution option model must be nonempty and contain no NUL")
    assert error.reason == "invalid_options"
    assert "model" in str(error)


def test_every_error_class_is_importable_from_delegation_itself() -> None:
    """design §18: ``from delegation import HostConflict, OptionsWidened, ...``."""
    import delegation

    classes = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, errors.DelegationError)
    }
    assert {"HostConflict", "OptionsWidened", "ResumeMismatch", "CancelUnconfirmed"} <= classes
    for name in classes:
        assert getattr(delegation, name) is getattr(errors, name), name
    assert classes <= set(errors.__all__)  # forwarded by delegation, listed by its errors


def test_the_library_prints_nothing_when_its_host_set_up_no_logging() -> None:
    """Issue 29: a warning of the engine's reaches the host's logging, if any; with none
    set up, nothing is printed (a NullHandler, not Python's last-resort handler)."""
    import subprocess
    import sys

    code = (
        "import logging, delegation\n"
        "logging.getLogger('delegation.engine').warning('a warning of the engine')\n"
        "logging.basicConfig()\n"
        "logging.getLogger('delegation.engine').warning('now the host shows it')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "WARNING:delegation.engine:now the host shows it\n"
