"""Rewinding a rollout: a driver that lost the answer to a turn the engine stored goes on.

Frameworks time out and abort requests routinely.  When the engine finished a turn
and stored its rows but the driver never got the tokens, every retry of that turn
conflicts with the stored rows (409) and, before issue 26, nothing let the driver
recover: the rollout was dead.  Now it rewinds to the rows it knows it holds and
sends the turn again.  Against the real service, over both transports.
"""

from __future__ import annotations

import asyncio

import pytest

from r3_client import (
    AsyncRoutingClient,
    InvalidRequestError,
    RolloutNotFoundError,
    RoutingClient,
    SegmentConflictError,
)
from tests.support.frames import TRAJ, frame_for, rid, same_sets
from tests.support.service_process import KEY_A, Service, url_of


def test_a_lost_turn_is_rewound_and_sent_again(service_single: Service, transport: str) -> None:
    r = rid()
    with RoutingClient(url_of(service_single, transport), api_key=KEY_A) as c:
        c.put(r, frame_for(TRAJ[:71], 0))  # turn 1: the driver has these rows
        c.put(r, frame_for(TRAJ[71:200], 71, version="v2"))  # turn 2: answer lost
        # The retry of turn 2 samples other tokens: it conflicts with the stored rows.
        retry = frame_for(TRAJ[100:250], 71, version="v2", digest=False)
        with pytest.raises(SegmentConflictError):
            c.put(r, retry)
        info = c.rewind(r, 71)
        assert info.num_rows == 71 and [s.segment.end for s in info.segments] == [71]
        assert info.stored_bytes == len(frame_for(TRAJ[:71], 0))
        assert c.rewind(r, 71).num_rows == 71  # idempotent
        c.put(r, retry)
        got = c.get(r)
        assert got.end == 221 and got.segments[-1].weight_version == "v2"
        assert same_sets(got.indices[71:], TRAJ[100:250])


def test_rewind_refusals(service_single: Service, transport: str) -> None:
    r = rid()
    with RoutingClient(url_of(service_single, transport), api_key=KEY_A) as c:
        c.put(r, frame_for(TRAJ[:50], 0))
        c.put(r, frame_for(TRAJ[50:120], 50))
        with pytest.raises(SegmentConflictError, match=r"segment \[50, 120\) covers rows on both"):
            c.rewind(r, 80)
        assert c.stat(r).num_rows == 120  # nothing dropped
        with pytest.raises(InvalidRequestError):
            c.rewind(r, 0)
        with pytest.raises(RolloutNotFoundError):
            c.rewind(rid(), 10)
        assert c.rewind(r, 500).num_rows == 120  # nothing past 500: nothing to drop


def test_rewind_keeps_the_store_accounts_and_shared_prompts(service_single: Service) -> None:
    """Segment count, bytes and shared bytes stay right; a shared prompt blob survives."""
    a, b = rid(), rid()

    async def run() -> None:
        async with AsyncRoutingClient(service_single.http_url, api_key=KEY_A) as c:
            for r in (a, b):
                # digest: stored once, shared; a fresh weight version gives a fresh share key
                # (a session-wide blob of another test's [0, 60) would differ and not share)
                await c.put(r, frame_for(TRAJ[:60], 0, version=a))
                await c.put(r, frame_for(TRAJ[60:90], 60, digest=False))
            before = await c.stat(a)
            assert before.shared_bytes > 0 and len(before.segments) == 2
            after = await c.rewind(a, 60)
            assert len(after.segments) == 1 and after.shared_bytes == before.shared_bytes
            assert after.stored_bytes == before.shared_bytes
            assert after.num_rows == 60
            with pytest.raises(SegmentConflictError):
                await c.rewind(a, 30)
            assert (await c.get(b)).end == 90  # the sibling keeps its rows and the blob
            assert same_sets((await c.get(a)).indices, TRAJ[:60])

    asyncio.run(run())
