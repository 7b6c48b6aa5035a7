"""The rollout side of slime and miles: the custom generate function and the fetch into ``Sample``.

Runs where the framework calls its legacy custom generate function
``(args, sample, sampling_params, evaluation=False)``, once per sample (it may return
several): slime's and miles' rollout process (their ``RolloutManager``, through
``--custom-generate-function-path``).  :class:`SampleRollout` is one framework's rollout
side: :meth:`~SampleRollout.wrap_generate` keys each sample and, when it finishes, fills
``Sample.rollout_routed_experts`` (``[len(tokens) - 1, num_layers, K]``, laid out by the
framework's layout) from the cache, or on the rank-local path only checks that its
rollout is stored.  Samples are duck-typed; nothing here imports either framework, whose
``generate`` is imported on the first call that needs it.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from r3_client._answers import RolloutInfo
from r3_client._exceptions import (
    FrameworkImportError,
    InvalidRequestError,
    R3Error,
    RolloutNotFoundError,
    ShapeError,
)
from r3_client._routing import Routing, check_rollout_id
from r3_client._step_check import StatsInHand, StepCheck, check_step, count_replay
from r3_client._views import ServedRouting, ViewPolicy, applicable_views, check_policy
from r3_client.integrations.samples.framework import (
    STATE_KEY,
    Framework,
    said_of,
    sample_key,
    sample_states,
)
from r3_client.integrations.tags import tag_sampling_params
from r3_client.layouts import Missing

#: Statuses whose sample is trained on, so whose routing is fetched.
FINISHED = ("COMPLETED", "TRUNCATED")

GenerateFn = Callable[..., Awaitable[Any]]


class AsyncCache(Protocol):
    """What the rollout side asks of the cache: the calls of an
    :class:`~r3_client.AsyncRoutingClient` it makes."""

    async def get(self, rollout_id: str, *, view: ViewPolicy = "generated") -> Routing:
        """The rollout's rows under ``view``."""
        ...

    def get_many(
        self, rollout_ids: Sequence[str]
    ) -> AsyncGenerator[tuple[str, Routing | R3Error], None]:
        """``(rollout_id, Routing)`` of each rollout, as they arrive."""
        ...

    async def get_served(self, rollout_id: str) -> list[ServedRouting]:
        """The rollout's routing states, each the routing its tokens attended to."""
        ...

    async def stat_many(self, rollout_ids: Sequence[str]) -> list[RolloutInfo | R3Error]:
        """Each rollout's stat (metadata only), an error in place of one not held."""
        ...

    async def delete(self, rollout_id: str) -> bool:
        """Drop the rollout; whether it was there."""
        ...


def finished(sample: Any) -> bool:
    """True when the sample's status is one its framework trains on (``FINISHED``)."""
    return getattr(sample.status, "name", sample.status) in FINISHED


def _state_routing(
    served: Sequence[ServedRouting], key: str, num_tokens: int, state: int | None, who: str
) -> Routing:
    """The rows ``[0, serves_end)`` of the routing state a sample of ``num_tokens`` tokens
    replays under ``exact``, from its rollout's states (``get_served``): its ``state`` (the
    state's first row; ``None`` is the first), refused (:class:`~r3_client.
    InvalidRequestError`) when the sample's tokens reach past that state, which one routing
    cannot replay: the sample is expanded first (``expand_samples``), or ``"latest"`` /
    ``"generated"`` named.  ``who`` names the sample in errors.  A rollout without views
    has one state: its rows."""
    at = 0 if state is None else int(state)
    for n, st in enumerate(served):
        if st.serves_start != at:
            continue
        if num_tokens - 1 > st.serves_end and n + 1 < len(served):
            raise InvalidRequestError(
                f'{who}: view="exact": its {num_tokens} tokens span {len(served) - n} routing '
                f"states of rollout {key!r} (states start at rows "
                f"{[x.serves_start for x in served]}); expand the sample into one training "
                'sample per state (expand_samples), or name view="latest" or "generated" to '
                "replay one routing for all its tokens"
            )
        return st.routing
    raise InvalidRequestError(
        f'{who}: view="exact": rollout {key!r} has no state starting at row {at}; its states '
        f"start at rows {[x.serves_start for x in served]}"
    )


async def exact_routing(
    client: AsyncCache, key: str, num_tokens: int, state: int | None, who: str
) -> Routing:
    """The routing one sample of ``num_tokens`` tokens replays under ``exact``: the rows of
    its ``state`` (``None``: the first), its rollout's states read (``get_served``); a
    sample whose tokens reach past that state is refused (``who`` names it)."""
    return _state_routing(await client.get_served(key), key, num_tokens, state, who)


async def _whole(client: AsyncCache, keys: Sequence[str]) -> dict[str, Routing]:
    """Each rollout's rows, in one streamed ``get_many``."""
    got: dict[str, Routing] = {}
    async with aclosing(client.get_many(keys)) as answers:
        async for key, routing in answers:
            assert isinstance(routing, Routing)  # errors raise: return_errors is off
            got[key] = routing
    return got


def _check_infos(
    fw: Framework,
    group: Sequence[Any],
    keys: Sequence[str],
    infos: dict[str, RolloutInfo | None],
    missing: Missing,
    view: ViewPolicy = "exact",
) -> StepCheck:
    """:func:`~r3_client.rank_local.check_step` on ``infos``, each stored segment's token
    digest included (rows computed from other tokens: an earlier attempt's, or another
    sample's); its :class:`~r3_client.rank_local.StepCheck`."""
    tokens = [[int(t) for t in s.tokens] for s in group]
    try:
        return check_step(
            StatsInHand(dict(infos)),
            keys,
            [len(t) for t in tokens],
            missing=missing,
            tokens=tokens,
            workers=1,
            view=view,
        )
    except (RolloutNotFoundError, ShapeError) as exc:
        raise said_of(fw, exc) from exc


async def _call(
    fn: GenerateFn, args: Any, sample: Any, sampling_params: Any, evaluation: bool
) -> Any:
    """Call a generate function the way slime and miles do: ``evaluation=`` only if it
    takes it (slime sglang_rollout.py:252-260, miles compatibility.py:51-65)."""
    if "evaluation" in inspect.signature(fn).parameters:
        return await fn(args, sample, sampling_params, evaluation=evaluation)
    return await fn(args, sample, sampling_params)


@dataclass(frozen=True)
class SampleRollout:
    """One framework's rollout side: how it keys a ``Sample`` and lays out its routing.

    ``generate_path``: ``module:function`` of the framework's own ``generate``;
    ``layout``: its ``rollout_routed_experts`` layout (``(routing, len(tokens), *,
    num_layers, missing)``); ``assign_key``: ``(run, sample) -> key``, set on the sample;
    ``assign_rank_key``: the rank-local mode's ``(run, sample) -> (key, restarted)``, the
    key rebuildable on a training rank from ``(run, Sample.index)``, ``restarted`` a
    generation from no tokens under a key that may hold an earlier attempt's rows (dropped
    before generating); ``check_args``: refuses ``args`` under which the key is not sent.
    """

    fw: Framework
    generate_path: str
    layout: Callable[..., npt.NDArray[np.integer[Any]]]
    assign_key: Callable[[str, Any], str]
    assign_rank_key: Callable[[str, Any], tuple[str, bool]]
    check_args: Callable[[Any], None]

    async def fill_routed_experts(
        self,
        samples: Any | Sequence[Any],
        client: AsyncCache,
        *,
        num_layers: int,
        missing: Missing = "raise",
        view: ViewPolicy = "exact",
    ) -> None:
        """Set each sample's ``rollout_routed_experts`` to the framework's layout of the
        rollout stored under its key (slime: ``slime_layout`` under ``sample.session_id``;
        miles: ``miles_layout``, int32, under ``sample.routing_key``); call it once a sample
        is ``COMPLETED`` or ``TRUNCATED``.

        ``samples``: one ``Sample`` or a sequence: a group, or the copies ``expand_samples``
        made of several samples (each keyed by its rollout and state,
        ``metadata["r3_state"]``).  ``num_layers``: the framework's ``--num-layers``
        (decoder layers, no MTP).  ``view`` (docs/store.md, "Views"): ``"exact"`` (the
        default: each sample's rows in its routing state; one batched stat, rollouts
        without views in one ``get_many``, each other rollout's states read once,
        ``get_served``, concurrently; a sample whose tokens span several states is
        refused, never filled with one of them), or by name ``"generated"`` (first
        computations: one ``get`` / ``get_many``) or ``"latest"`` (what the rollout's last
        call attended to: one ``get(view="latest")`` per sample, concurrent), each counted
        as a pre-dispatch check counts it (one batched stat,
        :func:`r3_client.rank_local.count_replay`: the tokens it replays off their own
        state, warned about).  Raises :class:`~r3_client.RolloutNotFoundError` for a
        rollout the cache does not hold and :class:`~r3_client.ShapeError` (naming the
        sample and rollout) for one whose rows are not ``len(tokens) - 1`` or include rows
        nobody shipped (``missing="fill"`` fills those instead); no sample is changed then.
        Samples sharing a key and a state are refused
        (:class:`~r3_client.InvalidRequestError`), as are expanded copies under a named
        policy.  docs/integrations.md.
        """
        policy = check_policy(view)
        group = list(samples) if isinstance(samples, Sequence) else [samples]
        keyed = self._fill_keys(group, policy)
        keys = [k for k, _ in keyed]
        routings: list[Routing]
        if policy == "exact":
            routings = await self._exact_fill(group, keyed, client)
        elif len(keys) == 1:
            routings = [await client.get(keys[0], view=policy)]
        elif policy == "latest":  # the batch stream answers first computations only
            routings = list(await asyncio.gather(*(client.get(k, view="latest") for k in keys)))
        else:
            got = await _whole(client, keys)
            routings = [got[k] for k in keys]
        arrays = [
            self._layout(s, key, routing, num_layers, missing)
            for s, key, routing in zip(group, keys, routings, strict=True)
        ]
        if policy != "exact":  # a named policy is counted where it is chosen
            count_replay(await client.stat_many(keys), [len(s.tokens) for s in group], policy)
        for s, arr in zip(group, arrays, strict=True):
            s.rollout_routed_experts = arr

    def _layout(
        self, sample: Any, key: str, routing: Routing, num_layers: int, missing: Missing
    ) -> npt.NDArray[np.integer[Any]]:
        try:
            return self.layout(routing, len(sample.tokens), num_layers=num_layers, missing=missing)
        except ShapeError as exc:
            raise ShapeError(
                f"{self.fw.name} sample (index={getattr(sample, 'index', '?')}), rollout "
                f"{key!r}: {exc}"
            ) from exc

    def _fill_keys(self, group: Sequence[Any], policy: str) -> list[tuple[str, int | None]]:
        """Each sample's ``(rollout key, state)``: the key it was generated under and, for
        an expanded copy (``expand_samples``), the state it replays.  Two samples with the
        same key and state are refused, as are expanded copies under a one-routing policy."""
        name = self.fw.name
        keys = [sample_key(self.fw, s) for s in group]
        states = sample_states(group)
        if policy != "exact" and any(x is not None for x in states):
            raise InvalidRequestError(
                f"{name} samples expanded into routing states (metadata[{STATE_KEY!r}]) "
                f'replay each its own state: fill them with view="exact", not {policy!r}'
            )
        first: dict[tuple[str, int], int] = {}
        for i, (key, state) in enumerate(zip(keys, states, strict=True)):
            at = (key, 0 if state is None else state)
            if at in first:
                raise InvalidRequestError(
                    f"{name} samples {first[at]} and {i} share rollout key {key!r}"
                    + (f" and state {at[1]}" if state is not None else "")
                    + ": each conversation needs its own key (rollout_key(..., conversation=k))"
                )
            first[at] = i
        return list(zip(keys, states, strict=True))

    async def _exact_fill(
        self,
        group: Sequence[Any],
        keyed: Sequence[tuple[str, int | None]],
        client: AsyncCache,
    ) -> list[Routing]:
        """Each sample's rows in its state (:meth:`fill_routed_experts` under ``exact``)."""
        keys = list(dict.fromkeys(k for k, _ in keyed))
        # rollouts without views (one state: their rows) in one get_many
        plain = [
            k
            for k, info in zip(keys, await client.stat_many(keys), strict=True)
            if isinstance(info, RolloutInfo) and not applicable_views(info)
        ]
        whole = await _whole(client, plain) if plain else {}
        rest = [k for k in keys if k not in whole]
        served = dict(
            zip(rest, await asyncio.gather(*(client.get_served(k) for k in rest)), strict=True)
        )
        name = self.fw.name
        return [
            whole[k]
            if k in whole
            else _state_routing(served[k], k, len(s.tokens), state, f"{name} sample {i} ({k!r})")
            for i, (s, (k, state)) in enumerate(zip(group, keyed, strict=True))
        ]

    async def check_stored(
        self,
        samples: Any | Sequence[Any],
        client: AsyncCache,
        *,
        missing: Missing = "raise",
        view: ViewPolicy = "exact",
    ) -> StepCheck:
        """Rollout side of the rank-local path, for a generate function of your own: each
        finished sample's rollout is stored with a row for every token but the last, no
        gap (unless ``missing="fill"``) and, where the engine recorded token digests, from
        the sample's own tokens.  One batched stat (metadata only); raises
        :class:`~r3_client.RolloutNotFoundError` / :class:`~r3_client.ShapeError` naming the
        sample and rollout.  Returns the :class:`~r3_client.rank_local.StepCheck`: the
        tokens a replay under ``view`` gives a routing other than the one they attended to
        (a warning is logged when some are)."""
        group = list(samples) if isinstance(samples, Sequence) else [samples]
        keys = [sample_key(self.fw, s) for s in group]
        infos: dict[str, RolloutInfo | None] = {}
        for key, got in zip(keys, await client.stat_many(keys), strict=True):
            if isinstance(got, R3Error) and not isinstance(got, RolloutNotFoundError):
                raise got
            infos[key] = got if isinstance(got, RolloutInfo) else None
        return _check_infos(self.fw, group, keys, infos, missing, view)

    def _framework_generate(self) -> GenerateFn:
        """The framework's own ``generate``, imported on first use."""
        name = self.fw.name
        module, _, attr = self.generate_path.partition(":")
        try:
            fn: GenerateFn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise FrameworkImportError(
                f"r3_client.integrations.{name} wraps {module}.{attr} by default, which could "
                f"not be imported ({exc}); install {name} or pass generate= to wrap another "
                "function"
            ) from exc
        return fn

    def wrap_generate(
        self,
        *,
        run: str,
        client: AsyncCache,
        num_layers: int,
        generate: GenerateFn | None = None,
        share_prompt: bool | None = None,
        missing: Missing = "raise",
        view: ViewPolicy | None = None,
        fill: bool = True,
    ) -> GenerateFn:
        """The framework's ``generate`` (or ``generate``) as a legacy custom generate function
        ``(args, sample, sampling_params, evaluation=False)`` that keys each sample's
        rollout and fills its ``rollout_routed_experts`` when it finishes.

        Per call: evaluation samples pass through untagged (slime renumbers them from 0;
        miles keys them itself, a fresh uuid4); otherwise ``args`` are checked (slime
        refuses ``args.router_policy`` other than ``consistent_hashing``,
        :class:`~r3_client.InvalidRequestError`, under which the key would not be sent)
        and the sample gets its rollout key (slime: ``sample.session_id``, miles:
        ``sample.routing_key``, ``= rollout_key(run, sample)``), which the framework sends
        as ``X-SMG-Routing-Key``; the sampling params carry the same tag in
        ``custom_params`` (with ``share_prompt``; sglang-router drops it, an engine reached
        directly reads it).  The framework's ``--use-rollout-routing-replay`` still adds
        ``return_routed_experts`` to its payload; the engine answers tagged requests
        without inline routing.  After the call, every returned sample whose status is
        ``COMPLETED`` or ``TRUNCATED`` gets ``rollout_routed_experts`` from the cache (one
        ``get_many`` when the call returns several); aborted samples get nothing until
        their resumed call finishes.  ``view``: the policy of that fetch
        (:meth:`fill_routed_experts`; ``None``: ``"exact"``).

        ``fill=False`` (rank-local training): the sample is keyed by ``assign_rank_key``
        (the key a training rank rebuilds with ``rank_keys``) and nothing is fetched into
        it; a finished sample's rollout is only checked (:meth:`check_stored`: one ``stat``,
        no rows), so a missing, short, gapped or foreign-token rollout fails here, naming
        the sample, before slime / miles ship it to the trainer, and each training rank
        reads its own slice (``fetch_rank_replay``).  Nothing is fetched here, so ``view``
        is not given: the training ranks choose their policy where they read (the
        rank-local fetches' ``view``, ``exact`` by default); a policy given here is refused
        (:class:`~r3_client.InvalidRequestError`) rather than ignored.
        """
        name = self.fw.name
        check_rollout_id(f"{run}.0")  # the run must make valid keys before any generation
        policy = check_policy("exact" if view is None else view)  # before any generation, too
        if not fill and view is not None:
            raise InvalidRequestError(
                f"{name} wrap_generate(fill=False) fetches nothing, so view={view!r} would be "
                "ignored: the rank-local fetch chooses its policy on the training side (each "
                "rank's fetch takes view=...)"
            )
        inner: list[GenerateFn] = [generate] if generate is not None else []

        async def generate_r3(
            args: Any, sample: Any, sampling_params: dict[str, Any], evaluation: bool = False
        ) -> Any:
            if not inner:
                inner.append(self._framework_generate())
            if evaluation:
                return await _call(inner[0], args, sample, sampling_params, evaluation)
            self.check_args(args)
            if fill:
                key = self.assign_key(run, sample)
            else:
                key, restarted = self.assign_rank_key(run, sample)
                if restarted:  # an earlier attempt's rows, from tokens this one will not repeat
                    await client.delete(key)
            params = tag_sampling_params(sampling_params, key, share_prompt=share_prompt)
            out = await _call(inner[0], args, sample, params, evaluation)
            done = [s for s in (out if isinstance(out, list) else [out]) if finished(s)]
            if done and fill:
                await self.fill_routed_experts(
                    done, client, num_layers=num_layers, missing=missing, view=policy
                )
            elif done:
                await self.check_stored(done, client, missing=missing)
            return out

        generate_r3.__doc__ = f"{name}'s generate with rollouts keyed, routing fetched by key."
        return generate_r3
