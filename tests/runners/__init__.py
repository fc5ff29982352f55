"""The runners (``delegation.runners``): the command runner with real children (its
profiles, version, confinement, containment, limits, reach, sockets, a root host's
children, the host's code out of reach), the pydantic-ai runner and the scripted one.
"""
