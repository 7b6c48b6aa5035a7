"""``python -m cache_service serve …`` is ``r3 serve …``."""

import sys

from r3_client.cli import main

sys.exit(main())
