"""A database URL's parts, read one way wherever the package reads a URL (design §17, §19).

PostgreSQL users name several hosts (a primary and its standbys, tried in turn) in
three spellings:

* ``postgresql://u@h1:5432,h2:5433/db?target_session_attrs=read-write``: libpq's own
  URI, what ``pg_autoctl show uri`` prints; SQLAlchemy cannot read it;
* ``postgresql://u@/db?host=h1,h2&port=5432,5433``: libpq's keywords in the query;
* ``postgresql://u@/db?host=h1:5432&host=h2:5433``: SQLAlchemy's own, which libpq
  cannot read.

:func:`one_spelling` writes the first and the last as the second, the one SQLAlchemy's
engines and the store's own psycopg connections read alike; the store converts every
URL it is given with it, once (``stores.normalize``). :data:`URL` splits a URL into its
parts, here and in :mod:`delegation.store.passwords`, so that a password is looked for where
a connection takes it from, before several hosts too. Only the standard library here
(SQLAlchemy is the store's alone).
"""

from __future__ import annotations

import re
from urllib.parse import quote_plus, unquote, unquote_plus

# SQLAlchemy's URL pattern (sqlalchemy.engine.url._parse_url), with any scheme, and its
# host and port read as one part, ``hosts``, which may name several. A user part ends at
# the first "@"; its password may hold ":" or "/" unescaped.
URL = re.compile(
    r"""
    (?P<scheme>[^:/?#]+)://
    (?:(?P<username>[^:/]*)(?::(?P<password>[^@]*))?@)?
    (?P<hosts>[^/?]*)
    (?:/(?P<database>[^?]*))?
    (?:\?(?P<query>.*))?
    """,
    re.X | re.S,
)
POSTGRES_SCHEMES = frozenset({"postgresql", "postgresql+psycopg"})
# One host of a list before the path: a name or address, or an IPv6 address in brackets;
# then its port, perhaps empty (libpq's default).
_HOST = re.compile(r"(?:\[(?P<v6>[^\]]*)\]|(?P<name>[^:\[\]]*))(?::(?P<port>[^:]*))?")
# One ``host=`` of SQLAlchemy's spelling, ``name:port`` (an IPv6 address in brackets).
_HOST_PORT = re.compile(r"(?:\[(?P<v6>[^\]]*)\]|(?P<name>[^:\[\]]*))(?::(?P<port>\d*))?")


def one_spelling(url: str) -> str:
    """``url`` with several hosts named as ``?host=h1,h2&port=p1,p2``, whichever of the
    spellings above it used; anything else unchanged (a URL that is not PostgreSQL's
    too). What is kept is kept as written (its escapes, its other arguments).

    Raises:
        ValueError: a PostgreSQL URL that cannot be read, said in one line: an
            argument given twice (but ``host=``), a port that is no number, hosts named
            both before the path and in the query, SQLAlchemy's ``host=h:p`` beside
            ``port=``, or neither one port nor one per host.
    """
    match = URL.fullmatch(url)
    if match is None or match["scheme"].lower() not in POSTGRES_SCHEMES:
        return url
    query = match["query"] or ""
    pairs = _pairs(query)
    _once_each(pairs)
    hosts = _hosts_before_path(match["hosts"])
    if len(hosts) > 1:
        if any(key in ("host", "port") for key, _ in pairs):
            raise ValueError("several hosts named both before the path and in host= or port=")
        rest = _parts(query)
    else:
        given = [value for key, value in pairs if key == "host"]
        if not _sqlalchemy_hosts(given, pairs):
            _check_ports(given, pairs)
            return url
        hosts = [_host_port(value) for value in given]
        rest = [part for part in _parts(query) if _key(part) != "host"]
    start, end = match.span("hosts")
    path = url[end : match.start("query") - 1] if match["query"] is not None else url[end:]
    return f"{url[:start]}{path}?{_query(hosts, rest)}"


def _parts(query: str) -> list[str]:
    return [part for part in query.split("&") if part]


def _pairs(query: str) -> list[tuple[str, str]]:
    """The query's arguments, decoded as SQLAlchemy decodes them, in order."""
    return [(_key(part), unquote_plus(part.partition("=")[2])) for part in _parts(query)]


def _key(part: str) -> str:
    return unquote_plus(part.partition("=")[0])


def _once_each(pairs: list[tuple[str, str]]) -> None:
    """Refuses an argument given twice (libpq would take the last, SQLAlchemy both),
    but ``host=``, which SQLAlchemy's spelling repeats."""
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen and key != "host":
            raise ValueError(f"{key}= given more than once")
        seen.add(key)


def _hosts_before_path(hosts: str) -> list[tuple[str, str]]:
    """The (host, port) pairs named before the path: one for most URLs, none for some."""
    if not hosts:
        return []
    if "@" in hosts:
        raise ValueError("an @ in a user name or password must be written %40")
    found = []
    for entry in hosts.split(","):
        one = _HOST.fullmatch(entry)
        if one is None:
            raise ValueError(f"{entry!r} is not a host or host:port")
        found.append((unquote(one["v6"] or one["name"] or ""), _port(one["port"] or "")))
    return found


def _sqlalchemy_hosts(given: list[str], pairs: list[tuple[str, str]]) -> bool:
    """Whether the query names its hosts as SQLAlchemy does: ``host=`` more than once,
    or one ``host=name:port`` without ``port=`` (as SQLAlchemy reads that too)."""
    if len(given) > 1:
        if any(key == "port" for key, _ in pairs):
            raise ValueError("host=h:p more than once cannot go with port=")
        return True
    return (
        len(given) == 1
        and not any(key == "port" for key, _ in pairs)
        and re.fullmatch(r"[A-Za-z0-9.-]*:\d*", given[0]) is not None
    )


def _host_port(value: str) -> tuple[str, str]:
    one = _HOST_PORT.fullmatch(value)
    if one is None:
        raise ValueError(f"host={value!r} is not a host or host:port")
    return one["v6"] or one["name"] or "", _port(one["port"] or "")


def _check_ports(given: list[str], pairs: list[tuple[str, str]]) -> None:
    """libpq's form, checked as libpq would: a number per port, one port or one per host."""
    ports = [value for key, value in pairs if key == "port"]
    if not ports:
        return
    listed = [_port(port) for port in ports[0].split(",")]
    named = given[0].split(",") if given else [""]
    if len(listed) > 1 and len(listed) != len(named):
        raise ValueError(
            f"{len(named)} hosts and {len(listed)} ports: name one port, or one per host"
        )


def _port(text: str) -> str:
    if text and not (text.isascii() and text.isdigit() and 0 < int(text) < 65536):
        raise ValueError(f"{text!r} is not a port number")
    return text


def _query(hosts: list[tuple[str, str]], rest: list[str]) -> str:
    """``host=h1,h2&port=p1,p2`` (no ports when none was given), then ``rest``."""
    listed = [f"host={quote_plus(','.join(host for host, _ in hosts), safe=',:')}"]
    if any(port for _, port in hosts):
        listed.append(f"port={','.join(port for _, port in hosts)}")
    return "&".join(listed + rest)


__all__ = ["POSTGRES_SCHEMES", "URL", "one_spelling"]
