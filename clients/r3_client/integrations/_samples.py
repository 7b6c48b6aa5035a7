"""The core slime and miles share: a ``Sample``'s key, its fetch and its custom generate.

Both frameworks hold ``Sample.rollout_routed_experts`` as ``[len(tokens) - 1,
num_layers, K]``, send a per-sample header key, and call a legacy custom generate
function ``(args, sample, sampling_params, evaluation=False)`` once per sample (it
may return several samples).  They differ in the key's field, the layout's dtype,
how the key is derived and where their ``generate`` lives: a :class:`Framework`.
Samples are duck-typed; nothing here imports either framework.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from r3_client._exceptions import ShapeError
from r3_client._routing import Routing, check_rollout_id
from r3_client._views import ViewPolicy, one_routing_policy
from r3_client.integrations.tags import tag_sampling_params
from r3_client.layouts import Missing

if TYPE_CHECKING:
    from r3_client._client import AsyncRoutingClient

#: Statuses whose sample is trained on, so whose routing is fetched.
FINISHED = ("COMPLETED", "TRUNCATED")

GenerateFn = Callable[..., Awaitable[Any]]


@dataclass(frozen=True)
class Framework:
    """What differs between slime and miles."""

    name: str
    key_field: str  # the Sample attribute sent as X-SMG-Routing-Key
    generate_path: str  # module:function of the framework's own generate
    layout: Callable[..., npt.NDArray[np.integer[Any]]]
    assign_key: Callable[[str, Any], str]  # (run, sample) -> key, set on the sample
    check_args: Callable[[Any], None]  # refuses args under which the key is not sent


def sample_key(fw: Framework, sample: Any) -> str:
    """The rollout key ``sample`` was generated under; ValueError when it has none."""
    key = getattr(sample, fw.key_field, None)
    if not key:
        raise ValueError(
            f"{fw.name} sample (index={getattr(sample, 'index', '?')}) has no {fw.key_field}: "
            f"it was not generated under a rollout key (r3_client.integrations.{fw.name}."
            "wrap_generate sets it)"
        )
    return check_rollout_id(key)


def finished(sample: Any) -> bool:
    """True when the sample's status is one its framework trains on (``FINISHED``)."""
    return getattr(sample.status, "name", sample.status) in FINISHED


def _layout(
    fw: Framework, sample: Any, key: str, routing: Routing, num_layers: int, missing: Missing
) -> npt.NDArray[np.integer[Any]]:
    try:
        return fw.layout(routing, len(sample.tokens), num_layers=num_layers, missing=missing)
    except ShapeError as exc:
        raise ShapeError(
            f"{fw.name} sample (index={getattr(sample, 'index', '?')}), rollout {key!r}: {exc}"
        ) from exc


async def fill(
    fw: Framework,
    samples: Any,
    client: AsyncRoutingClient,
    *,
    num_layers: int,
    missing: Missing = "raise",
    view: ViewPolicy = "generated",
) -> None:
    """Set each sample's ``rollout_routed_experts`` from the rollout stored under its key.

    ``samples``: one ``Sample`` (one ``get``) or a sequence, such as a group (one
    ``get_many``).  ``view``: ``"generated"`` or ``"latest"`` (docs/store.md, "Views");
    under ``"latest"`` a group is read with one ``get(view="latest")`` per sample, run
    concurrently.  Raises :class:`~r3_client.RolloutNotFoundError` for a rollout the
    cache does not hold and :class:`~r3_client.ShapeError` (naming the sample and
    rollout) for one whose rows are not ``len(tokens) - 1`` or include rows nobody
    shipped; no sample is changed then.  Samples sharing a key are refused (ValueError).
    """
    policy = one_routing_policy(view, fw.name)
    group = list(samples) if isinstance(samples, Sequence) else [samples]
    keys = [sample_key(fw, s) for s in group]
    first: dict[str, int] = {}
    for i, key in enumerate(keys):
        if key in first:
            raise ValueError(
                f"{fw.name} samples {first[key]} and {i} share rollout key {key!r}: each "
                "conversation needs its own key (rollout_key(..., conversation=k))"
            )
        first[key] = i
    if len(keys) == 1:
        routings = {keys[0]: await client.get(keys[0], view=policy)}
    elif policy == "latest":  # the batch stream answers first computations only
        got = await asyncio.gather(*(client.get(k, view="latest") for k in keys))
        routings = dict(zip(keys, got, strict=True))
    else:
        routings = {}
        async for key, routing in client.get_many(keys):
            assert isinstance(routing, Routing)  # errors raise: return_errors is off
            routings[key] = routing
    arrays = [
        _layout(fw, s, key, routings[key], num_layers, missing)
        for s, key in zip(group, keys, strict=True)
    ]
    for s, arr in zip(group, arrays, strict=True):
        s.rollout_routed_experts = arr


def _framework_generate(fw: Framework) -> GenerateFn:
    """The framework's own ``generate``, imported on first use."""
    module, _, name = fw.generate_path.partition(":")
    try:
        fn: GenerateFn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ImportError(
            f"r3_client.integrations.{fw.name} wraps {module}.{name} by default, which could "
            f"not be imported ({exc}); install {fw.name} or pass generate= to wrap another "
            "function"
        ) from exc
    return fn


async def _call(
    fn: GenerateFn, args: Any, sample: Any, sampling_params: Any, evaluation: bool
) -> Any:
    """Call a generate function the way slime and miles do: ``evaluation=`` only if it
    takes it (slime sglang_rollout.py:252-260, miles compatibility.py:51-65)."""
    if "evaluation" in inspect.signature(fn).parameters:
        return await fn(args, sample, sampling_params, evaluation=evaluation)
    return await fn(args, sample, sampling_params)


def wrap_generate(
    fw: Framework,
    *,
    run: str,
    client: AsyncRoutingClient,
    num_layers: int,
    generate: GenerateFn | None = None,
    share_prompt: bool | None = None,
    missing: Missing = "raise",
    view: ViewPolicy = "generated",
) -> GenerateFn:
    """A legacy custom generate function around ``generate`` (default: the framework's own).

    Per call: evaluation samples pass through untagged; otherwise the sample gets its
    rollout key (``fw.assign_key``), which the framework sends as
    ``X-SMG-Routing-Key``, and the sampling params carry the same tag in
    ``custom_params`` (with ``share_prompt``; sglang-router drops it, an engine reached
    directly reads it).  After the call, every returned sample whose status is
    ``COMPLETED`` or ``TRUNCATED`` gets ``rollout_routed_experts`` from the cache (one
    ``get_many`` when the call returns several); aborted samples get nothing until
    their resumed call finishes.  ``view``: the policy of that fetch (:func:`fill`).
    """
    check_rollout_id(f"{run}.0")  # the run must make valid keys before any generation
    one_routing_policy(view, fw.name)  # refused before any generation, too
    inner: list[GenerateFn] = [generate] if generate is not None else []

    async def generate_r3(
        args: Any, sample: Any, sampling_params: dict[str, Any], evaluation: bool = False
    ) -> Any:
        if not inner:
            inner.append(_framework_generate(fw))
        if evaluation:
            return await _call(inner[0], args, sample, sampling_params, evaluation)
        fw.check_args(args)
        key = fw.assign_key(run, sample)
        params = tag_sampling_params(sampling_params, key, share_prompt=share_prompt)
        out = await _call(inner[0], args, sample, params, evaluation)
        done = [s for s in (out if isinstance(out, list) else [out]) if finished(s)]
        if done:
            await fill(fw, done, client, num_layers=num_layers, missing=missing, view=view)
        return out

    generate_r3.__doc__ = f"{fw.name}'s generate with rollouts keyed, routing fetched by key."
    return generate_r3
