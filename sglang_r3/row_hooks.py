"""Hooks that carry a tagged request's rows to the HTTP process: marked in the scheduler,
compacted in the detokenizer."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sglang_r3.config import engine_config
from sglang_r3.row_transport import TaggedRows, compact_rows
from sglang_r3.tagging import carries_tag

log = logging.getLogger("sglang_r3")


def _pickle_ipc() -> bool:
    from sglang.srt.managers import io_struct

    return bool(io_struct._USE_PICKLE_IPC)


def around_collect_routed_experts(original: Callable[..., Any], self: Any, req: Any) -> Any:
    """AROUND the scheduler's ``_maybe_collect_routed_experts``: mark a tagged request's
    rows for the detokenizer (:class:`TaggedRows`).  Upstream's gather is unchanged and
    nothing proportional to rows is added to the scheduler."""
    result = original(self, req)
    rows = getattr(req, "routed_experts", None)
    if (
        rows is not None
        and not isinstance(rows, TaggedRows)
        and carries_tag(getattr(getattr(req, "sampling_params", None), "custom_params", None))
        and engine_config().enabled
        and _pickle_ipc()
    ):
        req.routed_experts = TaggedRows(rows)
    return result


def around_detokenize(original: Callable[..., Any], self: Any, recv_obj: Any) -> Any:
    """AROUND ``DetokenizerManager.handle_batch_token_id_out``: tagged rows cross to
    the HTTP process compact (uint8/uint16), not as base64 int32."""
    items = getattr(recv_obj, "routed_experts", None)
    marked = [i for i, x in enumerate(items or ()) if isinstance(x, TaggedRows)]
    if not marked:
        return original(self, recv_obj)
    assert items is not None
    compact = {i: compact_rows(items[i]) for i in marked}
    for i in marked:
        items[i] = None  # upstream base64-encodes the others, as before
    out = original(self, recv_obj)
    for i, rows in compact.items():
        out.routed_experts[i] = rows
    return out
