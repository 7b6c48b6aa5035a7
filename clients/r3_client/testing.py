"""Old name of :mod:`r3_client.synthetic`, kept for one release: old imports keep working.

Importing it warns (``DeprecationWarning``) and gives the same objects; import
``r3_client.synthetic`` instead.  It goes in sglang-r3 0.2.
"""

import warnings

from r3_client.synthetic import *  # noqa: F403
from r3_client.synthetic import __all__ as __all__

warnings.warn(
    "r3_client.testing is now r3_client.synthetic; the old name goes in sglang-r3 0.2",
    DeprecationWarning,
    stacklevel=2,
)
