"""The files that stand for a PostgreSQL database's credentials (design §17, §23).

libpq reads a password file, client keys and certificates, revocation lists and
service files; whoever reads them can log in as the host. :func:`files` names every
such file a host's connections may use:

* the ones the URL names: ``passfile``, ``sslkey``, ``sslcert``, ``sslrootcert``,
  ``sslcrl``, ``sslcrldir``, and the service files a ``service=`` is looked up in,
  with the files that service's entry names in turn;
* the ones libpq's environment names (``PGPASSFILE``, ``PGSSLKEY`` …, ``PGSERVICE``,
  ``PGSERVICEFILE``, ``PGSYSCONFDIR``);
* libpq's defaults: ``~/.pgpass``, ``~/.postgresql/`` (its client key, certificates
  and revocation list), ``~/.pg_service.conf`` and the system's ``pg_service.conf``.

Each is named whether it exists or not (a file made later is as secret), made absolute
as libpq would (relative to the host's working directory). Only the standard library.
"""

from __future__ import annotations

import configparser
import os
from collections.abc import Mapping
from urllib.parse import unquote_plus

from delegation.store import dburl

# A connection parameter naming a file, and the variable libpq reads it from.
FILE_PARAMETERS = {
    "passfile": "PGPASSFILE",
    "sslkey": "PGSSLKEY",
    "sslcert": "PGSSLCERT",
    "sslrootcert": "PGSSLROOTCERT",
    "sslcrl": "PGSSLCRL",
    "sslcrldir": "PGSSLCRLDIR",
}
# Where the system's service file is, for the builds of libpq a host is likely to load
# (Debian's and PGDG's packages; psycopg's binary wheel's).
SYSTEM_SERVICE_FILES = ("/etc/postgresql-common/pg_service.conf", "/etc/pg_service.conf")


def files(url: str, environ: Mapping[str, str] | None = None) -> list[str]:
    """Every credential file a connection to ``url`` may read (see the module)."""
    env = os.environ if environ is None else environ
    home = env.get("HOME") or os.path.expanduser("~")
    query = _query(url)
    found: list[str] = []
    for key, variable in FILE_PARAMETERS.items():
        found += [given for given in (query.get(key), env.get(variable)) if given]
    found += [os.path.join(home, ".pgpass"), os.path.join(home, ".postgresql")]
    services = _service_files(env, home)
    found += services
    name = query.get("service") or env.get("PGSERVICE")
    if name:
        found += _named_in_service(services, name)
    return list(dict.fromkeys(os.path.abspath(path) for path in found))


def _query(url: str) -> dict[str, str]:
    match = dburl.URL.fullmatch(url)
    if match is None or not match["query"]:
        return {}
    pairs = (part.partition("=") for part in match["query"].split("&") if part)
    return {unquote_plus(key): unquote_plus(value) for key, _, value in pairs}


def _service_files(env: Mapping[str, str], home: str) -> list[str]:
    found = [env.get("PGSERVICEFILE") or os.path.join(home, ".pg_service.conf")]
    if env.get("PGSYSCONFDIR"):
        found.append(os.path.join(env["PGSYSCONFDIR"], "pg_service.conf"))
    return found + [path for path in SYSTEM_SERVICE_FILES if os.path.exists(path)]


def _named_in_service(services: list[str], name: str) -> list[str]:
    """The files a service's entry names, in the first service file that has it."""
    for path in services:
        parser = configparser.ConfigParser(interpolation=None, strict=False)
        try:
            with open(path, encoding="utf-8") as file:
                parser.read_file(file)
        except (OSError, UnicodeDecodeError, configparser.Error):
            continue
        if parser.has_section(name):
            entry = parser[name]
            return [entry[key] for key in FILE_PARAMETERS if entry.get(key)]
    return []
