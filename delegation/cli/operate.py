"""``delegation cancel``, ``steer``, ``input``, ``send``, ``unpin``, ``rewind`` and
``controls``: an operator acts on a child from another process (design §11, §21,
§33-35). Parsing and printing only: the work is :class:`delegation.operator.Operator`'s.

A control is judged against the database when given (refused at once, one line, exit 1,
nothing recorded), recorded, and waited for up to ``--wait`` seconds while the host that
owns the child applies it. With no live host it stays pending, the command says so, and
the next host applies it at boot; ``delegation controls`` shows what became of it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import secrets
import sys
import time
from typing import TYPE_CHECKING, Any

from delegation.cli.arguments import (
    CHILD_HELP,
    REFUSED,
    RUN_HELP,
    add_db,
    add_json,
    json_value,
    positive_int,
    wait_seconds,
)

if TYPE_CHECKING:
    from delegation.operator import Operator, Outcome

COMMANDS = ("cancel", "steer", "input", "send", "unpin", "rewind", "controls")
WAIT_S = 3.0  # how long a command waits for the host by default (it applies in ~0.1 s)
WAIT_HELP = f"seconds to wait for the host to apply it (default {WAIT_S:g}; 0: do not wait)"


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The operator's commands, on the ``delegation`` command's sub-parsers."""
    cancel = commands.add_parser("cancel", help="cancel a child (applied within a second)")
    _child(cancel)
    cancel.add_argument(
        "--wait", nargs="?", type=wait_seconds, const=math.inf, default=None, metavar="SECONDS",
        help="until the child has stopped (at most SECONDS)",
    )  # fmt: skip
    add_json(cancel)

    steer = commands.add_parser("steer", help="steer a running child")
    _child(steer, "message", help="the new heading for the child")
    _wait(steer)

    answer = commands.add_parser(
        "input", help="answer a waiting child's input request (applied within a second)"
    )
    _child(answer, "input_id", metavar="INPUT_ID", help="the request's inputId")
    given = answer.add_mutually_exclusive_group(required=True)
    given.add_argument("--approve", action="store_true", help="approve (an approval)")
    given.add_argument("--deny", action="store_true", help="deny (an approval)")
    given.add_argument("--text", help="a text answer (a request without options)")
    given.add_argument("--decision", help="one of the request's options")
    _wait(answer)

    send = commands.add_parser(
        "send", help="send an event to a child's conversation (ctx.wait_event takes it)"
    )
    _child(send, "key", help="the event's key", run=False)
    send.add_argument(
        "--data", type=json_value, default=None, help="its payload, as JSON (default: null)"
    )
    send.add_argument("--id", dest="idempotency_key", help="sent once per conversation")
    send.set_defaults(run=None)  # to the conversation: its newest execution waits for it
    _wait(send)

    unpin = commands.add_parser(
        "unpin", help="let the current code resume a child its runner version pinned"
    )
    _child(unpin)
    _wait(unpin)

    rewind = commands.add_parser(
        "rewind",
        help="run a child's conversation again from a recorded step of an ended execution",
    )
    add_db(rewind)
    rewind.add_argument("child", help=CHILD_HELP)
    rewind.add_argument(
        "--run", required=True, help="the ended execution to rewind (runId, or a unique prefix)"
    )
    rewind.add_argument("--step", help="the step to run again from (default: after its last step)")
    _wait(rewind)

    listing = commands.add_parser(
        "controls", help="the controls given (cancel, steer, input, send …) and their outcomes"
    )
    add_db(listing)
    listing.add_argument("child", nargs="?", help=f"{CHILD_HELP} (default: every child)")
    listing.add_argument(
        "--limit", type=positive_int, default=50, help="at most this many, newest first"
    )
    listing.add_argument(
        "--wait", type=wait_seconds, default=0.0, metavar="SECONDS",
        help="first wait up to SECONDS for the pending ones to be applied",
    )  # fmt: skip
    listing.set_defaults(run=None)
    add_json(listing)


def _child(parser: argparse.ArgumentParser, *more: str, run: bool = True, **more_spec: Any) -> None:
    add_db(parser)
    parser.add_argument("child", help=CHILD_HELP)
    if more:
        parser.add_argument(*more, **more_spec)
    if run:
        parser.add_argument("--run", help=RUN_HELP)


def _wait(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--wait", type=wait_seconds, default=WAIT_S, metavar="SECONDS", help=WAIT_HELP
    )
    add_json(parser)


def command(args: argparse.Namespace, url: str) -> int:
    """Run one of :data:`COMMANDS`; returns the exit code (1: refused, 0: done or pending;
    a usage error exits 2 in argparse, before this)."""
    from delegation import errors
    from delegation.cli.show import missing_child, resolve_ids
    from delegation.operator import Operator

    with Operator(url) as operator:
        operator.inspector.check()
        refusal = resolve_ids(operator.inspector, args)
        if refusal is not None:
            return _fail(args, refusal, "ambiguous_id")
        if args.command == "controls":
            return _controls(operator, args)
        child = operator.show(args.child, args.run)
        if child is None and args.command == "rewind" and operator.show(args.child):
            unknown = errors.RewindRunUnknown()  # the source named is not of this child
            return _fail(args, str(unknown), unknown.reason)
        if child is None:
            return _fail(args, missing_child(args), "child_not_found")
        try:
            outcome = _give(operator, args, child.run_id)
        except errors.DelegationError as exc:
            return _fail(args, str(exc), exc.reason)
        fields = dict(outcome.fields)
        if args.command == "cancel" and args.wait is not None and outcome.status == "applied":
            ended = operator.wait_ended(child.conversation_id, child.run_id, args.wait)
            if ended is not None:
                fields.update(state=ended.state, error=ended.error)
        return _report(args, outcome, fields, child.run_id)


def _give(operator: Operator, args: argparse.Namespace, run_id: str) -> Outcome:
    """The control a command gives, given and waited for.

    Raises:
        errors.DelegationError: refused.
    """
    child = args.child
    if args.command == "cancel":  # --wait: for the host to apply it too, if shorter
        return operator.cancel(child, run_id, wait=_cancel_wait(args))
    request_id = f"op-{secrets.token_hex(8)}"
    if args.command == "steer":
        return operator.steer(child, args.message, run_id, request_id=request_id, wait=args.wait)
    if args.command == "unpin":
        return operator.unpin(child, run_id, wait=args.wait)
    if args.command == "rewind":
        return operator.rewind(child, run_id, args.step, request_id=request_id, wait=args.wait)
    if args.command == "input":
        decision = "approve" if args.approve else "deny" if args.deny else args.decision
        return operator.answer_input(
            child, args.input_id, decision=decision, text=args.text, run_id=run_id,
            request_id=request_id, wait=args.wait,
        )  # fmt: skip
    key = args.idempotency_key or ""
    return operator.send_event(child, args.key, args.data, idempotency_key=key, wait=args.wait)


def _cancel_wait(args: argparse.Namespace) -> float:
    """How long a cancel waits for the host to apply it: ``--wait`` SECONDS if shorter."""
    return WAIT_S if args.wait is None else min(WAIT_S, args.wait)


def _report(args: argparse.Namespace, outcome: Outcome, fields: dict[str, Any], run_id: str) -> int:
    from delegation.cli.terminal import printable

    applied = outcome.status == "applied"
    if args.json:
        print(json.dumps({
            "action": args.command, "conversationId": outcome.conversation_id,
            "runId": run_id, "applied": applied, **fields,
        }))  # fmt: skip
        return 0
    who = f"{outcome.conversation_id} (run {run_id})"
    if not applied:
        waited = _cancel_wait(args) if args.command == "cancel" else args.wait
        if not waited:  # --wait 0: a live host may apply it in a moment
            print(
                f"{args.command} of {who} is recorded (control {outcome.id}, not waited for):"
                f" `delegation controls {outcome.conversation_id}` shows what becomes of it"
            )
            return 0
        print(
            f"{args.command} of {who} is queued: no live host applied it within {waited:g} s;"
            f" the next host to open the database applies it (control {outcome.id}:"
            f" `delegation controls {outcome.conversation_id}` shows what becomes of it)"
        )
    elif args.command == "cancel":
        state = fields.get("state", "cancelling")
        error = fields.get("error") or ""
        print(printable(f"cancelled {who}: {state}" + (f" ({error})" if error else "")))
    elif args.command == "input":
        print(printable(f"answered {args.input_id} of {who}: {fields.get('state', '')}"))
    elif args.command == "unpin":
        print(printable(f"unpinned {who}: {fields.get('state', '')}"))
    elif args.command == "rewind":
        place = f"before step {args.step!r}" if args.step is not None else "after its last step"
        new = f"{fields.get('rewoundAs', '')} ({fields.get('state', '')})"
        print(printable(f"rewound {who} {place}: new execution {new}"))
    elif args.command == "send":
        kept = "sent" if fields.get("accepted") else "already sent (nothing changed)"
        print(printable(f"event {args.key} to {outcome.conversation_id}: {kept}"))
    else:
        reason = f" ({fields['reason']})" if fields.get("reason") else ""
        print(f"steered {who}: {fields.get('outcome')}{reason}")
    return 0


def _controls(operator: Operator, args: argparse.Namespace) -> int:
    from delegation import errors
    from delegation.cli.terminal import printable

    conversation = args.child  # None: every child's
    listed = operator.controls(conversation, args.limit)
    deadline = time.monotonic() + args.wait
    for pending in [o for o in listed if o.status == "pending"]:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        with contextlib.suppress(errors.DelegationError):  # a refusal is listed with the rest
            operator.wait(pending.id, left)
    if args.wait:
        listed = operator.controls(conversation, args.limit)
    if args.json:
        print(json.dumps([_control_json(outcome) for outcome in listed]))
        return 0
    for outcome in listed:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(outcome.created_at))
        said = outcome.error if outcome.status == "refused" else _said(outcome.fields)
        reason = f" [{outcome.reason}]" if outcome.reason else ""
        print(printable(
            f"{outcome.id:>6}  {when}  {outcome.action:<6}  {outcome.conversation_id}"
            f"  {outcome.status}{reason}" + (f": {said}" if said else "")
        ))  # fmt: skip
    return 0


def _said(fields: dict[str, Any]) -> str:
    return ", ".join(f"{key} {value}" for key, value in fields.items() if value not in ("", None))


def _control_json(outcome: Outcome) -> dict[str, Any]:
    return {
        "id": outcome.id, "action": outcome.action, "conversationId": outcome.conversation_id,
        "runId": outcome.run_id, "requestId": outcome.request_id,
        "createdAt": outcome.created_at, "appliedAt": outcome.applied_at,
        "status": outcome.status, "reason": outcome.reason, "error": outcome.error,
        "outcome": outcome.fields,
    }  # fmt: skip


def _fail(args: argparse.Namespace, message: str, reason: str | None = None) -> int:
    from delegation.cli.terminal import printable

    if args.json:
        print(json.dumps({"error": message, "reason": reason or "refused"}))
    print(f"delegation: {printable(message)}", file=sys.stderr)
    return REFUSED
