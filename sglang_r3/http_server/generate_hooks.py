"""Hooks on ``TokenizerManager``: tagged generation, cache lookups, shipping, send plans."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from sglang_r3 import releases
from sglang_r3.config import EngineConfig, engine_config
from sglang_r3.errors import (
    CacheUnavailableError,
    R3RequestError,
    bad_request,
    samples_conflict,
)
from sglang_r3.http_server.continuation import Continuation, check_prefix
from sglang_r3.http_server.loop_probe import LOOP_PROBE
from sglang_r3.http_server.output_rows import to_base64
from sglang_r3.http_server.pd import check_decode_retractions, decode_start, is_decode_server
from sglang_r3.http_server.request_state import refs_holder, remember_error
from sglang_r3.http_server.shipping import Shipper
from sglang_r3.http_server.tagging import (
    OutputTag,
    misplaced_tag,
    output_tags,
    request_shape,
    sampling_params_tagged,
)
from sglang_r3.layers import MoeShape, moe_shape
from sglang_r3.tags import carries_tag

log = logging.getLogger("sglang_r3")

# ---------------------------------------------------------------- per process


@dataclass
class _Runtime:
    shipper: Shipper
    loop: asyncio.AbstractEventLoop


_RUNTIME: _Runtime | None = None


def _shape_of(tokenizer_manager: Any) -> MoeShape:
    mc = tokenizer_manager.model_config
    return moe_shape(getattr(mc, "hf_text_config", None) or mc.hf_config)


def _shipper(tokenizer_manager: Any) -> Shipper:
    """The process's shipper, created on first use on the running loop."""
    global _RUNTIME
    loop = asyncio.get_running_loop()
    if _RUNTIME is None or _RUNTIME.loop is not loop:
        name = getattr(tokenizer_manager, "served_model_name", None) or ""
        shipper = Shipper(engine_config(), _shape_of(tokenizer_manager), str(name))
        _RUNTIME = _Runtime(shipper, loop)
    return _RUNTIME.shipper


# ---------------------------------------------------------------- generate


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
    tagged = sampling_params_tagged(sampling_params)
    # A custom_params that is a JSON string naming r3 is refused only where the extension
    # ships routing: elsewhere (no --routing-cache, or plain sglang.launch_server with the
    # package installed) the plugin is inert and upstream answers such a request with 200.
    if not tagged and (misplaced_tag(sampling_params) is None or not engine_config().enabled):
        if engine_config().require_tag and not _is_own_probe(self, obj):
            exc = _untagged_refusal()
            remember_error(request, exc)
            raise exc
        async for out in original(self, obj, request):
            yield out
        return
    try:
        if not tagged:
            raise bad_request(
                f"custom_params must be an object like "
                f'{{"r3": {{"rollout_id": "..."}}}}, got a {misplaced_tag(sampling_params)} '
                "that names r3; refusing rather than generating without routing"
            )
        async for out in _tagged_generate(original, self, obj, request):
            yield out
    except R3RequestError as exc:
        remember_error(request, exc)
        raise


def _checked_tags(config: EngineConfig, obj: Any) -> tuple[list[OutputTag], int, int, bool]:
    """A tagged request's output tags and shape ``(tags, batch, n, single)``, or a 400."""
    if not config.enabled:
        raise bad_request(
            "this server does not ship routing; launch it with `python -m "
            "sglang_r3.launch_server ... --return-routed-experts --routing-cache URL`"
        )
    if not hasattr(obj, "return_routed_experts"):
        raise bad_request("only generation requests can be tagged")
    batch, n, single = request_shape(obj.text, obj.input_ids, obj.sampling_params)
    tags = output_tags(
        obj.sampling_params,
        batch_size=batch,
        n=n,
        max_outputs=config.max_outputs,
        share_prompt=config.share_prompt,
    )
    assert tags is not None  # sampling_params_tagged said so
    if obj.routed_experts_start_len:
        raise bad_request(
            "routed_experts_start_len is managed by r3 for tagged requests; leave it 0"
        )
    return tags, batch, n, single


async def _look_up(
    shipper: Shipper,
    config: EngineConfig,
    tags: list[OutputTag],
    assumed_new: list[bool],
    gaps: bool = False,
) -> list[Continuation | None]:
    """What the cache holds of each tagged rollout (None: new), looked up concurrently
    (``gaps``: as a PD decode server sees it, :mod:`sglang_r3.http_server.pd`)."""

    async def lookup(tag: OutputTag, new: bool) -> Continuation | None:
        if new:
            return None
        try:
            return await shipper.continuation(tag.rollout_id, gaps=gaps)
        except CacheUnavailableError:
            # Under the inline policy a rollout the cache cannot be asked about is
            # generated from row 0, so the inline fallback carries every row.
            if (tag.on_cache_error or config.on_cache_error) == "inline":
                return None
            raise

    pairs = zip(tags, assumed_new, strict=True)
    return list(await asyncio.gather(*(lookup(t, new) for t, new in pairs)))


async def _tagged_generate(
    original: Callable[..., AsyncIterator[Any]], tm: Any, obj: Any, request: Any
) -> AsyncIterator[Any]:
    """A tagged request: look its rollouts up, plan its sends, ship each finished output."""
    config = engine_config()
    tags, batch, n, single = _checked_tags(config, obj)
    shipper = _shipper(tm)
    # PD decode: rows from the prompt length on, whatever is stored (sglang_r3.http_server.pd).
    # It always looks up (the prefix check), since "assumed new" would store from 0.
    decode = is_decode_server(tm)
    # --routing-lookup seen: a rollout this process has not seen is assumed new, with
    # no lookup before generation (its first write cannot overlap stored rows;
    # Shipper.ship resolves that case after generation).
    assumed_new = [
        not decode and config.lookup == "seen" and not shipper.seen(t.rollout_id) for t in tags
    ]
    conts = await _look_up(shipper, config, tags, assumed_new, gaps=decode)
    if n > 1:
        taken = [t.rollout_id for t, c in zip(tags, conts, strict=True) if c is not None]
        if taken:
            raise samples_conflict(taken[0])
    call = _TaggedCall(
        shipper,
        tags,
        n,
        decode,
        assumed_new,
        starts=[c.end if c is not None else 0 for c in conts],
        user_wants_prompt_ids=bool(getattr(obj, "return_prompt_token_ids", False)),
        incremental=bool(getattr(obj, "stream", False))
        and bool(getattr(tm, "incremental_streaming_output", False)),
        holder=refs_holder(request),
        start_version=getattr(getattr(tm, "server_args", None), "weight_version", None),
    )
    obj.return_routed_experts = True
    if releases.current().has("return_prompt_token_ids"):
        obj.return_prompt_token_ids = True
    planned: list[str] = []
    if decode or any(c is not None for c in conts):  # (fixing the rids only when needed)
        for rid, tag, cont in zip(_send_rids(obj, batch, single), tags, conts, strict=True):
            if decode or cont is not None:  # the send hooks check its prefix, set its start
                _SEND_PLANS[rid] = (tag, cont, decode)
                planned.append(rid)
    pinned = _pin_dp_ranks(config, tm, obj, tags, batch, n, single)
    try:
        async for out in original(tm, obj, request):
            if isinstance(out, list):
                await asyncio.gather(*(call.finish(k, o) for k, o in enumerate(out)))
            elif isinstance(out, dict):
                await call.finish(int(out.get("index", 0)), out)
            yield out
    finally:
        for rid in planned:
            _SEND_PLANS.pop(rid, None)
        for rid in pinned:
            _DP_RANKS.pop(rid, None)


@dataclass
class _TaggedCall:
    """One tagged request from its lookups to its last output: what finishing each
    output needs (``starts``: the row each output's routing starts at)."""

    shipper: Shipper
    tags: list[OutputTag]
    n: int
    decode: bool
    assumed_new: list[bool]
    starts: list[int]
    user_wants_prompt_ids: bool
    incremental: bool  # streamed outputs carry only their new ids
    holder: list[dict[str, Any]] | None
    start_version: Any  # the engine's weight version when the request arrived
    streamed_ids: dict[int, list[int]] = field(default_factory=dict)

    async def finish(self, k: int, out: dict[str, Any]) -> None:
        """Output ``k``'s chunk: when it is the last, ship its routing and put the
        reference in its ``meta_info`` (with the rows inline when asked or fallen back)."""
        meta = out.get("meta_info") or {}
        if self.incremental:
            self.streamed_ids.setdefault(k, []).extend(out.get("output_ids") or [])
        if meta.get("finish_reason") is None:
            if not self.user_wants_prompt_ids:
                out.pop("prompt_token_ids", None)
            return
        tag = self.tags[k]
        routing = meta.pop("routed_experts", None)
        prompt_ids = _prompt_ids(out, meta)
        if self.incremental:
            output_ids = self.streamed_ids.get(k, [])
        else:
            output_ids = out.get("output_ids") or []
        check_one_weight_version(tag, meta, self.start_version)
        if self.decode:  # the send hook asked for rows from the prompt's end
            self.starts[k] = len(prompt_ids)
            check_decode_retractions(tag, meta)
        ref = await self.shipper.ship(
            tag,
            self.starts[k],
            routing,
            prompt_ids,
            output_ids,
            meta,
            assumed_new=self.assumed_new[k],
            may_continue=self.n == 1,
        )
        ref["index"] = k
        meta["r3"] = ref
        if routing is not None and (tag.inline or ref.get("inline")):
            meta["routed_experts"] = await self._inline(routing, ref, self.starts[k])
        if not self.user_wants_prompt_ids:
            out.pop("prompt_token_ids", None)
        if self.holder is not None:
            self.holder.append(ref)

    async def _inline(self, routing: Any, ref: dict[str, Any], start: int) -> str:
        """Upstream's base64 int32 of the rows this call computed or reused, from the
        reference's start, or from where the call recomputed stored rows when it did
        (``inline_start``; the stored first computations may differ there)."""
        first = getattr(routing, "first", None)
        base = start if first is None else first
        if ref.get("views"):
            ref["inline_start"] = base
            skip = 0
        else:
            skip = ref["start"] - base
        return await asyncio.to_thread(to_base64, routing, self.shipper.shape, skip)


def check_one_weight_version(tag: OutputTag, meta: dict[str, Any], start: Any) -> None:
    """503 for an output whose weights changed while it ran, on a release that does not
    say where (``meta_info["weight_versions"]`` is SGLang 0.5.19 on).

    ``/pause_generation`` ``in_place`` (or ``retract``), a weight update, then
    ``/continue_generation`` leaves one output with rows from two weight versions; with
    no spans, which rows are whose cannot be told, so they are not stored under one
    label.  The engine's version when the request arrived is compared with the one its
    output reports.
    """
    if releases.current().has("weight_version_spans") or "weight_versions" in meta:
        return
    end = meta.get("weight_version")
    if start is None or end is None or str(end) == str(start):
        return
    raise R3RequestError(
        503,
        f"r3: the weights changed from {start!r} to {end!r} while this request ran, and "
        f"SGLang {releases.current().version} does not say at which token "
        '(meta_info["weight_versions"] is SGLang 0.5.19 on), so its routing rows cannot be '
        f"labelled; not stored (rollout {tag.rollout_id!r}): send the turn again",
    )


def dp_rank_of(rollout_id: str, num_ranks: int) -> int:
    """The DP rank a rollout's requests go to under ``--routing-dp-affinity rollout``.

    A stable hash of the id (BLAKE2b, not Python's per-process salted ``hash``), so
    every tokenizer process and every restart sends a rollout to the same rank.
    """
    digest = hashlib.blake2b(rollout_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % num_ranks


def _pin_dp_ranks(
    config: EngineConfig, tm: Any, obj: Any, tags: list[OutputTag], batch: int, n: int, single: bool
) -> list[str]:
    """Pin a tagged request to its rollout's DP rank (``routed_dp_rank``); the request
    ids whose rank the send hooks set (a batch of prompts), to forget when it ends.

    Each DP rank has its own KV pool, radix cache and routing rows, and SGLang's
    DataParallelController balances requests over the ranks (round robin by default,
    ``data_parallel_controller.py:880-899``), so a rollout's next turn usually lands
    on a rank that never saw its prefix and computes it again.  A request that names
    a rank goes there instead (``maybe_external_dp_rank_routing``, ``:865-878``), with
    or without DP attention.  Nothing is pinned when the request names its own rank
    (``routed_dp_rank``, the ``x-override-routed-dp-rank`` header, or the deprecated
    ``data_parallel_rank`` a DP-aware sgl-model-gateway sets) or carries a PD
    bootstrap room (a disaggregated pair routes by the room; a pin would conflict,
    ``disaggregation/common/conn.py:2160-2180``).  A request with ``n > 1`` goes whole
    to its first output's rank: SGLang sends its samples after a prefix warm-up under
    request ids it makes itself, so they cannot be pinned one by one.
    """
    num_ranks = getattr(tm, "elastic_worker_count", 1)
    if config.dp_affinity != "rollout" or not isinstance(num_ranks, int) or num_ranks <= 1:
        return []
    if obj.routed_dp_rank is not None or getattr(obj, "data_parallel_rank", None) is not None:
        return []
    if getattr(obj, "bootstrap_room", None) is not None:
        return []
    if single or n > 1:
        # GenerateReqInput copies routed_dp_rank into every item it splits off.
        obj.routed_dp_rank = dp_rank_of(tags[0].rollout_id, num_ranks)
        return []
    rids = _send_rids(obj, batch, single)
    for rid, tag in zip(rids, tags, strict=True):
        _DP_RANKS[rid] = dp_rank_of(tag.rollout_id, num_ranks)
    return rids


# Pinned DP ranks of the prompts of tagged batches, from the generate hook to the send
# hooks, by request id (removed when the request ends, like _SEND_PLANS).
_DP_RANKS: dict[str, int] = {}

# Continued rollouts' plans, from the generate hook to the send hooks, by request id.
# Request ids are unique within the process's one TokenizerManager; the generate hook
# removes its entries when the request ends.  (Kept here, not as an attribute set on
# SGLang's own object.)
# (tag, what is stored, on a PD decode server).
_SEND_PLANS: dict[str, tuple[OutputTag, Continuation | None, bool]] = {}


def _apply_plan(tm: Any, tokenized: Any) -> None:
    _note_prompt(tokenized)
    rank = _DP_RANKS.get(getattr(tokenized, "rid", None) or "")
    if rank is not None:
        tokenized.routed_dp_rank = rank
    plan = _SEND_PLANS.get(getattr(tokenized, "rid", None) or "")
    if plan is None:
        return
    tag, cont, decode = plan
    if decode:
        tokenized.routed_experts_start_len = decode_start(tag, cont, tokenized.input_ids)
        return
    assert cont is not None  # planned only when stored
    check_prefix(tag, cont, tokenized.input_ids)
    tokenized.routed_experts_start_len = cont.end


async def around_send_one_request(original: Callable[..., Any], self: Any, tokenized: Any) -> Any:
    """AROUND ``_send_one_request``: check a continued rollout's prefix, set its start
    (and, in a tagged batch, its DP rank)."""
    _apply_plan(self, tokenized)
    return await original(self, tokenized)


async def around_send_batch_request(
    original: Callable[..., Any], self: Any, tokenized_objs: Any
) -> Any:
    """AROUND ``_send_batch_request``: :func:`around_send_one_request` per item."""
    for tokenized in tokenized_objs:
        _apply_plan(self, tokenized)
    return await original(self, tokenized_objs)


def around_send_one_request_sync(original: Callable[..., Any], self: Any, tokenized: Any) -> Any:
    """:func:`around_send_one_request` where upstream's is a plain ``def`` (before SGLang
    0.5.20, :mod:`sglang_r3.releases`)."""
    _apply_plan(self, tokenized)
    return original(self, tokenized)


def around_send_batch_request_sync(
    original: Callable[..., Any], self: Any, tokenized_objs: Any
) -> Any:
    """:func:`around_send_batch_request` where upstream's is a plain ``def``."""
    for tokenized in tokenized_objs:
        _apply_plan(self, tokenized)
    return original(self, tokenized_objs)


# A tagged request's prompt ids by request id, where SGLang cannot return them
# (``return_prompt_token_ids`` is 0.5.13 on): noted at the send, taken at the finish.
# Bounded: a request whose client went away before its end leaves its entry behind.
_PROMPTS: OrderedDict[str, list[int]] = OrderedDict()
_PROMPTS_MAX = 65536


def _note_prompt(tokenized: Any) -> None:
    if releases.current().has("return_prompt_token_ids"):
        return
    params = getattr(tokenized, "sampling_params", None)
    rid = getattr(tokenized, "rid", None)
    if rid is None or not carries_tag(getattr(params, "custom_params", None)):
        return
    _PROMPTS[str(rid)] = list(getattr(tokenized, "input_ids", None) or ())
    while len(_PROMPTS) > _PROMPTS_MAX:
        _PROMPTS.popitem(last=False)


def _prompt_ids(out: dict[str, Any], meta: dict[str, Any]) -> list[int]:
    """A finished output's prompt ids: upstream's (``return_prompt_token_ids``), else
    those :func:`_note_prompt` kept for its request id."""
    ids = out.get("prompt_token_ids")
    if ids is not None:
        return list(ids)
    return _PROMPTS.pop(str(meta.get("id")), [])
