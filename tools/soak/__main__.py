"""``python -m delegation.soak``."""

import sys

from tools.soak import main

sys.exit(main())
