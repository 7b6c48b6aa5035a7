"""``r3 get`` / ``r3 stat`` / ``r3 get-many`` as subprocesses against a real service."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from r3_client import RoutingClient
from tests.support.frames import TRAJ, frame_for, rid, same_sets
from tests.support.service_process import KEY_A, Service


def r3(svc: Service, *args: str, url: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "R3_URL": url or svc.http_url, "R3_API_KEY": KEY_A}
    return subprocess.run(
        [sys.executable, "-m", "r3_client.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_get_and_stat(service_single: Service, tmp_path: Path, transport: str) -> None:
    url = service_single.http_url if transport == "http" else f"grpc://{service_single.grpc_target}"
    r = rid()
    with RoutingClient(url, api_key=KEY_A) as c:
        c.put(r, frame_for(TRAJ[:40], 0))
    out = tmp_path / "r.npy"
    res = r3(service_single, "get", r, "-o", str(out), "--start", "5", "--layers", "3,5", url=url)
    assert res.returncode == 0, res.stderr
    arr = np.load(out)
    assert arr.shape == (35, 2, 4)
    assert same_sets(arr, TRAJ[5:40][:, 1:])
    stat = json.loads(r3(service_single, "stat", r, url=url).stdout)
    assert stat["num_rows"] == 40
    missing = r3(service_single, "stat", "no-such-rollout", url=url)
    assert missing.returncode == 1
    assert "not_found" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_get_many(service_single: Service, tmp_path: Path) -> None:
    ids = [rid() for _ in range(5)]
    with RoutingClient(service_single.http_url, api_key=KEY_A) as c:
        for i, r in enumerate(ids):
            c.put(r, frame_for(TRAJ[: 10 + i], 0))
    listing = tmp_path / "ids.txt"
    listing.write_text("\n".join([*ids, "missing-one"]) + "\n")
    res = r3(service_single, "get-many", str(listing), "-o", str(tmp_path / "out"))
    assert res.returncode == 1  # one id was missing: reported, the rest written
    assert "missing-one: not_found" in res.stderr
    for i, r in enumerate(ids):
        assert np.load(tmp_path / "out" / f"{r}.npy").shape == (10 + i, 3, 4)


def test_get_takes_the_view_policy(service_single: Service, tmp_path: Path) -> None:
    url = service_single.http_url
    r = rid()
    recomputed = TRAJ[::-1].copy()
    with RoutingClient(url, api_key=KEY_A) as c:
        c.put(r, frame_for(TRAJ[:40], 0))
        c.put(r, frame_for(recomputed[:40], 0, version="v2"), view=40)
        c.put(r, frame_for(TRAJ[40:60], 40, version="v2"))
    for view, want in (
        ("generated", TRAJ[:60]),
        ("latest", np.concatenate([recomputed[:40], TRAJ[40:60]])),
    ):
        out = tmp_path / f"{view}.npy"
        res = r3(service_single, "get", r, "-o", str(out), "--view", view, url=url)
        assert res.returncode == 0, res.stderr
        assert same_sets(np.load(out), want)
