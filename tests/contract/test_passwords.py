"""A database URL's passwords (design §17): found in every form a URL gives one, and never
left in a URL as shown. What the CLI, the page and the logs do with it is in
tests/cli/test_cli_passwords.py."""

from __future__ import annotations

from urllib.parse import quote, quote_plus

import pytest
from hypothesis import given
from hypothesis import strategies as st
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy import make_url

from delegation.store import stores
from delegation.store.passwords import in_url, redacted

PW = "Pw-s3cret-42"
WITH_PASSWORD = [
    (f"postgresql+psycopg://operator:{PW}@db.example:5432/app", "operator:***@db.example"),
    (f"postgresql://operator:{PW}@db.example/app", "postgresql://operator:***@db.example/app"),
    (f"postgresql://operator@db.example/app?password={PW}", "app?password=***"),
    (f"postgresql://db.example/app?PASSWORD={PW}", "app?PASSWORD=***"),
    (f"postgresql://u@h/app?sslmode=require&Password={PW}&connect_timeout=5", "&Password=***&c"),
    (f"postgresql://u@h/app?sslpassword={PW}", "?sslpassword=***"),
    (f"postgresql://u@h/app?pass%77ord={PW}", "?pass%77ord=***"),  # an encoded key
    (f"postgresql://u:{PW}@h1:5432,h2:5433/app", "postgresql://u:***@h1:5432,h2:5433/app"),
    (f"postgresql://u@/app?host=h1,h2&port=5432,5433&password={PW}", "5433&password=***"),
    # Several hosts in each spelling a store reads (design §19), IPv6 ones too.
    (f"postgresql://u:{PW}@h1,h2/app?target_session_attrs=read-write", "u:***@h1,h2/app?"),
    (f"postgresql://u:{PW}@[::1]:5432,[fe80::2]:5433/app", "u:***@[::1]:5432,[fe80::2]:5433/"),
    (f"postgresql+psycopg://u@/app?host=h1:5432&host=h2:5433&password={PW}", "5433&password=***"),
    (f"postgresql+psycopg://u:{PW}@/app?host=h1:5432&host=h2:5433", "u:***@/app?host=h1:5432"),
    (f"postgresql://u@h/app?password={PW}&password={PW}x", "?password=***&password=***"),
    (f"sqlite:////var/db/x.db?password={PW}", "sqlite:////var/db/x.db?password=***"),
    # Unescaped characters that end a host elsewhere, as SQLAlchemy reads them.
    (f"postgresql://u:{PW}/x?y@h/app", "postgresql://u:***@h/app"),
    (f"postgresql://u:{PW}@x@h/app", "postgresql://u:***@h/app"),
    (f"mysql+pymysql://u:{PW}@h/app", "mysql+pymysql://u:***@h/app"),
    (f"my-db://u:{PW}@h/app", "my-db://u:***@h/app"),
]
WITHOUT_PASSWORD = [
    "postgresql+psycopg://operator@db.example/app",
    "postgresql://operator:@db.example/app",  # an empty password is none
    "postgresql://db.example/app?password=",
    "postgresql://u@h/app?passfile=/home/u/.pgpass&sslmode=require",
    "postgresql://u@/app?host=h1,h2&port=5432,5433",
    "sqlite:////var/db/delegation.db",
    "./delegation.db",
    "/var/db/u:pw@host.db",  # a file's path is no URL
]


@pytest.mark.parametrize(("url", "shown"), WITH_PASSWORD)
def test_a_password_in_any_form_is_found_and_hidden(url: str, shown: str) -> None:
    assert in_url(url)
    assert PW not in redacted(url)
    assert shown in redacted(url)


@pytest.mark.parametrize("url", WITHOUT_PASSWORD)
def test_a_url_without_a_password_is_shown_as_it_is(url: str) -> None:
    assert not in_url(url)
    assert redacted(url) == url


# A password to be found: nothing of it is ever in the URL otherwise.
secrets = st.text(min_size=1).map(lambda text: "Zq" + text)


@given(secrets)
def test_what_sqlalchemy_would_send_as_the_password_is_never_shown(password: str) -> None:
    for url in (
        f"postgresql+psycopg://user:{quote(password, safe='')}@host:5432/app",
        f"postgresql://user@host/app?sslmode=require&password={quote_plus(password)}",
    ):
        parsed = make_url(url)
        sent = parsed.password or parsed.query["password"]
        assert sent == password
        assert in_url(url)
        assert quote(password, safe="") not in redacted(url)
        assert quote_plus(password) not in redacted(url)


@given(st.text(alphabet=st.characters(exclude_characters="@"), min_size=1).map("Zq".__add__))
def test_an_unescaped_password_sqlalchemy_reads_is_never_shown(password: str) -> None:
    url = f"postgresql+psycopg://user:{password}@host/app"
    assert make_url(url).password == password
    assert in_url(url)
    assert password not in redacted(url)


# Any character libpq can send (not NUL, which ends its strings).
# What libpq can be sent: no NUL, and UTF-8 (no lone surrogate: Hypothesis found one).
sendable = st.text(
    alphabet=st.characters(exclude_characters="\x00", exclude_categories=("Cs",)), min_size=1
).map("Zq".__add__)


@given(sendable)
def test_a_password_before_several_hosts_is_sent_as_written_and_never_shown(
    password: str,
) -> None:
    # In each spelling the store reads, before and after it is made one (normalize),
    # and in the connection string its own psycopg connections get (libpq).
    for url in (
        f"postgresql://user:{quote(password, safe='')}@h1:5432,[::1]:5433/app"
        "?target_session_attrs=read-write",
        f"postgresql+psycopg://user@/app?host=h1:5432&host=h2:5433&password={quote_plus(password)}",
        f"postgresql+psycopg://user:{quote(password, safe='')}@/app?host=h1,h2&port=5432,5433",
    ):
        normal = stores.normalize(url)
        parsed = make_url(normal)
        assert (parsed.password or parsed.query["password"]) == password
        assert parsed.query["host"] in ("h1,::1", "h1,h2")
        assert conninfo_to_dict(stores.libpq(normal))["password"] == password
        for shown in (url, normal):
            assert in_url(shown)
            assert quote(password, safe="") not in redacted(shown)
            assert quote_plus(password) not in redacted(shown)
        hidden = make_url(redacted(normal))
        assert (hidden.password or hidden.query["password"]) == "***"
