"""The host's surfaces (``delegation.host``): ``delegation serve`` end to end (bounds,
follow, shutdown, sockets), ``LocalHost``, and one owner per database.
"""
