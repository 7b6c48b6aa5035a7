"""The no-I/O core both clients share: argument checks, frames, retry decisions, batch cursors.

:class:`ClientCore` validates arguments, builds requests (a put's frame and options),
decides on retries and parses and decodes answers; :class:`Cursor` keeps a ``get_many``
batch's place so every id is answered exactly once.  The shells drive a transport with
them, in the caller's thread (:class:`~r3_client._sync_client.RoutingClient`) or on its
event loop (:class:`~r3_client._async_client.AsyncRoutingClient`); :mod:`r3_client._range_plan`
plans a ranged read the same way, without I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import numpy.typing as npt

from r3_client._answers import Deleted, DropResult, RolloutInfo, ViewInfo, freed_total
from r3_client._config import Retry, Timeout
from r3_client._exceptions import (
    ConnectError,
    FormatError,
    FrameError,
    InvalidRequestError,
    LimitExceededError,
    ProtocolError,
    R3Error,
    RequestTimeoutError,
    ServiceError,
    ShapeError,
    StoreUnavailableError,
    TransportError,
    error_for_code,
)
from r3_client._routing import Routing, Segment, check_rollout_id, check_weight_version
from r3_client._transports import (
    AsyncGrpcTransport,
    AsyncHTTPTransport,
    AsyncTransport,
    GrpcTransport,
    HTTPTransport,
    Transport,
)
from r3_client._views import ServedRouting, Steps, applicable_views, apply_views, served
from r3_client.codec import CodecName, decode_rollout, encode_frame, read_header
from r3_client.codec.stream import StreamItem

T = TypeVar("T")
#: Failures that say nothing about the request: worth another try.
RETRYABLE = (ConnectError, RequestTimeoutError, StoreUnavailableError)
Result = tuple[str, Routing | R3Error]
#: Frames above this size are decoded off the event loop (AsyncRoutingClient.get_many).
THREAD_DECODE_BYTES = 64 << 10


class ClientCore:
    """Everything both clients share; no I/O."""

    def __init__(self, retry: Retry, max_bytes: int) -> None:
        self.retry = retry
        self.max_bytes = max_bytes

    def backoff(self, exc: Exception, failures: int) -> float:
        """Seconds to wait before trying again after the ``failures``-th failure.

        Re-raises ``exc`` when it is not worth retrying or the attempts are spent.
        """
        if not isinstance(exc, RETRYABLE) or failures >= self.retry.attempts:
            raise exc
        return self.retry.delay(failures - 1)

    def put_request(
        self,
        rollout_id: str,
        routing: Routing | npt.ArrayLike | bytes,
        *,
        num_experts: int | None,
        layer_ids: Sequence[int] | None,
        start: int | None,
        segment: Segment | None,
        codec: CodecName,
        view: int | None,
        share: bool | None,
    ) -> tuple[bytes, dict[str, Any]]:
        """A put's frame and the transport's keyword arguments, every argument checked
        before any I/O (the id, then ``view`` / ``share``, then the routing).  The frame:
        bytes are checked and sent as they are, anything else encoded."""
        check_rollout_id(rollout_id)
        opts = self.put_options(view, share)
        if isinstance(routing, bytes | bytearray | memoryview):
            read_header(routing)  # fail here, with the reason, rather than as a 400
            return bytes(routing), opts
        frame = encode_frame(
            routing,
            num_experts=num_experts,
            layer_ids=layer_ids,
            start=start,
            segment=segment,
            codec=codec,
        )
        return frame, opts

    @staticmethod
    def put_options(view: int | None, share: bool | None) -> dict[str, Any]:
        """A put's ``view`` and ``share``, checked before any I/O, as the transport's keyword
        arguments (only those set: a transport without them still serves plain puts)."""
        if share is not None and not isinstance(share, bool):
            raise InvalidRequestError(f"share must be True, False or None, got {share!r}")
        if view is not None and share:
            raise InvalidRequestError(
                "views are never shared: a view's rows are what one call recomputed; "
                "put it without share"
            )
        opts: dict[str, Any] = {}
        if view is not None:
            opts["view"] = view
        if share is not None:
            opts["share"] = share
        return opts

    @staticmethod
    def check_range(start: int, end: int | None) -> None:
        if start < 0 or (end is not None and end <= start):
            raise ShapeError(f"token range [{start}, {end}) is empty or negative")

    def check_read(self, rollout_id: str, start: int, end: int | None) -> None:
        """A read's id and rows, checked before any I/O."""
        check_rollout_id(rollout_id)
        self.check_range(start, end)

    @staticmethod
    def view_window(v: ViewInfo, base: Routing) -> tuple[int, int] | Routing:
        """The rows of view ``v`` within ``base``'s range, or, when it has none there, the
        routing of no rows that answers them (nothing to read)."""
        a, b = max(v.start, base.start), min(v.end, base.end)
        if a >= b:
            return Routing(base.indices[:0], base.num_experts, base.layer_ids, a)
        return a, b

    def decode(
        self,
        data: bytes,
        rollout_id: str,
        start: int,
        end: int | None,
        layers: Sequence[int] | None,
    ) -> Routing:
        """A read's frames, stitched and trimmed to the request (the service never decodes);
        a result over ``max_bytes`` is refused before it is allocated."""
        return decode_rollout(
            data,
            start=start,
            end=end,
            layers=layers,
            rollout_id=rollout_id,
            max_bytes=self.max_bytes,
        )

    def latest_steps(self, base: Routing, info: RolloutInfo, rollout_id: str) -> Steps[Routing]:
        """``base`` with the views of the rollout's stat ``info`` applied (policy
        ``latest``), as the steps the shell runs (each reads one view's rows)."""
        views = applicable_views(info)
        return apply_views(base, views, max_bytes=self.max_bytes, rollout_id=rollout_id)

    def served_steps(
        self, base: Routing, info: RolloutInfo, policy: str, rollout_id: str
    ) -> Steps[list[ServedRouting]]:
        """What ``get_served`` answers under ``policy`` from ``base`` (every row) and the
        rollout's stat ``info``, as the steps the shell runs."""
        views = applicable_views(info)
        return served(
            base, views, info.num_rows, policy, max_bytes=self.max_bytes, rollout_id=rollout_id
        )

    def result(
        self, item: StreamItem, start: int, end: int | None, layers: Sequence[int] | None
    ) -> Result:
        """An item's routing, or its error: a service error, or a stored body that does not
        decode (a :class:`FrameError` naming the rollout and segment; the batch goes on)."""
        rid, got = self.raw(item)
        return rid, self.decoded(rid, got, start, end, layers)

    @staticmethod
    def raw(item: StreamItem) -> tuple[str, bytes | R3Error]:
        """An item's undecoded bytes, or the error the service sent for it."""
        if item.frame is not None:
            return item.rollout_id, item.frame
        err = error_for_code(
            item.error_code or "service_error", item.error_message or "", status=item.status
        )
        return item.rollout_id, err

    def decoded(
        self,
        rid: str,
        got: bytes | R3Error,
        start: int,
        end: int | None,
        layers: Sequence[int] | None,
    ) -> Routing | R3Error:
        """``got`` decoded (errors pass through; a decode failure becomes the result)."""
        if isinstance(got, R3Error):
            return got
        try:
            return self.decode(got, rid, start, end, layers)
        except (FormatError, FrameError) as exc:
            return exc

    @staticmethod
    def no_batch_stat(exc: R3Error) -> bool:
        """True when ``exc`` says the service predates batch stats (HTTP 404/405 on the
        route itself, gRPC ``UNIMPLEMENTED``): the client then stats id by id."""
        if isinstance(exc, ServiceError):
            return exc.status in (404, 405)
        return isinstance(exc, TransportError) and "UNIMPLEMENTED" in str(exc)

    @staticmethod
    def stats(
        asked: Sequence[str], got: Sequence[tuple[str, dict[str, Any] | R3Error]]
    ) -> list[RolloutInfo | R3Error]:
        """A batch stat's answers for ``asked``, each a :class:`RolloutInfo` or its error;
        :class:`ProtocolError` when the service answered for other ids."""
        if [rid for rid, _ in got] != list(asked):
            raise ProtocolError("batch stat answered other ids than it was asked")
        return [r if isinstance(r, R3Error) else RolloutInfo.from_dict(r) for _, r in got]

    @staticmethod
    def answered(results: Sequence[RolloutInfo | R3Error]) -> int:
        """How many of a batch stat's ``results`` the service answered before its reply
        budget cut the batch (``R3_CACHE_MAX_BATCH_STAT_BYTES``: every item from the cut
        on is a :class:`LimitExceededError`, to be asked for again)."""
        for i, r in enumerate(results):
            if isinstance(r, LimitExceededError):
                return i
        return len(results)

    @staticmethod
    def deleted(
        asked: Sequence[str], got: Sequence[tuple[str, dict[str, Any] | R3Error]]
    ) -> list[Deleted]:
        """A batch delete's answers for ``asked``; the first item's error is raised (the
        other ids of the batch were deleted: deleting again is harmless); a
        :class:`ProtocolError` when the service answered for other ids."""
        if [rid for rid, _ in got] != list(asked):
            raise ProtocolError("batch delete answered other ids than it was asked")
        for _, r in got:
            if isinstance(r, R3Error):
                raise r
        return [Deleted.from_dict(r) for _, r in got]  # type: ignore[arg-type]

    @staticmethod
    def dropped(total: DropResult | None, step: dict[str, Any]) -> DropResult:
        """``total`` with one drop call's answer added (its cursor is the step's)."""
        got = DropResult.from_dict(step)
        if total is None:
            return got
        return DropResult(
            total.dropped + got.dropped,
            total.kept_newer + got.kept_newer,
            total.kept_unversioned + got.kept_unversioned,
            freed_total((total.freed_bytes, got.freed_bytes)),
            total.examined + got.examined,
            got.cursor,
        )

    @staticmethod
    def next_drop(total: DropResult | None, calls: int, max_calls: int | None) -> str | None:
        """The cursor the next drop call starts at (``""``: the first), or None when the
        walk has ended or ``max_calls`` calls were made."""
        if total is None:
            return ""
        if total.cursor and (max_calls is None or calls < max_calls):
            return total.cursor
        return None

    @staticmethod
    def drop_version(upto: int | str) -> str:
        """``upto`` as the service takes it (decimal digits), checked before any I/O
        (:func:`~r3_client.check_weight_version`)."""
        return str(check_weight_version(upto))

    @staticmethod
    def chunks(ids: Sequence[str], size: int) -> list[list[str]]:
        """``ids`` (each checked against the id rule first, before any I/O) in batches."""
        if size < 1:
            raise ValueError("chunk_size must be >= 1")
        if isinstance(ids, str):
            raise TypeError("rollout_ids must be a sequence of ids, not one string")
        ids = [check_rollout_id(r) for r in ids]
        return [ids[i : i + size] for i in range(0, len(ids), size)]


class Cursor:
    """Where one batch of ``get_many`` stands: which ids are answered, failures since.

    No I/O: the shells feed it each stream item (:meth:`take`) and each
    retryable failure (:meth:`failed`) and do what it says.  Every id is
    answered exactly once, in order: a retry resumes *at* the first unanswered
    id, including one whose item was itself a retryable error (Redis briefly
    down), so no path can skip an id.
    """

    def __init__(
        self,
        core: ClientCore,
        ids: list[str],
        return_errors: bool,
        rows: tuple[int, int | None, Sequence[int] | None] = (0, None, None),
    ) -> None:
        self._core = core
        self._rows = rows
        self._ids = ids
        self._return_errors = return_errors
        self._done = 0
        self._failures = 0
        self._item_error: R3Error | None = None

    @property
    def remaining(self) -> list[str]:
        """The ids still to ask for."""
        return self._ids[self._done :]

    def take(self, item: StreamItem, *, decode: bool = True) -> tuple[str, Any]:
        """The result the stream's next item gives the next id.

        Raises a retryable item error (for the shell to retry from this id), a
        non-retryable one unless ``return_errors``, and :class:`ProtocolError`
        when the service answers for an id out of order.  With ``decode=False``
        the result is the item's bytes or error, never raised (the caller decodes,
        in order, and raises there).
        """
        if self._done >= len(self._ids) or item.rollout_id != self._ids[self._done]:
            expected = self._ids[self._done] if self._done < len(self._ids) else None
            raise ProtocolError(
                f"batch stream answered for {item.rollout_id!r} where {expected!r} was next"
            )
        rid, res = self._core.result(item, *self._rows) if decode else self._core.raw(item)
        if isinstance(res, RETRYABLE):
            self._item_error = res
            raise res
        self._advance()
        if decode and isinstance(res, R3Error) and not self._return_errors:
            raise res
        return rid, res

    def ended(self) -> None:
        """The stream closed cleanly: raise :class:`ProtocolError` if it left ids unanswered."""
        if self.remaining:
            raise ProtocolError(
                f"batch stream ended with {len(self.remaining)} rollouts unanswered"
            )

    def failed(self, exc: R3Error) -> tuple[float, Result | None]:
        """After a retryable failure: ``(delay, None)`` to retry from the same id.

        When the attempts are spent on an id whose own item was the error and
        ``return_errors`` is set, that id is answered with its error:
        ``(0, (rid, error))``.  Otherwise re-raises ``exc``.
        """
        self._failures += 1
        try:
            return self._core.backoff(exc, self._failures), None
        except R3Error:
            if not (self._return_errors and exc is self._item_error):
                raise
        rid = self._ids[self._done]
        self._advance()
        return 0.0, (rid, exc)

    def _advance(self) -> None:
        self._done += 1
        self._failures = 0
        self._item_error = None


def _scheme(url: str) -> str:
    """``grpc`` or ``http`` (for http:// and https://); ValueError for any other URL."""
    if url.startswith("grpc://"):
        return "grpc"
    if url.startswith(("http://", "https://")):
        return "http"
    raise ValueError(f"unsupported URL {url!r}: use http://, https:// or grpc://")


def sync_transport(url: str, api_key: str | None, timeout: Timeout) -> Transport:
    cls = GrpcTransport if _scheme(url) == "grpc" else HTTPTransport
    return cls(url, api_key=api_key, timeout=timeout)


def async_transport(url: str, api_key: str | None, timeout: Timeout) -> AsyncTransport:
    cls = AsyncGrpcTransport if _scheme(url) == "grpc" else AsyncHTTPTransport
    return cls(url, api_key=api_key, timeout=timeout)
