"""No database password on a command line, and none ever printed (design §17), as an
operator meets it: every command refuses ``--db`` with a password (one line, exit 2,
nothing made); the password reaches a real PostgreSQL server that asks for it through
``DELEGATION_DB``, ``PGPASSWORD`` or a ``PGPASSFILE``; and no output, log, error or page
shows it, in any form a URL gives one.
"""

from __future__ import annotations

import asyncio
import os
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from delegation.cli.commands import main
from tests.harness import browser, postgres
from tests.harness.password_hosts import a_child_on_a_host
from tests.harness.pg_cli import COMMANDS, cli, needs_postgres, one_line

PW = "Pw-s3cret-42"
WRONG = "Wr0ng-guess-17"
MESSAGE = (
    "a database password on the command line is visible to every local process:"
    " use DELEGATION_DB or a libpq password file"
)
EVERY_COMMAND = [*COMMANDS, ("web",)]
URLS = [
    "postgresql+psycopg://operator:{pw}@db.example/app",
    "postgresql://operator@db.example/app?sslmode=require&Password={pw}",
    "postgresql://operator:{pw}@h1:5432,h2:5433/app",
    "postgresql+psycopg://operator@/app?host=h1,h2&port=5432,5433&password={pw}",
    "sqlite:///{tmp}/x.db?password={pw}",
]


# --- refused on the command line -----------------------------------------------------------


@pytest.mark.parametrize("url", URLS)
def test_every_command_refuses_a_password_in_db(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DELEGATION_DB", raising=False)
    url = url.format(pw=PW, tmp=tmp_path)
    for command in EVERY_COMMAND:
        for argv in (["--db", url, *command], [*command, "--db", url]):
            assert main(argv) == 2, argv
            assert capsys.readouterr() == ("", f"delegation: {MESSAGE}\n"), argv
    assert main(["--db", url, "completion", "bash"]) == 2
    assert capsys.readouterr() == ("", f"delegation: {MESSAGE}\n")
    assert not list(tmp_path.iterdir()), "nothing was created"


def test_the_real_commands_refuse_it_in_one_line_and_create_nothing(tmp_path: Path) -> None:
    # A SQLite file would be made (its password ignored) were the URL let through.
    for url in (URLS[0].format(pw=PW), URLS[-1].format(pw=PW, tmp=tmp_path)):
        for command in (("serve", "--stdio"), ("web",), ("children",), ("db", "upgrade")):
            done = cli(*command, "--db", url, cwd=tmp_path)
            assert (done.returncode, done.stdout, done.stderr) == (
                2,
                "",
                f"delegation: {MESSAGE}\n",
            )
    assert not list(tmp_path.iterdir()), "nothing was created"


# --- a server that asks for the password -----------------------------------------------


@pytest.fixture(scope="module")
def secured() -> Iterator[str]:
    """A PostgreSQL server of its own whose user ``postgres`` must give :data:`PW` over
    TCP; its URL names no password."""
    server = postgres.start(durable=False, password=PW)
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def database(secured: str) -> Iterator[str]:
    """A new, empty database on that server, for this test; its URL, without password."""
    name = f"pw_{uuid.uuid4().hex[:12]}"
    admin = libpq(secured)
    with psycopg.connect(admin, password=PW, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    yield secured.rsplit("/", 1)[0] + f"/{name}"
    with psycopg.connect(admin, password=PW, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


def libpq(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def environment(home: Path, **extra: str) -> dict[str, str]:
    """This environment without a password from anywhere else (no PG* variables, no
    ~/.pgpass, no DELEGATION_DB), and ``extra``."""
    kept = {k: v for k, v in os.environ.items() if not k.startswith("PG") and k != "DELEGATION_DB"}
    home.mkdir(exist_ok=True)
    return {**kept, "HOME": str(home), "PGPASSFILE": str(home / "none"), **extra}


FORMS = ["user", "query", "hosts", "libpq URI", "SQLAlchemy"]


def with_password(url: str, form: str, password: str = PW) -> str:
    """``url`` (``postgresql+psycopg://postgres@127.0.0.1:PORT/DB``) with ``password``
    in one of the forms a URL gives one."""
    head, _, database = url.rpartition("/")
    address = head.rpartition("@")[2]
    return {
        "user": f"postgresql+psycopg://postgres:{password}@{address}/{database}",
        "query": f"{url}?sslmode=disable&password={password}&connect_timeout=10",
        "hosts": (
            f"postgresql+psycopg://postgres@/{database}?host={address.split(':')[0]},127.0.0.1"
            f"&port={address.split(':')[1]},{address.split(':')[1]}&password={password}"
        ),
        # Several hosts as pg_autoctl and SQLAlchemy write them, one where nothing listens
        # first (design §19).
        "libpq URI": (
            f"postgresql://postgres:{password}@127.0.0.1:1,{address}/{database}"
            "?target_session_attrs=read-write"
        ),
        "SQLAlchemy": (
            f"postgresql+psycopg://postgres@/{database}?host=127.0.0.1:1&host={address}"
            f"&password={password}&target_session_attrs=read-write"
        ),
    }[form]


@needs_postgres
def test_the_server_asks_for_the_password(database: str, tmp_path: Path) -> None:
    done = cli("db", "current", "--db", database, env=environment(tmp_path / "home"))
    assert done.returncode == 1
    assert "no password supplied" in one_line(done.stderr)


@needs_postgres
@pytest.mark.parametrize("source", ["PGPASSWORD", "PGPASSFILE"])
async def test_a_host_without_a_password_in_its_url_gets_it_from_libpq(
    source: str, database: str, tmp_path: Path, workspace: Path
) -> None:
    env = environment(tmp_path / "home")
    if source == "PGPASSWORD":
        env["PGPASSWORD"] = PW
    else:  # host:port:database:user:password, a file only its owner reads (libpq checks)
        passfile = tmp_path / "pgpass"
        address = database.rpartition("@")[2].rpartition("/")[0]
        passfile.write_text(f"{address}:*:postgres:{PW}\n")
        passfile.chmod(0o600)
        env["PGPASSFILE"] = str(passfile)
    await a_child_on_a_host(env, tmp_path / "serve.log", workspace, "--db", database)
    listed = await asyncio.to_thread(cli, "children", "--json", "--db", database, env=env)
    assert listed.returncode == 0, listed.stderr
    assert '"state":"done"' in listed.stdout.replace(" ", "")


@needs_postgres
@pytest.mark.parametrize("form", FORMS)
async def test_a_password_from_DELEGATION_DB_works_and_is_never_printed(
    form: str, database: str, tmp_path: Path, workspace: Path
) -> None:
    env = environment(tmp_path / "home", DELEGATION_DB=with_password(database, form))
    said = []
    for command in (("db", "upgrade"), ("db", "current"), ("children",), ("leases", "--wide")):
        done = await asyncio.to_thread(cli, *command, env=env)
        assert done.returncode == 0, (command, done.stderr)
        said += [done.stdout, done.stderr]
    logged = await a_child_on_a_host(env, tmp_path / "serve.log", workspace, "--log-level", "debug")
    assert "action=" in logged, "the host logged at debug level"
    with browser.web(None, env=env) as web:
        with urllib.request.urlopen(web.link(), timeout=10) as answer:
            page = answer.read().decode()
        assert "***" in page and "127.0.0.1" in page, "the page names the database"
        said += [page, web.said]
        assert web.stop() == 130
    said += [logged, web.stderr]
    assert not [text for text in said if PW in text]


@needs_postgres
@pytest.mark.parametrize("form", FORMS)
def test_a_wrong_password_from_DELEGATION_DB_is_one_line_without_it(
    form: str, database: str, tmp_path: Path
) -> None:
    env = environment(tmp_path / "home", DELEGATION_DB=with_password(database, form, WRONG))
    work = tmp_path / "work"
    work.mkdir()
    # Every command with one form; the paths through the store are the same for others.
    some = (("serve", "--stdio"), ("children",), ("db", "upgrade"), ("web",))
    for command in EVERY_COMMAND if form == "query" else some:
        done = cli(*command, env=env, cwd=work)
        said = done.stdout + done.stderr
        assert done.returncode == 1 and "password authentication failed" in said, said
        assert WRONG not in said and "Traceback" not in said
        if command[0] != "demo":  # the demo tells its own story
            assert done.stdout == "" and one_line(done.stderr)
    assert not list(work.iterdir()), "nothing was created"


def test_a_url_refused_from_DELEGATION_DB_is_shown_without_its_password(tmp_path: Path) -> None:
    # A port that is no number among several hosts: a usage error names the URL.
    url = f"postgresql+psycopg://postgres:{PW}@127.0.0.1:5432,127.0.0.1:x/app"
    for command in (("serve", "--stdio"), ("children",), ("web",)):
        done = cli(*command, env={**os.environ, "DELEGATION_DB": url}, cwd=tmp_path)
        assert (done.returncode, done.stdout) == (2, ""), done.stderr
        line = one_line(done.stderr)
        assert line.startswith("delegation: --db postgresql+psycopg://postgres:***@127.0.0.1:5432,")
        assert line.endswith(": 'x' is not a port number")
        assert PW not in line
    assert not list(tmp_path.iterdir()), "nothing was created"
