"""The PostgreSQL dialect of the store (SPEC §12), through psycopg 3: its connection
setup (:mod:`.connect`), error codes (:mod:`.errors`), the writer's dialect
(:mod:`.dialect`), the operator's tools (:mod:`.admin`) and its watch (:mod:`.watch`).
Nothing here imports psycopg until a connection is made."""

from __future__ import annotations

from typing import Any

__all__ = ["CHANNEL", "PostgresDialect", "PostgresWatch"]


def __getattr__(name: str) -> Any:
    # Lazily: the store's failure classification imports .errors, below everything.
    if name == "CHANNEL":
        from delegation.store.postgres.admin import CHANNEL

        return CHANNEL
    if name == "PostgresDialect":
        from delegation.store.postgres.dialect import PostgresDialect

        return PostgresDialect
    if name == "PostgresWatch":
        from delegation.store.postgres.watch import PostgresWatch

        return PostgresWatch
    raise AttributeError(name)
