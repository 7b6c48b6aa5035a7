"""The hooks the plugin registers with SGLang's ``HookRegistry``, and their checks.

Every SGLang internal this extension touches is named in :data:`HOOKS` (and, for
attributes it reads, in :data:`UPSTREAM_FIELDS`); the canary test resolves all of
them against the installed SGLang, so an upgrade that moves one fails loudly.

Where the work happens (all in SGLang's HTTP process unless noted):

- ``TokenizerManager.generate_request`` (AROUND): every ``/generate`` and OpenAI
  request passes here.  Tagged requests get capture switched on, their rollouts
  looked up in the cache, and each finished output's rows shipped before the
  output is released.  Untagged requests go straight to upstream (or are refused
  under ``--routing-require-tag``, SGLang's warm-up and health probes excepted).
- ``TokenizerManager._send_one_request`` / ``_send_batch_request`` (AROUND): the
  tokenized prompt is known here, so a continued rollout's prefix is checked
  against the stored trajectory and ``routed_experts_start_len`` set per request.
- ``OpenAIServingBase.handle_request`` (AROUND): tags a request from the routing-key
  header (``X-SMG-Routing-Key``) when its body has no tag; puts the references into the
  OpenAI response (``sglext.r3``), streaming or not, and gives an r3 error its own
  status (upstream's handlers answer every ``ValueError`` with 400).
- ``http_server.serve_generate_request`` (AROUND): the same header tagging for
  ``/generate``; a tagged ``/generate`` stream
  refused before generation is answered with the error's status, not a 200 stream
  holding an error event.
- ``http_server.launch_server`` (BEFORE): verifies the hooks of this process,
  refuses unsupported options, adds ``/r3/metrics`` and ``/r3/info``.
- ``Scheduler.__init__`` (AROUND, scheduler process): the same verification and
  refusal there, and the CPU allocator check.
- ``SchedulerBatchResultProcessor._maybe_collect_routed_experts`` (AROUND, scheduler
  process): marks a tagged request's rows (:class:`sglang_r3.rows.TaggedRows`); O(1).
- ``DetokenizerManager.handle_batch_token_id_out`` (AROUND, detokenizer process):
  marked rows become compact :class:`sglang_r3.rows.EngineRows` instead of base64.
- ``DetokenizerManager.__init__`` (AROUND, detokenizer process): verification there.
"""

from __future__ import annotations

import asyncio
import json
import logging
import pkgutil
import re
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sglang_r3 import metrics
from sglang_r3.config import EngineConfig
from sglang_r3.errors import R3RequestError, bad_request
from sglang_r3.layers import MoeShape, moe_shape
from sglang_r3.probe import LOOP_PROBE
from sglang_r3.rows import TaggedRows, compact_rows
from sglang_r3.shipping import (
    CacheUnavailableError,
    Continuation,
    Shipper,
    samples_conflict,
    to_base64,
)
from sglang_r3.tagging import OutputTag, output_tags, request_shape

log = logging.getLogger("sglang_r3")

SGLANG_VERSION = "0.5.23"

_TM = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
T_GENERATE = f"{_TM}.generate_request"
T_SEND_ONE = f"{_TM}._send_one_request"
T_SEND_BATCH = f"{_TM}._send_batch_request"
T_OPENAI = "sglang.srt.entrypoints.openai.serving_base.OpenAIServingBase.handle_request"
T_LAUNCH = "sglang.srt.entrypoints.http_server.launch_server"
T_SERVE_GENERATE = "sglang.srt.entrypoints.http_server.serve_generate_request"
T_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler.__init__"
T_COLLECT = (
    "sglang.srt.managers.scheduler_components.batch_result_processor."
    "SchedulerBatchResultProcessor._maybe_collect_routed_experts"
)
_DETOK = "sglang.srt.managers.detokenizer_manager.DetokenizerManager"
T_DETOKENIZE = f"{_DETOK}.handle_batch_token_id_out"
T_DETOKENIZER = f"{_DETOK}.__init__"

# Attributes of upstream objects the hooks read or write (canary-tested).
UPSTREAM_FIELDS: dict[str, tuple[str, ...]] = {
    "sglang.srt.managers.io_struct.GenerateReqInput": (
        "text",
        "input_ids",
        "sampling_params",
        "rid",
        "stream",
        "return_routed_experts",
        "routed_experts_start_len",
        "return_prompt_token_ids",
    ),
    "sglang.srt.managers.io_struct.TokenizedGenerateReqInput": (
        "rid",
        "input_ids",
        "routed_experts_start_len",
        "return_routed_experts",
    ),
    "sglang.srt.managers.io_struct.BatchTokenIDOutput": ("rids", "routed_experts"),
    "sglang.srt.managers.io_struct.BatchStrOutput": ("rids", "routed_experts"),
    # The IPC mode: compact rows only cross pickle IPC (msgpack types the field as str).
    "sglang.srt.managers.io_struct": ("_USE_PICKLE_IPC",),
    # Health checks generate through generate_request under this rid prefix; an engine
    # that requires tags must still answer them.
    "sglang.srt.constants": ("HEALTH_CHECK_RID_PREFIX",),
    # ... and warm up over HTTP while the server is Starting.
    "sglang.srt.managers.tokenizer_manager.ServerStatus": ("Starting", "Up"),
    # Both OpenAI requests carry custom_params, copied into sampling_params.
    "sglang.srt.entrypoints.openai.protocol.CompletionRequest": ("custom_params",),
    "sglang.srt.entrypoints.openai.protocol.ChatCompletionRequest": ("custom_params",),
    "sglang.srt.server_args.ServerArgs": (
        "enable_return_routed_experts",
        "enable_hierarchical_cache",
        "hicache_storage_backend",
        "enable_lmcache",
        "enable_flexkv",
        "disaggregation_mode",
        "tokenizer_worker_num",
        "speculative_algorithm",
        "enable_hisparse",
        "device",
        "served_model_name",
        "model_path",
    ),
}


# ---------------------------------------------------------------- per process


@dataclass
class _Runtime:
    config: EngineConfig
    shipper: Shipper | None = None
    loop: asyncio.AbstractEventLoop | None = None


_RUNTIME: _Runtime | None = None


def engine_config() -> EngineConfig:
    """This process's configuration (read from the environment once)."""
    global _RUNTIME
    if _RUNTIME is None:
        _RUNTIME = _Runtime(EngineConfig.from_env())
    return _RUNTIME.config


def _shape_of(tokenizer_manager: Any) -> MoeShape:
    mc = tokenizer_manager.model_config
    return moe_shape(getattr(mc, "hf_text_config", None) or mc.hf_config)


def _shipper(tokenizer_manager: Any) -> Shipper:
    """The process's shipper, created on first use on the running loop."""
    engine_config()
    assert _RUNTIME is not None
    loop = asyncio.get_running_loop()
    if _RUNTIME.shipper is None or _RUNTIME.loop is not loop:
        name = getattr(tokenizer_manager, "served_model_name", None) or ""
        _RUNTIME.shipper = Shipper(_RUNTIME.config, _shape_of(tokenizer_manager), str(name))
        _RUNTIME.loop = loop
    return _RUNTIME.shipper


# ---------------------------------------------------------------- generate


def _is_tagged(sampling_params: Any) -> bool:
    """Cheap test run on every request: does any sampling_params carry ``r3``?"""
    if isinstance(sampling_params, Mapping):
        cp = sampling_params.get("custom_params")
        return isinstance(cp, Mapping) and "r3" in cp
    if isinstance(sampling_params, list):
        return any(_is_tagged(sp) for sp in sampling_params)
    return False


_NAMES_R3 = re.compile(r"(?<![A-Za-z0-9_])r3(?![A-Za-z0-9_])")


def _misplaced_tag(sampling_params: Any) -> str | None:
    """The type of a ``custom_params`` that is not an object but names ``r3`` (else None).

    ``/generate`` passes any JSON value through as ``custom_params``; a tag sent as a
    JSON *string* would otherwise be generated untagged, with no routing stored.
    """
    sps = sampling_params if isinstance(sampling_params, list) else [sampling_params]
    for sp in sps:
        cp = sp.get("custom_params") if isinstance(sp, Mapping) else None
        if cp is None or isinstance(cp, Mapping):
            continue
        text = cp if isinstance(cp, str) else json.dumps(cp, default=str)
        if _NAMES_R3.search(text):
            return type(cp).__name__
    return None


def _is_own_probe(tokenizer_manager: Any, obj: Any) -> bool:
    """SGLang's own untagged generations: the start-up warm-up request (sent over HTTP
    while the server is still ``Starting``) and the ``/health`` / ``/health_generate``
    probe (a 1-token generation under a reserved rid prefix)."""
    from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX
    from sglang.srt.managers.tokenizer_manager import ServerStatus

    if getattr(tokenizer_manager, "server_status", None) == ServerStatus.Starting:
        return True
    rid = getattr(obj, "rid", None)
    return isinstance(rid, str) and rid.startswith(HEALTH_CHECK_RID_PREFIX)


def _untagged_refusal() -> R3RequestError:
    header = engine_config().tag_header
    how = f"the header {header}: <rollout id> (what sglang-router routes by) or " if header else ""
    return bad_request(
        "this server requires every generation request to name its rollout "
        f'(--routing-require-tag): send {how}custom_params {{"r3": {{"rollout_id": "..."}}}}'
    )


def _header_rollout(raw_request: Any) -> str | None:
    """The rollout id in the configured tag header of ``raw_request`` (None: absent/off)."""
    name = engine_config().tag_header
    headers = getattr(raw_request, "headers", None) if name else None
    if headers is None:
        return None
    value = headers.get(name)
    return value if isinstance(value, str) and value != "" else None


def _tag_with_header(custom_params: Any, rollout_id: str) -> dict[str, Any]:
    """``custom_params`` with the header's tag added; raises 400 if they disagree.

    A tag already in the body wins (it may carry options the header cannot), but a
    body tag naming a different single rollout is a driver bug worth refusing.
    """
    name = engine_config().tag_header
    if custom_params is None:
        return {"r3": {"rollout_id": rollout_id}}
    if not isinstance(custom_params, Mapping):
        raise bad_request(
            f"custom_params must be an object to carry the {name} header's rollout tag, "
            f"got a {type(custom_params).__name__}"
        )
    tag = custom_params.get("r3")
    if tag is None:
        return {**custom_params, "r3": {"rollout_id": rollout_id}}
    body_id = tag.get("rollout_id") if isinstance(tag, Mapping) else None
    if isinstance(body_id, str) and body_id != rollout_id:
        raise bad_request(
            f"the {name} header names rollout {rollout_id[:80]!r} but custom_params.r3 "
            f"names {body_id[:80]!r}; send one rollout id"
        )
    return dict(custom_params)


def _tag_generate_from_header(obj: Any, request: Any) -> None:
    """Tag a ``/generate`` request from the header (sglang-router drops ``custom_params``)."""
    rollout_id = _header_rollout(request)
    if rollout_id is None or not engine_config().enabled:
        return
    sp = getattr(obj, "sampling_params", None)
    if isinstance(sp, list):
        if _is_tagged(sp):
            return
        raise bad_request(
            f"the {engine_config().tag_header} header names one rollout; a batch with one "
            "sampling_params per prompt cannot take it (send one sampling_params object: "
            "outputs are then {id}-{k}; or one request per prompt)"
        )
    sp = {} if sp is None else sp
    if not isinstance(sp, Mapping):
        return  # upstream refuses it
    obj.sampling_params = {
        **sp,
        "custom_params": _tag_with_header(sp.get("custom_params"), rollout_id),
    }


def _state(request: Any) -> dict[str, Any] | None:
    """The per-request state dict of a Starlette request (shared with upstream's handlers)."""
    scope = getattr(request, "scope", None)
    if not isinstance(scope, dict):
        return None
    state = scope.setdefault("state", {})
    return state if isinstance(state, dict) else None


def _remember_error(request: Any, exc: R3RequestError) -> None:
    """Leave ``exc`` on the request, for the hooks that turn upstream's 400 into its status."""
    state = _state(request)
    if state is not None:
        state["r3_error"] = exc


def _remembered_error(request: Any) -> R3RequestError | None:
    state = _state(request)
    err = state.get("r3_error") if state is not None else None
    return err if isinstance(err, R3RequestError) else None


def _refs_holder(request: Any) -> list[dict[str, Any]] | None:
    """The list an OpenAI handler left on the raw request for our references."""
    state = _state(request)
    holder = state.get("r3_refs") if state is not None else None
    return holder if isinstance(holder, list) else None


def _send_rids(obj: Any, batch: int, single: bool) -> list[str]:
    """Fix the request ids now (as SGLang would) so a per-request plan can find them."""
    if single:
        if obj.rid is None:
            obj.rid = uuid.uuid4().hex
        return [obj.rid]
    if obj.rid is None:
        obj.rid = [uuid.uuid4().hex for _ in range(batch)]
    if isinstance(obj.rid, str):
        return [f"{obj.rid}_{i}" for i in range(batch)]
    return list(obj.rid)


async def around_generate_request(
    original: Callable[..., AsyncIterator[Any]], self: Any, obj: Any, request: Any = None
) -> AsyncIterator[Any]:
    """AROUND ``TokenizerManager.generate_request``: ship tagged outputs' routing."""
    LOOP_PROBE.ensure_started()
    sampling_params = getattr(obj, "sampling_params", None)
    tagged = _is_tagged(sampling_params)
    if not tagged and _misplaced_tag(sampling_params) is None:
        if engine_config().require_tag and not _is_own_probe(self, obj):
            exc = _untagged_refusal()
            _remember_error(request, exc)
            raise exc
        async for out in original(self, obj, request):
            yield out
        return
    try:
        if not tagged:
            raise bad_request(
                f"custom_params must be an object like "
                f'{{"r3": {{"rollout_id": "..."}}}}, got a {_misplaced_tag(sampling_params)} '
                "that names r3; refusing rather than generating without routing"
            )
        async for out in _tagged_generate(original, self, obj, request):
            yield out
    except R3RequestError as exc:
        _remember_error(request, exc)
        raise


async def _tagged_generate(
    original: Callable[..., AsyncIterator[Any]], tm: Any, obj: Any, request: Any
) -> AsyncIterator[Any]:
    config = engine_config()
    if not config.enabled:
        raise bad_request(
            "this server does not ship routing; launch it with `python -m "
            "sglang_r3.launch_server ... --return-routed-experts --routing-cache URL`"
        )
    if not hasattr(obj, "return_routed_experts"):
        raise bad_request("only generation requests can be tagged")
    batch, n, single = request_shape(obj.text, obj.input_ids, obj.sampling_params)
    tags = output_tags(obj.sampling_params, batch_size=batch, n=n, max_outputs=config.max_outputs)
    assert tags is not None  # _is_tagged said so
    if obj.routed_experts_start_len:
        raise bad_request(
            "routed_experts_start_len is managed by r3 for tagged requests; leave it 0"
        )
    shipper = _shipper(tm)
    # --routing-lookup seen: a rollout this process has not seen is assumed new, with
    # no lookup before generation (its first write cannot overlap stored rows;
    # Shipper.ship resolves that case after generation).
    assumed_new = [config.lookup == "seen" and not shipper.seen(t.rollout_id) for t in tags]

    async def lookup(tag: OutputTag, new: bool) -> Continuation | None:
        if new:
            return None
        try:
            return await shipper.continuation(tag.rollout_id)
        except CacheUnavailableError:
            # Under the inline policy a rollout the cache cannot be asked about is
            # generated from row 0, so the inline fallback carries every row.
            if (tag.on_cache_error or config.on_cache_error) == "inline":
                return None
            raise

    conts: list[Continuation | None] = list(
        await asyncio.gather(*(lookup(t, new) for t, new in zip(tags, assumed_new, strict=True)))
    )
    if n > 1:
        taken = [t.rollout_id for t, c in zip(tags, conts, strict=True) if c is not None]
        if taken:
            raise samples_conflict(taken[0])
    user_wants_prompt_ids = bool(obj.return_prompt_token_ids)
    obj.return_routed_experts = True
    obj.return_prompt_token_ids = True

    plans = _SEND_PLANS
    planned: list[str] = []
    if any(c is not None for c in conts):
        for rid, tag, cont in zip(_send_rids(obj, batch, single), tags, conts, strict=True):
            if cont is not None:
                plans[rid] = (tag, cont)
                planned.append(rid)
    starts = [c.end if c is not None else 0 for c in conts]
    incremental = bool(getattr(obj, "stream", False)) and bool(
        getattr(tm, "incremental_streaming_output", False)
    )
    streamed_ids: dict[int, list[int]] = {}
    holder = _refs_holder(request)

    async def finish(k: int, out: dict[str, Any]) -> None:
        meta = out.get("meta_info") or {}
        if incremental:
            streamed_ids.setdefault(k, []).extend(out.get("output_ids") or [])
        if meta.get("finish_reason") is None:
            if not user_wants_prompt_ids:
                out.pop("prompt_token_ids", None)
            return
        tag = tags[k]
        routing = meta.pop("routed_experts", None)
        prompt_ids = out.get("prompt_token_ids") or []
        output_ids = streamed_ids.get(k, []) if incremental else out.get("output_ids") or []
        ref = await shipper.ship(
            tag,
            starts[k],
            routing,
            prompt_ids,
            output_ids,
            meta,
            assumed_new=assumed_new[k],
            may_continue=n == 1,
        )
        ref["index"] = k
        meta["r3"] = ref
        if routing is not None and (tag.inline or ref.get("inline")):
            # Upstream's base64 int32 of the rows from the reference's start.
            skip = ref["start"] - starts[k]
            meta["routed_experts"] = await asyncio.to_thread(
                to_base64, routing, shipper.shape, skip
            )
        if not user_wants_prompt_ids:
            out.pop("prompt_token_ids", None)
        if holder is not None:
            holder.append(ref)

    try:
        async for out in original(tm, obj, request):
            if isinstance(out, list):
                await asyncio.gather(*(finish(k, o) for k, o in enumerate(out)))
            elif isinstance(out, dict):
                await finish(int(out.get("index", 0)), out)
            yield out
    finally:
        for rid in planned:
            plans.pop(rid, None)


# Continued rollouts' plans, from the generate hook to the send hooks, by request id.
# Request ids are unique within the process's one TokenizerManager; the generate hook
# removes its entries when the request ends.  (Kept here, not as an attribute set on
# SGLang's own object.)
_SEND_PLANS: dict[str, tuple[OutputTag, Continuation]] = {}


def _apply_plan(tm: Any, tokenized: Any) -> None:
    plan = _SEND_PLANS.get(getattr(tokenized, "rid", None) or "")
    if plan is None:
        return
    tag, cont = plan
    Shipper.check_prefix(tag, cont, tokenized.input_ids)
    tokenized.routed_experts_start_len = cont.end


async def around_send_one_request(original: Callable[..., Any], self: Any, tokenized: Any) -> Any:
    """AROUND ``_send_one_request``: check a continued rollout's prefix, set its start."""
    _apply_plan(self, tokenized)
    return await original(self, tokenized)


async def around_send_batch_request(
    original: Callable[..., Any], self: Any, tokenized_objs: Any
) -> Any:
    """AROUND ``_send_batch_request``: :func:`around_send_one_request` per item."""
    for tokenized in tokenized_objs:
        _apply_plan(self, tokenized)
    return await original(self, tokenized_objs)


# ---------------------------------------------------------------- OpenAI


def _openai_tagged(request: Any) -> bool:
    cp = getattr(request, "custom_params", None)
    return isinstance(cp, Mapping) and "r3" in cp


# OpenAI error ``type`` per status (the names of the OpenAI SDK's error classes).
_ERROR_TYPES = {
    400: "BadRequestError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def _openai_error(err: R3RequestError) -> dict[str, Any]:
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

    rollout_id = _header_rollout(raw_request)
    if rollout_id is not None and engine_config().enabled and hasattr(request, "custom_params"):
        try:
            request.custom_params = _tag_with_header(request.custom_params, rollout_id)
        except R3RequestError as exc:
            return ORJSONResponse(_openai_error(exc), status_code=exc.status_code)
    if raw_request is None or not _openai_tagged(request):
        response = await original(self, request, raw_request)
        err = _remembered_error(raw_request)
        if err is not None and isinstance(response, Response) and response.status_code >= 400:
            return ORJSONResponse(_openai_error(err), status_code=err.status_code)
        return response

    holder: list[dict[str, Any]] = []
    raw_request.state.r3_refs = holder
    response = await original(self, request, raw_request)
    if isinstance(response, StreamingResponse):
        response.body_iterator = _openai_stream(aiter(response.body_iterator), holder, raw_request)
        return response
    err = _remembered_error(raw_request)
    if err is not None and isinstance(response, Response) and response.status_code >= 400:
        return ORJSONResponse(_openai_error(err), status_code=err.status_code)
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
            err = _remembered_error(raw_request)
            if err is not None:
                yield f"data: {json.dumps({'error': _openai_error(err)})}\n\n"
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
        _tag_generate_from_header(obj, request)
    except R3RequestError as exc:
        return ORJSONResponse({"error": {"message": exc.message}}, status_code=exc.status_code)
    response = await original(obj, request)
    sampling_params = getattr(obj, "sampling_params", None)
    if not getattr(obj, "stream", False) or not (
        _is_tagged(sampling_params)
        or _misplaced_tag(sampling_params)
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
    err = _remembered_error(request)
    text = first.decode() if isinstance(first, bytes | bytearray) else str(first)
    if err is not None and _is_error_event(text):
        # Nothing reached the scheduler: upstream already dropped the request's state
        # (its abort task is for disconnects of running streams, and would fail here).
        return ORJSONResponse({"error": {"message": err.message}}, status_code=err.status_code)
    response.body_iterator = _generate_stream(first, chunks, request)
    return response


async def _generate_stream(
    first: Any, chunks: AsyncIterator[Any], request: Any
) -> AsyncIterator[Any]:
    yield first
    async for chunk in chunks:
        text = chunk.decode() if isinstance(chunk, bytes | bytearray) else str(chunk)
        err = _remembered_error(request) if _is_error_event(text) else None
        yield _generate_error_event(err) if err is not None else chunk


# ---------------------------------------------------------------- checks


def unsupported_options(server_args: Any, config: EngineConfig) -> list[str]:
    """Options under which shipped routing could be wrong; empty when all is well."""
    if not config.enabled:
        return []

    def on(name: str) -> Any:
        return getattr(server_args, name, None)

    problems = []
    if not on("enable_return_routed_experts"):
        problems.append(
            "--enable-return-routed-experts is off, so the engine records nothing "
            "(the sglang_r3 launcher adds it)"
        )
    if on("enable_hierarchical_cache") or on("hicache_storage_backend"):
        problems.append(
            "HiCache (--enable-hierarchical-cache / --hicache-storage-backend) loads KV "
            "without a forward pass, so routing rows of those tokens would be stale (sglang#26975)"
        )
    if on("enable_lmcache") or on("enable_flexkv"):
        problems.append(
            "--enable-lmcache / --enable-flexkv restore KV without recomputing it; "
            "routing rows of restored tokens would be stale"
        )
    if on("disaggregation_mode") == "decode":
        problems.append(
            "--disaggregation-mode decode receives prompt KV from the prefill node, "
            "so prompt rows are never computed here"
        )
    if (on("tokenizer_worker_num") or 1) > 1:
        problems.append(
            "--tokenizer-worker-num > 1 serves HTTP from processes SGLang loads no plugins in"
        )
    if on("speculative_algorithm"):
        problems.append("speculative decoding: upstream capture does not cover verify tokens")
    if on("enable_hisparse"):
        problems.append("--enable-hisparse restores KV without recomputing it")
    return problems


def _resolve(target: str) -> Any:
    owner, _, attr = target.rpartition(".")
    return getattr(pkgutil.resolve_name(owner), attr)


def verify_hooks(targets: list[str]) -> list[str]:
    """Problems with our hooks on ``targets`` in this process (empty: all took effect)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    problems = []
    ours = {t: h for t, h, _ in HOOKS}
    for target in targets:
        registered = [h for _, h, _ in HookRegistry._hooks.get(target, [])]
        if ours[target] not in registered:
            problems.append(f"{target}: hook not registered")
            continue
        if target not in HookRegistry._patched:
            problems.append(f"{target}: SGLang did not apply the hook (see its log for why)")
            continue
        try:
            fn = _resolve(target)
        except (AttributeError, ImportError, ValueError) as exc:
            problems.append(f"{target}: cannot resolve ({exc})")
            continue
        if getattr(fn, "__wrapped__", None) is None:
            problems.append(f"{target}: attribute is not the patched wrapper")
    return problems


HTTP_TARGETS = [T_GENERATE, T_SEND_ONE, T_SEND_BATCH, T_OPENAI, T_SERVE_GENERATE, T_LAUNCH]
SCHEDULER_TARGETS = [T_SCHEDULER, T_COLLECT]
DETOKENIZER_TARGETS = [T_DETOKENIZER, T_DETOKENIZE]


class StartupError(RuntimeError):
    """The extension refuses to start: a hook did not take or an option is unsafe."""


def check_startup(targets: list[str], server_args: Any | None) -> None:
    """Raise :class:`StartupError` listing every problem, if any (only a warning when
    routing shipping is off: the plugin is then merely installed)."""
    config = engine_config()
    problems = verify_hooks(targets)
    if server_args is not None:
        problems += unsupported_options(server_args, config)
        if str(getattr(server_args, "device", "")) == "cpu":
            from sglang_r3.cpu import allocator_installed

            if not allocator_installed():
                problems.append("--device cpu without the CPU host allocator (plugin not loaded?)")
    if not problems:
        return
    message = (
        "sglang_r3 cannot start:\n  - "
        + "\n  - ".join(problems)
        + f"\n(sglang_r3 supports sglang=={SGLANG_VERSION} exactly)"
    )
    if not config.enabled:
        # Installed but not asked to ship routing: do not stop someone else's server;
        # tagged requests will be refused anyway.
        log.warning("%s\n(routing shipping is off, so the server starts)", message)
        return
    raise StartupError(message)


def before_launch_server(server_args: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE ``http_server.launch_server``: verify, refuse, add the ``/r3`` routes."""
    check_startup(HTTP_TARGETS, server_args)
    _add_routes()
    return None


def around_scheduler_init(
    original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND ``Scheduler.__init__``: the scheduler process's start-up check."""
    server_args = kwargs.get("server_args", args[0] if args else None)
    check_startup(SCHEDULER_TARGETS, server_args)
    return original(self, *args, **kwargs)


def _req_tagged(req: Any) -> bool:
    cp = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    return isinstance(cp, Mapping) and "r3" in cp


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
        and _req_tagged(req)
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


def around_detokenizer_init(
    original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND ``DetokenizerManager.__init__``: the start-up check of that process."""
    server_args = kwargs.get("server_args", args[0] if args else None)
    check_startup(DETOKENIZER_TARGETS, server_args)
    return original(self, *args, **kwargs)


def _add_routes() -> None:
    from fastapi import Response
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from sglang.srt.entrypoints import http_server

    app = http_server.app
    if any(getattr(r, "path", None) == "/r3/metrics" for r in app.router.routes):
        return

    async def r3_metrics() -> Response:
        return Response(generate_latest(metrics.REGISTRY), media_type=CONTENT_TYPE_LATEST)

    async def r3_info() -> dict[str, Any]:
        config = engine_config()
        return {
            "enabled": config.enabled,
            "routing_cache": config.routing_cache,
            "on_cache_error": config.on_cache_error,
            "on_retraction": config.on_retraction,
            "sglang": SGLANG_VERSION,
            "hooks": HTTP_TARGETS,
        }

    async def r3_loop() -> dict[str, Any]:
        LOOP_PROBE.ensure_started()
        return LOOP_PROBE.take()

    app.add_api_route("/r3/metrics", r3_metrics, methods=["GET"], include_in_schema=False)
    app.add_api_route("/r3/loop", r3_loop, methods=["GET"], include_in_schema=False)
    app.add_api_route("/r3/info", r3_info, methods=["GET"], include_in_schema=False)


def _hook_type(name: str) -> Any:
    from sglang.srt.plugins.hook_registry import HookType

    return getattr(HookType, name)


# (target, hook, HookType name).  The canary test walks this list.
HOOKS: list[tuple[str, Callable[..., Any], str]] = [
    (T_GENERATE, around_generate_request, "AROUND"),
    (T_SEND_ONE, around_send_one_request, "AROUND"),
    (T_SEND_BATCH, around_send_batch_request, "AROUND"),
    (T_OPENAI, around_openai_handle_request, "AROUND"),
    (T_SERVE_GENERATE, around_serve_generate_request, "AROUND"),
    (T_LAUNCH, before_launch_server, "BEFORE"),
    (T_SCHEDULER, around_scheduler_init, "AROUND"),
    (T_COLLECT, around_collect_routed_experts, "AROUND"),
    (T_DETOKENIZER, around_detokenizer_init, "AROUND"),
    (T_DETOKENIZE, around_detokenize, "AROUND"),
]


def register_hooks() -> None:
    """Register every hook in :data:`HOOKS` (SGLang applies them after all plugins ran)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    for target, hook, kind in HOOKS:
        if hook not in [h for _, h, _ in HookRegistry._hooks.get(target, [])]:
            HookRegistry.register(target, hook, _hook_type(kind))
