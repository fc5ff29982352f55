"""The contract and the pure core, the package's top level: the wire's shape, vectors,
decoding, validation, typed inputs and properties (``delegation.wire``, ``codec``), the
options, the state machine, the authority matrix and the security claims, the error tree
(``delegation.errors``), the root's face and the API reference, the package's layout,
the docs' code blocks, and the bench and soak entry points.
"""
