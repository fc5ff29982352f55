"""``delegation cancel``, ``steer``, ``input`` and ``send``: an operator acts on a child of
a live host from another process (design §11, §21). Parsing and printing only.

The command records a control request in the database (one short write beside the
host) and waits for the host to apply it (:mod:`delegation.engine.operators`), watching the file
rather than re-reading tables. With no live host the request stays queued and the next
host applies it at boot; the command says so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import secrets
import sys
import time
from typing import Any

from delegation.cli.show import missing_child, resolve_ids
from delegation.cli.terminal import printable
from delegation.records import ChildRecord
from delegation.store import controls
from delegation.store.controls import ControlRecord
from delegation.store.stores import open_watch, write_once
from delegation.usecases.inspector import Inspector

APPLY_TIMEOUT_S = 3.0  # a live host applies within about 0.1 s


def command(args: argparse.Namespace, url: str) -> int:
    """Run ``cancel`` or ``steer``; returns the exit code (1: refused, 0: done or queued)."""
    with Inspector(url) as inspector:
        inspector.check()
        refusal = resolve_ids(inspector, args)
        if refusal is not None:
            return _fail(args, refusal, "ambiguous_id")
        child = inspector.get_child(args.child, args.run)
        if child is None:
            return _fail(args, missing_child(args))
        if child.terminal and args.command != "send":
            return _fail(args, f"child {child.conversation_id} has already ended ({child.state})")
        try:
            action, message, request_id = _control(args)
        except ValueError as exc:
            return _fail(args, str(exc))
        control_id = write_once(
            url,
            lambda c: controls.submit(
                c, child.conversation_id, None if action == "event" else child.run_id, action,
                message, request_id, time.time(),
            ),
        )  # fmt: skip
        applied = _wait_applied(inspector, url, control_id)
        if applied is None:
            return _report(args, child, {"applied": False})
        outcome: dict[str, Any] = json.loads(applied.outcome or "{}")
        if "failure" in outcome:
            return _fail(args, str(outcome["failure"]), outcome.get("failureReason"))
        if args.command == "cancel" and getattr(args, "wait", False):
            outcome.update(_wait_ended(inspector, url, child))
        return _report(args, child, {"applied": True, **outcome})


def _control(args: argparse.Namespace) -> tuple[str, str, str]:
    """The control request a command records: its action, message and request id.

    Raises:
        ValueError: what the command was given cannot make one.
    """
    fresh = f"op-{secrets.token_hex(8)}"
    if args.command == "cancel":
        return "cancel", "", ""
    if args.command == "steer":
        if not args.message.strip():
            raise ValueError("a steer needs a nonempty message")
        return "steer", args.message, fresh
    if args.command == "input":
        decision = "approve" if args.approve else "deny" if args.deny else args.decision
        fields = {"inputId": args.input_id, "decision": decision, "text": args.text}
        return "input", json.dumps(fields), fresh
    try:
        payload = json.loads(args.data)
    except ValueError as exc:
        raise ValueError(f"--data is not JSON: {exc}") from None
    return "event", json.dumps({"key": args.key, "payload": payload}), args.idempotency_key or ""


def _wait_applied(inspector: Inspector, url: str, control_id: int) -> ControlRecord | None:
    """The control once a host applied it, or None after ``APPLY_TIMEOUT_S``."""
    found: list[ControlRecord] = []

    def applied() -> bool:
        control = inspector.control(control_id)
        if control is not None and control.applied_at is not None:
            found.append(control)
        return bool(found)

    with contextlib.closing(open_watch(url, 0.02)) as watch:
        watch.until(applied, APPLY_TIMEOUT_S)
    return found[0] if found else None


def _wait_ended(inspector: Inspector, url: str, child: ChildRecord) -> dict[str, Any]:
    """Wait (as long as it takes) until the execution is terminal; its state and error."""
    last: list[ChildRecord | None] = []

    def ended() -> bool:
        last[:] = [inspector.get_child(child.conversation_id, child.run_id)]
        return last[0] is None or last[0].terminal

    with contextlib.closing(open_watch(url, 0.05)) as watch:
        watch.until(ended)
    record = last[0]
    return {} if record is None else {"state": record.state, "error": record.error}


def _report(args: argparse.Namespace, child: ChildRecord, outcome: dict[str, Any]) -> int:
    document = {
        "action": args.command,
        "conversationId": child.conversation_id,
        "runId": child.run_id,
        **outcome,
    }
    if args.json:
        print(json.dumps(document))
        return 0
    who = f"{child.conversation_id} (run {child.run_id})"
    if not outcome["applied"]:
        print(
            f"{args.command} of {who} is queued: no live host applied it within"
            f" {APPLY_TIMEOUT_S:g} s; the next host to open the database applies it"
        )
    elif args.command == "cancel":
        state = outcome.get("state", "cancelling")
        error = outcome.get("error") or ""
        print(printable(f"cancelled {who}: {state}" + (f" ({error})" if error else "")))
    elif args.command == "input":
        print(printable(f"answered {args.input_id} of {who}: {outcome.get('state', '')}"))
    elif args.command == "send":
        kept = "sent" if outcome.get("accepted") else "already sent (nothing changed)"
        print(printable(f"event {args.key} to {child.conversation_id}: {kept}"))
    else:
        reason = f" ({outcome['reason']})" if outcome.get("reason") else ""
        print(f"steered {who}: {outcome.get('outcome')}{reason}")
    return 0


def _fail(args: argparse.Namespace, message: str, reason: str | None = None) -> int:
    if args.json:
        print(json.dumps({"error": message, "reason": reason or "refused"}))
    print(f"delegation: {printable(message)}", file=sys.stderr)
    return 1
