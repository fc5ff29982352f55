"""``python -m delegation.soak``."""

import sys

from delegation.soak import main

sys.exit(main())
