"""``python -m delegation.soak``."""

import sys

from delegation.tools.soak import main

sys.exit(main())
