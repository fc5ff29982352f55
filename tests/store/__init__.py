"""The store (``delegation.store``): SQLite's and PostgreSQL's, the contract every store
keeps, migrations and schema, URLs, bad rows, watches, the database file, faults, and a
database that goes away, blinks, goes silent, loses an answer or fails over (PgBouncer,
pg_auto_failover, Patroni).
"""
