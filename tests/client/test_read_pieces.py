"""``read_pieces``: where each row of a ranged read comes from once its views are applied.

A reader reads each piece from its source (the segments, or the view that wins it) and so
receives every row once; the pieces must tile the range and name, for each row, the last
applied view that holds it (else the segments), and applying only the views that win a
piece must answer what applying all of them answers.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from r3_client import ViewInfo
from r3_client._views import piece_sources, read_pieces

_view = st.tuples(st.integers(0, 60), st.integers(-5, 60))  # start, length (<= 0: empty)
_views = st.lists(_view, max_size=6).map(
    lambda spans: [ViewInfo(100 + i, a, a + n, "w", 1) for i, (a, n) in enumerate(spans)]
)
_range = st.tuples(st.integers(0, 70), st.integers(-3, 40))  # start, length


def _source(views: list[ViewInfo], row: int) -> ViewInfo | None:
    won = None
    for v in views:
        if v.start <= row < v.end:
            won = v
    return won


@given(views=_views, span=_range)
def test_pieces_tile_the_range_and_name_each_rows_source(
    views: list[ViewInfo], span: tuple[int, int]
) -> None:
    start, end = span[0], span[0] + span[1]
    pieces = read_pieces(views, start, end)
    if end <= start:
        assert pieces == []
        return
    assert pieces[0][1] == start and pieces[-1][2] == end
    at = start
    for i, (source, a, b) in enumerate(pieces):
        assert a == at and a < b  # contiguous, none empty
        at = b
        for row in range(a, b):
            assert _source(views, row) is source, (row, source)
        if i:  # adjacent pieces of one source are merged
            assert pieces[i - 1][0] is not source


@given(views=_views, span=_range)
def test_applying_the_winning_views_answers_what_all_of_them_answer(
    views: list[ViewInfo], span: tuple[int, int]
) -> None:
    start, end = span[0], span[0] + max(1, span[1])
    first = np.arange(start, end)  # each row's first computation
    rows = {v.serves: np.arange(v.start, max(v.start, v.end)) + 1000 * v.serves for v in views}

    def applied(vs: tuple[ViewInfo, ...] | list[ViewInfo]) -> np.ndarray:
        out = first.copy()
        for v in vs:
            a, b = max(v.start, start), min(v.end, end)
            if a < b:
                out[a - start : b - start] = rows[v.serves][a - v.start : b - v.start]
        return out

    won = piece_sources(views, start, end)
    assert [v.serves for v in won] == sorted(v.serves for v in won)  # their order kept
    np.testing.assert_array_equal(applied(won), applied(views))
    # ... and each row read once from its piece's source is that answer too
    once = np.empty_like(first)
    for source, a, b in read_pieces(views, start, end):
        src = first[a - start : b - start] if source is None else rows[source.serves]
        once[a - start : b - start] = (
            src if source is None else src[a - source.start : b - source.start]
        )
    np.testing.assert_array_equal(once, applied(views))


def test_a_later_view_covering_an_earlier_one_hides_it() -> None:
    """Two pushes: the second view recomputes every row of the first; a read in the
    last state reads no row of the first view and none of the segments it covers."""
    v1, v2 = ViewInfo(40, 0, 40, "w2", 1), ViewInfo(100, 0, 100, "w3", 1)
    assert read_pieces([v1, v2], 0, 150) == [(v2, 0, 100), (None, 100, 150)]
    assert piece_sources([v1, v2], 0, 150) == (v2,)
    assert read_pieces([v1], 30, 60) == [(v1, 30, 40), (None, 40, 60)]
    inner = ViewInfo(60, 10, 20, "w", 1)
    assert read_pieces([v1, inner], 0, 50) == [
        (v1, 0, 10),
        (inner, 10, 20),
        (v1, 20, 40),
        (None, 40, 50),
    ]
    assert read_pieces([], 5, 9) == [(None, 5, 9)]
