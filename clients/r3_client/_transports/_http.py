"""HTTP transports over httpx (sync and async), with httpx errors translated in one place."""

from __future__ import annotations

import asyncio
import functools
import os
import ssl
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any
from urllib.parse import quote

import httpx

from r3_client._config import Timeout
from r3_client._exceptions import ProtocolError, R3Error, error_for_code, from_httpx
from r3_client.codec.stream import FRAME_MEDIA_TYPE, StreamDecoder, StreamItem

__all__ = ["AsyncHTTPTransport", "HTTPTransport"]


def _path(rollout_id: str, suffix: str = "") -> str:
    """``/v1/rollouts/<id><suffix>`` with the id percent-encoded as one path segment.

    The client checks ids against the id rule before any I/O; encoding every
    reserved character as well means no id can ever reach another path, query
    or fragment, whatever the rule allows.
    """
    return f"/v1/rollouts/{quote(rollout_id, safe='')}{suffix}"


def _json(resp: httpx.Response) -> dict[str, Any]:
    """A 2xx answer's JSON object; :class:`ProtocolError` when it is not one."""
    try:
        out = resp.json()
    except ValueError:  # also UnicodeDecodeError
        raise ProtocolError(f"HTTP {resp.status_code} answer is not JSON") from None
    if not isinstance(out, dict):
        raise ProtocolError(f"HTTP {resp.status_code} answer is not a JSON object")
    return out


def _params(
    start: int, end: int | None, layers: Sequence[int] | None, view: int | None = None
) -> dict[str, Any]:
    p: dict[str, Any] = {} if view is None else {"view": view}
    if start:
        p["start"] = start
    if end is not None:
        p["end"] = end
    if layers is not None:
        p["layers"] = ",".join(str(int(x)) for x in layers)
    return p


def _put_params(view: int | None, share: bool | None) -> dict[str, Any] | None:
    """A put's query: ``view`` and ``share`` when set (``share`` as ``true``/``false``)."""
    p: dict[str, Any] = {} if view is None else {"view": view}
    if share is not None:
        p["share"] = "true" if share else "false"
    return p or None


def _batch_body(
    ids: Sequence[str],
    start: int,
    end: int | None,
    layers: Sequence[int] | None,
    ranges: Sequence[tuple[int, int]] | None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "rollout_ids": list(ids),
        "start": start,
        "end": end,
        "layers": None if layers is None else [int(x) for x in layers],
    }
    if ranges is not None:
        body["ranges"] = [[int(a), int(b)] for a, b in ranges]
    return body


def _batch_items(
    body: dict[str, Any], field: str = "stat"
) -> list[tuple[str, dict[str, Any] | R3Error]]:
    """``POST /v1/batch/stat``'s items (``/v1/batch/delete``'s: ``field="deleted"``): each
    the record's JSON or the error it names."""
    what = f"batch {field}"
    items = body.get("items")
    if not isinstance(items, list):
        raise ProtocolError(f"{what} answer has no items list")
    out: list[tuple[str, dict[str, Any] | R3Error]] = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("rollout_id"), str):
            raise ProtocolError(f"{what} item is not an object with a rollout_id")
        rid, stat, err = item["rollout_id"], item.get(field), item.get("error")
        if isinstance(stat, dict):
            out.append((rid, stat))
        elif isinstance(err, dict):
            code, msg = str(err.get("code", "service_error")), str(err.get("message", ""))
            status = item.get("status")
            status = status if isinstance(status, int) else None
            out.append((rid, error_for_code(code, msg, status=status)))
        else:
            raise ProtocolError(f"{what} item for {rid!r} has neither {field} nor error")
    return out


def _error(resp: httpx.Response) -> R3Error:
    """The exception for a non-2xx answer (its JSON error code, else the status)."""
    try:
        err = resp.json()["error"]
        return error_for_code(str(err["code"]), str(err["message"]), status=resp.status_code)
    except (ValueError, KeyError, TypeError):
        return ProtocolError(f"HTTP {resp.status_code} without an r3 error body")


def _raise_for(resp: httpx.Response) -> None:
    if resp.status_code >= 400:
        resp.read()
        raise _error(resp)


@contextmanager
def _translate() -> Iterator[None]:
    try:
        yield
    except httpx.HTTPError as exc:
        raise from_httpx(exc) from exc


@asynccontextmanager
async def _atranslate() -> AsyncIterator[None]:
    try:
        yield
    except httpx.HTTPError as exc:
        raise from_httpx(exc) from exc


async def _whole(resp: httpx.Response) -> httpx.Response:
    """``resp`` (sent with ``stream=True``) with its body read, as a response of its own.

    Read from ``resp.stream``, not ``aread()``: httpx closes a response itself once its
    body is read, where this library cannot keep a cancel out of the close (:func:`_aclose`).
    """
    assert isinstance(resp.stream, httpx.AsyncByteStream)
    body = b"".join([part async for part in resp.stream])
    return httpx.Response(
        resp.status_code, headers=resp.headers, content=body, request=resp.request
    )


async def _aclose(resp: httpx.Response) -> None:
    """Close ``resp`` to the end, even when this task is cancelled meanwhile.

    httpcore marks a response closed before its close is done, so a cancel landing inside
    the close (``get_many`` cancels its other streams when one is refused) left the pool's
    request and its connection held for good, and the pool ran dry (issue 53;
    encode/httpcore#1115).  The close runs in a task of its own, which that cancel does not
    reach, and the caller waits for it before the cancel goes on."""
    closing = asyncio.ensure_future(resp.aclose())
    try:
        await asyncio.shield(closing)
    except asyncio.CancelledError:
        await asyncio.wait([closing])
        raise


async def _asend(http: httpx.AsyncClient, request: httpx.Request) -> httpx.Response:
    """``request`` sent (``stream=True``) in a task of its own, so that a cancel reaches the
    caller and never the pool: httpcore 1.0.9 keeps a connection it created for a request
    cancelled between the connection's assignment and its use, neither idle, closed nor
    usable, and ``max_connections`` of them leave every later request waiting out its pool
    timeout (encode/httpcore#1093).  A cancelled caller waits for the answer's head
    (bounded by the client's connect and read timeouts), closes it, then is cancelled."""
    sending = asyncio.ensure_future(http.send(request, stream=True))
    try:
        return await asyncio.shield(sending)
    except asyncio.CancelledError:
        while not sending.done():
            try:
                await asyncio.wait([sending])
            except asyncio.CancelledError:  # (cancelled again: the send still ends first)
                continue
        if not sending.cancelled() and sending.exception() is None:
            await _aclose(sending.result())
        raise


@functools.cache
def _verifying_context(cert_file: str | None, cert_dir: str | None) -> ssl.SSLContext:
    """httpx's default certificate-verifying TLS context for the CA bundle the environment
    names (``SSL_CERT_FILE``, ``SSL_CERT_DIR``, read as httpx reads them), built on a
    client's first use in a process and shared by every client after it.

    httpx builds one per client and loads the whole CA bundle each time: 62 ms a client on
    this machine, most of what a short-lived client costs (a rank's client per step, a
    worker's per request).  An ``SSLContext`` is safe to share between clients and threads.
    """
    del cert_file, cert_dir  # (the cache's key: another bundle named, another context)
    return httpx.create_ssl_context()


def _client_kwargs(url: str, api_key: str | None, timeout: Timeout) -> dict[str, Any]:
    tls = _verifying_context(os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
    return {
        "base_url": url,
        "verify": tls,
        "headers": {"Authorization": f"Bearer {api_key}"} if api_key else {},
        "timeout": httpx.Timeout(timeout.read, connect=timeout.connect),
    }


class HTTPTransport:
    """Blocking HTTP transport (one httpx.Client, connection pooling)."""

    def __init__(
        self, url: str, *, api_key: str | None = None, timeout: Timeout = Timeout()
    ) -> None:
        self._http = httpx.Client(**_client_kwargs(url, api_key, timeout))

    def put(
        self,
        rollout_id: str,
        frame: bytes,
        *,
        view: int | None = None,
        share: bool | None = None,
    ) -> dict[str, Any]:
        """See :class:`Transport`."""
        with _translate():
            resp = self._http.put(
                _path(rollout_id, "/segments"),
                params=_put_params(view, share),
                content=frame,
                headers={"Content-Type": FRAME_MEDIA_TYPE},
            )
        _raise_for(resp)
        return _json(resp)

    def read_plan(self) -> dict[str, Any]:
        """``POST /v1/read-plan``: this key's direct-read credentials (HTTP only)."""
        with _translate():
            resp = self._http.post("/v1/read-plan")
        _raise_for(resp)
        return _json(resp)

    def get(
        self,
        rollout_id: str,
        start: int,
        end: int | None,
        layers: Sequence[int] | None,
        *,
        view: int | None = None,
    ) -> bytes:
        """See :class:`Transport`."""
        params = _params(start, end, layers, view)
        with _translate():
            resp = self._http.get(_path(rollout_id), params=params)
        _raise_for(resp)
        return resp.content

    def stat(self, rollout_id: str) -> dict[str, Any]:
        """See :class:`Transport`."""
        with _translate():
            resp = self._http.get(_path(rollout_id, "/stat"))
        _raise_for(resp)
        return _json(resp)

    def stat_many(self, rollout_ids: Sequence[str]) -> list[tuple[str, dict[str, Any] | R3Error]]:
        """See :class:`Transport`."""
        with _translate():
            resp = self._http.post("/v1/batch/stat", json={"rollout_ids": list(rollout_ids)})
        _raise_for(resp)
        return _batch_items(_json(resp))

    def delete(self, rollout_id: str) -> bool:
        """See :class:`Transport` (404 is "did not exist", not an error)."""
        with _translate():
            resp = self._http.delete(_path(rollout_id))
        if resp.status_code == 404:
            return False
        _raise_for(resp)
        return True

    def delete_many(self, rollout_ids: Sequence[str]) -> list[tuple[str, dict[str, Any] | R3Error]]:
        """See :class:`Transport`."""
        with _translate():
            resp = self._http.post("/v1/batch/delete", json={"rollout_ids": list(rollout_ids)})
        _raise_for(resp)
        return _batch_items(_json(resp), "deleted")

    def drop_consumed(self, upto: str, cursor: str, max_rollouts: int | None) -> dict[str, Any]:
        """See :class:`Transport`."""
        body = {"upto": upto, "cursor": cursor, "max_rollouts": max_rollouts}
        with _translate():
            resp = self._http.post("/v1/drop-consumed", json=body)
        _raise_for(resp)
        return _json(resp)

    def touch(self, rollout_id: str, ttl_s: int | None) -> None:
        """See :class:`Transport`."""
        with _translate():
            resp = self._http.post(_path(rollout_id, "/touch"), json={"ttl_s": ttl_s})
        _raise_for(resp)

    def rewind(self, rollout_id: str, rows: int) -> dict[str, Any]:
        """See :class:`Transport`."""
        with _translate():
            resp = self._http.post(_path(rollout_id, "/rewind"), json={"rows": rows})
        _raise_for(resp)
        return _json(resp)

    def batch_get(
        self,
        rollout_ids: Sequence[str],
        start: int,
        end: int | None,
        layers: Sequence[int] | None,
        ranges: Sequence[tuple[int, int]] | None = None,
    ) -> Generator[StreamItem, None, None]:
        """See :class:`Transport`."""
        dec = StreamDecoder()
        with (
            _translate(),
            self._http.stream(
                "POST", "/v1/batch/get", json=_batch_body(rollout_ids, start, end, layers, ranges)
            ) as resp,
        ):
            _raise_for(resp)
            for chunk in resp.iter_raw(1 << 20):
                yield from dec.feed(chunk)
        dec.close()

    def close(self) -> None:
        """See :class:`Transport`."""
        self._http.close()


class AsyncHTTPTransport:
    """Asyncio HTTP transport (one httpx.AsyncClient)."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        timeout: Timeout = Timeout(),
        max_connections: int = 32,
    ) -> None:
        self._http = httpx.AsyncClient(
            **_client_kwargs(url, api_key, timeout),
            limits=httpx.Limits(max_connections=max_connections),
        )

    async def put(
        self,
        rollout_id: str,
        frame: bytes,
        *,
        view: int | None = None,
        share: bool | None = None,
    ) -> dict[str, Any]:
        """See :class:`Transport`."""
        resp = await self._send(
            "PUT",
            _path(rollout_id, "/segments"),
            params=_put_params(view, share),
            content=frame,
            headers={"Content-Type": FRAME_MEDIA_TYPE},
        )
        _raise_for(resp)
        return _json(resp)

    async def get(
        self,
        rollout_id: str,
        start: int,
        end: int | None,
        layers: Sequence[int] | None,
        *,
        view: int | None = None,
    ) -> bytes:
        """See :class:`Transport`."""
        resp = await self._send("GET", _path(rollout_id), params=_params(start, end, layers, view))
        _raise_for(resp)
        return resp.content

    async def stat(self, rollout_id: str) -> dict[str, Any]:
        """See :class:`Transport`."""
        resp = await self._send("GET", _path(rollout_id, "/stat"))
        _raise_for(resp)
        return _json(resp)

    async def stat_many(
        self, rollout_ids: Sequence[str]
    ) -> list[tuple[str, dict[str, Any] | R3Error]]:
        """See :class:`Transport`."""
        resp = await self._send("POST", "/v1/batch/stat", json={"rollout_ids": list(rollout_ids)})
        _raise_for(resp)
        return _batch_items(_json(resp))

    async def delete(self, rollout_id: str) -> bool:
        """See :class:`Transport`."""
        resp = await self._send("DELETE", _path(rollout_id))
        if resp.status_code == 404:
            return False
        _raise_for(resp)
        return True

    async def delete_many(
        self, rollout_ids: Sequence[str]
    ) -> list[tuple[str, dict[str, Any] | R3Error]]:
        """See :class:`Transport`."""
        resp = await self._send("POST", "/v1/batch/delete", json={"rollout_ids": list(rollout_ids)})
        _raise_for(resp)
        return _batch_items(_json(resp), "deleted")

    async def drop_consumed(
        self, upto: str, cursor: str, max_rollouts: int | None
    ) -> dict[str, Any]:
        """See :class:`Transport`."""
        body = {"upto": upto, "cursor": cursor, "max_rollouts": max_rollouts}
        resp = await self._send("POST", "/v1/drop-consumed", json=body)
        _raise_for(resp)
        return _json(resp)

    async def touch(self, rollout_id: str, ttl_s: int | None) -> None:
        """See :class:`Transport`."""
        resp = await self._send("POST", _path(rollout_id, "/touch"), json={"ttl_s": ttl_s})
        _raise_for(resp)

    async def rewind(self, rollout_id: str, rows: int) -> dict[str, Any]:
        """See :class:`Transport`."""
        resp = await self._send("POST", _path(rollout_id, "/rewind"), json={"rows": rows})
        _raise_for(resp)
        return _json(resp)

    async def batch_get(
        self,
        rollout_ids: Sequence[str],
        start: int,
        end: int | None,
        layers: Sequence[int] | None,
        ranges: Sequence[tuple[int, int]] | None = None,
    ) -> AsyncGenerator[StreamItem, None]:
        """See :class:`Transport`.  The response is closed on every exit (the stream's end,
        an error, the consumer closing this generator, a cancel), by :func:`_aclose`."""
        dec = StreamDecoder()
        body = _batch_body(rollout_ids, start, end, layers, ranges)
        async with _atranslate():
            resp = await _asend(
                self._http, self._http.build_request("POST", "/v1/batch/get", json=body)
            )
            try:
                if resp.status_code >= 400:
                    raise _error(await _whole(resp))
                assert isinstance(resp.stream, httpx.AsyncByteStream)
                async for chunk in resp.stream:  # (not aiter_raw: it closes resp itself)
                    for item in dec.feed(chunk):
                        yield item
            finally:
                await _aclose(resp)
        dec.close()

    async def _send(self, method: str, url: str, **kw: Any) -> httpx.Response:
        """One request and its answer read whole, the response closed by :func:`_aclose`
        whatever happens (every call but the batch stream)."""
        async with _atranslate():
            resp = await _asend(self._http, self._http.build_request(method, url, **kw))
            try:
                return await _whole(resp)
            finally:
                await _aclose(resp)

    async def aclose(self) -> None:
        """See :class:`AsyncTransport`."""
        await self._http.aclose()
