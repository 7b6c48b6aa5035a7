"""What shipping one output answers: the reference put in the response, and the status
each failure answers with.

Runs in SGLang's HTTP process, on the tokenizer manager's event loop, once per finished
tagged output (:meth:`sglang_r3.http_server.shipping.Shipper.ship`).  Every way a ship
ends is counted here (``r3_engine_outputs_total`` by outcome): stored, aborted, failed,
or, under the ``inline`` on-cache-error policy, answered with the routing inline.  A
failure is translated here, once, into the :class:`~sglang_r3.errors.R3RequestError`
the client sees.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from r3_client import (
    AuthError,
    FormatError,
    LimitExceededError,
    PutResult,
    Segment,
    SegmentConflictError,
    ServiceError,
    StoreUnavailableError,
    TransportError,
)
from sglang_r3.errors import CacheUnavailableError, R3RequestError
from sglang_r3.http_server import metrics

log = logging.getLogger("sglang_r3")

#: Failures that say the cache is unreachable or unwell; they fall under the
#: on-cache-error policy.  Everything else is about the request and fails it.
CACHE_DOWN = (TransportError, StoreUnavailableError, ServiceError, AuthError)


def new_reference(rollout_id: str, start: int, end: int) -> dict[str, Any]:
    """The reference of an output whose rows ``[start, end)`` are not stored yet."""
    return {
        "rollout_id": rollout_id,
        "start": start,
        "end": end,
        "stored": False,
        "nbytes": 0,
        "segments": [],
    }


def stored(ref: dict[str, Any]) -> dict[str, Any]:
    """``ref``, marked stored."""
    ref["stored"] = True
    metrics.OUTPUTS.labels("stored").inc()
    return ref


def stored_segments(
    ref: dict[str, Any],
    segs: Sequence[Segment],
    puts: Sequence[PutResult],
    *,
    rows: int,
    since: float,
) -> dict[str, Any]:
    """``ref`` with the written segments (``rows`` rows, shipping began at ``since``,
    a ``time.perf_counter()``), marked stored."""
    for seg, put in zip(segs, puts, strict=True):
        ref["nbytes"] += put.nbytes
        ref["segments"].append(
            {
                "start": seg.start,
                "end": seg.end,
                "nbytes": put.nbytes,
                "dedupe_hit": put.dedupe_hit,
                "weight_version": seg.weight_version,
            }
        )
    metrics.ROWS.inc(rows)
    metrics.BYTES_SHIPPED.inc(ref["nbytes"])
    metrics.SHIP_SECONDS.observe(time.perf_counter() - since)
    return stored(ref)


def no_routing(meta_info: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """An aborted request has no routing (the reference says why); else capture is off."""
    finish = meta_info.get("finish_reason") or {}
    if isinstance(finish, dict) and finish.get("type") == "abort":
        metrics.OUTPUTS.labels("aborted").inc()
        ref["error"] = f"request aborted: {finish.get('message', '')}".strip()
        return ref
    metrics.GUARD_TRIPS.labels("missing").inc()
    raise R3RequestError(
        500, "r3: the engine returned no routing for a finished request (capture is off?)"
    )


def cache_unreachable(exc: Exception, rollout_id: str) -> CacheUnavailableError:
    """The 503 of a lookup the cache could not answer (one of :data:`CACHE_DOWN`)."""
    metrics.CACHE_ERRORS.labels(type(exc).__name__).inc()
    return CacheUnavailableError(
        503, f"r3: routing cache unreachable while looking up rollout {rollout_id!r}: {exc}"
    )


def failed(
    exc: Exception, ref: dict[str, Any], *, on_cache_error: str, attempts: int
) -> dict[str, Any]:
    """The status a failed store answers with, or under ``inline`` the fallback reference.

    ``exc`` is a :class:`FormatError` (500), a :class:`SegmentConflictError` (409), a
    :class:`LimitExceededError` (413) or one of :data:`CACHE_DOWN` (503, or the
    fallback when ``on_cache_error`` is ``inline``) after ``attempts`` tries.
    """
    if isinstance(exc, FormatError):
        metrics.GUARD_TRIPS.labels("invalid_rows").inc()
        raise R3RequestError(
            500, f"r3: engine routing failed validation, not stored: {exc}"
        ) from None
    if isinstance(exc, SegmentConflictError):
        metrics.CONFLICTS.inc()
        raise R3RequestError(409, f"r3: {exc}") from None
    if isinstance(exc, LimitExceededError):
        metrics.OUTPUTS.labels("failed").inc()
        raise R3RequestError(413, f"r3: the routing cache refused the segment: {exc}") from None
    metrics.CACHE_ERRORS.labels(type(exc).__name__).inc()
    metrics.ROWS_LOST.labels(type(exc).__name__).inc(ref["end"] - ref["start"])
    reason = f"routing cache write failed after {attempts} attempt(s): {exc}"
    if on_cache_error == "inline":
        log.warning("r3: %s; returning routing inline for %s", reason, ref["rollout_id"])
        metrics.OUTPUTS.labels("inline_fallback").inc()
        ref["error"] = reason
        ref["inline"] = True
        return ref
    metrics.OUTPUTS.labels("failed").inc()
    raise R3RequestError(503, f"r3: {reason} (policy: fail)") from None
