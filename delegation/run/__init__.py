"""The run's side: what a runner author reads (design §6, §15, §21, §26).

A runner's ``Run`` gets a :class:`~delegation.run.context.ChildContext`; everything
behind it lives here, above the use cases whose transactions it calls:

* :mod:`~delegation.run.context` - the runner protocol and the context a child run sees
  (``Runner``, ``Run``, ``ChildContext``, ``Recovery``, ``admit``, ``emit``);
* :mod:`~delegation.run.journal` - the step journal: ``ctx.step``, ``ctx.recorded`` and
  ``ctx.patched``;
* :mod:`~delegation.run.waits` - a run's waits: ``ctx.ask``, ``ctx.sleep`` and
  ``ctx.wait_event`` (their rows are :mod:`delegation.usecases.waiting`'s);
* :mod:`~delegation.run.emits` - a resumed run's emits matched with the events its
  execution committed, so none is written twice (design §26);
* :mod:`~delegation.run.protection` - what no process of a child may reach (the host's
  database, credentials and code), handed to every run.

The engine runs these (``delegation.engine.local_run``); runners stand on them.
"""
