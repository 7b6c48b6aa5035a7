"""The logical routing format: typed objects and their validation.

A rollout's routing is an integer array ``[T-1, L, K]``: one row per token
position ``0 … T-2`` of the whole trajectory (the last token never went through
a forward pass), ``L`` MoE layers only (their absolute decoder-layer ids are
kept in ``layer_ids``), ``K`` = top-k.  ``-1`` fills a whole row where no route
was recorded; trainers fall back to native routing there.  Padding is never 0.

Within a row, order carries no meaning: a row is the *set* of experts the
router picked.  The ``raw`` codec keeps whatever order it was given; the ``set``
codecs return a canonical order (see :mod:`r3_client.codec`).  Every consumer in this
project treats rows as sets.
"""

from __future__ import annotations

import hashlib
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from r3_client._exceptions import (
    DuplicateExpertError,
    ExpertIdError,
    FormatError,
    InvalidRequestError,
    PartialRowError,
    ShapeError,
    quote_items,
)
from r3_client._kernels import native as _native
from r3_client._kernels.sortnet import sort_rows

__all__ = [
    "MAX_EXPERTS",
    "MAX_TOPK",
    "Routing",
    "Segment",
    "canonical_rows",
    "check_rollout_id",
    "check_text",
    "index_dtype",
    "token_digest",
    "validate_indices",
]

#: Largest expert count the format accepts (the ``raw`` codec's uint16 keeps 65535 for -1).
MAX_EXPERTS = 65535
#: Largest top-k the format accepts.
MAX_TOPK = 64
#: Largest MoE layer id the format accepts.
MAX_LAYER_ID = 65535

_DIGEST_RE = re.compile(r"[0-9a-f]{64}")
_MAX_TEXT = 256
_ROLLOUT_ID_RE = re.compile(r"[A-Za-z0-9_.:@+=-]{1,200}")
#: The rollout id rule in words, for error messages and docs.
ROLLOUT_ID_RULE = "1-200 characters from A-Z a-z 0-9 _ . : @ + = -, and not '.' or '..'"


def check_rollout_id(rollout_id: object) -> str:
    """Return ``rollout_id`` or raise :class:`InvalidRequestError` saying what is allowed.

    The one rule every part applies (client before any I/O, service, engine tags):
    characters that need no escaping in a URL path segment or a Redis key, and
    never a dot segment (``.``/``..``), which HTTP clients and proxies rewrite.
    """
    if (
        not isinstance(rollout_id, str)
        or not _ROLLOUT_ID_RE.fullmatch(rollout_id)
        or rollout_id in (".", "..")
    ):
        shown = repr(rollout_id)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        raise InvalidRequestError(f"invalid rollout id {shown}: use {ROLLOUT_ID_RULE}")
    return rollout_id


def index_dtype(num_experts: int) -> np.dtype[Any]:
    """The dtype decoded routing uses: int16 while ids and -1 fit, else int32."""
    return np.dtype(np.int16) if num_experts <= np.iinfo(np.int16).max else np.dtype(np.int32)


def token_digest(token_ids: Sequence[int] | npt.NDArray[np.integer[Any]]) -> str:
    """SHA-256 (hex) of token ids as little-endian uint32.

    A segment's digest covers the token prefix ``tokens[0:end]``: under causal
    attention the rows of ``[start, end)`` depend on every token before ``end``,
    so two segments with equal digests (and model and weight version) were
    computed from identical inputs.
    """
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ShapeError(f"token ids must be 1-D, got shape {arr.shape}")
    if arr.size and (not np.issubdtype(arr.dtype, np.integer) or arr.min() < 0):
        raise ShapeError("token ids must be non-negative integers")
    if arr.size and arr.max() > np.iinfo(np.uint32).max:
        raise ShapeError("token ids must fit in uint32")
    return hashlib.sha256(arr.astype("<u4").tobytes()).hexdigest()


#: The largest weight version a drop by version compares: 15 decimal digits (exact in the
#: doubles of Redis's Lua, where the versions are compared).
MAX_WEIGHT_VERSION = 10**15 - 1


def check_weight_version(upto: object) -> int:
    """``upto`` as a weight version a drop compares (a decimal integer, 0 ..
    :data:`MAX_WEIGHT_VERSION`, given as an int or its digits); :class:`InvalidRequestError`
    saying why otherwise (the one rule the client, before any I/O, and the service apply)."""
    if isinstance(upto, str) and re.fullmatch(r"[0-9]{1,15}", upto):
        return int(upto)
    if isinstance(upto, int) and not isinstance(upto, bool) and 0 <= upto <= MAX_WEIGHT_VERSION:
        return upto
    shown = repr(upto)[:40]
    raise InvalidRequestError(
        f"weight version {shown} is not one a drop can compare: a decimal integer from 0 to "
        f"{MAX_WEIGHT_VERSION} (the step counter verl, slime, miles and AReaL write)"
    )


def check_text(name: str, value: object) -> str:
    """Return ``value`` if it is a printable string of at most 256 characters, else raise
    :class:`FormatError` (the rule for a segment's ``model_id`` and ``weight_version``)."""
    if not isinstance(value, str):
        raise FormatError(f"{name} must be a string, got {type(value).__name__}")
    if len(value) > _MAX_TEXT or not value.isprintable():
        raise FormatError(f"{name} must be printable and at most {_MAX_TEXT} characters")
    return value


@dataclass(frozen=True, slots=True)
class Segment:
    """One stored piece of a rollout: rows for token positions ``[start, end)``.

    ``model_id`` and ``weight_version`` name the policy that produced the rows
    (multi-turn rollouts may span weight versions); ``tokens_digest`` is
    :func:`token_digest` of ``tokens[0:end]`` ("" when the writer did not supply
    tokens).
    """

    start: int
    end: int
    model_id: str = ""
    weight_version: str = ""
    tokens_digest: str = ""

    def __post_init__(self) -> None:
        for name in ("start", "end"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise FormatError(f"segment {name} must be an int, got {type(value).__name__}")
        if not 0 <= self.start < self.end:
            raise FormatError(
                f"segment range [{self.start}, {self.end}) is empty or negative; "
                "need 0 <= start < end"
            )
        if self.end > 2**40:
            raise FormatError(f"segment end {self.end} is implausibly large")
        check_text("model_id", self.model_id)
        check_text("weight_version", self.weight_version)
        check_text("tokens_digest", self.tokens_digest)
        if self.tokens_digest and not _DIGEST_RE.fullmatch(self.tokens_digest):
            raise FormatError("tokens_digest must be 64 lowercase hex characters (SHA-256)")

    @property
    def num_rows(self) -> int:
        """Number of token rows the segment holds."""
        return self.end - self.start

    def overlaps(self, start: int, end: int) -> bool:
        """True when ``[start, end)`` shares at least one row with this segment."""
        return self.start < end and start < self.end

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (frame headers, JSON responses)."""
        return {
            "start": self.start,
            "end": self.end,
            "model_id": self.model_id,
            "weight_version": self.weight_version,
            "tokens_digest": self.tokens_digest,
        }

    @classmethod
    def from_dict(cls, data: object) -> Segment:
        """Inverse of :meth:`to_dict`; raises :class:`FormatError` on anything else."""
        if not isinstance(data, dict):
            raise FormatError("segment must be a mapping")
        unknown = set(data) - {"start", "end", "model_id", "weight_version", "tokens_digest"}
        if unknown:
            raise FormatError(f"segment has unknown fields {sorted(map(str, unknown))}")
        try:
            return cls(**data)
        except TypeError as exc:  # missing start/end
            raise FormatError(f"segment is incomplete: {exc}") from None


def check_layer_ids(layer_ids: Sequence[int]) -> tuple[int, ...]:
    """``layer_ids`` as a tuple of ints, checked: non-empty, non-negative, strictly
    increasing, at most :data:`MAX_LAYER_ID`.  Called for every header a reader parses,
    so the common case (plain ints) is checked by C-level iteration (``map``), not a
    Python loop per id."""
    ids = tuple(layer_ids)
    if not ids:
        raise ShapeError("layer_ids must name at least one MoE layer")
    if set(map(type, ids)) == {int}:
        out = ids
    elif all(isinstance(i, int | np.integer) and not isinstance(i, bool) for i in ids):
        out = tuple(map(int, ids))
    else:
        raise ShapeError("layer_ids must be integers")
    if out[0] < 0 or not all(map(operator.lt, out, out[1:])):
        raise ShapeError(
            f"layer_ids must be non-negative and strictly increasing, got {quote_items(out)}"
        )
    if out[-1] > MAX_LAYER_ID:
        raise ShapeError(f"layer ids above {MAX_LAYER_ID} are not supported")
    return out


def check_params(num_experts: int, topk: int) -> None:
    """Raise :class:`ShapeError` unless ``1 <= topk <= num_experts <= MAX_EXPERTS``."""
    for name, v in (("num_experts", num_experts), ("topk", topk)):
        if not isinstance(v, int | np.integer) or isinstance(v, bool):
            raise ShapeError(f"{name} must be an int")
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ShapeError(f"num_experts must be in [1, {MAX_EXPERTS}], got {num_experts}")
    if not 1 <= topk <= min(MAX_TOPK, num_experts):
        raise ShapeError(
            f"topk must be in [1, min({MAX_TOPK}, num_experts={num_experts})], got {topk}"
        )


def canonical_rows(indices: npt.ArrayLike, num_experts: int) -> npt.NDArray[np.integer[Any]]:
    """Validate ``[..., K]`` routing and return it with each row sorted ascending.

    ``-1`` rows stay ``-1``.  Raises :class:`PartialRowError`,
    :class:`ExpertIdError` or :class:`DuplicateExpertError` naming the first
    offending position.  Vectorised: one sort, a few comparisons.
    """
    arr = np.asarray(indices)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ShapeError(f"routing must be an integer array, got dtype {arr.dtype}")
    if arr.ndim < 1 or arr.shape[-1] < 1:
        raise ShapeError(f"routing must have a non-empty last (top-k) axis, got {arr.shape}")
    if arr.size == 0:
        return arr.astype(index_dtype(num_experts))
    native = _native.canonical(arr, num_experts, index_dtype(num_experts))
    if native is not None:
        return native
    # The reference (and, when the compiled pass refused the rows, the exact error).
    lo, hi = arr.min(), arr.max()
    if lo < -1 or hi >= num_experts:
        bad = np.argwhere((arr < -1) | (arr >= num_experts))[0]
        raise ExpertIdError(
            f"expert id {int(arr[tuple(bad)])} at position {tuple(int(b) for b in bad)} "
            f"is outside [0, {num_experts}) and is not -1"
        )
    srt = sort_rows(arr.astype(index_dtype(num_experts), copy=False))
    if lo == -1:
        empty = srt[..., -1] == -1
        partial = (srt[..., 0] == -1) & ~empty
        if partial.any():
            bad = np.argwhere(partial)[0]
            raise PartialRowError(
                f"row {tuple(int(b) for b in bad)} mixes -1 with expert ids; "
                "-1 must fill a whole row"
            )
    dup = srt[..., 1:] == srt[..., :-1]
    if dup.size and hi >= 0:
        dup &= srt[..., 1:] != -1
        if dup.any():
            bad = np.argwhere(dup)[0]
            raise DuplicateExpertError(
                f"expert {int(srt[tuple(bad)])} appears twice in row "
                f"{tuple(int(b) for b in bad[:-1])}"
            )
    return srt


def validate_indices(
    indices: npt.ArrayLike,
    num_experts: int,
    num_layers: int | None = None,
    topk: int | None = None,
    num_rows: int | None = None,
) -> None:
    """Raise a :class:`FormatError` subclass unless ``indices`` is valid ``[R, L, K]`` routing."""
    arr = np.asarray(indices)
    if arr.ndim != 3:
        raise ShapeError(f"routing must be [tokens, layers, topk], got shape {arr.shape}")
    for axis, (name, want) in enumerate(
        (("token rows", num_rows), ("MoE layers", num_layers), ("top-k", topk))
    ):
        if want is not None and arr.shape[axis] != want:
            raise ShapeError(f"routing has {arr.shape[axis]} {name}, expected {want}")
    canonical_rows(arr, num_experts)


@dataclass(frozen=True, eq=False)
class Routing:
    """Routing for token positions ``[start, start + len(indices))`` of one rollout.

    ``indices`` is ``[rows, L, K]`` (int16 unless E > 32767), read-only.
    ``layer_ids`` are the absolute decoder-layer ids of the ``L`` MoE layers.
    ``segments`` lists the stored pieces the rows came from (empty for ad-hoc
    arrays).  Construct through :meth:`from_array` to validate.
    """

    indices: npt.NDArray[np.integer[Any]]
    num_experts: int
    layer_ids: tuple[int, ...]
    start: int = 0
    segments: tuple[Segment, ...] = field(default=())

    @classmethod
    def from_array(
        cls,
        indices: npt.ArrayLike,
        *,
        num_experts: int,
        layer_ids: Sequence[int],
        start: int = 0,
        segments: Sequence[Segment] = (),
    ) -> Routing:
        """Validate ``indices`` and wrap it (converted to :func:`index_dtype`)."""
        check_params(num_experts, int(np.shape(indices)[-1]) if np.ndim(indices) == 3 else 1)
        layers = check_layer_ids(layer_ids)
        arr = np.asarray(indices)
        validate_indices(arr, num_experts, num_layers=len(layers))
        if not isinstance(start, int) or start < 0:
            raise ShapeError(f"start must be a non-negative int, got {start!r}")
        out = np.array(arr, dtype=index_dtype(num_experts), copy=True)
        out.flags.writeable = False
        return cls(out, int(num_experts), layers, start, tuple(segments))

    @property
    def end(self) -> int:
        """One past the last token position covered."""
        return self.start + int(self.indices.shape[0])

    @property
    def num_rows(self) -> int:
        """Token rows held."""
        return int(self.indices.shape[0])

    @property
    def num_layers(self) -> int:
        """MoE layers held (``L``)."""
        return int(self.indices.shape[1])

    @property
    def topk(self) -> int:
        """Experts per token per layer (``K``)."""
        return int(self.indices.shape[2])

    def to_torch(self, dtype: Any = None) -> Any:
        """The indices as a ``torch.Tensor`` (a copy; ``dtype`` e.g. ``torch.int64``).

        Needs the ``torch`` extra.  -1 rows stay -1.
        """
        import torch  # lazy: the format itself does not need torch

        tensor = torch.from_numpy(np.array(self.indices, copy=True))
        return tensor if dtype is None else tensor.to(dtype)

    def sorted(self) -> Routing:
        """A copy with every row in ascending order (the canonical set form)."""
        srt = sort_rows(self.indices)
        srt.flags.writeable = False
        return Routing(srt, self.num_experts, self.layer_ids, self.start, self.segments)

    def same_sets(self, other: Routing) -> bool:
        """True when both hold the same expert *sets* for the same positions and layers."""
        return (
            self.num_experts == other.num_experts
            and self.layer_ids == other.layer_ids
            and self.start == other.start
            and self.indices.shape == other.indices.shape
            and bool(np.array_equal(sort_rows(self.indices), sort_rows(other.indices)))
        )

    def select(
        self,
        *,
        start: int | None = None,
        end: int | None = None,
        layers: Sequence[int] | None = None,
    ) -> Routing:
        """Rows for absolute token positions ``[start, end)`` and absolute layer ids ``layers``.

        Layers come back in ascending order, whatever order ``layers`` lists them in.

        Raises :class:`ShapeError` when the range leaves the held rows or a
        layer id is not one of ``layer_ids``.
        """
        lo = self.start if start is None else start
        hi = self.end if end is None else end
        if not self.start <= lo <= hi <= self.end:
            raise ShapeError(
                f"token range [{lo}, {hi}) is outside the held rows [{self.start}, {self.end})"
            )
        idx = self.indices[lo - self.start : hi - self.start]
        layer_ids = self.layer_ids
        if layers is not None:
            pos = layer_positions(self.layer_ids, layers)
            idx = idx[:, pos]
            layer_ids = tuple(self.layer_ids[p] for p in pos)
        segs = tuple(s for s in self.segments if s.overlaps(lo, hi))
        out = np.ascontiguousarray(idx)
        out.flags.writeable = False
        return Routing(out, self.num_experts, layer_ids, lo, segs)


def layer_positions(layer_ids: Sequence[int], wanted: Sequence[int]) -> list[int]:
    """Positions, in ascending layer order, of the absolute layer ids ``wanted``.

    A subset always comes back in the stored (ascending) layer order whatever
    order it was asked in, so the result is itself valid routing.  Raises
    :class:`ShapeError` for an id that is not a stored MoE layer or for a
    repeated id.
    """
    where = {lid: i for i, lid in enumerate(layer_ids)}
    wanted = [int(w) for w in wanted]
    if not wanted:
        raise ShapeError("layer subset is empty")
    seen: set[int] = set()
    for w in wanted:
        if w in seen:
            raise ShapeError(f"layer subset repeats id {w}: {quote_items(wanted)}")
        seen.add(w)
    missing = [w for w in wanted if w not in where]
    if missing:
        raise ShapeError(
            f"layers {quote_items(missing)} are not MoE layers of this rollout "
            f"{quote_items(layer_ids)}"
        )
    return sorted(where[w] for w in wanted)
