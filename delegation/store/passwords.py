"""A database URL's passwords: found, and hidden wherever a URL is shown (design §17).

A password sits in a URL's user part (``user:pw@host``, also before several hosts:
``user:pw@h1:5432,h2:5433``) or in its query (``?password=…``, the key in any case,
anywhere among the other arguments, and libpq's ``sslpassword``, the key file's). The
user part is read as SQLAlchemy reads it (what a connection would send), by the pattern
that reads every URL's parts (:data:`delegation.store.dburl.URL`), before several hosts too;
an unescaped ``@`` in a password (``user:p@ss@host``) is hidden up to the last ``@``
before the host, as a URL parser reading it the other way would take it. Every URL the
package prints or logs passes :func:`redacted`; the CLI refuses a ``--db`` for which
:func:`in_url` holds.
"""

from __future__ import annotations

import re
from urllib.parse import unquote_plus

from delegation.store import dburl

MASK = "***"
# The query keys whose value is a secret, compared in lower case.
SECRET_KEYS = frozenset({"password", "sslpassword"})


def _spans(url: str) -> list[tuple[int, int]]:
    """Where each non-empty password in ``url`` is: (start, end), in order."""
    match = dburl.URL.match(url)
    if match is None:
        return []
    spans = [_user_password(url, match)] if match["password"] else []
    if match["query"] is not None:
        offset = match.start("query")
        for part in match["query"].split("&"):
            key, equals, value = part.partition("=")
            if equals and value and unquote_plus(key).lower() in SECRET_KEYS:
                start = offset + len(key) + 1
                spans.append((start, start + len(value)))
            offset += len(part) + 1
    return spans


def _user_password(url: str, match: re.Match[str]) -> tuple[int, int]:
    start, end = match.span("password")
    host = re.match(r"[^/?]*", url[end + 1 :])
    more = host[0].rfind("@") if host else -1
    return start, end if more < 0 else end + 1 + more


def in_url(url: str) -> bool:
    """Whether ``url`` carries a password (an empty one is none)."""
    return bool(_spans(url))


def redacted(url: str) -> str:
    """``url`` fit to print or log: each password replaced by ``***``; anything that
    is not a URL (a file's path) unchanged."""
    shown, last = [], 0
    for start, end in _spans(url):
        shown += [url[last:start], MASK]
        last = end
    return "".join([*shown, url[last:]])


__all__ = ["MASK", "in_url", "redacted"]
