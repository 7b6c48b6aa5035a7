"""Redis as a test or benchmark reaches it (an admin connection, the bytes Redis sent), and
stored frames as found there: whole (one field) or chunked (the head in
the segment's field, a field per chunk: docs/store.md, "Layout"), read as one frame and
written back in the layout they were found in (damage planted at rest)."""

from __future__ import annotations

from typing import Any

import redis

from r3_client import read_header
from r3_client.wire import is_frame_head, parse_chunk_field


def admin_redis(url: str) -> redis.Redis | redis.RedisCluster:
    """An admin connection to the Redis (or the Redis Cluster a node of which) is at ``url``:
    what a bad disk or a tenant's write path would touch."""
    probe = redis.Redis.from_url(url)
    try:
        clustered = int(probe.info("cluster").get("cluster_enabled", 0)) == 1
    finally:
        probe.close()
    return (redis.RedisCluster if clustered else redis.Redis).from_url(url)


def redis_sent(url: str) -> int:
    """Bytes the Redis at ``url`` has sent its clients so far (``INFO stats``)."""
    conn = redis.Redis.from_url(url)
    try:
        return int(conn.info("stats")["total_net_output_bytes"])
    finally:
        conn.close()


def read_stored(conn: Any, key: str, field: str) -> tuple[bytes, list[tuple[bytes, int, int]]]:
    """The frame stored in ``field`` of hash ``key`` (a chunked one's chunks joined back),
    and where its chunks lie when chunked (``(chunk field, offset, length)`` in the frame;
    empty when whole)."""
    value = conn.hget(key, field)
    assert isinstance(value, bytes)
    if not is_frame_head(value):
        return value, []
    hdr = read_header(value, head=True)
    a, b = (
        int(x) for x in (field.split(":")[1:3] if field.startswith("s:") else (hdr.start, hdr.end))
    )
    chunks: dict[int, tuple[bytes, bytes]] = {}
    for name in conn.hkeys(key):
        got = parse_chunk_field(name)
        if got is not None and (got.seg_start, got.seg_end) == (a, b):
            chunks[got.index] = (name, conn.hget(key, name))
    assert sorted(chunks) == list(range(len(hdr.chunks))), "a chunk field is missing"
    body = b"".join(chunks[i][1] for i in sorted(chunks))
    frame = value[:-4] + body + value[-4:]
    at = len(value) - 4
    where = []
    for i in sorted(chunks):
        where.append((chunks[i][0], at, len(chunks[i][1])))
        at += len(chunks[i][1])
    return frame, where


def write_stored(
    conn: Any, key: str, field: str, frame: bytes, where: list[tuple[bytes, int, int]]
) -> None:
    """Write ``frame`` (same length as the one read) back into ``field`` in the layout
    :func:`read_stored` found: whole, or cut at the same places into head and chunks."""
    if not where:
        conn.hset(key, field, frame)
        return
    body_at = where[0][1]
    conn.hset(key, field, frame[:body_at] + frame[-4:])
    for name, at, length in where:
        conn.hset(key, name, frame[at : at + length])
