"""The Redis segment store: rollouts as atomically-written, stitched segments.

:class:`SegmentStore` (``segment_store``: connecting, puts, touches, rewinds) is put
together from ``lifecycle`` (deletes: one, many, and a namespace's rollouts up to a weight
version), ``reads`` (frames, stats, memory; parsed headers kept by ``header_cache``),
``grants`` (direct reads' Redis users), ``durability`` (durable writes, the start-up
check) and ``base`` (client, Lua scripts, namespace, keys, the translation of redis-py
errors); ``settings`` holds :class:`StoreSettings` and the namespace rule.  The Lua
scripts are ``cache_service/lua/*.lua``.  The layout below (field names and values, a
frame kept whole or as head and chunks, a ranged read's cut) is :mod:`r3_client.stored`'s,
shared with :class:`~r3_client.DirectReader`: the store takes its names from there.

One Redis hash per rollout, ``<prefix>:{<rollout_id>}``, or
``<prefix>:<namespace>:{<rollout_id>}`` in a tenant's namespace
(:meth:`SegmentStore.for_namespace`); the ``{…}`` hash tag keeps every key of a
rollout in one Redis Cluster slot, so the same Lua scripts run unchanged on a single
Redis and on a cluster.  Fields:

* ``m`` — rollout meta, msgpack ``[E, K, MoE layer ids]``; every segment must agree;
* ``s:<a>:<b>`` — the frame of segment ``[a, b)``, exactly as validated on put, or
  ``@<blob key>`` for a shared segment, or (layout ``chunked``, a v3 frame of several
  chunks) the frame's head: prefix, header and trailer;
* ``k:<a>:<b>:<i>:<r0>:<r1>:<l0>:<l1>`` — chunked layout: chunk ``i`` of that frame
  (rows ``[r0, r1)``, layer ids ``l0`` … ``l1``), so a ranged read fetches only the chunks
  it needs (``r3_client.stored.fields``; docs/store.md "Layout");
* ``d:<a>:<b>`` — the writer's digest of the segment's *content* (canonical rows +
  meta), so a re-put of the same data in another codec is still recognised as a
  duplicate;
* ``h:<a>:<b>`` — segment info, msgpack ``[segment (range, model, weight version,
  token digest), codec, frame bytes, shared]``;
* ``r:<a>:<b>`` — for a *shared* segment, the blob key holding its frame, and
  ``t:<a>:<b>`` the token of the reference this rollout holds in that blob;
* ``c:<digest>`` — a format-v2 context (E, K, layer ids, relabel table), stored by the
  frame that carries it; a continuation frame names it and is refused until it is there;
* ``b`` / ``sb`` / ``n`` — total frame bytes / bytes of shared segments / segment count.

GRPO prompt dedupe: a segment put as shared (``share``; by default one from row 0) with a
token digest is stored once per (namespace, E, K, layers, range, model id, weight version,
token digest) in a blob hash ``<prefix>[:<namespace>]:blob:{<sha>}`` (fields ``f``, the
frame or its head, ``d``, its content digest, the chunk fields of a chunked frame, and one
``x:<token>`` per referencing put with ``rc`` their count) and referenced from every
rollout that puts it, so the n samples of one prompt keep one copy of the prompt's rows.
If two writers send different rows under the same share key (non-deterministic numerics),
the second keeps its own copy: sharing never changes what a rollout reads.  A reference is
taken (``put_blob.lua``) before the rollout points at the blob and released
(``unref_blob.lua``) after the pointer is gone (delete, drop, rewind, a refused put); the
release that leaves none deletes the blob, so deletes free what they remove
(docs/store.md, "GRPO prompt dedupe").  A blob's TTL is kept at least as long as that of
every rollout referencing it (refreshed on each put and touch): the backstop for a
reference a crashed writer left behind.

Durability (``StoreSettings.durability``): ``ack`` answers once Redis has applied a
write (what survives a crash is then up to that Redis's AOF policy); ``replicas``
follows every write with ``WAIT n timeout``, ``fsync`` with ``WAITAOF 1 0 timeout``
(plus ``WAIT n`` with replicas).  They are sent in one pipeline on the *same
connection* as the write (both count only what that connection wrote) and, on a
cluster, on the master that owns the key's slot.  A write that is not confirmed in
time raises :class:`StoreUnavailableError`: applied, maybe not durable, safe to
retry.  Paths that find their data already stored (a duplicate segment, a shared
blob already there) still write one unchanged field, so the retry's wait covers the
data an earlier, unconfirmed request stored.

Rules (all enforced inside one Lua script, so concurrent writers cannot race):
putting an identical segment again is a no-op; a segment overlapping a stored
one and not identical to it is a :class:`SegmentConflictError`; rows between
segments that were never written read back as ``-1``.  Every write refreshes
the rollout's TTL.
"""

from cache_service.store.segment_store import SegmentStore
from cache_service.store.settings import DURABILITY_MODES, StoreSettings, check_namespace

__all__ = ["DURABILITY_MODES", "SegmentStore", "StoreSettings", "check_namespace"]
