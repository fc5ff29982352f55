"""The root's face (STYLE: "a root face of about 20 names"): ``delegation.__all__``
lists what a newcomer needs, and is what ``from delegation import *`` and ``dir()`` show.
Every name the root listed before (131 of them) stays importable from ``delegation``,
forwarded when first used (SPEC §18: ``from delegation import HostConflict,
OptionsWidened, ResumeMismatch``), and a strict type checker sees each of them."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import delegation
import delegation.errors

# The root's __all__ before it kept to a face: every one stays importable from delegation.
OLD_FACE = """
    CANCEL_METHOD READ_METHOD RELEASE_METHOD START_METHOD STEER_METHOD ActiveSubmission
    AdmissionFailed AdmissionPending AdmissionPolicy AmbiguousChild AuthorityError
    BadContextMode BadLeaseId BadPresetName BadPriority BadResume BadSteer
    CancelUnconfirmed ChildContext ChildEnded ChildNotFound ChildNotOwned ChildPurged
    ChildRecord ChildUnreadable CommandsWidened ConflictError ConnectionLimit
    CwdOutsideWorkspace DatabaseBusy DatabaseReadOnly DatabaseReplaced DeadlineWidened
    DelegationError Engine EngineConfig Event EventBufferFull EventClosed EventTimeout
    EventTooLarge ExecutionOptions FollowLimit FollowupRequiresRunId ForkRequiresTool
    FsSearchEnabled HostClosing HostConflict HostFenced Identity IllegalTransition
    InputAnswered InputClosed InputError InputInvalid InputLimit InputTimeout InputTooLarge
    InputUnknown InternalError InvalidCwd InvalidId InvalidOptions InvalidRpcRequest
    LeaseCapacity LeaseMismatch LeaseNotActivated LeaseOwnerMismatch LeaseRecord LimitError
    LocalHost MalformedInput MethodNotFound NestingLimit NoExtensionsRelaxed
    NoSkillsRelaxed NoToolsRelaxed NotOwned NotPinned NotResumable Operator OptionsWidened
    Params ParseError Preset PresetLimit PresetPromptConflict PresetPromptTooLarge
    PresetStale Profile ProtocolError QueueFull Recovery ReleaseOwnerRequired
    ReleaseUnconfirmed Request RequestIdReused RequestIncomplete Result ResumeMismatch
    Rewind RewindNoAuthority RewindRequiresResume RewindRunUnknown RewindStepUnknown Run
    Runner RunnerConnection RunnerNotFound SchemaMismatch StaleConnection SteerLimit
    SteerNotOwned SteerRequestIdReused SteerResult StepLimit StepTimeout StepTooLarge
    StoreError StoreUnavailable SubmissionLimit TokenLimitRaised ToolAlreadyOpen ToolHandle
    ToolsWidened TurnLimitWidened admit decode effective_options encode valid_id
""".split()  # noqa: SIM905 (a block of names reads better than 131 lines)


def test_the_face_is_about_twenty_names() -> None:
    assert 15 <= len(delegation.__all__) <= 25
    assert len(set(delegation.__all__)) == len(delegation.__all__)
    assert set(delegation.__all__) <= set(OLD_FACE)  # the face took nothing new


def test_the_face_is_what_import_star_and_dir_show() -> None:
    scope: dict[str, object] = {}
    exec("from delegation import *", scope)
    assert set(scope) - {"__builtins__"} == set(delegation.__all__)
    shown = {name for name in dir(delegation) if not name.startswith("_")}
    assert shown == {*delegation.__all__, "errors"}  # the errors, as delegation.errors.X


def test_every_name_of_the_old_face_is_importable_from_delegation() -> None:
    assert len(OLD_FACE) == len(set(OLD_FACE)) == 131
    wrong = []
    for name in OLD_FACE:
        scope: dict[str, object] = {}
        exec(f"from delegation import {name}", scope)
        if name in delegation.errors.__all__:
            home = delegation.errors
        else:
            home = importlib.import_module(delegation._LAZY[name])
        if scope[name] is not getattr(home, name):
            wrong.append(name)
    assert wrong == []


def test_every_error_class_is_importable_from_delegation() -> None:
    for name in ("HostConflict", "OptionsWidened", "ResumeMismatch", "CancelUnconfirmed"):
        assert name in OLD_FACE
    for name in delegation.errors.__all__:
        assert getattr(delegation, name) is getattr(delegation.errors, name), name


def test_a_name_the_root_never_had_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="NoSuchName"):
        delegation.NoSuchName  # noqa: B018
    with pytest.raises(ImportError):
        exec("from delegation import NoSuchName", {})


def _names_type_checkers_see() -> dict[str, bool]:
    """Each name the ``if TYPE_CHECKING:`` blocks of delegation/__init__.py import, and
    whether it is re-exported explicitly (``X as X``, or by ``import *``)."""
    tree = ast.parse(Path(delegation.__file__).read_text(encoding="utf-8"))
    seen: dict[str, bool] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for imported in node.body:
                assert isinstance(imported, ast.ImportFrom) and imported.module is not None
                for alias in imported.names:
                    if alias.name == "*":
                        module = importlib.import_module(imported.module)
                        seen.update(dict.fromkeys(module.__all__, True))
                    else:
                        seen[alias.name] = alias.asname == alias.name
    return seen


def test_a_strict_type_checker_sees_every_name_of_the_old_face() -> None:
    # mypy --strict sees no module __getattr__ (it is defined only at run time), so a name
    # it does not see imported is an error; one outside __all__ must be re-exported
    # explicitly, or mypy says "does not explicitly export".
    seen = _names_type_checkers_see()
    assert [name for name in OLD_FACE if name not in seen] == []
    hidden = [name for name in OLD_FACE if name not in delegation.__all__ and not seen[name]]
    assert hidden == []
