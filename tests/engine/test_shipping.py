"""sglang_r3.http_server.shipping: rows are validated before they are stored, and
labelled by the weight version that computed them."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_r3.config import EngineConfig
from sglang_r3.errors import R3RequestError
from sglang_r3.http_server.shipping import Shipper, version_at, version_runs
from sglang_r3.http_server.tagging import OutputTag
from tests.support.engine_requests import SHAPE, b64
from tests.support.service_process import KEY_A, Service


@pytest.mark.parametrize("bad", ["zeros", "duplicate", "out_of_range"])
async def test_invalid_engine_rows_are_refused_not_stored(engine_cache: Service, bad: str) -> None:
    """A never-written slot (all zeros), a repeated expert or an id >= E: 500, nothing stored.

    The real engine does not produce these on demand, so the rows are crafted here.
    """
    from r3_client import AsyncRoutingClient, RolloutNotFoundError

    cfg = EngineConfig(routing_cache=engine_cache.http_url, api_key=KEY_A)
    shipper = Shipper(cfg, SHAPE, "tiny")
    rows = np.tile(np.array([1, 2], np.int32), (9, 3, 1))
    if bad == "zeros":
        rows[4] = 0
    elif bad == "duplicate":
        rows[4, 1] = [3, 3]
    else:
        rows[4, 2] = [1, 8]
    tag = OutputTag(0, 0, f"guard-{bad}", "", False, False)
    with pytest.raises(R3RequestError) as err:
        await shipper.ship(tag, 0, b64(rows), list(range(3, 8)), list(range(8, 13)), {})
    assert err.value.status_code == 500 and "failed validation" in str(err.value)
    async with AsyncRoutingClient(engine_cache.http_url, api_key=KEY_A) as client:
        with pytest.raises(RolloutNotFoundError):
            await client.stat(f"guard-{bad}")
    await shipper.client.aclose()


def test_rows_are_labelled_by_the_weight_version_that_computed_them() -> None:
    # No span, or one version: the default (the tag's version, else the engine's).
    assert version_runs({}, 10, "tag") == ((0, "tag"),)
    one = [{"version": "e1", "start": 0, "end": 5}]
    assert version_runs({"weight_versions": one}, 10, "tag") == ((0, "tag"),)
    # Output token a was sampled from position P + a - 1: that row starts the next run.
    spans = [
        {"version": "e1", "start": 0, "end": 3},
        {"version": "e2", "start": 3, "end": 7},
        {"version": "e3", "start": 7, "end": 9},
    ]
    runs = version_runs({"weight_versions": spans}, 10, "tag")
    assert runs == ((0, "e1"), (12, "e2"), (16, "e3"))
    assert [version_at(runs, r) for r in (0, 11, 12, 15, 16, 40)] == [
        "e1",
        "e1",
        "e2",
        "e2",
        "e3",
        "e3",
    ]
    shipper_tag = OutputTag(0, 0, "r", "", False, True)
    # Cuts: the prompt's end (shared) and each version boundary inside [start, end).
    assert Shipper._cuts(shipper_tag, 0, 9, 18, runs) == [0, 9, 12, 16, 18]
    assert Shipper._cuts(shipper_tag, 13, 9, 15, runs) == [13, 15]
    # A later turn's new prompt part is not split off (only a first turn's prompt is).
    assert Shipper._cuts(shipper_tag, 5, 9, 11, runs) == [5, 11]
