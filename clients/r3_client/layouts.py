"""Collate per-rollout routing into each trainer's batch layout.

Every function here takes one or more rollouts' routing, each ``[T-1, L, K]``
(a :class:`~r3_client.Routing` starting at token 0, or a plain integer array),
and places routing row ``t`` at the position where the trainer puts token
``t``.  Rows are sets: copied as they are, order within a row never relied upon.

What goes where no row was recorded is the consumer's contract, pinned per
framework in ``docs/integrations.md``:

* **third-party trainers** (:func:`verl_layout`, :func:`slime_layout`,
  :func:`miles_layout`): the shape, dtype, layer axis and fill their own replay
  code consumes.  verl fills padding and the last token with ``0`` (as its own
  rollout does; a ``-1`` in a replayed row crashes its gather); slime and
  miles take ``T-1`` rows and add the last one themselves.  ``num_layers=``
  makes the layer axis absolute (dense layers ``0``, as upstream SGLang returns
  them).  Rows nobody shipped (``-1`` from :func:`~r3_client.decode_rollout`)
  are refused unless ``missing="fill"``: none of these trainers falls back to its
  router on them.
* **our replay adapters** (:func:`hf_layout`, :func:`megatron_layout`): the
  last token and padding hold ``-1``, never ``0`` (``0`` is a real expert, and
  repeated zeros crash Megatron's all-to-all); the HF adapter routes ``-1`` rows
  natively, the Megatron driver replays experts ``0..K-1`` there (miles' rule).
  Megatron has no per-token fallback, so :func:`megatron_layout` refuses rows
  nobody shipped like the third-party layouts (``missing="fill"`` keeps them
  ``-1``), and checks each sample against the trainer's ``seqlens``.

Numpy layouts are ``int16`` (``int32`` when an expert id does not fit in int16,
and always for miles); the Megatron layout is ``int64``, which
``RouterReplay.set_replay_data`` wants.  See ``docs/layouts.md``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from r3_client._exceptions import ShapeError
from r3_client._layout_rows import Missing, absolute_layers, uncovered
from r3_client._routing import Routing, check_layer_ids

__all__ = [
    "MegatronReplayBatch",
    "Missing",
    "RoutingLike",
    "hf_layout",
    "megatron_layout",
    "miles_layout",
    "slime_layout",
    "verl_layout",
]

#: One rollout's routing: a :class:`Routing` (``start == 0``) or an integer array ``[T-1, L, K]``.
RoutingLike: TypeAlias = "Routing | npt.NDArray[np.integer[Any]]"

_I16 = np.iinfo(np.int16)


@dataclass(frozen=True)
class _Rows:
    """Validated rows of a batch of rollouts (all share ``L`` and ``K``)."""

    arrays: list[npt.NDArray[np.integer[Any]]]
    layer_ids: tuple[int, ...] | None  # from Routing inputs, when any were given
    num_layers: int
    topk: int
    max_id: int
    rollout_ids: tuple[str, ...] | None = None  # the caller's, for error messages only
    single: bool = False  # one sample (slime, miles): no batch index to name

    def _rid(self, i: int) -> str:
        return f" (rollout {self.rollout_ids[i]!r})" if self.rollout_ids is not None else ""

    def who(self, i: int) -> str:
        """Sample ``i`` in an error message: ``sample 2 (rollout 'r-7')``."""
        return ("the sample" if self.single else f"sample {i}") + self._rid(i)

    def routing_name(self, i: int) -> str:
        """Sample ``i``'s routing in an error message: ``sample 2's routing (rollout 'r-7')``."""
        return ("the routing" if self.single else f"sample {i}'s routing") + self._rid(i)

    @property
    def out_dtype(self) -> np.dtype[Any]:
        """int16 while every id fits, else int32."""
        return np.dtype(np.int16) if self.max_id <= _I16.max else np.dtype(np.int32)

    def lengths(self) -> npt.NDArray[np.int64]:
        return np.array([a.shape[0] for a in self.arrays], dtype=np.int64)


def _as_numpy(x: Any) -> npt.NDArray[Any]:
    """A numpy view of a numpy array, array-like, or (CPU or GPU) torch tensor."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        return np.asarray(x.detach().cpu().numpy())
    return np.asarray(x)


def _one(routing: RoutingLike, name: str) -> tuple[npt.NDArray[Any], tuple[int, ...] | None]:
    """Validate one rollout's routing; return its ``[T-1, L, K]`` array and layer ids."""
    layer_ids: tuple[int, ...] | None = None
    if isinstance(routing, Routing):
        if routing.start != 0:
            raise ShapeError(
                f"{name} starts at token {routing.start}; layouts need the whole rollout's rows "
                "from token 0 (fetch it without start=, or select(start=0))"
            )
        arr = routing.indices
        layer_ids = routing.layer_ids
    else:
        arr = _as_numpy(routing)
    if arr.ndim != 3:
        raise ShapeError(f"{name} must be [tokens-1, layers, topk], got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ShapeError(f"{name} must hold integer expert ids, got dtype {arr.dtype}")
    if arr.shape[1] < 1 or arr.shape[2] < 1:
        raise ShapeError(f"{name} has an empty layer or top-k axis: shape {arr.shape}")
    return arr, layer_ids


def _rollout_ids(ids: Sequence[str] | None, n: int) -> tuple[str, ...] | None:
    """The caller's rollout ids, one per sample (they only name samples in errors)."""
    if ids is None:
        return None
    if isinstance(ids, str):
        raise ShapeError("rollout_ids must list one id per sample, not be one string")
    out = tuple(ids)
    if len(out) != n:
        raise ShapeError(f"rollout_ids must name each sample ({n}), got {len(out)}")
    bad = [x for x in out if not isinstance(x, str)]
    if bad:
        raise ShapeError(f"rollout_ids must be strings, got {type(bad[0]).__name__}")
    return out


def _collect(
    routings: Sequence[RoutingLike] | RoutingLike,
    what: str,
    rollout_ids: Sequence[str] | None = None,
    *,
    single: bool = False,
) -> _Rows:
    """Validate a batch: each rollout well-formed, all with the same L, K (and layer ids).

    ``rollout_ids`` and ``single`` only change how errors name a sample (:class:`_Rows`).
    """
    if isinstance(routings, Routing) or (isinstance(routings, np.ndarray) and routings.ndim == 3):
        raise ShapeError(f"{what} takes a list of rollouts (one per sample), not one routing")
    items = list(routings)
    if not items:
        raise ShapeError(f"{what} needs at least one sample")
    names = _Rows([], None, 0, 0, 0, _rollout_ids(rollout_ids, len(items)), single)
    arrays: list[npt.NDArray[Any]] = []
    layer_ids: tuple[int, ...] | None = None
    lo, hi = 0, -1
    for i, item in enumerate(items):
        arr, ids = _one(item, names.routing_name(i))
        if arrays and arr.shape[1:] != arrays[0].shape[1:]:
            raise ShapeError(
                f"{names.routing_name(i)} has [layers, topk] = {list(arr.shape[1:])}, "
                f"but sample 0 has {list(arrays[0].shape[1:])}"
            )
        if ids is not None:
            if layer_ids is not None and ids != layer_ids:
                raise ShapeError(
                    f"{names.routing_name(i)} covers MoE layers {list(ids)}, "
                    f"an earlier sample covers {list(layer_ids)}"
                )
            layer_ids = ids
        if arr.size:
            lo, hi = min(lo, int(arr.min())), max(hi, int(arr.max()))
        arrays.append(arr)
    if lo < -1:
        raise ShapeError(f"routing holds expert id {lo}; ids are >= 0, and -1 marks 'no route'")
    if hi > np.iinfo(np.int32).max:
        raise ShapeError(f"routing holds expert id {hi}, which does not fit in int32")
    return dataclasses.replace(
        names,
        arrays=arrays,
        layer_ids=layer_ids,
        num_layers=arrays[0].shape[1],
        topk=arrays[0].shape[2],
        max_id=hi,
    )


def _lengths(values: Sequence[int] | npt.ArrayLike, name: str, n: int) -> npt.NDArray[np.int64]:
    """A 1-D vector of ``n`` non-negative integer lengths."""
    arr = _as_numpy(values)
    if arr.ndim != 1 or arr.shape[0] != n:
        raise ShapeError(f"{name} must list one length per sample ({n}), got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ShapeError(f"{name} must be integers, got dtype {arr.dtype}")
    out = arr.astype(np.int64)
    if (out < 0).any():
        raise ShapeError(f"{name} must be non-negative, got {out.tolist()}")
    return out


def _check_rows_match_tokens(batch: _Rows, tokens: npt.NDArray[np.int64], how: str) -> None:
    """Every sample must have exactly ``tokens - 1`` routing rows."""
    rows = batch.lengths()
    bad = np.flatnonzero(rows != tokens - 1)
    if bad.size:
        i = int(bad[0])
        if tokens[i] < 1:
            raise ShapeError(f"{batch.who(i)} has no tokens ({how}); every sample needs >= 1 token")
        raise ShapeError(
            f"{batch.who(i)}: routing has {rows[i]} rows but the sample has {tokens[i]} tokens "
            f"({how}); expected {tokens[i] - 1} rows (one per token except the last)"
        )


def _layer_ids(batch: _Rows, layer_ids: Sequence[int] | None) -> tuple[int, ...] | None:
    """The routing's MoE layer ids: from its :class:`Routing` inputs or ``layer_ids``."""
    if layer_ids is None:
        return batch.layer_ids
    ids = check_layer_ids(layer_ids)
    if batch.layer_ids is not None and batch.layer_ids != ids:
        raise ShapeError(
            f"layer_ids={list(ids)} but the routing covers MoE layers {list(batch.layer_ids)}"
        )
    return ids


def _consumer_rows(
    batch: _Rows,
    layer_ids: Sequence[int] | None,
    num_layers: int | None,
    missing: Missing,
    fill: npt.NDArray[Any],
) -> tuple[list[npt.NDArray[Any]], int]:
    """Each sample's rows with uncovered rows handled and the layer axis made absolute."""
    ids = _layer_ids(batch, layer_ids)
    out = []
    for i, arr in enumerate(batch.arrays):
        arr = uncovered(arr, batch.routing_name(i), missing, fill)
        out.append(absolute_layers(arr, ids, num_layers, batch.routing_name(i)))
    return out, out[0].shape[1]


def verl_layout(
    routings: Sequence[RoutingLike],
    prompt_lens: Sequence[int] | npt.ArrayLike,
    response_lens: Sequence[int] | npt.ArrayLike,
    *,
    prompt_len: int | None = None,
    response_len: int | None = None,
    num_layers: int | None = None,
    layer_ids: Sequence[int] | None = None,
    missing: Missing = "raise",
    rollout_ids: Sequence[str] | None = None,
) -> npt.NDArray[np.integer[Any]]:
    """verl 0.9.1's ``batch["routed_experts"]``: ``[bs, prompt_len + response_len, L, K]``.

    Use it when building a verl ``DataProto`` whose ``prompts`` are left-padded
    to ``prompt_len`` and ``responses`` right-padded to ``response_len``.
    Sample ``i`` has ``P_i = prompt_lens[i]`` prompt and ``R_i = response_lens[i]``
    response tokens and ``P_i + R_i - 1`` routing rows.  Token ``t < P_i`` sits
    at column ``prompt_len - P_i + t``, token ``t >= P_i`` at
    ``prompt_len + t - P_i``.  ``prompt_len`` / ``response_len`` default to
    the batch maxima.  Every padding position and each sample's last token hold
    ``0``, as verl's own rollout fills them (verl never gathers there: it drops
    padding and leaves the last token to its router; a ``-1`` inside a sample's
    replayed rows crashes its gather, hence ``missing``).

    ``num_layers``: the model's ``num_hidden_layers``; the layer axis becomes
    absolute (verl indexes it by ``layer_number - 1``), MoE rows at their layer ids
    (a :class:`Routing`'s, or ``layer_ids`` for plain arrays), dense layers ``0``.
    Required for models with dense layers (DeepSeek-V3, GLM-4.5, Kimi-K2, ...).
    ``missing``: rows nobody shipped raise (default) or, with ``"fill"``, become ``0``.
    ``rollout_ids``: one per sample, to name the rollout in errors (a :class:`Routing`
    does not carry its id).
    Raises :class:`ShapeError` when a sample's row count is not ``P_i + R_i - 1``
    or it does not fit the given lengths::

        P_i=3, R_i=2, prompt_len=5, response_len=4   (r_t = routing row t)

        column:  0   1   2   3   4 | 5   6   7   8
                 pad pad r0  r1  r2| r3  0   pad pad
                 <-- prompt, left- | response, right-padded -->
        every pad and the last token (0 after r3) hold 0 in all L x K slots
    """
    batch = _collect(routings, "verl_layout", rollout_ids)
    n = len(batch.arrays)
    p = _lengths(prompt_lens, "prompt_lens", n)
    r = _lengths(response_lens, "response_lens", n)
    _check_rows_match_tokens(batch, p + r, "prompt + response")
    plen = int(p.max()) if prompt_len is None else int(prompt_len)
    rlen = int(r.max()) if response_len is None else int(response_len)
    for name, have, cap in (("prompt", p, plen), ("response", r, rlen)):
        over = np.flatnonzero(have > cap)
        if over.size:
            i = int(over[0])
            raise ShapeError(
                f"{batch.who(i)} has {have[i]} {name} tokens, more than {name}_len={cap}"
            )
    fill = np.zeros(batch.topk, dtype=np.int64)
    arrays, nl = _consumer_rows(batch, layer_ids, num_layers, missing, fill)
    # np.zeros is calloc: pages are zeroed lazily, so the fill costs no extra pass.
    out = np.zeros((n, plen + rlen, nl, batch.topk), dtype=batch.out_dtype)
    for i, arr in enumerate(arrays):
        pi, rows = int(p[i]), arr.shape[0]
        in_prompt = min(pi, rows)
        out[i, plen - pi : plen - pi + in_prompt] = arr[:in_prompt]
        out[i, plen : plen + rows - in_prompt] = arr[in_prompt:]
    return out


def _sample_layout(
    routing: RoutingLike,
    num_tokens: int,
    what: str,
    dtype: np.dtype[Any] | None,
    num_layers: int | None,
    layer_ids: Sequence[int] | None,
    missing: Missing,
    rollout_id: str | None,
) -> npt.NDArray[np.integer[Any]]:
    """One sample's ``[num_tokens - 1, L or num_layers, K]`` rows (slime and miles)."""
    # One sample: errors say "the routing" (a "sample 0" would not be the trainer's index).
    batch = _collect([routing], what, None if rollout_id is None else [rollout_id], single=True)
    arr = batch.arrays[0]
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int | np.integer):
        raise ShapeError(f"num_tokens must be an int, got {type(num_tokens).__name__}")
    if num_tokens < 1 or arr.shape[0] != num_tokens - 1:
        where = "" if rollout_id is None else f"{batch.who(0)}: "
        raise ShapeError(
            f"{where}routing has {arr.shape[0]} rows but the sample has {num_tokens} tokens; "
            f"expected {max(num_tokens - 1, 0)} rows (one per token except the last)"
        )
    fill = np.arange(batch.topk, dtype=np.int64)
    (rows,), _ = _consumer_rows(batch, layer_ids, num_layers, missing, fill)
    return rows.astype(dtype or batch.out_dtype, copy=rows is arr)


def slime_layout(
    routing: RoutingLike,
    num_tokens: int,
    *,
    num_layers: int | None = None,
    layer_ids: Sequence[int] | None = None,
    missing: Missing = "raise",
    rollout_id: str | None = None,
) -> npt.NDArray[np.integer[Any]]:
    """slime's ``Sample.rollout_routed_experts`` for one sample of ``num_tokens`` tokens.

    ``[num_tokens - 1, L, K]``: one row per token but the last, which slime's
    trainer adds itself (it asserts ``len(tokens) - 1`` rows).  ``num_layers`` (slime's
    ``args.num_layers``) makes the layer axis absolute: MoE rows at their layer ids,
    dense layers ``0``.  ``missing="fill"`` fills rows nobody shipped with experts
    ``0..K-1`` instead of raising.  ``rollout_id`` names the rollout in errors (which
    otherwise say "the routing").  ``int16`` (``int32`` for ids beyond int16)::

        num_tokens = 4  ->  [r0, r1, r2]   shape [3, L, K]
        token index:         0   1   2     (token 3: slime's trainer adds its row)
    """
    return _sample_layout(
        routing, num_tokens, "slime_layout", None, num_layers, layer_ids, missing, rollout_id
    )


def miles_layout(
    routing: RoutingLike,
    num_tokens: int,
    *,
    num_layers: int | None = None,
    layer_ids: Sequence[int] | None = None,
    missing: Missing = "raise",
    rollout_id: str | None = None,
) -> npt.NDArray[np.int32]:
    """miles' ``Sample.rollout_routed_experts``: :func:`slime_layout`'s rows as ``int32``.

    miles asserts the same ``[len(tokens) - 1, num_layers, K]`` shape and adds the
    last row itself, but its replay gathers with the array's own dtype, which must
    be ``int32`` or ``int64``.
    """
    out = _sample_layout(
        routing,
        num_tokens,
        "miles_layout",
        np.dtype(np.int32),
        num_layers,
        layer_ids,
        missing,
        rollout_id,
    )
    return out.astype(np.int32, copy=False)


def hf_layout(
    routings: Sequence[RoutingLike],
    attention_mask: Any,
    *,
    as_torch: bool = False,
    dtype: Any = None,
) -> Any:
    """Routing aligned with HF ``input_ids`` / ``attention_mask`` ``[B, T]``: ``[B, T, L, K]``.

    Use it with the HF transformers replay adapter.  ``attention_mask`` is a
    numpy array or torch tensor (nonzero = attended); padding may sit on
    either side or anywhere.  The k-th attended position of row ``b`` holds
    routing row ``k`` of sample ``b``; the last attended position and every
    masked position hold ``-1``.  Raises :class:`ShapeError` when sample ``b``
    attends to a number of positions other than its routing rows + 1::

        attention_mask[b] = 0 0 1 1 1 1      (left padding; 4 tokens, rows r0..r2)
        out[b]            = - - r0 r1 r2 -   ("-" = -1 in all L x K slots)

        attention_mask[b] = 1 1 1 0 0 0      (right padding; 3 tokens, rows r0, r1)
        out[b]            = r0 r1 - - - -

    Returns ``int16`` numpy (``int32`` for ids beyond int16), or with
    ``as_torch=True`` a CPU ``torch.Tensor``.  ``dtype`` overrides the result
    dtype (a numpy dtype, or a torch dtype with ``as_torch``, e.g.
    ``torch.int64``).
    """
    mask = _as_numpy(attention_mask)
    if mask.ndim != 2:
        raise ShapeError(f"attention_mask must be [batch, seq_len], got shape {mask.shape}")
    batch = _collect(routings, "hf_layout")
    n, seq = mask.shape
    if len(batch.arrays) != n:
        raise ShapeError(f"attention_mask has {n} rows but {len(batch.arrays)} routings were given")
    attended = mask != 0
    _check_rows_match_tokens(batch, attended.sum(axis=1).astype(np.int64), "attended positions")
    out = np.full((n, seq, batch.num_layers, batch.topk), -1, dtype=batch.out_dtype)
    for b, arr in enumerate(batch.arrays):
        out[b, np.flatnonzero(attended[b])[:-1]] = arr
    if as_torch:
        import torch  # lazy: numpy users need not install torch

        tensor = torch.from_numpy(out)
        return tensor if dtype is None else tensor.to(dtype)
    return out if dtype is None else out.astype(dtype)


@dataclass(frozen=True)
class MegatronReplayBatch:
    """What :func:`megatron_layout` returns for one micro-batch on one rank.

    ``per_layer``   one ``[local_tokens, K]`` int64 array (or tensor) per local MoE
                    layer, in ``layer_ids`` order: pass it to
                    ``RouterReplay.set_replay_data(batch.per_layer)``.
    ``layer_ids``   the absolute MoE layer ids of ``per_layer`` (ascending).
    ``cu_seqlens``  ``[n + 1]`` int32 cumulative *padded* sequence lengths of the
                    whole packed batch (before the CP/SP split), i.e. the
                    ``cu_seqlens_padded`` of Megatron's ``PackedSeqParams``.
    ``seqlens``     ``[n]`` int32 true token counts ``T_i`` (the trainer's, each
                    checked to equal the sample's routing rows + 1).
    ``positions``   ``[local_tokens]`` int64: for each local token, its index in
                    the padded packed batch (to slice other per-token tensors
                    the same way).
    ``rollout_ids`` the samples' rollout ids when the caller gave them (they name
                    a sample in the driver's errors), else ``None``.
    """

    per_layer: list[Any]
    layer_ids: tuple[int, ...]
    cu_seqlens: npt.NDArray[np.int32]
    seqlens: npt.NDArray[np.int32]
    positions: npt.NDArray[np.int64]
    rollout_ids: tuple[str, ...] | None = None

    @property
    def num_local_tokens(self) -> int:
        """Tokens this rank's routers see (``local_tokens``)."""
        return int(self.positions.shape[0])


def _gather_local(
    batch: Any,
    rows: npt.NDArray[np.int64],
    cu: npt.NDArray[np.int64],
    positions: npt.NDArray[np.int64],
    layer_pos: list[int],
) -> list[Any]:
    """The local tokens' rows, one int64 ``[local_tokens, K]`` array per stage layer."""
    # Gather from the unpadded rows plus one -1 sentinel row instead of building the padded batch.
    rows_cu = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
    sample = np.searchsorted(cu, positions, side="right") - 1
    offset = positions - cu[sample]
    sentinel = int(rows_cu[-1])
    source = np.where(offset < rows[sample], rows_cu[sample] + offset, sentinel)
    src = np.full((sentinel + 1, len(layer_pos), batch.topk), -1, dtype=batch.out_dtype)
    for i, arr in enumerate(batch.arrays):
        src[rows_cu[i] : rows_cu[i + 1]] = arr[:, layer_pos]
    local = src[source]  # still int16: widen per layer, only the local tokens
    return [local[:, j].astype(np.int64) for j in range(len(layer_pos))]


def _stage_layers(
    batch: Any, layer_ids: Sequence[int] | None, stage_layers: Sequence[int] | None
) -> tuple[tuple[int, ...], list[int]]:
    """This stage's MoE layer ids (ascending) and their positions in the routing."""
    if layer_ids is None:
        if batch.layer_ids is None:
            raise ShapeError("megatron_layout needs layer_ids= for plain-array routing")
        ids = batch.layer_ids
    else:
        ids = check_layer_ids(layer_ids)
        if batch.layer_ids is not None and batch.layer_ids != ids:
            raise ShapeError(
                f"layer_ids={list(ids)} but the routing covers MoE layers {list(batch.layer_ids)}"
            )
    if len(ids) != batch.num_layers:
        raise ShapeError(
            f"routing has {batch.num_layers} MoE layers but layer_ids names {len(ids)}: {list(ids)}"
        )
    if stage_layers is None:
        local_ids = ids
    else:
        wanted = [int(s) for s in stage_layers]
        missing = [s for s in wanted if s not in ids]
        if missing:
            raise ShapeError(f"stage layers {missing} are not among the MoE layer_ids {list(ids)}")
        if not wanted or len(set(wanted)) != len(wanted):
            raise ShapeError(f"stage_layers must be non-empty without repeats, got {wanted}")
        local_ids = tuple(sorted(wanted))
    return local_ids, [ids.index(lid) for lid in local_ids]


def _sp_part(positions: npt.NDArray[np.int64], tp_size: int, tp_rank: int) -> Any:
    """Sequence parallel: TP rank ``tp_rank``'s contiguous part of the CP-local tokens."""
    n_cp = positions.shape[0]
    if n_cp % tp_size:
        raise ShapeError(
            f"sequence parallel splits the {n_cp} CP-local tokens over tp_size={tp_size} "
            "ranks, which does not divide evenly; raise pad_to_multiple"
        )
    part = n_cp // tp_size
    return positions[tp_rank * part : (tp_rank + 1) * part]


def _check_rank(size: int, rank: int, name: str) -> None:
    if size < 1:
        raise ShapeError(f"{name}_size must be >= 1, got {size}")
    if not 0 <= rank < size:
        raise ShapeError(f"{name}_rank must be in [0, {size}), got {rank}")


def _cp_positions(
    cu: npt.NDArray[np.int64], padded: npt.NDArray[np.int64], cp_size: int, cp_rank: int
) -> npt.NDArray[np.int64]:
    """Packed-batch positions CP rank ``cp_rank`` keeps: per sequence, two zigzag chunks."""
    if cp_size == 1:
        return np.arange(int(cu[-1]), dtype=np.int64)
    chunk = padded // (2 * cp_size)
    firsts = (cu[:-1] + cp_rank * chunk, cu[:-1] + (2 * cp_size - 1 - cp_rank) * chunk)
    # Sequence i contributes [first_a, first_a + chunk) then [first_b, first_b + chunk).
    starts = np.stack(firsts, axis=1).reshape(-1)
    lens = np.repeat(chunk, 2)
    offsets = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    return np.repeat(starts, lens) + offsets


def megatron_layout(
    routings: Sequence[RoutingLike],
    *,
    seqlens: Sequence[int] | npt.ArrayLike,
    layer_ids: Sequence[int] | None = None,
    tp_size: int = 1,
    tp_rank: int = 0,
    cp_size: int = 1,
    cp_rank: int = 0,
    sequence_parallel: bool = False,
    stage_layers: Sequence[int] | None = None,
    pad_to_multiple: int | None = None,
    missing: Missing = "raise",
    rollout_ids: Sequence[str] | None = None,
    as_torch: bool = False,
) -> MegatronReplayBatch:
    """Per-local-MoE-layer ``[local_tokens, K]`` int64 routing for ``RouterReplay``.

    Call it once per micro-batch on every rank, with that rank's TP / CP
    coordinates and its pipeline stage's MoE layers, right before the
    forward pass; then ``RouterReplayDriver.add_micro_batch(batch)``.
    ``layer_ids`` are the absolute MoE layer ids of the routing's ``L`` axis
    (required for plain arrays; taken from :class:`Routing` inputs).

    **Lengths.**  ``seqlens`` (required) are the trainer's own per-sample token
    counts ``T_i``, before padding (what it packs; numpy, list or torch).  Sample
    ``i`` must have exactly ``T_i - 1`` rows: a partial rollout with fewer rows
    would otherwise shift every later sample, and Megatron's gather accepts the
    shorter index without an error.

    **Rows nobody shipped** (all ``-1`` inside a sample's ``T_i - 1`` rows, where
    stored segments left a gap) raise by default: Megatron has no per-token
    fallback, so the driver would replay them as experts ``0..K-1``.
    ``missing="fill"`` keeps them ``-1`` and the driver does exactly that (miles'
    rule).  ``rollout_ids`` (one per sample) name the rollout in errors, here and
    in the driver's.

    **Packing (THD).**  Sample ``i`` has ``T_i`` tokens: its ``T_i - 1`` rows
    plus one ``-1`` row for its last token, then ``-1`` rows up to a multiple of
    ``pad_to_multiple`` (default ``2 * tp_size * cp_size`` when ``cp_size > 1``,
    else ``tp_size`` with ``sequence_parallel``, else 1; pass the multiple your
    trainer packs with if it differs -- verl pads to ``tp_size`` whenever
    ``cp_size == 1``).  Samples are concatenated; the padded lengths give
    ``cu_seqlens``.

    **Context parallel** (``cp_size > 1``).  Each padded sequence is cut into
    ``2 * cp_size`` equal chunks; CP rank ``r`` keeps chunks ``r`` and
    ``2*cp_size - 1 - r`` (Megatron's load-balanced zigzag), sequence by
    sequence.

    **Sequence parallel.**  The CP-local token axis is split into ``tp_size``
    equal contiguous parts; TP rank ``t`` keeps part ``t`` (without sequence
    parallel every TP rank's router sees all CP-local tokens).

    **Pipeline.**  ``stage_layers`` lists the absolute MoE layer ids this
    stage (all its virtual-pipeline chunks) owns, default all of
    ``layer_ids``; ``per_layer`` holds those layers in ascending order.

    Raises :class:`ShapeError` for inconsistent routing, a sample whose rows are
    not ``seqlens[i] - 1``, rows nobody shipped (unless ``missing="fill"``), a
    padded length not divisible by ``2 * cp_size``, a CP-local token count not
    divisible by ``tp_size`` under sequence parallel, or a stage layer that is not
    in ``layer_ids``.  ``as_torch=True`` returns CPU ``torch.int64`` tensors.
    Worked examples of each split: docs/layouts.md ("Megatron-Core: megatron_layout").
    """
    batch = _collect(routings, "megatron_layout", rollout_ids)
    _check_rank(tp_size, tp_rank, "tp")
    _check_rank(cp_size, cp_rank, "cp")
    local_ids, layer_pos = _stage_layers(batch, layer_ids, stage_layers)
    tokens = _lengths(seqlens, "seqlens", len(batch.arrays))
    _check_rows_match_tokens(batch, tokens, "the trainer's seqlens")
    for i, arr in enumerate(batch.arrays):
        # fill=None: "fill" keeps -1 there; the driver replays 0..K-1 on the device.
        uncovered(arr, batch.routing_name(i), missing, None)
    if pad_to_multiple is None:
        multiple = 2 * tp_size * cp_size if cp_size > 1 else (tp_size if sequence_parallel else 1)
    else:
        multiple = int(pad_to_multiple)
        if multiple < 1:
            raise ShapeError(f"pad_to_multiple must be >= 1, got {multiple}")
    rows = tokens - 1
    padded = -(-tokens // multiple) * multiple
    if cp_size > 1 and (padded % (2 * cp_size)).any():
        raise ShapeError(
            f"context parallel needs every padded sequence divisible by 2*cp_size={2 * cp_size}; "
            f"pad_to_multiple={multiple} gives lengths {padded.tolist()}"
        )
    cu = np.concatenate([[0], np.cumsum(padded)]).astype(np.int64)
    positions = _cp_positions(cu, padded, cp_size, cp_rank)
    if sequence_parallel:
        positions = _sp_part(positions, tp_size, tp_rank)
    per_layer: list[Any] = _gather_local(batch, rows, cu, positions, layer_pos)
    if as_torch:
        import torch  # lazy: numpy users need not install torch

        per_layer = [torch.from_numpy(a) for a in per_layer]
    return MegatronReplayBatch(
        per_layer=per_layer,
        layer_ids=local_ids,
        cu_seqlens=cu.astype(np.int32),
        seqlens=tokens.astype(np.int32),
        positions=positions,
        rollout_ids=batch.rollout_ids,
    )
