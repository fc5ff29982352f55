"""The use cases: what the engine does, one write transaction each, over the store.

Each is a function ``fn(conn, now, ...)`` the engine's runtime runs in one transaction
(:class:`delegation.engine.runtime.Use`), or a read over a connection:

* :mod:`~delegation.usecases.reservation` - ``child.start``'s checks and its reservation;
* :mod:`~delegation.usecases.service` - the other child methods, tool calls and runs;
* :mod:`~delegation.usecases.maintenance` - boot, heartbeats and takeover, expiry,
  retention, operators' control requests;
* :mod:`~delegation.usecases.queries` - the read models (pages, records, lists);
* :mod:`~delegation.usecases.followups` - a follow-up's frozen configuration;
* :mod:`~delegation.usecases.redaction` - the credentials a run's error may quote, redacted
  before anyone reads it (SPEC §26);
* :mod:`~delegation.usecases.waiting` - a child that waits (design §21): its waits
  opened, suspended, woken, answered, and events sent (the run's side of it is
  :mod:`delegation.run.waits`);
* :mod:`~delegation.usecases.admission` - admission waits its turn (design §22): a
  child's slots taken or its place queued, the queue admitted, policies stored;
* :mod:`~delegation.usecases.operating` - an operator's control judged when given and
  recorded, and every control listed with its outcome (design §33);
* :mod:`~delegation.usecases.versions` - a child knows which code ran it (design §34):
  the runner version judged at every resume (resume, refuse, pin), pins and unpins;
* :mod:`~delegation.usecases.rewinding` - a rewind (design §35): its source, its point
  and the seed of the new execution;
* :mod:`~delegation.usecases.orphans` - children a lost commit answer left with no run
  on their live host, adopted once the database is back (design §32);
* :mod:`~delegation.usecases.stored` - stored request and preset blobs, decoded;
* :mod:`~delegation.usecases.follow` - following a child's events as they commit;
* :mod:`~delegation.usecases.inspector` - the read-only inspection of a database
  beside a live host (the CLI's and the web page's reads);
* :mod:`~delegation.usecases.views` - the read models as JSON and text for people and
  scripts (``--json``, the web page).

They import the contract, the pure core and the store; never the engine above them.
"""
