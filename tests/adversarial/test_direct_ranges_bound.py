"""``DirectReader.get_ranges`` holds what its workers hold, whatever the reads (issue 42, defect 7).

A rank may name one rollout in many reads.  Before the fix the reader submitted a decode
job for every read of a rollout as soon as its hash arrived, so a caller that consumed
lazily found the reader holding one future (then one decoded answer) per read: +33 MiB
at 10^4 reads, +199 MiB at 10^5, where the service path stays flat.  Now at most
``2 x workers`` answers wait, a rollout's frames are dropped after its last read (reads
are taken in windows naming at most ``_range_window`` rollouts, each read once per window
it is named in), and every rollout is still read once per call when fewer are named.
Checked against a real service with direct reads on, over a passworded ``redis-server``.
"""

from __future__ import annotations

import gc
import itertools
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from r3_client import DirectReader, InvalidRequestError, RolloutNotFoundError, Routing
from r3_client.synthetic import synthetic_routing
from tests.support.frames import LAYERS, TRAJ, E, K, frame_for, rid
from tests.support.service_process import KEY_A, Service

MIB = 1 << 20
SPAN = 3  # rows per read
OTHER = synthetic_routing(200, len(LAYERS), E, K, skew=1.0, seed=11)


def _put(svc: Service, rows: np.ndarray) -> str:
    key = rid()
    with svc.http() as c:
        resp = c.put(f"/v1/rollouts/{key}/segments", content=frame_for(rows, 0, digest=False))
        assert resp.status_code in (200, 201), resp.text
    return key


@pytest.fixture(scope="module")
def stored(service_single: Service) -> dict[str, np.ndarray]:
    """Two rollouts (300 and 200 rows), by id."""
    return {_put(service_single, TRAJ): TRAJ, _put(service_single, OTHER): OTHER}


@pytest.fixture
def reader(service_single: Service) -> Iterator[DirectReader]:
    with DirectReader.from_service(service_single.http_url, api_key=KEY_A) as r:
        yield r


def _small_reads(key: str, rows: int, n: int) -> list[tuple[str, int, int]]:
    starts = itertools.cycle(range(0, rows - SPAN + 1, SPAN))
    return [(key, a, a + SPAN) for a in itertools.islice(starts, n)]


def _right(got: Any, rows: np.ndarray, a: int, b: int, layers: list[int] | None = None) -> None:
    assert isinstance(got, Routing), got
    chosen = LAYERS if layers is None else tuple(sorted(layers))  # in the stored order
    want = rows[a:b][:, [LAYERS.index(x) for x in chosen]]
    assert got.start == a and got.end == b
    assert got.layer_ids == chosen
    np.testing.assert_array_equal(np.sort(got.indices, -1), np.sort(want, -1))


def _held_after_first(reader: DirectReader, reads: list[tuple[str, int, int]]) -> int:
    """Heap bytes the reader holds once its first answer is taken, the rest not consumed."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        it = reader.get_ranges(reads, workers=2)
        next(it)
        time.sleep(0.3)  # the decode workers run ahead as far as they may
        grown = tracemalloc.get_traced_memory()[0] - base
        del it  # its last reference: the generator is closed
    finally:
        tracemalloc.stop()
    return grown


def test_a_lazy_caller_finds_the_reader_holding_the_same_at_1e3_and_1e5_reads(
    reader: DirectReader, stored: dict[str, np.ndarray]
) -> None:
    key = next(iter(stored))
    few = _held_after_first(reader, _small_reads(key, 300, 1_000))
    many = _held_after_first(reader, _small_reads(key, 300, 100_000))
    # What remains per read is the call's own list of (id, start, end): under 100 B a
    # read; before the fix ~2 KB a read (a future, then a decoded answer, for each).
    assert many - few < 12 * MIB, (few / MIB, many / MIB)


def test_consuming_every_read_peaks_where_a_few_reads_do(
    reader: DirectReader, stored: dict[str, np.ndarray]
) -> None:
    key = next(iter(stored))

    def peak(n: int) -> int:
        reads = _small_reads(key, 300, n)
        gc.collect()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            for m, ((_, a, b), (_, got)) in enumerate(
                zip(reads, reader.get_ranges(reads, workers=2), strict=True)
            ):
                if m % 997 == 0:
                    _right(got, TRAJ, a, b)
                if m % 64 == 0:
                    time.sleep(0.001)  # a slow consumer: the workers may run ahead
            return tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()

    few, many = peak(200), peak(3_000)
    assert many - few < 2 * MIB, (few / MIB, many / MIB)


def test_answers_are_exact_in_order_with_errors_per_read(
    reader: DirectReader, stored: dict[str, np.ndarray]
) -> None:
    a_key, b_key = stored
    missing = rid()
    rng = np.random.default_rng(5)
    reads: list[tuple[str, int, int]] = []
    for _ in range(1_500):
        key = str(rng.choice([a_key, b_key, missing], p=[0.65, 0.3, 0.05]))
        n = stored[key].shape[0] if key in stored else 50
        lo = int(rng.integers(0, n))
        hi = lo + int(rng.integers(1, 8))
        reads.append((key, lo, hi))  # hi may pass the rollout's rows: an error
    got = list(reader.get_ranges(reads, layers=[LAYERS[2], LAYERS[0]], return_errors=True))
    assert [r for r, _ in got] == [r for r, _, _ in reads]
    outside = 0
    for (key, lo, hi), (_, ans) in zip(reads, got, strict=True):
        if key == missing:
            assert isinstance(ans, RolloutNotFoundError), ans
        elif hi > stored[key].shape[0]:
            assert isinstance(ans, InvalidRequestError) and "outside rollout" in str(ans)
            outside += 1
        else:
            _right(ans, stored[key], lo, hi, [LAYERS[2], LAYERS[0]])
    assert outside
    with pytest.raises(RolloutNotFoundError):
        list(reader.get_ranges([(a_key, 0, 1), (missing, 0, 1)]))


def _counting(reader: DirectReader, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The rollout keys ``reader`` reads from Redis, in order (whole hashes, ``_read``, or
    the fields ranged reads need, ``_read_wanted``)."""
    keys: list[str] = []
    real, real_wanted = reader._read, reader._read_wanted

    def read(batch: list[str]) -> list[dict[bytes, Any]]:
        keys.extend(batch)
        return real(batch)

    def read_wanted(batch: list[str], wants: Any) -> Any:
        keys.extend(batch)
        return real_wanted(batch, wants)

    monkeypatch.setattr(reader, "_read", read)
    monkeypatch.setattr(reader, "_read_wanted", read_wanted)
    return keys


def test_each_rollout_is_read_once_per_call_however_its_reads_interleave(
    reader: DirectReader, stored: dict[str, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    a_key, b_key = stored
    keys = _counting(reader, monkeypatch)
    reads = [
        r
        for pair in zip(
            _small_reads(a_key, 300, 1_000), _small_reads(b_key, 200, 1_000), strict=True
        )
        for r in pair
    ]
    for (key, lo, hi), (got_key, got) in zip(reads, reader.get_ranges(reads), strict=True):
        assert got_key == key
        if lo % 31 == 0:
            _right(got, stored[key], lo, hi)
    assert sorted(keys) == sorted([reader.key(a_key), reader.key(b_key)])


def test_past_the_window_a_rollout_named_again_is_read_again_not_held(
    reader: DirectReader, stored: dict[str, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """At most ``_range_window`` rollouts are held: reads cycling over more rollouts than
    that read each one once per window it is named in, never once per read."""
    a_key, b_key = stored
    monkeypatch.setattr(DirectReader, "_range_window", 1)
    keys = _counting(reader, monkeypatch)
    reads = [(a_key, 0, 3), (a_key, 3, 6), (b_key, 0, 3), (b_key, 9, 12), (a_key, 6, 9)] * 3
    got = list(reader.get_ranges(reads, chunk_size=2))
    for (key, lo, hi), (got_key, ans) in zip(reads, got, strict=True):
        assert got_key == key
        _right(ans, stored[key], lo, hi)
    ka, kb = reader.key(a_key), reader.key(b_key)
    assert keys == [ka, kb, ka, kb, ka, kb, ka]  # (a a)(b b)(a a a)(b b)(a a a)(b b)(a)
