"""How a request names its rollout, and which output gets which rollout id.

A request is tagged through SGLang's own ``custom_params`` carrier, which every
endpoint passes to the engine untouched (decision, docs/engine.md):

- ``/generate``: ``"sampling_params": {..., "custom_params": {"r3": TAG}}``, or one
  tag per prompt with a list of ``sampling_params``;
- ``/v1/completions`` and ``/v1/chat/completions``: top-level ``"custom_params": {"r3": TAG}``.

``TAG`` is ``{"rollout_id": str | [str, ...], "weight_version": str?, "inline": bool?,
"share_prompt": bool?, "on_cache_error": "fail"|"inline"?, "on_retraction": "mark"|"fail"?}``
(the last two override the server's policies for this request).  Outputs are
numbered prompt-major (``k = i * n + j`` for prompt ``i``, sample ``j``), as SGLang
returns them.  One string id with a single
output names that output; with several outputs, output ``k`` gets ``f"{id}-{k}"``
(a per-prompt tag: ``f"{id}-{j}"``).  A list names the outputs one by one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from r3_client import FormatError, InvalidRequestError, check_rollout_id, check_text
from sglang_r3.config import engine_config
from sglang_r3.errors import bad_request
from sglang_r3.tags import carries_tag

_TAG_KEYS = {
    "rollout_id",
    "weight_version",
    "inline",
    "share_prompt",
    "on_cache_error",
    "on_retraction",
}


@dataclass(frozen=True, slots=True)
class OutputTag:
    """The rollout one output of a request belongs to."""

    index: int  # position in SGLang's output order
    prompt_index: int
    rollout_id: str
    weight_version: str
    inline: bool
    share_prompt: bool
    on_cache_error: str | None = None  # overrides the server's policy for this output
    on_retraction: str | None = None


def sampling_params_tagged(sampling_params: Any) -> bool:
    """Whether a ``/generate`` request's ``sampling_params`` (one, or one per prompt)
    carry a tag: :func:`carries_tag` of any of their ``custom_params``."""
    if isinstance(sampling_params, Mapping):
        return carries_tag(sampling_params.get("custom_params"))
    if isinstance(sampling_params, list):
        return any(sampling_params_tagged(sp) for sp in sampling_params)
    return False


_NAMES_R3 = re.compile(r"(?<![A-Za-z0-9_])r3(?![A-Za-z0-9_])")


def misplaced_tag(sampling_params: Any) -> str | None:
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


def _tag_of(custom_params: Any) -> Mapping[str, Any] | None:
    if not carries_tag(custom_params):
        return None
    tag = custom_params["r3"]
    if not isinstance(tag, Mapping):
        raise bad_request('custom_params["r3"] must be an object like {"rollout_id": "..."}')
    unknown = set(tag) - _TAG_KEYS
    if unknown:
        raise bad_request(
            f"unknown field(s) {sorted(map(str, unknown))}; known: {sorted(_TAG_KEYS)}"
        )
    if "rollout_id" not in tag:
        raise bad_request("rollout_id is required")
    return tag


def _check_id(rollout_id: Any, derived_from: str | None = None) -> str:
    """The format's id rule (``r3_client.check_rollout_id``), as a 400.

    The rule is the one the cache and the client apply, checked here so a bad id
    fails before any generation work is done.
    """
    try:
        return check_rollout_id(rollout_id)
    except InvalidRequestError as exc:
        if derived_from is None:
            raise bad_request(str(exc)) from None
        raise bad_request(
            f"{exc} (derived from rollout_id {derived_from[:40]!r} as '{{id}}-{{k}}' for "
            "one of several outputs; use a shorter id or list the ids)"
        ) from None


def _ids(value: Any, count: int, what: str) -> list[str]:
    if isinstance(value, str):
        _check_id(value)
        if count == 1:
            return [value]
        return [_check_id(f"{value}-{k}", derived_from=value) for k in range(count)]
    if isinstance(value, Sequence) and not isinstance(value, bytes | bytearray):
        ids = list(value)
        if len(ids) != count:
            raise bad_request(f"{what} lists {len(ids)} rollout ids for {count} outputs")
        return [_check_id(i) for i in ids]
    raise bad_request(
        f"rollout_id must be a string or a list of strings, got {type(value).__name__}"
    )


def _choice(tag: Mapping[str, Any], key: str, allowed: tuple[str, ...]) -> str | None:
    value = tag.get(key)
    if value is not None and value not in allowed:
        raise bad_request(f"{key} must be one of {list(allowed)}, got {value!r}")
    return value


def _flag(tag: Mapping[str, Any], key: str, default: bool) -> bool:
    value = tag.get(key, default)
    if not isinstance(value, bool):
        raise bad_request(f"{key} must be true or false, got {value!r}")
    return value


def output_tags(
    sampling_params: Any,
    *,
    batch_size: int,
    n: int,
    max_outputs: int,
    share_prompt: str = "auto",
) -> list[OutputTag] | None:
    """The tag of every output, or None when the request is not tagged at all.

    ``batch_size`` prompts with ``n`` samples each give ``batch_size * n`` outputs.
    ``share_prompt`` is the server's policy for a tag that does not say
    (:attr:`sglang_r3.config.EngineConfig.share_prompt`): ``auto`` shares the
    prompt's rows when ``n > 1``, ``always`` and ``never`` as named.
    Raises a 400 :class:`~sglang_r3.errors.R3RequestError` for a malformed tag,
    a bad or repeated rollout id, or a request only partly tagged.
    """
    total = batch_size * n

    def check_total() -> None:
        if total > max_outputs:
            raise bad_request(f"{total} outputs in one request exceed the limit of {max_outputs}")

    if isinstance(sampling_params, list):
        tags = [
            _tag_of(sp.get("custom_params") if isinstance(sp, Mapping) else None)
            for sp in sampling_params
        ]
        if all(t is None for t in tags):
            return None
        if any(t is None for t in tags) or len(tags) != batch_size:
            raise bad_request(
                "tag every prompt of a batch, or tag it once in a shared sampling_params"
            )
        check_total()
        per_prompt: list[tuple[Mapping[str, Any], list[str]]] = [
            (t, _ids(t["rollout_id"], n, f"prompt {i}"))
            for i, t in enumerate(tags)
            if t is not None
        ]
    else:
        cp = sampling_params.get("custom_params") if isinstance(sampling_params, Mapping) else None
        tag = _tag_of(cp)
        if tag is None:
            return None
        check_total()
        ids = _ids(tag["rollout_id"], batch_size * n, "the request")
        per_prompt = [(tag, ids[i * n : (i + 1) * n]) for i in range(batch_size)]
    out: list[OutputTag] = []
    for i, (tag, ids) in enumerate(per_prompt):
        try:
            # The rule the format applies to a segment's weight version (r3_client).
            wv = check_text("weight_version", tag.get("weight_version", ""))
        except FormatError as exc:
            raise bad_request(str(exc)) from None
        inline = _flag(tag, "inline", False)
        share = _flag(
            tag, "share_prompt", n > 1 if share_prompt == "auto" else share_prompt == "always"
        )
        on_err = _choice(tag, "on_cache_error", ("fail", "inline"))
        on_ret = _choice(tag, "on_retraction", ("mark", "fail"))
        for j, rid in enumerate(ids):
            out.append(OutputTag(i * n + j, i, rid, wv, inline, share, on_err, on_ret))
    seen: set[str] = set()
    for t in out:
        if t.rollout_id in seen:
            raise bad_request(f"rollout id {t.rollout_id!r} names two outputs of one request")
        seen.add(t.rollout_id)
    return out


def request_shape(text: Any, input_ids: Any, sampling_params: Any) -> tuple[int, int, bool]:
    """``(batch_size, n, is_single)`` of a ``GenerateReqInput`` before SGLang normalises it."""
    if text is not None:
        single = isinstance(text, str)
        batch = 1 if single else len(text)
    elif input_ids is not None:
        single = len(input_ids) == 0 or isinstance(input_ids[0], int)
        batch = 1 if single else len(input_ids)
    else:
        raise bad_request("routing capture needs text or input_ids (embeddings carry no tokens)")
    first = (
        sampling_params[0]
        if isinstance(sampling_params, list) and sampling_params
        else sampling_params
    )
    n = first.get("n", 1) if isinstance(first, Mapping) else 1
    if not isinstance(n, int) or n < 1:
        raise bad_request(f"n must be a positive integer, got {n!r}")
    return batch, n, single and n == 1


# ---------------------------------------------------------------- the routing-key header


def header_rollout(raw_request: Any) -> str | None:
    """The rollout id in the configured tag header of ``raw_request`` (None: absent/off)."""
    name = engine_config().tag_header
    headers = getattr(raw_request, "headers", None) if name else None
    if headers is None:
        return None
    value = headers.get(name)
    return value if isinstance(value, str) and value != "" else None


def tag_with_header(custom_params: Any, rollout_id: str) -> dict[str, Any]:
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


def tag_generate_from_header(obj: Any, request: Any) -> None:
    """Tag a ``/generate`` request from the header (sglang-router drops ``custom_params``)."""
    rollout_id = header_rollout(request)
    if rollout_id is None or not engine_config().enabled:
        return
    sp = getattr(obj, "sampling_params", None)
    if isinstance(sp, list):
        if sampling_params_tagged(sp):
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
        "custom_params": tag_with_header(sp.get("custom_params"), rollout_id),
    }
