"""The schema, as SQLAlchemy Core tables. Alembic migrations are generated from it
and a parity test keeps the two identical."""

from __future__ import annotations

from sqlalchemy import MetaData

# Stable constraint names, so migrations can refer to (and batch-alter) them.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = MetaData(naming_convention=NAMING_CONVENTION)
