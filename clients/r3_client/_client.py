"""``RoutingClient`` and ``AsyncRoutingClient``: one core, two thin shells.

Shaped like httpx, module by module:

* :mod:`r3_client._client_core` -- the core both clients share, with no I/O: argument
  checks, request building, retry decisions, answer parsing and decoding, the batch
  stream's cursor;
* :mod:`r3_client._range_plan` -- a ranged read planned (which rows the segments answer,
  which a view) and put together, also without I/O;
* :mod:`r3_client._sync_client` -- :class:`RoutingClient`, the blocking shell (the
  caller's thread; a small pool decodes a batch stream while it goes on);
* :mod:`r3_client._async_client` -- :class:`AsyncRoutingClient`, the asyncio shell (the
  caller's event loop);
* :mod:`r3_client._transports` -- HTTP and gRPC, sync and async: the test seam
  (``transport=``).

Both names are served from here and, lazily, from :mod:`r3_client`; code inside the
package imports each from its own module.
"""

from __future__ import annotations

from r3_client._async_client import AsyncRoutingClient
from r3_client._sync_client import RoutingClient

__all__ = ["AsyncRoutingClient", "RoutingClient"]
