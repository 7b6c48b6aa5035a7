"""The driver side of slime and miles: a step's samples checked, or expanded, before dispatch.

Runs where the step's finished samples are gathered, after the reward model and before
the framework converts them to train data and ships them to the training ranks (slime's
and miles' ``RolloutManager``: the end of a ``--rollout-function-path`` function, or a
``--custom-convert-samples-to-train-data-path`` function).  :class:`SampleDriver` is one
framework's driver side: :meth:`~SampleDriver.check_samples` (one batched stat: every
rollout stored and long enough) and :meth:`~SampleDriver.expand_samples` (one ``Sample``
per routing state, for ``view="exact"`` on the ranks), refusing the trainer settings
the cut would change.  Samples are duck-typed; nothing here imports either framework.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from r3_client._exceptions import InvalidRequestError, RolloutNotFoundError, ShapeError
from r3_client._step_check import StatSource, StepCheck, check_step
from r3_client._views import ViewPolicy
from r3_client.expansion import Expansion, SampleState, expand_states
from r3_client.integrations.samples.framework import (
    STATE_KEY,
    Framework,
    said_of,
    sample_key,
    sample_states,
)
from r3_client.layouts import Missing

#: Per-response-token lists of slime's / miles' ``Sample``, cut with the response (slime
#: ``utils/types.py:119-128``, checked against ``response_length`` at ``:418-426``; miles
#: ``utils/types.py:44-55``, cut together by ``strip_last_output_tokens``, ``:221-244``).
_PER_RESPONSE = ("loss_mask", "rollout_log_probs", "teacher_log_probs", "opd_reverse_kl")
#: Per-row arrays (``[len(tokens) - 1, ...]``), cut with the tokens.
_PER_ROW = ("rollout_routed_experts", "rollout_indexer_topk")
#: miles keeps one more per-response-token list in ``metadata`` (``types.py:236-237``).
_PER_RESPONSE_META = ("opd_student_top_logprobs",)

#: Advantage estimators whose per-token values run to the sample's end (GAE, discounted
#: returns: slime ``backends/megatron_utils/loss.py:769-794``, miles
#: ``training_utils/loss_hub/advantages.py:59-91``) or whose ratio is one per sequence
#: (GSPO, ``loss.py:1021-1028``): a sample cut at a state's end would change them.
_CUT_CHANGES = ("ppo", "reinforce_plus_plus", "gspo")


def _no_check(args: Any) -> None:
    """A framework with no settings of its own that expansion changes."""


def _check_cut_args(fw: Framework, args: Any) -> None:
    """Refuse the advantage estimators and ratios under which the expanded samples would not
    train what the originals do (both frameworks)."""
    estimator = getattr(args, "advantage_estimator", None)
    if estimator in _CUT_CHANGES or getattr(args, "use_opsm", False):
        what = "use_opsm" if estimator not in _CUT_CHANGES else f"advantage_estimator={estimator!r}"
        raise InvalidRequestError(
            f"{fw.name} state expansion cuts a sample at each state's end, which changes "
            f"{what}: its values run over the whole sample (token-level returns, or one "
            "ratio per sequence).  Use grpo / cispo / reinforce_plus_plus_baseline, or "
            'replay one routing per sample (view="latest" or "generated")'
        )


def _cut(value: Any, n: int) -> Any:
    return None if value is None else value[:n]


def _copy_state(
    sample: Any, state: int, num_tokens: int, first_token: int, prompt: int
) -> Any | None:
    """``sample`` cut to its first ``num_tokens`` tokens, training tokens ``first_token ..``
    only; ``None`` when that trains nothing."""
    response = num_tokens - prompt
    if response <= 0:
        return None  # all prompt
    mask = [1] * sample.response_length if sample.loss_mask is None else list(sample.loss_mask)
    mask = [0 if prompt + j < first_token else int(m) for j, m in enumerate(mask[:response])]
    if not any(mask):
        return None
    out = copy.copy(sample)
    out.tokens = list(sample.tokens[:num_tokens])
    out.response_length = response
    for name in _PER_RESPONSE[1:]:
        if hasattr(sample, name):
            setattr(out, name, _cut(getattr(sample, name), response))
    out.loss_mask = mask
    for name in _PER_ROW:
        if hasattr(sample, name):
            setattr(out, name, _cut(getattr(sample, name), num_tokens - 1))
    offsets = getattr(sample, "rollout_top_p_token_offsets", None)
    if offsets is not None:  # slime's ragged top-p ids: response token i owns ids[o[i]:o[i+1]]
        out.rollout_top_p_token_offsets = offsets[: response + 1]
        out.rollout_top_p_token_ids = sample.rollout_top_p_token_ids[: int(offsets[response])]
    meta = dict(getattr(sample, "metadata", None) or {})
    for name in _PER_RESPONSE_META:
        if meta.get(name) is not None:
            meta[name] = meta[name][:response]
    meta[STATE_KEY] = int(state)
    out.metadata = meta
    if getattr(sample, "rollout_id", None) is None and hasattr(sample, "rollout_id"):
        out.rollout_id = sample.index  # siblings share it: the rollout is counted once
    return out


def _copies(sample: Any, own: Sequence[SampleState]) -> list[Any]:
    """The copies of one sample of several states, one per state that trains a token, or,
    when none does (e.g. ``remove_sample``), one copy keeping its place in its last state
    (where a rank reads it, too)."""
    prompt = len(sample.tokens) - int(sample.response_length)
    copies = [_copy_state(sample, s.state, s.num_tokens, s.first_token, prompt) for s in own]
    kept = [c for c in copies if c is not None]
    if not kept:
        whole = copy.copy(sample)
        whole.metadata = {**(getattr(sample, "metadata", None) or {}), STATE_KEY: own[-1].state}
        kept = [whole]
    return kept


@dataclass(frozen=True)
class SampleDriver:
    """One framework's driver side.  ``check_args``: the framework's own refusals of the
    trainer's ``args`` that expansion would change (slime: its count-reshaping reward
    normalization), after those both share."""

    fw: Framework
    check_args: Callable[[Any], None] = _no_check

    def check_samples(
        self,
        samples: Sequence[Any],
        source: StatSource,
        *,
        missing: Missing = "raise",
        view: ViewPolicy = "exact",
        states: Sequence[int | None] | None = None,
    ) -> StepCheck:
        """Before dispatch: every sample's rollout exists and holds ``len(tokens) - 1``
        rows (:func:`~r3_client.rank_local.check_step` over the samples' keys and
        ``len(tokens)``, one batched stat); raises one error naming the failing samples'
        positions and rollouts.  ``view`` / ``states``: the policy the ranks replay under
        and, under ``exact``, each sample's state (default: the state an expanded sample
        records, ``metadata["r3_state"]``); returns the
        :class:`~r3_client.rank_local.StepCheck` (tokens replayed off their own state)."""
        keys = [sample_key(self.fw, s) for s in samples]
        if states is None and view == "exact":
            recorded = sample_states(samples)
            states = recorded if any(x is not None for x in recorded) else None
        try:
            return check_step(
                source,
                keys,
                [len(s.tokens) for s in samples],
                missing=missing,
                view=view,
                states=states,
            )
        except (RolloutNotFoundError, ShapeError) as exc:
            raise said_of(self.fw, exc) from exc

    def expand_samples(self, samples: Sequence[Any], source: Any, *, args: Any = None) -> list[Any]:
        """One ``Sample`` per routing state of each sample (``view="exact"``,
        docs/integrations.md "Exact replay by state expansion"):
        :func:`r3_client.expand_states` of the samples' keys and ``len(tokens)`` (one
        batched stat through ``source``, a :class:`~r3_client.RoutingClient`; metadata
        only), then per state ``s`` (rows ``[s, end)``) a shallow copy of the sample with

        * ``tokens`` cut to the state's ``num_tokens`` (``end + 1``; the last state: all),
          ``response_length`` to ``num_tokens - prompt`` (the prompt: ``len(tokens) -
          response_length`` of the original);
        * ``loss_mask`` (``None``: all ones) cut to that and zeroed on the response tokens
          before ``s + 1``, so each trained token of the original is trained by exactly one
          copy; the other per-response-token lists (``rollout_log_probs``,
          ``teacher_log_probs``, ``opd_reverse_kl``, slime's top-p ids and offsets, miles'
          ``metadata["opd_student_top_logprobs"]``, as miles' ``strip_last_output_tokens``
          cuts them) and per-row arrays (``rollout_routed_experts``,
          ``rollout_indexer_topk``) cut with them;
        * ``metadata["r3_state"] = s``; ``rollout_id`` (``None``: the original's ``index``)
          shared by the copies, so slime / miles count the rollout once (per-rollout loss
          denominators, step split, reward groups); ``index``, key, ``reward``,
          ``status``, ``group_index`` and the rest copied (``response``, the text, is the
          original's).

        A state that trains no token (all prompt, or loss mask zero there) is dropped; a
        sample of one state is returned as it is.  Samples without a reward are refused
        when cut (expand after the reward model).  Run it on the rollout side once the
        rewards are set and before the framework converts the samples to train data, e.g.
        at the end of a ``--rollout-function-path`` function, each group as lists of
        copies (slime flattens nested groups and checks that siblings share
        ``rollout_id``, ``ray/rollout.py:595-604``).  ``args`` (the trainer's): refuses
        settings the cut would change (``ppo`` / ``reinforce_plus_plus`` returns, ``gspo``
        / ``use_opsm`` sequence ratios; slime's count-reshaping reward normalization
        without ``--custom-reward-post-process-path
        r3_client.integrations.slime.normalize_rewards``).
        """
        if args is not None:
            _check_cut_args(self.fw, args)
            self.check_args(args)
        keys = [sample_key(self.fw, s) for s in samples]
        try:
            exp = expand_states(source, keys, [len(s.tokens) for s in samples])
        except (RolloutNotFoundError, ShapeError) as exc:
            raise said_of(self.fw, exc) from exc
        return self.expand_sample_states(samples, exp)

    def expand_sample_states(self, samples: Sequence[Any], exp: Expansion) -> list[Any]:
        """:meth:`expand_samples` from an :class:`~r3_client.expansion.Expansion` of
        ``samples`` already made (e.g. by :func:`r3_client.expansion.expand_infos` from
        stats read asynchronously)."""
        if exp.num_samples != len(samples):
            raise ShapeError(
                f"an expansion of {exp.num_samples} samples for {len(samples)} samples"
            )
        by_origin: dict[int, list[SampleState]] = {}
        for st in exp.states:
            by_origin.setdefault(st.origin, []).append(st)
        out: list[Any] = []
        for i, sample in enumerate(samples):
            own = by_origin.get(i, [])
            if len(own) <= 1:
                out.append(sample)  # one state: replayed as it is
                continue
            if getattr(sample, "reward", None) is None:
                raise InvalidRequestError(
                    f"{self.fw.name} sample {i} (index={getattr(sample, 'index', '?')}) has no "
                    "reward yet: expand after the reward model ran, since each expanded sample "
                    "copies the original's reward (scored on a cut copy it would be another)"
                )
            out.extend(_copies(sample, own))
        return out
