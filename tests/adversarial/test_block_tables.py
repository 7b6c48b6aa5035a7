"""Stored frames have the format's block table, and the service parses a stored header
once, not per request.

Before issue 25 a frame of 250,000 one-row blocks (a 1 MB header) was stored with 201,
and every ranged GET re-parsed that header: 0.90 s of service CPU per GET against
0.0028 s for the same rows in 2,048-row blocks.  Now a stored frame's blocks are
``BLOCK_ROWS`` rows each (the last may be shorter), so its header grows with its data,
and parsed headers are kept by content digest.  Since issue 44 the writer's default is 512
rows and the store also takes 2,048-row blocks, what writers before it wrote
(``STORED_BLOCK_ROWS``); nothing else.
"""

from __future__ import annotations

import pytest

from cache_service.store.header_cache import HeaderCache
from r3_client import Segment, encode_frame, read_header, token_digest
from r3_client.codec.frame import BLOCK_ROWS, STORED_BLOCK_ROWS
from r3_client.synthetic import synthetic_routing
from tests.support.frames import LAYERS, E, rid
from tests.support.service_process import Service


def _frame(rows: int, block_rows: int | None, seed: int = 1) -> bytes:
    idx = synthetic_routing(rows, len(LAYERS), E, 4, seed=seed)
    seg = Segment(0, rows, "blocks", "v1", token_digest(range(rows + 1)))
    return encode_frame(idx, num_experts=E, layer_ids=LAYERS, segment=seg, block_rows=block_rows)


@pytest.mark.parametrize("block_rows", [1, 100, BLOCK_ROWS // 2, BLOCK_ROWS * 2, 4096])
def test_a_frame_with_a_non_canonical_block_table_is_refused_at_put(
    service_single: Service, block_rows: int
) -> None:
    frame = _frame(5000, block_rows)
    with service_single.http() as c:
        resp = c.put(f"/v1/rollouts/{rid()}/segments", content=frame)
    assert resp.status_code == 400, resp.text
    message = resp.json()["error"]["message"]
    assert "512 or 2048 rows each" in message and "block_rows" in message, message


@pytest.mark.parametrize("rows", [1, BLOCK_ROWS, BLOCK_ROWS + 1, 3 * BLOCK_ROWS - 5, 5000])
@pytest.mark.parametrize("block_rows", [None, *STORED_BLOCK_ROWS])
def test_canonical_block_tables_are_stored(
    service_single: Service, rows: int, block_rows: int | None
) -> None:
    frame = _frame(rows, block_rows, seed=rows)
    size = BLOCK_ROWS if block_rows is None else block_rows
    assert read_header(frame).blocks[:-1] == (size,) * (len(read_header(frame).blocks) - 1)
    with service_single.http() as c:
        assert c.put(f"/v1/rollouts/{rid()}/segments", content=frame).status_code == 201


def test_the_header_cache_parses_each_stored_header_once() -> None:
    cache = HeaderCache(max_bytes=1 << 20)
    frame = _frame(300, None)
    first = cache.header(frame)
    assert cache.header(bytes(frame)) is first  # the same bytes: the parsed header, kept
    assert cache.parses == 1
    other = _frame(300, None, seed=2)
    assert cache.header(other) is not first and cache.parses == 2
    assert cache.header(other).chunks == read_header(other).chunks
    # Bounded by header bytes: a cache too small for two headers keeps the newest.
    small = HeaderCache(max_bytes=len(frame) - read_header(frame).body_length + 16)
    small.header(frame)
    small.header(other)
    assert small.header(frame) is not first and small.parses == 3
