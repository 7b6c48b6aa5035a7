"""Tagging a generation request with its rollout id, without asking for inline routing.

The forms the SGLang plugin reads (docs/engine.md, "Tagging a request"):

* ``/generate``: ``sampling_params.custom_params.r3`` (:func:`tag_generate`); with a
  list of ``sampling_params``, one tag per prompt;
* ``/v1/completions``, ``/v1/chat/completions``: top-level ``custom_params.r3``
  (:func:`tag_openai`);
* the header ``X-SMG-Routing-Key: <rollout id>`` (:func:`routing_headers`): the id
  alone, and the only form that crosses sglang-router, which drops ``custom_params``.

The payload functions return a new payload and leave the given one unchanged.  They
also drop :data:`INLINE_ROUTING_FIELDS` (:func:`without_inline_routing`): the engine
ships a tagged request's routing to the cache, and refuses a tagged request that sets
``routed_experts_start_len`` (it sets that itself to continue a rollout).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from r3_client._exceptions import InvalidRequestError, UsageError
from r3_client._routing import check_rollout_id, check_text

__all__ = [
    "INLINE_ROUTING_FIELDS",
    "ROUTING_KEY_HEADER",
    "rollout_tag",
    "routing_headers",
    "tag_generate",
    "tag_openai",
    "tag_sampling_params",
    "without_inline_routing",
]

#: The header the engine reads a rollout id from (``--routing-tag-header``'s default),
#: which sglang-router forwards and routes by.
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
#: Top-level ``/generate`` fields that ask SGLang for routing in the answer.
INLINE_ROUTING_FIELDS = ("return_routed_experts", "routed_experts_start_len")


def rollout_tag(
    rollout_id: str | Sequence[str],
    *,
    weight_version: str | None = None,
    share_prompt: bool | None = None,
) -> dict[str, Any]:
    """The tag ``{"rollout_id": ..., ...}`` the engine reads from ``custom_params["r3"]``.

    ``rollout_id``: one id, or a list naming the request's outputs one by one.
    ``weight_version`` labels the stored rows (default: the engine's own version);
    ``share_prompt`` stores a first turn's prompt rows once for every rollout with
    the same prompt (default: the engine's ``--routing-share-prompt`` policy).
    Options left as ``None`` are not sent.  Raises
    :class:`~r3_client.InvalidRequestError` for an id the cache would refuse and
    :class:`~r3_client.FormatError` for an unprintable or over-long version.
    """
    if isinstance(rollout_id, str):
        tag: dict[str, Any] = {"rollout_id": check_rollout_id(rollout_id)}
    else:
        tag = {"rollout_id": [check_rollout_id(i) for i in rollout_id]}
    if weight_version is not None:
        tag["weight_version"] = check_text("weight_version", weight_version)
    if share_prompt is not None:
        if not isinstance(share_prompt, bool):
            raise UsageError(f"share_prompt must be True, False or None, got {share_prompt!r}")
        tag["share_prompt"] = share_prompt
    return tag


def _with_tag(custom_params: Any, tag: dict[str, Any], where: str) -> dict[str, Any]:
    """``custom_params`` (None or an object) with ``"r3"`` set to ``tag``, other keys kept."""
    if custom_params is None:
        return {"r3": tag}
    if not isinstance(custom_params, Mapping):
        raise UsageError(
            f"{where} must be an object to carry the rollout tag, "
            f"got {type(custom_params).__name__}"
        )
    return {**custom_params, "r3": tag}


def tag_sampling_params(
    sampling_params: Mapping[str, Any] | None,
    rollout_id: str | Sequence[str],
    *,
    weight_version: str | None = None,
    share_prompt: bool | None = None,
) -> dict[str, Any]:
    """A copy of one ``/generate`` ``sampling_params`` with the rollout tag in its
    ``custom_params`` (for frameworks that build the payload themselves from the
    sampling params they are given)."""
    sp = dict(sampling_params or {})
    tag = rollout_tag(rollout_id, weight_version=weight_version, share_prompt=share_prompt)
    sp["custom_params"] = _with_tag(sp.get("custom_params"), tag, "sampling_params.custom_params")
    return sp


def without_inline_routing(payload: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``payload`` without :data:`INLINE_ROUTING_FIELDS`."""
    return {k: v for k, v in payload.items() if k not in INLINE_ROUTING_FIELDS}


def tag_generate(
    payload: Mapping[str, Any],
    rollout_id: str | Sequence[str],
    *,
    weight_version: str | None = None,
    share_prompt: bool | None = None,
) -> dict[str, Any]:
    """A SGLang ``/generate`` payload tagged with its rollout id(s), inline routing dropped.

    With one ``sampling_params`` object (or none), ``rollout_id`` is one id, or a
    list naming the outputs (prompt-major, ``n`` per prompt).  With a list of
    ``sampling_params`` (one per prompt), ``rollout_id`` lists one id per prompt
    and each prompt gets its own tag.
    """
    out = without_inline_routing(payload)
    opts: dict[str, Any] = {"weight_version": weight_version, "share_prompt": share_prompt}
    sp = out.get("sampling_params")
    if isinstance(sp, list):
        if isinstance(rollout_id, str) or len(rollout_id) != len(sp):
            count = "one id" if isinstance(rollout_id, str) else f"{len(rollout_id)} ids"
            raise InvalidRequestError(
                f"a /generate batch with {len(sp)} sampling_params takes one rollout id per "
                f"prompt, got {count}"
            )
        out["sampling_params"] = [
            tag_sampling_params(p, i, **opts) for p, i in zip(sp, rollout_id, strict=True)
        ]
    else:
        out["sampling_params"] = tag_sampling_params(sp, rollout_id, **opts)
    return out


def tag_openai(
    payload: Mapping[str, Any],
    rollout_id: str | Sequence[str],
    *,
    weight_version: str | None = None,
    share_prompt: bool | None = None,
) -> dict[str, Any]:
    """A ``/v1/completions`` or ``/v1/chat/completions`` payload tagged with its rollout
    id(s) in the top-level ``custom_params``, inline routing dropped."""
    out = without_inline_routing(payload)
    tag = rollout_tag(rollout_id, weight_version=weight_version, share_prompt=share_prompt)
    out["custom_params"] = _with_tag(out.get("custom_params"), tag, "custom_params")
    return out


def routing_headers(rollout_id: str) -> dict[str, str]:
    """``{"X-SMG-Routing-Key": rollout_id}``: the tag that crosses sglang-router.

    Only the id travels this way; the engine's defaults apply to the rest
    (its weight version and ``--routing-share-prompt`` policy).
    """
    return {ROUTING_KEY_HEADER: check_rollout_id(rollout_id)}
