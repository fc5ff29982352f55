"""``python -m delegation.cli``: as the ``delegation`` command."""

import sys

from delegation.cli import main

sys.exit(main())
