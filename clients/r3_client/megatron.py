"""Old name of :mod:`r3_client.replay.megatron`, kept for one release: old imports keep working.

Importing it warns (``DeprecationWarning``) and gives the same objects; import
``r3_client.replay.megatron`` instead.  It goes in sglang-r3 0.2.
"""

import warnings

from r3_client.replay.megatron import *  # noqa: F403
from r3_client.replay.megatron import __all__ as __all__

warnings.warn(
    "r3_client.megatron is now r3_client.replay.megatron; the old name goes in sglang-r3 0.2",
    DeprecationWarning,
    stacklevel=2,
)
