"""The inspection commands: ``children``, ``show``, ``events``, ``steps`` and ``leases``.

Printing only: every value comes from an :class:`Inspector`, which reads the file
through SQLite's read-only mode, so these commands are safe beside a running host.
Tables are for people (they fit the terminal, ``--wide`` for every column: see
:mod:`delegation.cli.listing`); ``--json`` is for scripts (one document, or JSON Lines for
``events`` so that ``--follow --json`` streams).

Children write much of what is printed (events, errors, outputs). Nothing of it may
drive the terminal (:mod:`delegation.cli.terminal`). ``--json`` output is left to JSON's own
escaping.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections import deque
from collections.abc import Callable
from datetime import datetime
from typing import Any

from rich.table import Table
from rich.text import Text

from delegation.cli.arguments import REFUSED, usage
from delegation.cli.listing import Column, table
from delegation.cli.terminal import cells, line_console, printable, printable_json, table_console
from delegation.codec import encode
from delegation.config import AdmissionPolicy, parse_scope
from delegation.machine import State
from delegation.records import ChildRecord, LeaseRecord, StepRow
from delegation.store import migrate
from delegation.store.prefixes import Kind
from delegation.store.steps import PATCH_PREFIX
from delegation.store.stores import write_once
from delegation.usecases.admission import ScopeUse, stored_policy
from delegation.usecases.inspector import MAX_STEPS_LISTED, MIN_PREFIX, AmbiguousId, Inspector
from delegation.usecases.views import (
    UNREADABLE,
    child_json,
    json_safe,
    lease_status,
    patch_name,
    step_json,
    wire_names,
)
from delegation.wire import Event

RECENT_EVENTS = 5
RECENT_STEPS = 10  # the last steps `show` lists; `steps` lists them all
_FIELDS = ("text", "tool_name", "input", "tool_output", "error")
# The arguments that name ids, with the kind of id each names: a unique prefix will do.
ID_ARGUMENTS: dict[str, Kind] = {
    "child": "conversation",
    "run": "run",
    "parent": "parent_run",
    "lease": "lease",
    "runner": "runner",
}
_NOUNS = {"parent_run": "parent run"}


def command(args: argparse.Namespace, url: str) -> int:
    """Run one inspection command on the database at ``url``; returns the exit code.

    Raises:
        errors.StoreError: the file is missing or unreadable (the CLI prints it).
    """
    commands: dict[str, Callable[[Inspector, argparse.Namespace], int]] = {
        "children": _children,
        "show": _show,
        "events": _events,
        "steps": _steps,
        "leases": _leases,
        "admission": _admission,
    }
    misused = misuse(args)
    if misused is not None:
        return usage(misused)
    with Inspector(url) as inspector:
        inspector.check()
        revision, head = inspector.revision(), migrate.head()
        if revision != head:
            found = f"schema {revision}" if revision else "no schema"
            return _fail(f"{found}, this delegation reads {head}: run `delegation db upgrade`")
        refusal = resolve_ids(inspector, args)
        if refusal is not None:
            return _fail(refusal)
        return commands[args.command](inspector, args)


def misuse(args: argparse.Namespace) -> str | None:
    """Why an inspection command line cannot be right (a usage error, exit 2), judged
    before the database is opened; or None."""
    if args.command == "children":
        if args.state is not None and args.state not in set(State):
            return f"unknown state {args.state!r}; use one of {', '.join(State)}"
        versioned = args.patch is not None or args.pinned
        if versioned and any(f is not None for f in (args.state, args.lease, args.parent)):
            return "--patch and --pinned take no --state, --lease or --parent"
        if args.patch is not None and (not args.patch or args.patch.startswith(PATCH_PREFIX[0])):
            return "--patch takes the name given to ctx.patched"
    if args.command == "admission":
        limits = (
            args.concurrency, args.rate, args.max_queued, args.queue_timeout, args.max_priority
        )  # fmt: skip
        given = any(value is not None for value in limits)
        named = "--concurrency, --rate, --max-queued, --queue-timeout"
        if args.scope is None and (given or args.remove):
            return f"{named}, --max-priority and --remove need a SCOPE"
        if args.remove and given:
            return f"--remove takes no {named} or --max-priority"
        if args.scope is not None:
            try:
                admission_change(args)
            except ValueError as exc:
                return str(exc)
    return None


def resolve_ids(inspector: Inspector, args: argparse.Namespace) -> str | None:
    """Every id argument made whole (a unique prefix stands for its id); None, or why
    not: a prefix that more than one id begins with."""
    for name, kind in ID_ARGUMENTS.items():
        text = getattr(args, name, None)
        if text is None:
            continue
        try:
            setattr(args, name, inspector.resolve(kind, text))
        except AmbiguousId as exc:
            shown = ", ".join(printable(c) for c in exc.candidates) + (", …" if exc.more else "")
            noun = _NOUNS.get(kind, kind)
            return (
                f"{printable(exc.prefix)} begins more than one {noun} id: {shown}; give more of it"
            )
    return None


def missing_child(args: argparse.Namespace) -> str:
    """``no child c-1 run r-2``, and why an id too short to be a prefix found nothing."""
    given = [args.child] + ([args.run] if args.run else [])
    said = f"no child {args.child}" + (f" run {args.run}" if args.run else "")
    if any(len(text) < MIN_PREFIX for text in given):
        return f"{said} (an id prefix needs at least {MIN_PREFIX} characters)"
    return said


# --- children ------------------------------------------------------------------------


def _children(inspector: Inspector, args: argparse.Namespace) -> int:
    if args.patch is not None or args.pinned:
        return _versioned(inspector, args)
    records = inspector.list_children(
        state=args.state, lease_id=args.lease, parent_run_id=args.parent, limit=args.limit
    )
    # Queued children show their place in the queue (design §22; 1: next).
    places = inspector.queue_positions() if any(r.state == "queued" for r in records) else {}
    if args.json:
        shown = [child_json(record) for record in records]
        for record, values in zip(records, shown, strict=True):
            if record.id in places:
                values["queuePosition"] = places[record.id]
        _print_json(shown)
        return 0
    console = table_console(wide=args.wide)
    width = None if args.wide else console.width
    console.print(table(records, child_columns(time.time(), places), inspector, width))
    return 0


def _versioned(inspector: Inspector, args: argparse.Namespace) -> int:
    """``children --patch NAME``: the live executions and the value each recorded for
    the patch; ``children --pinned``: the children pinned to a runner version (§34)."""
    now = time.time()
    if args.pinned:
        records = inspector.pinned(args.limit)
        extra = Column[ChildRecord]("pinned", lambda r: r.pinned_version or "")
        if args.json:
            _print_json([child_json(record) for record in records])
            return 0
    else:
        found = inspector.patch_values(args.patch, args.limit)
        if args.json:
            _print_json([{**child_json(record), "patch": value} for record, value in found])
            return 0
        values = {record.id: value for record, value in found}
        records = [record for record, _ in found]
        extra = Column[ChildRecord](f"patch {args.patch}", lambda r: _patch_cell(values[r.id]))
    console = table_console(wide=args.wide)
    columns = child_columns(now)
    columns.insert(3, extra)
    console.print(table(records, columns, inspector, None if args.wide else console.width))
    return 0


def _patch_cell(value: bool | None) -> str:
    return "not asked" if value is None else str(value).lower()


def child_columns(now: float, places: dict[int, int] | None = None) -> list[Column[ChildRecord]]:
    """The columns of ``children``: those at 80 columns, then the rest with ``--wide``.
    A queued child's state shows its place in the queue (``queued #3``)."""
    where = places or {}
    return [
        Column("conversation", lambda r: r.conversation_id, kind="conversation"),
        Column("run", lambda r: r.run_id, kind="run"),
        Column("state", lambda r: f"{r.state} #{where[r.id]}" if r.id in where else r.state),
        Column("profile", lambda r: r.profile, most=12),
        Column("runner", lambda r: r.runner_id, kind="runner", narrow=False),
        Column("extension", lambda r: r.extension_id, narrow=False),
        Column("lease", lambda r: r.lease_id or "", kind="lease", narrow=False),
        Column("parent conversation", lambda r: r.parent_conversation_id, narrow=False),
        Column("parent run", lambda r: r.parent_run_id, kind="parent_run", narrow=False),
        Column("created", lambda r: local_time(r.created_at), narrow=False),
        Column("finished", lambda r: local_time(r.finished_at), narrow=False),
        Column("age", lambda r: age(now - r.created_at)),
        Column("error / output", lambda r: shorten(r.error or r.output), fill=True),
    ]


# --- show ----------------------------------------------------------------------------


def _show(inspector: Inspector, args: argparse.Namespace) -> int:
    record = inspector.get_child(args.child, args.run)
    if record is None:
        return _missing(args)
    count, recent = 0, deque[Event](maxlen=RECENT_EVENTS)
    for event in inspector.all_events(record.conversation_id, record.run_id):
        count += 1
        recent.append(event)
    steps = inspector.steps(record.conversation_id, record.run_id, RECENT_STEPS, latest=True)
    asks = inspector.input_requests(record)
    drift = inspector.drift(record)  # None while its newest attempt runs
    versioned = record.version is not None or record.attempt_version is not None
    rewound_as = inspector.rewound_as(record)  # the executions rewound from it (§35)
    if args.json:
        document = child_json(record)
        if rewound_as:
            document["rewoundAs"] = rewound_as
        if asks:  # as the child's Result carries them (design §21)
            document["inputRequests"] = {key: json.loads(encode(ask)) for key, ask in asks.items()}
        document["eventCount"] = count
        document["recentEvents"] = [json.loads(encode(event)) for event in recent]
        document["stepCount"] = steps.count
        document["recentSteps"] = [
            step_json(step, steps.versions.get(step.ordinal)) for step in steps.steps
        ]
        if drift or (drift is not None and versioned):  # design §34
            document["drift"] = drift
        _print_json(document)
        return 0
    grid = Table("field", "value", show_header=False, box=None, pad_edge=False)
    grid.columns[0].no_wrap = True
    grid.columns[1].overflow = "fold"  # a long word is folded onto the next line, never cut
    for key, value in child_json(record).items():
        if isinstance(value, dict):  # its newlines are layout: escaped line by line
            grid.add_row(Text(key), Text(printable_json(value)))
            continue
        if key.endswith("At"):
            value = local_time(value)
        grid.add_row(*cells(key, "" if value is None else str(value)))
    if rewound_as:
        grid.add_row(*cells("rewoundAs", ", ".join(rewound_as)))
    grid.add_row(*cells("events", str(count)))
    grid.add_row(*cells("steps", str(steps.count)))
    for key, ask in asks.items():
        choices = f" ({' / '.join(ask.options)})" if ask.options else ""
        said = f"{ask.kind}: {ask.prompt}{choices}"
        grid.add_row(*cells(f"input {key}", said))
    if drift:  # recorded steps the newest attempt never asked for (design §34)
        grid.add_row(*cells("drift", ", ".join(drift)))
    elif drift is None and versioned:
        grid.add_row(*cells("drift", "(its newest attempt runs)"))
    console = table_console()
    console.print(grid)
    for event in recent:
        console.print(event_line(event))
    if steps.steps:
        columns = step_columns(steps.versions)
        console.print(table(steps.steps, columns, inspector, console.width))
    if steps.more:
        said = f"{steps.more} earlier: delegation steps {record.conversation_id}"
        console.print(Text(printable(said), style="dim"))
    return 0


# --- events --------------------------------------------------------------------------


def _events(inspector: Inspector, args: argparse.Namespace) -> int:
    record = inspector.get_child(args.child, args.run)
    if record is None:
        return _missing(args)
    emit = _json_line if args.json else _human_line()
    if not args.follow:
        for event in inspector.all_events(record.conversation_id, record.run_id, args.after):
            emit(event)
        return 0
    for event in inspector.follow(record.conversation_id, record.run_id, args.after):
        emit(event)
    return ended(inspector.get_child(record.conversation_id, record.run_id), args.json)


GONE = "the child is no longer in the database (purged)"


def ended(record: ChildRecord | None, as_json: bool) -> int:
    """How a followed execution ended, as its last line: its final state and error (or
    that it is gone, exit 1: a follow ends only once its child is terminal or gone)."""
    if as_json:
        end: dict[str, Any] = {"state": None, "error": GONE, "output": ""}
        if record is not None:
            end = {"state": record.state, "error": record.error, "output": record.output}
        sys.stdout.write(json.dumps({"end": end}) + "\n")
        sys.stdout.flush()
    elif record is None:
        line_console().print(Text(f"-- gone: {GONE}", style="bold"))
    else:
        how = f"{record.state}: {record.error}" if record.error else record.state
        line_console().print(Text(f"-- {printable(how)}", style="bold"))
    return 0 if record is not None else REFUSED


def event_line(event: Event) -> Text:
    line = Text(f"{event.sequence:>6} ", style="dim")
    line.append(f"{printable(event.kind):<12}", style="bold")
    parts = [printable(getattr(event, name)) for name in _FIELDS if getattr(event, name)]
    if event.success is not None:
        parts.append("ok" if event.success else "failed")
    line.append(" " + " | ".join(parts))
    return line


def _json_line(event: Event) -> None:
    sys.stdout.write(encode(event).decode() + "\n")
    sys.stdout.flush()


def _human_line() -> Callable[[Event], None]:
    console = line_console()

    def emit(event: Event) -> None:
        console.print(event_line(event))
        console.file.flush()

    return emit


# --- steps ---------------------------------------------------------------------------


def _steps(inspector: Inspector, args: argparse.Namespace) -> int:
    found = inspector.steps(args.child, args.run)
    record = found.child
    if record is None:
        return _missing(args)
    if args.json:
        document = {
            "conversationId": record.conversation_id,
            "runId": record.run_id,
            "stepCount": found.count,
            "steps": [step_json(step, found.versions.get(step.ordinal)) for step in found.steps],
        }
        _print_json(document)
        return 0
    if not found.steps:
        said = f"no steps recorded by child {record.conversation_id} run {record.run_id}"
        line_console().print(Text(printable(said)))
        return 0
    console = table_console(wide=args.wide)
    console.print(
        table(
            found.steps,
            step_columns(found.versions),
            inspector,
            None if args.wide else console.width,
        )
    )
    if found.more:  # only past a host's max_steps above the default
        said = f"{found.more} more not listed (a listing stops at {MAX_STEPS_LISTED})"
        console.print(Text(said, style="dim"))
    return 0


def step_columns(versions: dict[int, str] | None = None) -> list[Column[StepRow]]:
    """The columns of ``steps``: the name takes what the line has left (cut with ``…``
    unless ``--wide``; a patch marker shown ``patched NAME``); a step's value is never
    shown. The runner version that recorded each, when one of them has one (§34)."""
    columns = [
        Column("#", lambda r: str(r.ordinal)),
        Column("name", _step_name, fill=True),
        Column("size", lambda r: byte_size(r.size)),
        Column("recorded", lambda r: local_time(r.recorded_at)),
    ]
    if versions:
        columns.append(Column("version", lambda r: versions.get(r.ordinal, ""), most=16))
    return columns


def _step_name(step: StepRow) -> str:
    patch = patch_name(step.name)
    return step.name if patch is None else f"patched {patch}"


def byte_size(size: int) -> str:
    """``512 B``, ``1.5 KiB``, ``1.0 MiB``."""
    if size < 1024:
        return f"{size} B"
    if size < 1024 * 1024:
        return f"{size / 1024:.1f} KiB"
    return f"{size / (1024 * 1024):.1f} MiB"


# --- leases --------------------------------------------------------------------------


def _admission(inspector: Inspector, args: argparse.Namespace) -> int:
    """``delegation admission``: set or remove a scope's policy, then list them all. A
    policy for a scope whose runner, extension or preset the database has never seen is
    stored (a runner may bring it later) with one warning line: it may be misspelled."""
    if args.scope is not None:
        changed = admission_change(args)
        write_once(inspector.url, lambda c: stored_policy(c, time.time(), args.scope, changed))
        unseen = None if changed is None else inspector.unseen(args.scope)
        if unseen is not None:
            print(
                f"delegation: warning: this database has never seen {printable(unseen)}: the"
                " policy is stored, and holds once a host brings it (never, if misspelled)",
                file=sys.stderr,
            )
    found = inspector.admission()
    if args.json:
        _print_json([scope_json(use) for use in found])
        return 0
    if not found:
        print("no admission policy")
        return 0
    console = table_console(wide=False)
    console.print(table(found, admission_columns(), inspector, console.width))
    return 0


def admission_change(args: argparse.Namespace) -> AdmissionPolicy | None:
    """The policy ``delegation admission SCOPE ...`` stores (None: ``--remove``).

    Raises:
        ValueError: the scope or a value is not one a policy takes.
    """
    parse_scope(args.scope)
    if args.remove:
        return None
    return AdmissionPolicy(
        concurrency=args.concurrency,
        rate=args.rate,
        max_queued=1024 if args.max_queued is None else args.max_queued,
        queue_timeout_s=args.queue_timeout,
        max_priority=args.max_priority,
    )


def scope_json(use: ScopeUse) -> dict[str, Any]:
    policy = use.row.policy
    return {
        "scope": use.scope,
        "concurrency": policy.concurrency,
        "rate": None if policy.rate is None else {"n": policy.rate[0], "seconds": policy.rate[1]},
        "maxQueued": policy.max_queued,
        "queueTimeoutS": policy.queue_timeout_s,
        "maxPriority": policy.max_priority,
        "inUse": use.in_use,
        "queued": use.queued,
    }


def admission_columns() -> list[Column[ScopeUse]]:
    def rate(use: ScopeUse) -> str:
        given = use.row.policy.rate
        return "" if given is None else f"{given[0]}/{given[1]:g}s"

    def slots(use: ScopeUse) -> str:
        limit = use.row.policy.concurrency
        return f"{use.in_use}/{'-' if limit is None else limit}"

    return [
        Column("scope", lambda u: u.scope, fill=True),
        Column("in use", slots),
        Column("rate", rate),
        Column("queued", lambda u: f"{u.queued}/{u.row.policy.max_queued}"),
        Column(
            "timeout", lambda u: "" if (t := u.row.policy.queue_timeout_s) is None else f"{t:g}s"
        ),
        Column("max prio", lambda u: "" if (p := u.row.policy.max_priority) is None else str(p)),
    ]


def _leases(inspector: Inspector, args: argparse.Namespace) -> int:
    records = inspector.leases(args.runner)
    now = time.time()
    if args.json:
        _print_json(
            [wire_names({**dataclasses.asdict(r), "status": lease_status(r, now)}) for r in records]
        )
        return 0
    console = table_console(wide=args.wide)
    console.print(
        table(records, lease_columns(now), inspector, None if args.wide else console.width)
    )
    return 0


def lease_columns(now: float) -> list[Column[LeaseRecord]]:
    """The columns of ``leases``: those at 80 columns, then the rest with ``--wide``."""
    return [
        Column("lease", lambda r: r.lease_id, kind="lease"),
        Column("runner", lambda r: r.runner_id, kind="runner"),
        Column("extension", lambda r: r.extension_id, most=12),
        Column("parent run", lambda r: r.run_id or "", narrow=False),
        Column("parent conversation", lambda r: r.conversation_id or "", narrow=False),
        Column("children", lambda r: str(r.children)),
        Column("created", lambda r: local_time(r.created_at), narrow=False),
        Column("status", lambda r: lease_status(r, now), fill=True),
    ]


def age(seconds: float) -> str:
    """How long ago, in its largest unit: ``42s``, ``5m``, ``3h``, ``12d``."""
    if not math.isfinite(seconds):  # from a time stored unreadable
        return UNREADABLE
    seconds = max(0, int(seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


# --- helpers -------------------------------------------------------------------------


def local_time(timestamp: float | None) -> str:
    if timestamp is None:
        return ""
    try:
        return datetime.fromtimestamp(timestamp).astimezone().isoformat(timespec="seconds")
    except (ValueError, OverflowError, OSError):  # NaN (stored unreadable), or no date
        return UNREADABLE


def shorten(text: str, width: int = 60) -> str:
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 1] + "…"


def _print_json(document: Any) -> None:
    sys.stdout.write(json.dumps(json_safe(document), indent=2) + "\n")


def _missing(args: argparse.Namespace) -> int:
    return _fail(missing_child(args))


def _fail(message: str) -> int:
    """A refusal (exit 1): the database has no such thing, or cannot be read."""
    print(f"delegation: {message}", file=sys.stderr)
    return REFUSED
