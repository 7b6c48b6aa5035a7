"""Every operation over HTTP and over gRPC against a real service, real Redis (both backends)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import grpc
import httpx
import numpy as np
import pytest

from cache_service.redis_proc import RedisProcess, free_port
from r3_client import decode_rollout, encode_frame
from r3_client._proto import r3_cache_pb2 as pb
from r3_client.codec.stream import StreamDecoder
from r3_client.synthetic import synthetic_routing
from tests.support.frames import LAYERS, TRAJ, frame_for, rid, same_sets
from tests.support.service_process import KEY_A, KEY_B, METRICS_KEY, Service, grpc_md


def put_http(svc: Service, r: str, frame: bytes, key: str = KEY_A) -> dict:
    with svc.http(key) as c:
        resp = c.put(
            f"/v1/rollouts/{r}/segments",
            content=frame,
            headers={"Content-Type": "application/x-r3-frame"},
        )
    assert resp.status_code in (200, 201), resp.text
    return resp.json()


def grpc_error(call: object) -> tuple[grpc.StatusCode, str, str]:
    """Run a gRPC call expected to fail: (status, details, r3-error-code)."""
    with pytest.raises(grpc.RpcError) as info:
        call()  # type: ignore[operator]
    err = info.value
    md = dict(err.trailing_metadata() or ())  # type: ignore[attr-defined]
    return err.code(), err.details(), md.get("r3-error-code", "")  # type: ignore[attr-defined]


def test_put_over_both_transports_and_read_identical_bytes(svc: Service) -> None:
    r = rid()
    first = put_http(svc, r, frame_for(TRAJ[:120], 0))
    assert first["status"] == "stored" and first["segment"]["end"] == 120
    stub = svc.stub()
    res = stub.PutSegment(
        pb.PutSegmentRequest(rollout_id=r, frame=frame_for(TRAJ[120:], 120)), metadata=grpc_md()
    )
    assert (res.status, res.segment.start, res.segment.end) == ("stored", 120, 300)
    again = stub.PutSegment(
        pb.PutSegmentRequest(rollout_id=r, frame=frame_for(TRAJ[:120], 0)), metadata=grpc_md()
    )
    assert again.status == "duplicate"
    with svc.http() as c:
        for params, req in [
            ({}, pb.GetRolloutRequest(rollout_id=r)),
            ({"start": 100, "end": 150}, pb.GetRolloutRequest(rollout_id=r, start=100, end=150)),
            ({"layers": "5,1"}, pb.GetRolloutRequest(rollout_id=r, layers=[5, 1])),
        ]:
            http = c.get(f"/v1/rollouts/{r}", params=params)
            assert http.status_code == 200
            assert http.headers["content-type"] == "application/x-r3-frame"
            over_grpc = stub.GetRollout(req, metadata=grpc_md()).frame
            assert http.content == over_grpc  # byte-identical across transports
        whole = decode_rollout(c.get(f"/v1/rollouts/{r}").content)
        assert same_sets(whole.indices, TRAJ)
        # issue 14: the service no longer decodes, so no .npy; a clear 400 says where to go
        npy = c.get(f"/v1/rollouts/{r}", params={"format": "npy", "start": 10, "end": 20})
        assert npy.status_code == 400
        assert "decode_rollout" in npy.json()["error"]["message"]


def test_single_segment_rollout_returns_the_stored_frame(svc: Service) -> None:
    r = rid()
    # no token digest: a private segment (a shared one returns the first writer's frame)
    frame = frame_for(TRAJ[:50], 0, codec="raw", digest=False)
    put_http(svc, r, frame)
    with svc.http() as c:
        assert c.get(f"/v1/rollouts/{r}").content == frame
    assert (
        svc.stub().GetRollout(pb.GetRolloutRequest(rollout_id=r), metadata=grpc_md()).frame == frame
    )


def test_stat_over_both_transports(svc: Service) -> None:
    r = rid()
    put_http(svc, r, frame_for(TRAJ[:100], 0))
    put_http(svc, r, frame_for(TRAJ[100:200], 100, version="v2"))
    with svc.http() as c:
        st = c.get(f"/v1/rollouts/{r}/stat").json()
    g = svc.stub().StatRollout(pb.RolloutRef(rollout_id=r), metadata=grpc_md())
    assert st["num_rows"] == g.num_rows == 200
    assert st["layer_ids"] == list(g.layer_ids) == list(LAYERS)
    assert st["stored_bytes"] == g.stored_bytes > 0
    assert [s["segment"]["weight_version"] for s in st["segments"]] == ["v1", "v2"]
    assert [s.segment.weight_version for s in g.segments] == ["v1", "v2"]
    assert 0 < st["ttl_s"] <= 86400 and g.HasField("ttl_s")


def test_touch_and_delete_over_both_transports(svc: Service) -> None:
    stub = svc.stub()
    for transport in ("http", "grpc"):
        r = rid()
        put_http(svc, r, frame_for(TRAJ[:10], 0))
        with svc.http() as c:
            if transport == "http":
                assert c.post(f"/v1/rollouts/{r}/touch", json={"ttl_s": 0}).status_code == 204
                assert c.get(f"/v1/rollouts/{r}/stat").json()["ttl_s"] is None
                assert c.delete(f"/v1/rollouts/{r}").status_code == 204
                gone = c.delete(f"/v1/rollouts/{r}")
                assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"
                assert c.post(f"/v1/rollouts/{r}/touch").status_code == 404
            else:
                stub.TouchRollout(pb.TouchRequest(rollout_id=r, ttl_s=0), metadata=grpc_md())
                st = stub.StatRollout(pb.RolloutRef(rollout_id=r), metadata=grpc_md())
                assert not st.HasField("ttl_s")
                assert stub.DeleteRollout(pb.RolloutRef(rollout_id=r), metadata=grpc_md()).existed
                assert not stub.DeleteRollout(
                    pb.RolloutRef(rollout_id=r), metadata=grpc_md()
                ).existed
                code, _, r3code = grpc_error(
                    lambda r=r: stub.TouchRollout(pb.TouchRequest(rollout_id=r), metadata=grpc_md())
                )
                assert (code, r3code) == (grpc.StatusCode.NOT_FOUND, "not_found")
            assert c.get(f"/v1/rollouts/{r}").status_code == 404


def _http_batch(svc: Service, body: dict) -> list:
    dec = StreamDecoder()
    items = []
    with svc.http() as c, c.stream("POST", "/v1/batch/get", json=body) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"] == "application/x-r3-stream"
        for chunk in resp.iter_bytes():
            items += list(dec.feed(chunk))
    dec.close()
    return items


def test_batch_get_over_both_transports(svc: Service) -> None:
    ids = [rid() for _ in range(20)]
    for i, r in enumerate(ids):
        put_http(svc, r, frame_for(synthetic_routing(30 + i, len(LAYERS), 64, 4, seed=i), 0))
    asked = [*ids[:10], "missing-one", *ids[10:], "bad id!"]
    http_items = _http_batch(svc, {"rollout_ids": asked, "start": 5, "end": 25, "layers": [3]})
    grpc_items = list(
        svc.stub().BatchGet(
            pb.BatchGetRequest(rollout_ids=asked, start=5, end=25, layers=[3]), metadata=grpc_md()
        )
    )
    assert [i.rollout_id for i in http_items] == [i.rollout_id for i in grpc_items] == asked
    with svc.http() as c:
        for h, g in zip(http_items, grpc_items, strict=True):
            if h.rollout_id == "missing-one":
                assert (h.error_code, h.status) == ("not_found", 404)
                assert g.error.code == "not_found" and g.error.http_status == 404
            elif h.rollout_id == "bad id!":
                assert h.error_code == g.error.code == "invalid_request"
            else:
                assert h.frame == g.frame  # identical bytes
                single = c.get(
                    f"/v1/rollouts/{h.rollout_id}", params={"start": 5, "end": 25, "layers": "3"}
                ).content
                assert h.frame == single
                assert decode_rollout(h.frame, start=5, end=25, layers=[3]).indices.shape == (
                    20,
                    1,
                    4,
                )


def test_grpo_dedupe_is_visible_in_stat_and_metrics(svc: Service) -> None:
    prompt = frame_for(TRAJ[:100], 0, version=rid())  # a fresh share key
    results = [put_http(svc, rid(), prompt) for _ in range(4)]
    assert [r["dedupe_hit"] for r in results] == [False, True, True, True]
    with svc.http(METRICS_KEY) as c:
        text = c.get("/metrics").text
    hits = [ln for ln in text.splitlines() if ln.startswith("r3_dedupe_hits_total")]
    assert hits and float(hits[0].split()[-1]) >= 3


def test_limits_are_4xx_with_reasons(svc: Service) -> None:
    r = rid()
    big = frame_for(synthetic_routing(20001, 1, 64, 4, seed=1), 0, layers=(1,))
    with svc.http() as c:
        resp = c.put(f"/v1/rollouts/{r}/segments", content=big)
        assert resp.status_code == 413
        assert resp.json()["error"]["code"] == "limit_exceeded"
        assert "20001 token rows" in resp.json()["error"]["message"]
        huge = c.put(f"/v1/rollouts/{r}/segments", content=b"\0" * (4 << 20 | 1))
        assert huge.status_code == 413 and "limit" in huge.json()["error"]["message"]
        many = c.post("/v1/batch/get", json={"rollout_ids": [f"r{i}" for i in range(65)]})
        assert many.status_code == 413 and "limit is 64" in many.json()["error"]["message"]
    stub = svc.stub()
    code, _details, r3code = grpc_error(
        lambda: stub.PutSegment(pb.PutSegmentRequest(rollout_id=r, frame=big), metadata=grpc_md())
    )
    assert (code, r3code) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "limit_exceeded")
    code, _, _ = grpc_error(
        lambda: list(
            stub.BatchGet(
                pb.BatchGetRequest(rollout_ids=[f"r{i}" for i in range(65)]), metadata=grpc_md()
            )
        )
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    code, _, _ = grpc_error(
        lambda: stub.PutSegment(
            pb.PutSegmentRequest(rollout_id=r, frame=b"\0" * (5 << 20)), metadata=grpc_md()
        )
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_bad_input_is_refused_clearly_on_both_transports(svc: Service) -> None:
    r = rid()
    good = frame_for(TRAJ[:10], 0)
    corrupt = bytearray(good)
    corrupt[-8] ^= 1
    stub = svc.stub()
    cases = [
        (bytes(corrupt), 400, "checksum_mismatch"),
        (b"hello", 400, "truncated_frame"),
        (good[:-3], 400, "truncated_frame"),
    ]
    with svc.http() as c:
        for body, status, code in cases:
            resp = c.put(f"/v1/rollouts/{r}/segments", content=body)
            assert (resp.status_code, resp.json()["error"]["code"]) == (status, code)
            g = grpc_error(
                lambda body=body: stub.PutSegment(
                    pb.PutSegmentRequest(rollout_id=r, frame=body), metadata=grpc_md()
                )
            )
            assert (g[0], g[2]) == (grpc.StatusCode.INVALID_ARGUMENT, code)
        put_http(svc, r, good)
        other = frame_for(np.roll(TRAJ[:10], 1, axis=0), 0)
        resp = c.put(f"/v1/rollouts/{r}/segments", content=other)
        assert resp.status_code == 409 and resp.json()["error"]["code"] == "conflict"
        g = grpc_error(
            lambda: stub.PutSegment(
                pb.PutSegmentRequest(rollout_id=r, frame=other), metadata=grpc_md()
            )
        )
        assert g[0] == grpc.StatusCode.ALREADY_EXISTS
        for params in (
            {"start": 5, "end": 500},
            {"layers": "2"},
            {"layers": "x"},
            {"start": -1},
            {"format": "pickle"},
        ):
            resp = c.get(f"/v1/rollouts/{r}", params=params)
            assert 400 <= resp.status_code < 500, (params, resp.text)
            assert resp.json()["error"]["message"]
        resp = c.get(f"/v1/rollouts/{'x' * 201}")
        assert resp.status_code == 400 and "invalid rollout id" in resp.json()["error"]["message"]
        assert c.get(f"/v1/rollouts/{r}").status_code == 200  # nothing was lost


def test_auth_no_key_wrong_key_and_cross_tenant(svc: Service) -> None:
    r = rid()
    put_http(svc, r, frame_for(TRAJ[:10], 0), key=KEY_A)
    stub = svc.stub()
    for key in (None, "not-a-key-0123456789"):
        with svc.http(key) as c:
            resp = c.get(f"/v1/rollouts/{r}")
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "unauthenticated"
            assert c.put(f"/v1/rollouts/{r}/segments", content=b"x").status_code == 401
        code, _, _ = grpc_error(
            lambda key=key: stub.GetRollout(
                pb.GetRolloutRequest(rollout_id=r), metadata=grpc_md(key)
            )
        )
        assert code == grpc.StatusCode.UNAUTHENTICATED
    with svc.http(KEY_B) as c:  # tenant B: A's rollout does not exist for it
        assert c.get(f"/v1/rollouts/{r}").status_code == 404
        assert c.delete(f"/v1/rollouts/{r}").status_code == 404
        assert put_http(svc, r, frame_for(TRAJ[50:60], 0), key=KEY_B)["status"] == "stored"
    code, _, _ = grpc_error(
        lambda: stub.GetRollout(pb.GetRolloutRequest(rollout_id=r), metadata=grpc_md(KEY_B + "x"))
    )
    assert code == grpc.StatusCode.UNAUTHENTICATED
    with svc.http(KEY_A) as c:  # A's data untouched by B
        assert same_sets(decode_rollout(c.get(f"/v1/rollouts/{r}").content).indices, TRAJ[:10])
        assert c.get("/healthz").status_code == 200


def test_health_ready_metrics_and_openapi(svc: Service) -> None:
    with svc.http(None) as c:
        assert c.get("/healthz").json() == {"status": "ok"}
        assert c.get("/readyz").json() == {"status": "ready"}
        # store-wide figures: the metrics key only, never anonymous or a tenant's key
        assert c.get("/metrics").status_code == 401
        for key in (KEY_A, KEY_B):
            headers = {"Authorization": f"Bearer {key}"}
            assert c.get("/metrics", headers=headers).json()["error"]["code"] == "unauthenticated"
        metrics = c.get("/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"}).text
        for name in (
            "r3_requests_total",
            "r3_request_seconds_bucket",
            "r3_bytes_in_total",
            "r3_bytes_out_total",
            "r3_store_used_memory_bytes",
            "r3_dedupe_hits_total",
            "r3_store_maxmemory_bytes",
            "r3_store_fullest_ratio",
            "r3_views_stored_total",
            "r3_view_rows_stored_total",
        ):
            assert name in metrics
        assert "r3_store_up 1.0" in metrics.splitlines()  # every primary answered INFO
        spec = c.get("/openapi.json").json()
    put = spec["paths"]["/v1/rollouts/{rollout_id}/segments"]["put"]
    assert put["requestBody"]["content"]["application/x-r3-frame"]["schema"]["format"] == "binary"
    get = spec["paths"]["/v1/rollouts/{rollout_id}"]["get"]["responses"]["200"]["content"]
    assert set(get) == {"application/x-r3-frame"}
    batch = spec["paths"]["/v1/batch/get"]["post"]["responses"]["200"]["content"]
    assert "application/x-r3-stream" in batch
    json.dumps(spec)


def test_assembled_frames_carry_segment_provenance(svc: Service) -> None:
    r = rid()
    put_http(svc, r, frame_for(TRAJ[:100], 0))
    put_http(svc, r, frame_for(TRAJ[100:150], 100, version="v2"))
    with svc.http() as c:
        got = decode_rollout(c.get(f"/v1/rollouts/{r}").content)
    assert [(s.start, s.end, s.weight_version) for s in got.segments] == [
        (0, 100, "v1"),
        (100, 150, "v2"),
    ]
    assert encode_frame(got) == encode_frame(got)


def test_http_only_deployment_via_uvicorn_factory(redis_single: RedisProcess) -> None:
    """`uvicorn --factory cache_service.http_app:create_app`: settings from R3_CACHE_* env."""
    port = free_port()
    env = {**os.environ, "R3_CACHE_REDIS_URL": redis_single.url, "R3_CACHE_AUTH": "off"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "--factory",
            "cache_service.http_app:create_app",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        r = rid()
        assert (
            httpx.put(f"{url}/v1/rollouts/{r}/segments", content=frame_for(TRAJ[:5], 0)).status_code
            == 201
        )
        assert httpx.get(f"{url}/v1/rollouts/{r}/stat").json()["num_rows"] == 5
    finally:
        proc.terminate()
        proc.wait(20)


def test_both_transports_label_the_same_outcome_the_same(service_single: Service) -> None:
    """``r3_requests_total{code}`` is the HTTP status on HTTP and on gRPC alike."""
    missing = rid()
    with service_single.http() as c:
        assert c.get(f"/v1/rollouts/{missing}/stat").status_code == 404
    with pytest.raises(grpc.RpcError) as err:
        service_single.stub().StatRollout(pb.RolloutRef(rollout_id=missing), metadata=grpc_md())
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with service_single.http(None) as c:
        text = c.get("/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"}).text
    for transport in ("http", "grpc"):
        line = f'r3_requests_total{{code="404",op="stat_rollout",transport="{transport}"}}'
        assert line in text, transport
    assert 'code="NOT_FOUND"' not in text and 'code="OK"' not in text
