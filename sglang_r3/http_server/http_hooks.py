"""Hooks on SGLang's HTTP entry points: the OpenAI handler and ``/generate`` streams.

Header tagging, references in OpenAI responses (``sglext.r3``), and r3 errors
answered with their own status, also before a stream starts.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from sglang_r3.config import engine_config
from sglang_r3.errors import R3RequestError
from sglang_r3.http_server.request_state import hold_refs, remembered_error
from sglang_r3.http_server.tagging import (
    header_rollout,
    misplaced_tag,
    sampling_params_tagged,
    tag_generate_from_header,
    tag_with_header,
)
from sglang_r3.tags import carries_tag

log = logging.getLogger("sglang_r3")

# ---------------------------------------------------------------- OpenAI


# OpenAI error ``type`` per status (the names of the OpenAI SDK's error classes).
_ERROR_TYPES = {
    400: "BadRequestError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def openai_error(err: R3RequestError) -> dict[str, Any]:
    """SGLang's OpenAI error object for ``err``, with its own status as ``code``."""
    return {
        "object": "error",
        "message": err.message,
        "type": _ERROR_TYPES.get(err.status_code, "R3Error"),
        "param": None,
        "code": err.status_code,
    }


def _is_error_event(text: str) -> bool:
    return text.startswith('data: {"error"')


async def around_openai_handle_request(
    original: Callable[..., Any], self: Any, request: Any, raw_request: Any = None
) -> Any:
    """AROUND ``OpenAIServingBase.handle_request``: references and statuses of r3.

    Adds ``sglext.r3`` to the answer: upstream's OpenAI answers carry routing for the
    first choice only; the references here cover every choice, by choice index.
    Upstream's completion and chat handlers answer every ``ValueError`` with 400
    (our error is one), so an r3 error is answered here with its own status and
    message: 409, 413, 503 as documented, not a permanent-looking 400.  In a stream
    that has already started (status 200 sent) the final error event carries it.
    A request without a body tag is first tagged from the routing-key header
    (sglang-router drops ``custom_params``), and an untagged one refused under
    ``--routing-require-tag`` is answered with r3's error object.
    """
    from fastapi.responses import ORJSONResponse, StreamingResponse
    from pydantic import BaseModel
    from starlette.responses import Response

    rollout_id = header_rollout(raw_request)
    if rollout_id is not None and engine_config().enabled and hasattr(request, "custom_params"):
        try:
            request.custom_params = tag_with_header(request.custom_params, rollout_id)
        except R3RequestError as exc:
            return ORJSONResponse(openai_error(exc), status_code=exc.status_code)
    if raw_request is None or not carries_tag(getattr(request, "custom_params", None)):
        response = await original(self, request, raw_request)
        err = remembered_error(raw_request)
        if err is not None and isinstance(response, Response) and response.status_code >= 400:
            return ORJSONResponse(openai_error(err), status_code=err.status_code)
        return response

    holder = hold_refs(raw_request)
    response = await original(self, request, raw_request)
    if isinstance(response, StreamingResponse):
        response.body_iterator = _openai_stream(aiter(response.body_iterator), holder, raw_request)
        return response
    err = remembered_error(raw_request)
    if err is not None and isinstance(response, Response) and response.status_code >= 400:
        return ORJSONResponse(openai_error(err), status_code=err.status_code)
    if isinstance(response, BaseModel) and holder:
        body = json.loads(response.model_dump_json(by_alias=True))
        ext = body.get("sglext") or {}
        ext["r3"] = sorted(holder, key=lambda r: r["index"])
        body["sglext"] = ext
        return ORJSONResponse(body)
    return response


async def _openai_stream(
    chunks: AsyncIterator[Any], holder: list[dict[str, Any]], raw_request: Any
) -> AsyncIterator[Any]:
    """Pass SSE chunks through; before ``[DONE]``, one chunk carrying the references;
    an error event caused by r3 gets r3's status as its ``code``."""
    head: dict[str, Any] = {}
    async for chunk in chunks:
        text = chunk.decode() if isinstance(chunk, bytes | bytearray) else str(chunk)
        if text.startswith("data: [DONE]") and holder:
            extra = {
                **head,
                "choices": [],
                "sglext": {"r3": sorted(holder, key=lambda r: r["index"])},
            }
            yield f"data: {json.dumps(extra)}\n\n"
        elif _is_error_event(text):
            err = remembered_error(raw_request)
            if err is not None:
                yield f"data: {json.dumps({'error': openai_error(err)})}\n\n"
                continue
        elif not head and text.startswith("data: {"):
            try:
                first = json.loads(text[len("data: ") :])
                head = {k: first[k] for k in ("id", "object", "created", "model") if k in first}
            except ValueError:
                pass
        yield chunk


# ---------------------------------------------------------------- /generate streams


def _generate_error_event(err: R3RequestError) -> bytes:
    """Upstream's ``/generate`` stream error event, with ``retryable`` set for a 503."""
    body = {
        "error": {
            "message": err.message,
            "type": "invalid_request_error" if err.status_code < 500 else "server_error",
            "code": err.status_code,
            "retryable": err.status_code == 503,
        }
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def around_serve_generate_request(
    original: Callable[..., Any], obj: Any, request: Any
) -> Any:
    """AROUND ``http_server.serve_generate_request``: statuses of tagged ``/generate`` streams.

    Upstream answers a stream with 200 at once and reports a failure as an error
    event.  For an r3 request, the first event is awaited before answering (as
    upstream's OpenAI handlers do): a request r3 refuses before generation (400,
    409, 503) is then answered with that status and ``{"error": {"message"}}``,
    like the non-streaming path.  A failure after the stream started stays an
    error event, carrying r3's status as ``code``.  Before any of that, a request
    without a body tag is tagged from the routing-key header (sglang-router drops
    ``custom_params``).
    """
    from fastapi.responses import ORJSONResponse, StreamingResponse

    try:
        tag_generate_from_header(obj, request)
    except R3RequestError as exc:
        return ORJSONResponse({"error": {"message": exc.message}}, status_code=exc.status_code)
    response = await original(obj, request)
    sampling_params = getattr(obj, "sampling_params", None)
    if not getattr(obj, "stream", False):
        return _with_r3_status(response, request)
    if not (
        sampling_params_tagged(sampling_params)
        or misplaced_tag(sampling_params)
        or engine_config().require_tag  # an untagged stream is refused: answer 400
    ):
        return response

    if not isinstance(response, StreamingResponse):
        return response
    chunks = aiter(response.body_iterator)
    try:
        first = await anext(chunks)
    except StopAsyncIteration:
        return response
    err = remembered_error(request)
    text = first.decode() if isinstance(first, bytes | bytearray) else str(first)
    if err is not None and _is_error_event(text):
        # Nothing reached the scheduler: upstream already dropped the request's state
        # (its abort task is for disconnects of running streams, and would fail here).
        return ORJSONResponse({"error": {"message": err.message}}, status_code=err.status_code)
    response.body_iterator = _generate_stream(first, chunks, request)
    return response


def _with_r3_status(response: Any, request: Any) -> Any:
    """A non-streaming answer carrying an r3 refusal's own status: SGLang before 0.5.17
    answers every ``ValueError`` of ``/generate`` with 400 (0.5.12 ``http_server.py:1826``
    ``_create_error_response``), 0.5.17 on with the error's ``status_code``."""
    from fastapi.responses import ORJSONResponse

    err = remembered_error(request)
    if err is None or getattr(response, "status_code", None) != 400 or err.status_code == 400:
        return response
    return ORJSONResponse({"error": {"message": err.message}}, status_code=err.status_code)


async def _generate_stream(
    first: Any, chunks: AsyncIterator[Any], request: Any
) -> AsyncIterator[Any]:
    yield first
    async for chunk in chunks:
        text = chunk.decode() if isinstance(chunk, bytes | bytearray) else str(chunk)
        err = remembered_error(request) if _is_error_event(text) else None
        yield _generate_error_event(err) if err is not None else chunk


def wrap_generate_route() -> None:
    """Put :func:`around_serve_generate_request` on the ``/generate`` route itself (once).

    Before SGLang 0.5.22 the decorated route function ``http_server.generate_request``
    is the whole handler, with no ``serve_generate_request`` to hook, and FastAPI holds
    the function it was given at import, so patching the module attribute would change
    nothing.  The route is replaced by one with the same path, methods and response
    class whose endpoint runs the hook around the original; FastAPI reads its
    parameters from the original's signature.
    """
    import functools
    import inspect

    from fastapi.routing import APIRoute
    from sglang.srt.entrypoints import http_server

    router = http_server.app.router
    route = next(
        (r for r in router.routes if isinstance(r, APIRoute) and r.path == "/generate"), None
    )
    if route is None or getattr(route.endpoint, "_r3_wrapped", False):
        return
    original = route.endpoint

    @functools.wraps(original)
    async def generate(obj: Any, request: Any) -> Any:
        return await around_serve_generate_request(original, obj, request)

    generate.__signature__ = inspect.signature(original, eval_str=True)  # type: ignore[attr-defined]
    generate._r3_wrapped = True  # type: ignore[attr-defined]
    router.routes.remove(route)
    http_server.app.add_api_route(
        "/generate",
        generate,
        methods=sorted(route.methods or ()),
        response_class=route.response_class,
        include_in_schema=route.include_in_schema,
    )
