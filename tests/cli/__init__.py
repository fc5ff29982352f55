"""The command line (``delegation.cli``): inspection commands, options, errors, ids,
tables, printing, progress, completion, passwords, steps, versions, rewind, the demo, and
every command on PostgreSQL.
"""
