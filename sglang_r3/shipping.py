"""From a finished output to stored segments and the reference put in the response.

Runs in SGLang's HTTP process (the tokenizer manager's event loop), never in the
scheduler: encoding goes to a worker thread and the write is an async call, so the
scheduler keeps stepping while routing is shipped, and the response is released
only once its routing is stored.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from r3_client import (
    AsyncRoutingClient,
    AuthError,
    Context,
    FormatError,
    LimitExceededError,
    PutResult,
    R3Error,
    Retry,
    RolloutNotFoundError,
    Segment,
    SegmentConflictError,
    ServiceError,
    StoreUnavailableError,
    Timeout,
    TransportError,
    encode_frame,
    read_header,
    token_digest,
)
from sglang_r3 import metrics
from sglang_r3.config import EngineConfig
from sglang_r3.errors import R3RequestError
from sglang_r3.layers import MoeShape
from sglang_r3.tagging import OutputTag

log = logging.getLogger("sglang_r3")

# Failures that say the cache is unreachable or unwell; they fall under the
# on-cache-error policy.  Everything else is about the request and fails it.
_CACHE_DOWN = (TransportError, StoreUnavailableError, ServiceError, AuthError)
#: Rollout contexts a process remembers for continuation frames (~6 KB each at 48x128).
_CONTEXTS = 4096


@dataclass(frozen=True, slots=True)
class Continuation:
    """What is already stored for a rollout: rows ``[0, end)`` over tokens with ``digest``."""

    end: int
    digest: str


def decode_rows(b64: str, shape: MoeShape) -> npt.NDArray[np.int32]:
    """Upstream's base64 int32 ``[rows, all layers, K]`` as an array."""
    raw = base64.b64decode(b64)
    width = shape.num_layers * shape.topk * 4
    if len(raw) % width:
        raise R3RequestError(
            500,
            f"r3: engine routing has {len(raw)} bytes, not a whole number of "
            f"[{shape.num_layers} layers x {shape.topk}] int32 rows",
        )
    return np.frombuffer(raw, dtype=np.int32).reshape(-1, shape.num_layers, shape.topk)


def check_rows(rows: npt.NDArray[np.int32], expected: int) -> None:
    """Guards on what the engine returned, before anything is stored.

    The row count must match the tokens (upstream only logs a warning).  All-zero
    rows, which is how a never-written slot reads, are refused later by the format's
    validation as a repeated expert id when ``K > 1``; with ``K = 1`` expert 0 is a
    legal row and cannot be told apart.
    """
    if rows.shape[0] != expected:
        metrics.GUARD_TRIPS.labels("row_count").inc()
        raise R3RequestError(
            500,
            f"r3: engine returned {rows.shape[0]} routing rows for {expected} token positions; "
            "refusing to store misaligned routing",
        )


class CacheUnavailableError(R3RequestError):
    """503: the cache could not be reached (after retries) to look up a rollout."""


class Shipper:
    """Owns the cache client of one process and turns outputs into stored segments."""

    def __init__(self, config: EngineConfig, shape: MoeShape, model_id: str) -> None:
        self.config = config
        self.shape = shape
        self.model_id = config.model_id or model_id
        self.client = AsyncRoutingClient(
            config.routing_cache,
            api_key=config.api_key,
            timeout=Timeout(connect=min(5.0, config.put_timeout_s), read=config.put_timeout_s),
            retry=Retry(attempts=config.put_attempts, backoff=0.1, max_backoff=1.0),
        )
        # rollout id -> the context (E, K, layers, relabel table) of its first segment
        # this process wrote, so later turns ship as continuation frames; LRU-bounded.
        self._contexts: OrderedDict[str, Context] = OrderedDict()

    async def continuation(self, rollout_id: str) -> Continuation | None:
        """The stored trajectory of ``rollout_id`` (None: new rollout).

        A stored rollout must be one contiguous run ``[0, end)`` from this model's
        geometry; anything else is a 409, since appending to it would misalign rows.
        """
        try:
            info = await self.client.stat(rollout_id)
        except RolloutNotFoundError:
            return None
        except _CACHE_DOWN as exc:
            metrics.CACHE_ERRORS.labels(type(exc).__name__).inc()
            raise CacheUnavailableError(
                503, f"r3: routing cache unreachable while looking up rollout {rollout_id!r}: {exc}"
            ) from None
        except R3Error as exc:
            raise R3RequestError(400, f"r3: rollout {rollout_id!r}: {exc}") from None
        geometry = (info.num_experts, info.topk, tuple(info.layer_ids))
        ours = (self.shape.num_experts, self.shape.topk, self.shape.moe_layer_ids)
        if geometry != ours:
            metrics.CONFLICTS.inc()
            raise R3RequestError(
                409,
                f"r3: rollout {rollout_id!r} is stored with (experts, top-k, layers)={geometry}, "
                f"this model has {ours}",
            )
        segs = sorted(info.segments, key=lambda s: s.segment.start)
        covered = 0
        for s in segs:
            if s.segment.start != covered:
                break
            covered = s.segment.end
        if not segs or covered != info.num_rows:
            metrics.CONFLICTS.inc()
            raise R3RequestError(
                409, f"r3: rollout {rollout_id!r} has gaps in its stored rows; cannot continue it"
            )
        digest = segs[-1].segment.tokens_digest
        if not digest:
            metrics.CONFLICTS.inc()
            raise R3RequestError(
                409,
                f"r3: rollout {rollout_id!r} was stored without token digests, so a new turn "
                "cannot be checked against it; use a new rollout id",
            )
        return Continuation(info.num_rows, digest)

    def _base(self, rollout_id: str, rows: int) -> Context | None:
        """The context a new segment of ``rollout_id`` continues from, if worth it.

        A continuation frame does not repeat E, K, the layer ids or a relabel
        table, and codes its rows with the table of the rollout's first segment.
        Used when this process wrote that segment (the context is cached) and it
        has a table, or when the new rows are too few to pay for a table anyway.
        """
        ctx = self._contexts.get(rollout_id)
        if ctx is None or not (ctx.has_table or rows < self.shape.num_experts):
            return None
        self._contexts.move_to_end(rollout_id)
        return ctx

    async def _put(self, rollout_id: str, rows: npt.NDArray[Any], seg: Segment) -> PutResult:
        """Encode ``rows`` as one segment (a continuation frame when :meth:`_base` allows)
        and store it; remember the rollout's context for its next segments."""
        base = self._base(rollout_id, len(rows))
        for attempt in (base, None) if base is not None else (None,):
            frame = await asyncio.to_thread(
                encode_frame,
                rows,
                num_experts=self.shape.num_experts,
                layer_ids=self.shape.moe_layer_ids,
                start=seg.start,
                segment=seg,
                base=attempt,
            )
            try:
                put = await self.client.put(rollout_id, frame)
            except SegmentConflictError as exc:
                if attempt is None or "holds no context" not in str(exc):
                    raise
                # The rollout was deleted or rewritten elsewhere: its context is gone.
                self._contexts.pop(rollout_id, None)
                continue
            if attempt is None and rollout_id not in self._contexts:
                own = read_header(frame, verify=False).context
                assert own is not None
                self._contexts[rollout_id] = Context.parse(own.raw)  # with its table
                while len(self._contexts) > _CONTEXTS:
                    self._contexts.popitem(last=False)
            return put
        raise AssertionError("unreachable")

    @staticmethod
    def check_prefix(tag: OutputTag, cont: Continuation, input_ids: Sequence[int]) -> None:
        """409 unless ``input_ids`` extends the stored trajectory of the rollout."""
        if len(input_ids) <= cont.end or token_digest(input_ids[: cont.end]) != cont.digest:
            metrics.CONFLICTS.inc()
            raise R3RequestError(
                409,
                f"r3: rollout {tag.rollout_id!r} has {cont.end} stored positions, and this "
                f"request's {len(input_ids)} prompt tokens do not start with that trajectory; "
                "send the full conversation so far, or start a new rollout id (a branch)",
            )

    async def ship(
        self,
        tag: OutputTag,
        start: int,
        b64: str | None,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        meta_info: dict[str, Any],
    ) -> dict[str, Any]:
        """Store the output's new rows; return the reference for the response.

        Under the ``inline`` policy a cache failure returns a reference with
        ``stored: false`` and leaves the base64 routing in ``meta_info``.
        """
        t0 = time.perf_counter()
        tokens = [*prompt_ids, *output_ids]
        end = len(tokens) - 1
        expected = max(end - start, 0)
        ref: dict[str, Any] = {
            "rollout_id": tag.rollout_id,
            "start": start,
            "end": max(end, start),
            "stored": False,
            "nbytes": 0,
            "segments": [],
        }
        if b64 is None:
            finish = meta_info.get("finish_reason") or {}
            if isinstance(finish, dict) and finish.get("type") == "abort":
                metrics.OUTPUTS.labels("aborted").inc()
                ref["error"] = f"request aborted: {finish.get('message', '')}".strip()
                return ref
            metrics.GUARD_TRIPS.labels("missing").inc()
            raise R3RequestError(
                500, "r3: the engine returned no routing for a finished request (capture is off?)"
            )
        rows = decode_rows(b64, self.shape)
        metrics.BYTES_UPSTREAM.inc(rows.nbytes)
        check_rows(rows, expected)
        retractions = int(meta_info.get("num_retractions") or 0)
        if retractions:
            metrics.RETRACTED.inc()
            ref["retractions"] = retractions
            if (tag.on_retraction or self.config.on_retraction) == "fail":
                metrics.GUARD_TRIPS.labels("retraction").inc()
                raise R3RequestError(
                    503,
                    f"r3: the scheduler retracted this request {retractions} time(s); its rows "
                    "may be re-prefilled rather than those sampled with (policy: fail)",
                )
        engine_wv = str(meta_info.get("weight_version") or "")
        wv = tag.weight_version or engine_wv
        ref["weight_version"] = wv
        if expected == 0:
            ref["stored"] = True
            metrics.OUTPUTS.labels("stored").inc()
            return ref
        moe = rows[:, list(self.shape.moe_layer_ids), :]
        prompt_end = len(prompt_ids) - 1
        cuts = [start, end]
        if tag.share_prompt and start < prompt_end < end:
            # The samples of a GRPO group read the prompt's rows from the same radix
            # slots; storing them as their own segment lets the service keep them once.
            cuts = [start, prompt_end, end]
        try:
            for a, b in itertools.pairwise(cuts):
                seg = Segment(a, b, self.model_id, wv, token_digest(tokens[:b]))
                put = await self._put(tag.rollout_id, moe[a - start : b - start], seg)
                ref["nbytes"] += put.nbytes
                ref["segments"].append(
                    {"start": a, "end": b, "nbytes": put.nbytes, "dedupe_hit": put.dedupe_hit}
                )
        except FormatError as exc:
            metrics.GUARD_TRIPS.labels("invalid_rows").inc()
            raise R3RequestError(
                500, f"r3: engine routing failed validation, not stored: {exc}"
            ) from None
        except SegmentConflictError as exc:
            metrics.CONFLICTS.inc()
            raise R3RequestError(409, f"r3: {exc}") from None
        except LimitExceededError as exc:
            metrics.OUTPUTS.labels("failed").inc()
            raise R3RequestError(413, f"r3: the routing cache refused the segment: {exc}") from None
        except _CACHE_DOWN as exc:
            metrics.CACHE_ERRORS.labels(type(exc).__name__).inc()
            reason = (
                f"routing cache write failed after {self.config.put_attempts} attempt(s): {exc}"
            )
            if (tag.on_cache_error or self.config.on_cache_error) == "inline":
                log.warning("r3: %s; returning routing inline for %s", reason, tag.rollout_id)
                metrics.OUTPUTS.labels("inline_fallback").inc()
                ref["error"] = reason
                ref["inline"] = True
                return ref
            metrics.OUTPUTS.labels("failed").inc()
            raise R3RequestError(503, f"r3: {reason} (policy: fail)") from None
        ref["stored"] = True
        metrics.OUTPUTS.labels("stored").inc()
        metrics.ROWS.inc(expected)
        metrics.BYTES_SHIPPED.inc(ref["nbytes"])
        metrics.SHIP_SECONDS.observe(time.perf_counter() - t0)
        return ref
