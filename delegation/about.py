"""What this project is called on the package index: ``pip install durable-delegation``
(another project holds the name "delegation" there); the import package is ``delegation``."""

from __future__ import annotations

DISTRIBUTION = "durable-delegation"
