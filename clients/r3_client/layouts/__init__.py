"""Collate per-rollout routing into each trainer's batch layout, or one rank's part of it.

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

**One rank's part.**  On a Megatron trainer each rank's routers see only some
tokens (its CP / TP slice of the packed micro-batch) at some layers (its pipeline
stage).  :func:`megatron_layout` and :func:`verl_rank_slice` build exactly that part,
reading only the rank's own rows; each equals slicing the whole batch's layout the
way the trainer's own code does (``tests/client/test_layout_slices.py`` drives verl's
and Megatron-Core's slicing functions to check it).

Numpy layouts are ``int16`` (``int32`` when an expert id does not fit in int16,
and always for miles); the per-rank targets are ``int64``, which
``RouterReplay`` wants.  See ``docs/layouts.md``.

This package ``__init__`` is the public surface; one module per consumer below it
(each imports only ``_rows`` and ``_packing``):

* :mod:`~r3_client.layouts._rows` -- validation of a batch, the layer axis, rows nobody shipped;
* :mod:`~r3_client.layouts._packing` -- packed (THD) batches, CP / SP / stage splits;
* :mod:`~r3_client.layouts.verl` -- :func:`verl_layout`, :func:`verl_rank_slice`,
  :func:`verl_rank_plan` (the rows a rank needs, from lengths alone);
* :mod:`~r3_client.layouts.samples` -- :func:`slime_layout`, :func:`miles_layout`;
* :mod:`~r3_client.layouts.hf` -- :func:`hf_layout`;
* :mod:`~r3_client.layouts.megatron` -- :func:`megatron_layout`, :func:`megatron_rank_plan`.
"""

from r3_client.layouts._packing import RankPlan
from r3_client.layouts._rows import Missing, RoutingLike
from r3_client.layouts.hf import hf_layout
from r3_client.layouts.megatron import MegatronReplayBatch, megatron_layout, megatron_rank_plan
from r3_client.layouts.samples import miles_layout, slime_layout
from r3_client.layouts.verl import (
    VerlRank,
    VerlRankPlan,
    VerlRankSlice,
    verl_layout,
    verl_rank_plan,
    verl_rank_slice,
)

__all__ = [
    "MegatronReplayBatch",
    "Missing",
    "RankPlan",
    "RoutingLike",
    "VerlRank",
    "VerlRankPlan",
    "VerlRankSlice",
    "hf_layout",
    "megatron_layout",
    "megatron_rank_plan",
    "miles_layout",
    "slime_layout",
    "verl_layout",
    "verl_rank_plan",
    "verl_rank_slice",
]
