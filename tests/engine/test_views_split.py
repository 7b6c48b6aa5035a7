"""``http_server.views.split_computations``: an output's first computations and its views."""

from __future__ import annotations

import numpy as np

from sglang_r3.http_server.views import split_computations

L, K = 2, 2


def rows(n: int, value: int) -> np.ndarray:
    return np.full((n, L, K), value, dtype=np.uint8)


def test_a_full_cache_hit_has_no_view() -> None:
    out = split_computations(rows(20, 5), 63, 63, (63,), ())
    assert out.views == () and out.cuts == () and out.rows.shape[0] == 20


def test_a_turn_that_recomputed_its_prefix() -> None:
    final = np.concatenate([rows(63, 4), rows(20, 5)])  # rows [0, 83) as the KV holds them
    out = split_computations(final, 0, 63, (0,), ())
    assert out.cuts == () and (out.rows == 5).all() and out.rows.shape[0] == 20
    (view,) = out.views
    assert (view.start, view.end, view.serves) == (0, 63, 63) and (view.rows == 4).all()


def test_a_partial_eviction_recomputes_only_past_the_hit() -> None:
    final = np.concatenate([rows(40, 4), rows(23, 6), rows(20, 5)])
    out = split_computations(final[40:], 40, 63, (40,), ())
    (view,) = out.views
    assert (view.start, view.end) == (40, 63) and (view.rows == 6).all()


def test_a_retraction_keeps_the_first_computation_and_the_re_prefill_is_a_view() -> None:
    # Rows [0, 30) computed (1), retracted, re-prefilled from the radix hit at 10 (2),
    # then decoded to 50 (3).
    snapshot = (30, rows(30, 1))
    final = np.concatenate([rows(10, 1), rows(20, 2), rows(20, 3)])
    out = split_computations(final, 0, 0, (0, 10), (snapshot,))
    assert out.cuts == (30,)
    assert (out.rows[:30] == 1).all() and (out.rows[30:] == 3).all()
    (view,) = out.views
    assert (view.start, view.end, view.serves) == (10, 30, 30) and (view.rows == 2).all()


def test_two_retractions_and_a_stored_prefix() -> None:
    # Stored [0, 20); epoch 0 recomputed from 15 and ran to 30; epoch 1 from 0 to 40;
    # epoch 2 from 35 to the end, 50.
    snap1 = (30, np.concatenate([rows(15, 9), rows(15, 1)]))
    snap2 = (40, np.concatenate([rows(40, 2)]))
    final = np.concatenate([rows(35, 2), rows(15, 3)])
    out = split_computations(final, 0, 20, (15, 0, 35), (snap1, snap2))
    assert out.cuts == (30, 40)
    assert (out.rows[:10] == 1).all()  # [20, 30): epoch 0
    assert (out.rows[10:20] == 2).all()  # [30, 40): epoch 1
    assert (out.rows[20:] == 3).all()  # [40, 50): epoch 2
    spans = [(v.start, v.end, v.serves, int(v.rows.max())) for v in out.views]
    assert spans == [(15, 20, 20, 1), (0, 30, 30, 2), (35, 40, 40, 3)]
