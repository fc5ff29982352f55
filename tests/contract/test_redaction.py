"""A provider's error crosses to a peer fully redacted (SPEC §26): URL userinfo, query
strings, key-like tokens (hex or base64 runs, ``key=``), cookies and JWTs in the text
of the exception a run raises never reach the peer (the page), the database, nor the
CLI; ids of ours in the same text are kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from delegation import ChildContext
from delegation.usecases.redaction import REDACTED, redact_secrets
from tests.harness.support import Harness
from tests.harness.terminal import in_process

JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.abc123DEF456ghi"  # short: no run of 32
HEX64 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
# (the shape, what a provider's exception says, the secret in it)
SHAPES: list[tuple[str, str, str]] = [
    ("https userinfo", "POST https://svc:Hunter2Pass@proxy.example/v1/chat: 407", "Hunter2Pass"),
    ("postgresql userinfo", "could not connect to postgresql://app:pw-Zq81x@db.internal/app",
     "pw-Zq81x"),
    ("a password holding @", "redis://:p@ssw0rd-x@cache:6379/0 refused", "ssw0rd-x"),
    ("query of another scheme", "amqp://broker.example/vh?heartbeat=30&sasl=plainv4lue closed",
     "plainv4lue"),
    ("a fragment holding =", "redirected to https://app.example/cb#state=1&code=c0de-value1",
     "c0de-value1"),
    ("lower-case hex key, 40", "bad key 3f786850e387550fdab836ed7e6dc881de23001b",
     "3f786850e387550fdab836ed7e6dc881de23001b"),
    ("lower-case hex key, 64", f"sig {HEX64} bad", HEX64),
    ("bare key=", "GET /v1/models key=plainvalue7 (403)", "plainvalue7"),
    ("key: in a dict", "{'key': 'Zm9vYmFy', 'model': 'x'}", "Zm9vYmFy"),
    ("Cookie header", "request headers: Cookie: sessionid=s3ss10n-v4lue; csrftoken=csrf-v4lue",
     "s3ss10n-v4lue"),
    ("Set-Cookie header", "response: Set-Cookie: auth=c00kie-t0ken; Path=/; HttpOnly",
     "c00kie-t0ken"),
    ("a cookie's value", "sessionid=s3ss10n-v4lue expired", "s3ss10n-v4lue"),
    ("JWT", f"invalid credentials {JWT} (expired)", JWT.split(".")[1]),
    ("Authorization: Token", "sent Authorization: Token abcdefghij0123", "abcdefghij0123"),
    ("base64, padded", "secret blob aGVsbG8gd29ybGQhIFNlY3JldDE= rejected",
     "aGVsbG8gd29ybGQhIFNlY3JldDE="),
    ("base64 with + and /", "key material Zm9vYmFy+Zm9vYmFyMTIzQUJD/eHl6 rejected",
     "Zm9vYmFyMTIzQUJD"),
    ("Stripe key", "No such customer (rk_live_51HqLyjWDarjtT1z)", "51HqLyjWDarjtT1z"),
]  # fmt: skip
IDS = [shape[0] for shape in SHAPES]


@pytest.mark.parametrize(("said", "secret"), [s[1:] for s in SHAPES], ids=IDS)
def test_every_shape_of_credential_is_redacted(said: str, secret: str) -> None:
    redacted = redact_secrets(said)
    assert secret not in redacted
    assert REDACTED in redacted


@pytest.mark.parametrize(
    "kept",
    [
        "child c-0123456789abcdef0123456789abcdef of run r-0123456789abcdef0123456789abcdef",
        "host h-0123456789abcdef0123456789abcdef was fenced",
        "command '/usr/bin/python3' exited with code 1: /home/JohnSmith/Projects2024/app/x.py",
        "max_tokens=4096 exceeds the model's limit; see https://docs.example.com/limits#tokens",
        "request 123e4567-e89b-12d3-a456-426614174000 timed out after 30 s",
        "cannot open /usr/include/c++/11/iostream",
    ],
)
def test_ids_of_ours_and_plain_words_are_kept(kept: str) -> None:
    assert redact_secrets(kept) == kept


def test_what_is_around_a_secret_is_kept() -> None:
    assert redact_secrets("POST https://svc:Hunter2Pass@proxy.example/v1/chat: 407") == (
        f"POST https://{REDACTED}@proxy.example/v1/chat: 407"
    )
    assert redact_secrets("Set-Cookie: sid=x; Path=/\nthe next line") == (
        f"Set-Cookie: {REDACTED}\nthe next line"
    )
    assert redact_secrets("x-0123456789abcdef0123456789abcdef") == f"x-{REDACTED}"


@pytest.mark.parametrize(("said", "secret"), [s[1:] for s in SHAPES], ids=IDS)
async def test_a_providers_error_reaches_no_reader_with_its_secret(
    harness: Harness,
    capsys: pytest.CaptureFixture[str],
    db_url: str,
    db_path: Path,
    said: str,
    secret: str,
) -> None:
    async def run(ctx: ChildContext) -> None:
        await ctx.admit()
        raise RuntimeError(f"provider call failed: {said}")

    harness.runner.script = run
    started = await harness.start()
    child = started.conversation_id
    record = await harness.wait_done(child)  # the database's row
    assert record.state == "done" and record.error.startswith("provider call failed: ")
    page = await harness.read(child)  # what the peer reads
    assert page.error == record.error
    assert secret not in record.error and secret not in page.error
    cli = in_process(capsys, db_url)
    for argv in (("show", child), ("show", child, "--json"), ("events", child, "--json")):
        code, out, err = cli(*argv)
        assert code == 0, err
        assert secret not in out and secret not in err
    _, shown, _ = cli("show", child, "--json")
    assert json.loads(shown)["error"] == record.error
    if db_url.startswith("sqlite"):  # nowhere in the file, nor in its WAL
        await harness.engine.close()
        for path in (db_path, db_path.with_name(db_path.name + "-wal")):
            if path.exists():
                assert secret.encode() not in path.read_bytes()
