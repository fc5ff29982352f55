"""The ``delegation`` command: argument parsing and printing only.

It calls the same API users call: ``serve`` runs an :class:`Engine` host,
``demo`` drives one, and the inspection commands read the database through an
:class:`Inspector` (read-only, safe while a host runs).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from delegation import errors
from delegation.about import DISTRIBUTION
from delegation.cli import completion, operate
from delegation.cli.arguments import (
    CHILD_HELP,
    DEFAULT_DB,
    PASSWORD_ON_COMMAND_LINE,
    REFUSED,
    RUN_HELP,
    count,
    positive_int,
    positive_seconds,
    priority,
    rate,
    usage,
    user_id,
)
from delegation.cli.arguments import add_db as _add_db
from delegation.cli.arguments import add_json as _add_json
from delegation.cli.arguments import add_wide as _add_wide
from delegation.store import passwords

# Each command imports what it needs when it runs: `delegation --version` and `--help`
# load no engine, store or wire types (README: "Startup").

# The longest path a Unix socket address holds (sun_path, less its terminating NUL).
MAX_SOCKET_PATH = 107


def db_url(where: str) -> str:
    """``--db``: a SQLite file's path, or a database URL (``sqlite:///PATH``,
    ``postgresql+psycopg://USER@HOST/DB``).

    Raises:
        ValueError: a URL of no store delegation has.
    """
    if "://" in where:
        from delegation.store.stores import normalize

        return normalize(where)
    return f"sqlite:///{Path(where).expanduser().resolve()}"


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed(DISTRIBUTION)
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="delegation", description="Durable, credential-free child runs for agent hosts."
    )
    parser.add_argument("--version", action="version", version=f"delegation {version()}")
    _add_db(parser)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="run a host speaking JSON-RPC 2.0")
    where = serve.add_mutually_exclusive_group()
    where.add_argument("--stdio", action="store_true", help="one connection on stdin/stdout")
    where.add_argument("--socket", metavar="PATH", help="a Unix socket (mode 0600)")
    _add_db(serve)
    serve.add_argument(
        "--runner", default="scripted", help="scripted, command, or module:attr (default scripted)"
    )
    serve.add_argument("--runner-config", type=Path, help="TOML settings for a built-in runner")
    serve.add_argument(
        "--allow-uid", type=user_id, help="the peer uid allowed on the socket (default: this uid)"
    )
    serve.add_argument("--lease-lifetime", type=positive_seconds, help="lease lifetime in seconds")
    serve.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        help="what is logged on stderr (default $DELEGATION_LOG, else warning)",
    )
    serve.add_argument(
        "--log-json", action="store_true", help="one JSON object per log line, with its fields"
    )
    serve.add_argument(
        "--max-inflight",
        type=positive_int,
        help="requests served at once per connection (default 64)",
    )
    serve.add_argument(
        "--max-connections",
        type=positive_int,
        help="connections served at once on --socket; the next is refused (default 64)",
    )
    serve.add_argument(
        "--idle-timeout",
        type=positive_seconds,
        help="close a --socket connection that sends nothing for this long while nothing"
        " of it is in flight or unread (default 60)",
    )
    serve.add_argument(
        "--request-timeout",
        type=positive_seconds,
        help="close a --socket connection whose request line (or first request) takes"
        " this long to arrive whole (default 10)",
    )
    serve.add_argument(
        "--max-runner-connections",
        type=positive_int,
        help="connections one runner may hold at once on --socket; its next registration"
        " is refused (default 16)",
    )
    serve.add_argument(
        "--max-page-bytes",
        type=positive_int,
        help="the encoded size a page of events stops before (default 4 MiB)",
    )

    contained = commands.add_parser(
        "containment", help="start one command child and print what it could and could not do"
    )
    contained.add_argument(
        "--runner-config", type=Path, help="the command runner's TOML (read_only, net_connect...)"
    )
    contained.add_argument(
        "--bench", type=positive_int, metavar="N", help="also time N starts of each kind"
    )
    _add_json(contained)

    demo = commands.add_parser("demo", help="the guided tour: crash a host and watch it resume")
    _add_db(demo)
    demo.add_argument("--fast", action="store_true", help="shorter steps")
    demo.add_argument("--runner", choices=("scripted", "pydantic-ai"), default="scripted")
    completion.add_parser(commands)

    children = commands.add_parser("children", help="list child runs, newest first")
    _add_db(children)
    children.add_argument(
        "--state", help="prepared, queued, admitted, running, waiting, done or cancelled"
    )
    children.add_argument("--lease", help="only children under this leaseId (or its prefix)")
    children.add_argument("--parent", help="only children of this parent runId (or its prefix)")
    children.add_argument("--limit", type=positive_int, default=50)
    versions = children.add_mutually_exclusive_group()
    versions.add_argument(
        "--patch",
        metavar="NAME",
        help="the live children and the value each recorded for ctx.patched(NAME)",
    )
    versions.add_argument(
        "--pinned", action="store_true", help="only children pinned to a runner version"
    )
    _add_json(children)
    _add_wide(children)

    show = commands.add_parser("show", help="one child run in detail")
    _add_db(show)
    show.add_argument("child", help=CHILD_HELP)
    show.add_argument("--run", help=RUN_HELP)
    _add_json(show)

    events = commands.add_parser("events", help="a child's events")
    _add_db(events)
    events.add_argument("child", help=CHILD_HELP)
    events.add_argument("--run", help=RUN_HELP)
    events.add_argument("--after", type=int, default=0, help="only events after this sequence")
    events.add_argument("--follow", action="store_true", help="keep printing until it ends")
    _add_json(events)

    steps = commands.add_parser(
        "steps", help="the steps a child recorded (name, size, when; never the value)"
    )
    _add_db(steps)
    steps.add_argument("child", help=CHILD_HELP)
    steps.add_argument("--run", help=RUN_HELP)
    _add_json(steps)
    _add_wide(steps)

    operate.add_parsers(commands)

    leases = commands.add_parser("leases", help="leases and tombstones")
    _add_db(leases)
    leases.add_argument("--runner", help="only this runnerId (or its prefix)")
    _add_json(leases)
    _add_wide(leases)

    policy = commands.add_parser(
        "admission",
        help="admission policies and the slots in use; set or remove one (design §22)",
    )
    _add_db(policy)
    policy.add_argument(
        "scope", nargs="?", help="runner:R, extension:R/E, preset:R/E/P or parent:C to set"
    )
    policy.add_argument("--concurrency", type=positive_int, help="children at once")
    policy.add_argument(
        "--rate", type=rate, metavar="N/SECONDS", help="N admissions per SECONDS (e.g. 10/60)"
    )
    policy.add_argument("--max-queued", type=count, help="children waiting at most (1024)")
    policy.add_argument("--queue-timeout", type=positive_seconds, help="seconds a child waits")
    policy.add_argument(
        "--max-priority", type=priority, help="the highest priority a child may ask (0-9)"
    )
    policy.add_argument("--remove", action="store_true", help="remove the scope's policy")
    _add_json(policy)

    db = commands.add_parser("db", help="the database schema")
    db_commands = db.add_subparsers(dest="db_command", required=True, metavar="ACTION")
    for action, says in (
        ("upgrade", "migrate the database to the newest schema (progress on a terminal)"),
        ("current", "print the schema revision"),
    ):
        db_action = db_commands.add_parser(action, help=says)
        _add_db(db_action)
        _add_json(db_action)

    web = commands.add_parser("web", help="a live, read-only page (needs durable-delegation[web])")
    _add_db(web)
    web.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    web.add_argument("--port", type=int, default=8765, help="port (default 8765; 0: any free)")
    web.add_argument(
        "--no-token",
        action="store_true",
        help="ask no token (a trusted machine only: whoever reaches the port reads every child)",
    )
    web.add_argument(
        "--a2a",
        action="store_true",
        help="also serve an A2A face at /a2a (needs durable-delegation[a2a]; docs/a2a.md)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = (
        getattr(args, "log_level", None) or os.environ.get("DELEGATION_LOG", "WARNING")
    ).upper()
    if not isinstance(logging.getLevelName(level), int):
        return usage(f"DELEGATION_LOG={level.lower()} is not a log level (try info or debug)")
    handler = logging.StreamHandler(sys.stderr)
    if getattr(args, "log_json", False):
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(_ActionFormatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])
    for chatty in ("alembic", "apscheduler"):  # their routine steps are not ours to show
        logging.getLogger(chatty).setLevel(max(logging.WARNING, logging.getLevelName(level)))
    try:
        return _run(args)
    except errors.DelegationError as exc:
        from delegation.cli.terminal import printable  # a message may quote what a peer sent

        print(f"delegation: {printable(str(exc))} ({exc.reason}){_why(exc)}", file=sys.stderr)
        return REFUSED
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`delegation events --json | head`): quiet, as a filter
        # is. What is still buffered for stdout goes nowhere, not into a traceback.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return REFUSED


def _why(exc: errors.DelegationError) -> str:
    """For an unreachable database, what the driver said first (one line, no password:
    libpq names the host and port, never the URL)."""
    cause = exc.__cause__
    if not isinstance(exc, errors.StoreUnavailable) or cause is None:
        return ""
    from delegation.cli.terminal import printable

    said = str(getattr(cause, "orig", None) or cause).strip().splitlines()
    return f": {printable(said[0])}" if said else ""


class _ActionFormatter(logging.Formatter):
    """Ends a record's line with its stable ``action`` key, when it has one: what a
    script (or a test) can match without depending on the wording."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        action = getattr(record, "action", None)
        return line if action is None else f"{line} action={action}"


# The attributes every LogRecord has: what is left in a record's __dict__ is what the
# call passed in ``extra`` (the structured fields).
_RECORD_FIELDS = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class _JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, and every structured
    field the call passed (``action``, ids, counts); a traceback as ``exception``."""

    def format(self, record: logging.LogRecord) -> str:
        import json

        line: dict[str, object] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS and key not in line:
                line[key] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def _run(args: argparse.Namespace) -> int:
    # Only --db itself is refused: the same URL from DELEGATION_DB is the way to give it.
    if passwords.in_url(getattr(args, "db", "")):
        return usage(PASSWORD_ON_COMMAND_LINE)
    if args.command == "completion":  # needs no database
        print(completion.script(args.shell, build_parser()), end="")
        return 0
    if args.command == "containment":  # nor does this
        return _containment(args)
    if getattr(args, "db", None) is None:
        args.db = os.environ.get("DELEGATION_DB") or DEFAULT_DB
    try:
        args.url = db_url(args.db)
    except ValueError as exc:
        return usage(f"--db {passwords.redacted(args.db)}: {exc}")
    if args.command == "serve":
        return _serve(args)
    if args.command == "demo":
        from delegation.cli.demo import run_demo

        return run_demo(args.url, fast=args.fast, runner=args.runner)
    if args.command == "db":
        return _db(args)
    if args.command == "web":
        return _web(args)
    if args.command in operate.COMMANDS:
        return operate.command(args, args.url)
    from delegation.cli import show

    return show.command(args, args.url)


def _serve(args: argparse.Namespace) -> int:
    import asyncio

    from delegation.config import EngineConfig
    from delegation.engine import Engine
    from delegation.host.serve import (
        IDLE_TIMEOUT_S,
        MAX_CONNECTIONS,
        MAX_INFLIGHT,
        MAX_RUNNER_CONNECTIONS,
        REQUEST_TIMEOUT_S,
        serve,
    )
    from delegation.runners import load_runner

    # Every refusal before the engine opens: a refused start creates nothing.
    refusal = _serve_paths(args)
    if refusal is not None:
        return usage(refusal)
    try:
        runner = load_runner(args.runner, args.runner_config)
    except (ValueError, ImportError, AttributeError, OSError) as exc:
        return usage(f"cannot load runner {args.runner!r}: {exc}")
    limits = {"lease_lifetime_s": args.lease_lifetime, "max_page_bytes": args.max_page_bytes}
    config = EngineConfig(**{name: value for name, value in limits.items() if value is not None})
    engine = Engine(args.url, runner=runner, config=config)
    try:
        asyncio.run(
            serve(
                engine,
                socket_path=args.socket,
                allowed_uid=args.allow_uid,
                max_inflight=args.max_inflight or MAX_INFLIGHT,
                max_connections=args.max_connections or MAX_CONNECTIONS,
                idle_timeout=args.idle_timeout or IDLE_TIMEOUT_S,
                request_timeout=args.request_timeout or REQUEST_TIMEOUT_S,
                max_runner_connections=args.max_runner_connections or MAX_RUNNER_CONNECTIONS,
                ready=_listening,
            )
        )
    except FileExistsError as exc:
        return usage(str(exc))
    except OSError as exc:  # the socket could not be bound, say: one line, no traceback
        print(f"delegation: {exc}", file=sys.stderr)
        return REFUSED
    return 0


def _listening(path: str) -> None:
    """One line once ``serve --socket`` takes connections, and where: a first client
    otherwise raced the start into FileNotFoundError; a script may wait for it."""
    print(f"delegation serve: listening on {path}", flush=True)


def _containment(args: argparse.Namespace) -> int:
    import json

    from delegation.runners.check import observe, render
    from delegation.runners.command import CommandConfigError, CommandRunner

    try:
        runner = (
            CommandRunner.from_file(args.runner_config)
            if args.runner_config
            else CommandRunner({"probe": ["true"]})
        )
    except (OSError, CommandConfigError) as exc:
        return usage(f"--runner-config: {exc}")
    report = observe(runner.containment)
    if args.bench:
        from delegation.runners.check import spawn_cost

        report["spawn_to_first_line"] = spawn_cost(runner.containment, args.bench)
    print(json.dumps(report) if args.json else render(report))
    return REFUSED if "error" in report else 0


def _serve_paths(args: argparse.Namespace) -> str | None:
    """Why the paths given to ``serve`` cannot work, or None."""
    from delegation.store.stores import file_of

    database, shown = file_of(args.url), passwords.redacted(args.db)
    # A database server (file_of is None) answers for itself when the engine opens.
    if database is not None and not database.parent.is_dir():
        return f"--db {shown}: no directory {database.parent}"
    if database is not None and database.is_dir():
        return f"--db {shown} is a directory"
    if args.socket is None:
        return None if _stdin_open() else "--stdio: standard input is closed"
    if not args.socket:
        return "--socket: an empty path"
    where = Path(args.socket)
    if not where.parent.is_dir():
        return f"--socket {args.socket}: no directory {where.parent}"
    if len(os.fsencode(where)) > MAX_SOCKET_PATH:
        return f"--socket {args.socket}: longer than {MAX_SOCKET_PATH} bytes"
    return None


def _stdin_open() -> bool:
    """Whether file descriptor 0 is open (``serve <&-`` leaves ``sys.stdin`` None)."""
    try:
        os.fstat(0)
    except OSError:
        return False
    return True


def _db(args: argparse.Namespace) -> int:
    import json

    from delegation.cli.progress import Progress
    from delegation.store.stores import upgrade

    if args.db_command == "current":
        _, revision = upgrade(args.url, apply=False)
        print(
            json.dumps({"revision": revision}) if args.json else revision or "empty (no schema yet)"
        )
        return 0
    with Progress("migrating", quiet=args.json) as progress:

        def step(steps: list[tuple[str, str]], done: int) -> None:
            what = f"migrating to {steps[done][0]}: {steps[done][1]}" if done < len(steps) else ""
            progress.update(what or "migrated", done=done, total=len(steps))

        before, after = upgrade(args.url, apply=True, on_step=step)
    print(
        json.dumps({"before": before, "after": after})
        if args.json
        else f"upgraded {before or 'empty'} -> {after}"
    )
    return 0


# What the web extra brings: without them `delegation web` says how to get them.
WEB_PACKAGES = ("starlette", "uvicorn")
A2A_PACKAGES = ("a2a", "sse_starlette", "google")


def _web(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        return usage(f"--port {args.port}: not a TCP port (0 to 65535)")
    try:
        from delegation.web.app import serve

        if args.a2a:
            import delegation.web.a2a_routes  # noqa: F401 (fails here, said in one line)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if missing in A2A_PACKAGES:
            return usage(
                f"`delegation web --a2a` needs the a2a extra ({missing} is missing):"
                " pip install -e '.[a2a]' from the checkout"
            )
        if missing not in WEB_PACKAGES:
            raise
        return usage(
            f"`delegation web` needs the web extra ({missing} is missing):"
            " pip install -e '.[web]' from the checkout"
            " (once published: pip install 'durable-delegation[web]')"
        )
    return serve(args.url, args.host, args.port, token=not args.no_token, a2a=args.a2a)


if __name__ == "__main__":
    sys.exit(main())
