"""A rank-local source that counts what the service sent it (tests and the step bench)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from r3_client import RoutingClient


class Counting:
    """``client``'s ``get_ranges``, counting the frame bytes its batch streams received
    (a rank's network share): ``bytes``; and ``view_bytes``, those of the views it read
    one by one under ``exact`` / ``latest`` (``get_frame(view=...)``).  Reset by the
    caller between measurements."""

    def __init__(self, client: RoutingClient) -> None:
        self.client = client
        self.bytes = 0
        self.view_bytes = 0
        t = client._t  # the transport: its stream items carry the frames as received
        inner = t.batch_get
        inner_get = t.get

        def counted(*args: Any, **kw: Any) -> Iterator[Any]:
            for item in inner(*args, **kw):
                self.bytes += len(item.frame or b"")
                yield item

        def counted_get(*args: Any, **kw: Any) -> bytes:
            data = inner_get(*args, **kw)
            if kw.get("view") is not None:
                self.view_bytes += len(data)
            return data

        t.batch_get = counted  # type: ignore[method-assign,assignment]
        t.get = counted_get  # type: ignore[method-assign]

    def get_ranges(self, *args: Any, **kw: Any) -> Any:
        """The client's :meth:`~r3_client.RoutingClient.get_ranges`, counted."""
        return self.client.get_ranges(*args, **kw)
