"""A child knows which code ran it (design §34): the runner version of each execution,
judged at every resume by the host's policy.

Every execution records the version that prepared it (``children.version``) and its
newest attempt's (``attempt_version``). At every resume — a boot or a takeover
(:func:`judge_lost`), a wake-up (:func:`judge_woken`) — the host compares the version the
child last ran with its own:

* unversioned on either side, the same version, or one the runner ``resumes``: it runs;
* otherwise the policy (``EngineConfig.on_version_change``) decides: ``resume`` runs it
  (``Recovery.version_changed``), ``refuse`` ends it ``done`` with
  ``runner_version_changed`` naming both versions (``prepare`` never called), ``pin``
  leaves it ``waiting`` with ``pinned_version``: no host of another version runs it, a
  host of that version takes it (:func:`claim_pinned`), and ``delegation unpin`` lets
  the current code resume it (:func:`unpin`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from delegation import errors
from delegation.config import EngineConfig, check_version
from delegation.records import ChildRecord
from delegation.store import children, waits
from delegation.store.sql import Connection, chunks, run
from delegation.usecases import service

ENV = "DELEGATION_RUNNER_VERSION"
REFUSED = "runner_version_changed"


class Verdict(StrEnum):
    RUN = "run"
    REFUSE = "refuse"
    PIN = "pin"


@dataclass(frozen=True, slots=True)
class HostVersion:
    """The version a host runs, those it can continue, and its policy for the rest."""

    version: str | None
    resumes: frozenset[str]
    policy: str

    @classmethod
    def of(cls, cfg: EngineConfig) -> HostVersion:
        return cls(cfg.runner_version, frozenset(cfg.runner_resumes), cfg.on_version_change)


def resolved(
    cfg: EngineConfig, declared: object, resumes: object
) -> tuple[str | None, tuple[str, ...]]:
    """The version a host runs: ``EngineConfig.runner_version``, else
    ``$DELEGATION_RUNNER_VERSION``, else the runner's own ``version`` (None: unversioned);
    and those it resumes: ``EngineConfig.runner_resumes``, else the runner's ``resumes``.

    Raises:
        ValueError: a version that may not name one (see :func:`config.check_version`).
    """
    given = cfg.runner_version or os.environ.get(ENV) or declared
    version = None if given is None else check_version(given)
    if isinstance(resumes, str) or not isinstance(resumes, Iterable):
        raise ValueError("a runner's resumes must be a sequence of versions")
    older = cfg.runner_resumes or tuple(resumes)
    return version, tuple(check_version(v) for v in older)


def ran(child: ChildRecord) -> str | None:
    """The version that last ran the execution (None: unversioned)."""
    return child.attempt_version or child.version


def changed(child: ChildRecord, host: HostVersion) -> bool:
    """Whether the host runs another version than the one that last ran the child."""
    last = ran(child)
    return last is not None and host.version is not None and last != host.version


def verdict(child: ChildRecord, host: HostVersion) -> Verdict:
    """What a resume of ``child`` on this host does."""
    if child.pinned_version is not None:
        mine = child.pinned_version == host.version or child.pinned_version in host.resumes
        return Verdict.RUN if mine else Verdict.PIN
    if child.unpinned_at is not None or not changed(child, host) or ran(child) in host.resumes:
        return Verdict.RUN
    return {"refuse": Verdict.REFUSE, "pin": Verdict.PIN}.get(host.policy, Verdict.RUN)


UNVERSIONED = HostVersion(None, frozenset(), "resume")


def note(child: ChildRecord, host: HostVersion) -> str:
    """What a ``recovery`` event adds when the version changed: both versions."""
    return f"; runner version {ran(child)} -> {host.version}" if changed(child, host) else ""


def refusal(child: ChildRecord, host: HostVersion) -> str:
    """The error a refused child ends with: both versions, and the reason."""
    return f"{REFUSED}: ran {ran(child)}, this host runs {host.version}"


def pin(conn: Connection, now: float, child: ChildRecord, instance_id: str) -> int:
    """Leave the child ``waiting`` for a host of the version it ran (held here, by no
    run, until one takes it or an operator unpins it); the caller tells every host
    (``controls.wake``) once. Returns 1 if it was pinned now, else 0."""
    return run(
        conn,
        "UPDATE children SET state = 'waiting', pinned_version = ?, wake_at = NULL,"
        " engine_instance_id = ?, updated_at = ? WHERE id = ?"
        " AND state IN ('admitted', 'waiting', 'queued')",
        (child.pinned_version or ran(child), instance_id, now, child.id),
    ).rowcount


def woken_by(conn: Connection, child: ChildRecord) -> str:
    """Why a waiting child wakes (``Recovery.reason``): an operator's unpin (``unpin``),
    a host of the version it is pinned to (``takeover``), else what it waited for:
    an answer (``input``), an event (``event``), its time (``sleep``) or a timeout."""
    if child.unpinned_at is not None:
        return "unpin"
    if child.pinned_version is not None:
        return "takeover"
    return waits.woken_by(conn, child.id)


def attempted(conn: Connection, child_ids: Iterable[int], host: HostVersion) -> None:
    """The children resumed here run this host's version now: their newest attempt's
    version, no pin, no unpin left."""
    for part in chunks(list(child_ids)):
        marks = ", ".join("?" for _ in part)
        run(
            conn,
            "UPDATE children SET attempt_version = ?, pinned_version = NULL, unpinned_at = NULL"
            f" WHERE id IN ({marks})",
            (host.version, *part),
        )


def claim_pinned(conn: Connection, now: float, instance_id: str, host: HostVersion) -> int:
    """Take the children pinned to this host's version that no live host of it holds:
    held here and due now (the wake-up runs them). Returns how many."""
    if host.version is None:
        return 0
    claimed = 0
    for version in (host.version, *sorted(host.resumes)):  # its own, then those it resumes
        claimed += run(
            conn,
            "UPDATE children SET engine_instance_id = ?, wake_at = ? WHERE pinned_version = ?"
            " AND state = 'waiting' AND wake_at IS NULL AND (engine_instance_id IS NULL"
            " OR engine_instance_id = ? OR engine_instance_id NOT IN (SELECT id FROM"
            " engine_instances WHERE closed_at IS NULL AND taken_by IS NULL"
            " AND runner_version = ?))",
            (instance_id, now, version, instance_id, host.version),
        ).rowcount
    return claimed


def unpin_exact(
    conn: Connection, now: float, conversation_id: str, run_id: str | None, instance_id: str
) -> ChildRecord:
    """:func:`unpin` of one execution by its ids (an operator's)."""
    return unpin(conn, now, service.exact(conn, conversation_id, run_id), instance_id)


def unpin(conn: Connection, now: float, child: ChildRecord, instance_id: str) -> ChildRecord:
    """An operator's unpin: the current code of whichever host holds the child may
    resume it; held here and due now.

    Raises:
        errors.ChildEnded: it has ended.
        errors.NotPinned: it is not pinned.
    """
    children.lock(conn, child.id)
    child = children.get(conn, child.id) or child
    if child.terminal:
        raise errors.ChildEnded(f"child {child.conversation_id} has already ended ({child.state})")
    if child.pinned_version is None:
        if child.unpinned_at is not None:  # unpinned already (another host applied it)
            return child
        raise errors.NotPinned()
    run(
        conn,
        "UPDATE children SET pinned_version = NULL, unpinned_at = ?, wake_at = ?,"
        " engine_instance_id = ?, updated_at = ? WHERE id = ?",
        (now, now, instance_id, now, child.id),
    )
    return children.get(conn, child.id) or child
