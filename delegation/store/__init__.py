"""Persistence: the only package that imports SQLAlchemy, and imports nothing above it.

The one writer, the same on both stores, and what it asks of a dialect:

* :mod:`~delegation.store.interface` - what a store guarantees (:class:`Store`);
* :mod:`~delegation.store.database`, :mod:`~delegation.store.batch`,
  :mod:`~delegation.store.reading` - the writer's batches (group commit) and reads;
* :mod:`~delegation.store.dialect`, :mod:`~delegation.store.spelling` - what a dialect
  provides, and how it spells the shared SQL; :mod:`~delegation.store.failures` - its
  errors as the package's; :mod:`~delegation.store.watch` - commit notices;
* :mod:`~delegation.store.backend` - one record per store, found once by the URL's
  scheme; :mod:`~delegation.store.registry` - the dialects known, one line each, and
  the part of a record the store's own modules reach (its spelling, its driver's
  errors); :mod:`~delegation.store.stores` - what the package asks of a store by URL;
* :mod:`~delegation.store.sql` - the plain SQL the hot paths run, on either store;
* ``sqlite/`` and ``postgres/`` - each dialect, exporting its record: a new dialect is
  a folder and its line in the registry, and no module here imports one;
* the aggregates' SQL: :mod:`~delegation.store.children`, :mod:`~delegation.store.grants`,
  :mod:`~delegation.store.lifecycle` (and :mod:`~delegation.store.retention`, the
  purge of finished children), :mod:`~delegation.store.events`,
  :mod:`~delegation.store.steers`, :mod:`~delegation.store.steps`,
  :mod:`~delegation.store.processes`, :mod:`~delegation.store.registrations`,
  :mod:`~delegation.store.controls`, :mod:`~delegation.store.prefixes`,
  :mod:`~delegation.store.waits` (what waiting children wait for, and events sent),
  :mod:`~delegation.store.admission` (policies by scope, and the queue's order),
  :mod:`~delegation.store.rewinds` (a rewind's point and seed);
  :mod:`~delegation.store.tables` - the schema as SQLAlchemy Core;
  :mod:`~delegation.store.migrate` - Alembic, the only way it changes;
* the URL itself: :mod:`~delegation.store.dburl` (its parts),
  :mod:`~delegation.store.passwords` (hidden wherever shown),
  :mod:`~delegation.store.credentials` (the files that stand for a PostgreSQL login).
"""
