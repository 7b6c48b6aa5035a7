"""Batch delete and drop by weight version through the real service: HTTP and gRPC, both
clients, a single Redis and a Redis Cluster, hostile input (another tenant's ids, 10^5
ids, versions and cursors that are not ones) refused with a reason and losing nothing,
and the operator's series counting what left."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from r3_client import (
    AsyncRoutingClient,
    Deleted,
    InvalidRequestError,
    LimitExceededError,
    RolloutNotFoundError,
    RoutingClient,
)
from r3_client._proto import r3_cache_pb2 as pb
from r3_client.cli import main as cli_main
from r3_client.integrations.release import arelease_step, release_step
from tests.support.frames import TRAJ, frame_for, rid
from tests.support.service_process import (
    KEY_A,
    KEY_B,
    METRICS_KEY,
    Service,
    grpc_md,
    start_service,
    url_of,
)


@pytest.fixture(
    scope="module", params=["single", pytest.param("cluster", marks=pytest.mark.cluster)]
)
def svc(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    """The service on the session's Redis, under a key prefix of its own: a drop by version
    walks a whole namespace, and must not take the rollouts other test modules keep."""
    if request.param == "single":
        url, cluster = request.getfixturevalue("redis_single").url, False
    else:
        url, cluster = request.getfixturevalue("redis_cluster")[0].url, True
    env = {"R3_CACHE_KEY_PREFIX": f"lc{uuid.uuid4().hex[:8]}"}
    service = start_service(tmp_path_factory.mktemp("lifecycle"), url, cluster=cluster, env=env)
    yield service
    service.stop()


def _put(c: RoutingClient, r: str, versions: tuple[str, ...]) -> None:
    for i, v in enumerate(versions):
        c.put(r, frame_for(TRAJ[40 * i : 40 * (i + 1)], 40 * i, version=v))


def _metric(svc: Service, name: str, how: str) -> float:
    with svc.http(METRICS_KEY) as c:
        text = c.get("/metrics").text
    m = re.search(rf'^{name}{{how="{how}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_batch_delete_answers_every_id_over_both_transports(svc: Service, transport: str) -> None:
    mine, theirs = [rid() for _ in range(5)], rid()
    with RoutingClient(url_of(svc, transport), api_key=KEY_B) as b:
        _put(b, theirs, ("1",))
    before = _metric(svc, "r3_rollouts_dropped_total", "batch_delete")
    with RoutingClient(url_of(svc, transport), api_key=KEY_A) as c:
        for r in mine[:4]:
            _put(c, r, ("1", "2"))
        asked = [*mine, mine[0], theirs]  # tenant B's id is not tenant A's rollout
        got = c.delete_many(asked, chunk_size=3)
        assert [g.rollout_id for g in got] == asked
        # mine[0] again, in the second request: deleted by the first
        assert [g.existed for g in got] == [True] * 4 + [False, False, False]
        same = c.delete_many([mine[1], mine[1]])  # twice in one request: one delete, one answer
        assert same[0] == same[1] and not same[0].existed
        assert all((g.freed_bytes or 0) > 1000 for g in got[:4])
        assert got[4].freed_bytes == 0
        for r in mine:
            with pytest.raises(RolloutNotFoundError):
                c.stat(r)
        with pytest.raises(InvalidRequestError):  # checked before any I/O
            c.delete_many([mine[0], "no/slash"])
    with RoutingClient(url_of(svc, transport), api_key=KEY_B) as b:
        assert b.stat(theirs).num_rows == 40  # another tenant's rollout: untouched
        b.delete(theirs)
    # the same store counts for both transports; asked 5 rollouts, 4 existed
    assert _metric(svc, "r3_rollouts_dropped_total", "batch_delete") - before == 4
    assert _metric(svc, "r3_dropped_bytes_total", "batch_delete") > 0


async def test_async_client_batch_delete_and_drop(svc: Service, transport: str) -> None:
    ids = [rid() for _ in range(3)]
    with RoutingClient(url_of(svc, transport), api_key=KEY_A) as c:
        for r in ids:
            _put(c, r, ("900001",))
    async with AsyncRoutingClient(url_of(svc, transport), api_key=KEY_A) as a:
        got = await a.delete_many(ids[:1])
        assert got == [Deleted(ids[0], True, got[0].freed_bytes)]
        res = await a.drop_consumed(900001, max_rollouts=2)
        assert res.done and res.dropped >= 2
        for r in ids:
            with pytest.raises(RolloutNotFoundError):
                await a.stat(r)


def test_a_batch_past_its_limit_is_refused_whole(svc: Service) -> None:
    kept = rid()
    with RoutingClient(svc.http_url, api_key=KEY_A) as c:
        _put(c, kept, ("1",))
    ids = [kept] + [f"r{i}" for i in range(100_000 - 1)]  # 10^5 ids: 1.2 MB of JSON
    with svc.http(KEY_A) as h:
        resp = h.post("/v1/batch/delete", json={"rollout_ids": ids})
    assert resp.status_code == 413, resp.text
    assert "limit" in resp.json()["error"]["message"]
    with svc.http(KEY_A) as h:  # within the body limit, past max_batch
        resp = h.post("/v1/batch/delete", json={"rollout_ids": ids[:65]})
    assert resp.status_code == 413 and "nothing was deleted" in resp.json()["error"]["message"]
    code = _grpc_code(
        lambda s: s.BatchDelete(pb.BatchDeleteRequest(rollout_ids=ids[:65]), metadata=grpc_md()),
        svc,
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    with RoutingClient(svc.http_url, api_key=KEY_A) as c:
        assert c.stat(kept).num_rows == 40  # nothing lost
        c.delete(kept)


def test_a_bad_id_is_answered_in_its_item(svc: Service) -> None:
    r = rid()
    with RoutingClient(svc.http_url, api_key=KEY_A) as c:
        _put(c, r, ("1",))
    with svc.http(KEY_A) as h:
        body = h.post("/v1/batch/delete", json={"rollout_ids": ["../x", r]}).json()
    assert body["items"][0]["status"] == 400
    assert body["items"][0]["error"]["code"] == "invalid_request"
    assert body["items"][1]["deleted"]["existed"] is True
    resp = svc.stub().BatchDelete(pb.BatchDeleteRequest(rollout_ids=["a b", r]), metadata=grpc_md())
    assert resp.items[0].error.http_status == 400
    assert resp.items[1].deleted.existed is False  # deleted by the HTTP call


def _grpc_code(call: object, svc: Service) -> grpc.StatusCode:
    try:
        call(svc.stub())  # type: ignore[operator]
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    raise AssertionError("the call was not refused")


@pytest.mark.parametrize("upto", ["abc", -1, 2.5, True, "1e3", "9" * 16, None, [3], ""])
def test_drop_refuses_a_version_that_is_not_one(svc: Service, upto: object) -> None:
    r = rid()
    with RoutingClient(svc.http_url, api_key=KEY_A) as c:
        _put(c, r, ("1",))
        with svc.http(KEY_A) as h:
            resp = h.post("/v1/drop-consumed", json={"upto": upto})
        assert resp.status_code in (400, 422), resp.text
        assert resp.json()["error"]["message"]
        if isinstance(upto, str):
            code = _grpc_code(
                lambda s: s.DropConsumed(pb.DropConsumedRequest(upto=upto), metadata=grpc_md()),
                svc,
            )
            assert code == grpc.StatusCode.INVALID_ARGUMENT
        if isinstance(upto, (str, int)) and not isinstance(upto, bool):
            with pytest.raises(InvalidRequestError):  # before any I/O
                c.drop_consumed(upto)
        assert c.stat(r).num_rows == 40  # nothing lost
        c.delete(r)


def test_drop_bounds_and_cursors(svc: Service) -> None:
    with svc.http(KEY_A) as h:
        for body in (
            {"upto": 3, "max_rollouts": 0},
            {"upto": 3, "max_rollouts": 1 << 20},
            {"upto": 3, "cursor": "not-a-cursor"},
            {"upto": 3, "cursor": "0." + "1" * 70},
        ):
            resp = h.post("/v1/drop-consumed", json=body)
            assert resp.status_code in (400, 422), (body, resp.text)


def test_drop_up_to_a_version_over_both_transports(svc: Service, transport: str) -> None:
    base = 700000 + (1 if transport == "grpc" else 0) * 10
    consumed = [rid() for _ in range(6)]
    newer, named = rid(), rid()
    theirs = rid()
    with RoutingClient(url_of(svc, transport), api_key=KEY_B) as b:
        _put(b, theirs, (str(base),))
    before = _metric(svc, "r3_rollouts_dropped_total", "drop_version")
    with RoutingClient(url_of(svc, transport), api_key=KEY_A) as c:
        for r in consumed:
            _put(c, r, (str(base), str(base + 1)))
        _put(c, newer, (str(base + 1), str(base + 2)))
        _put(c, named, (str(base), "latest"))
        res = c.drop_consumed(base + 1, max_rollouts=2)
        assert res.done
        assert res.dropped >= 6 and res.freed_bytes and res.freed_bytes > 6 * 1000
        assert res.kept_newer >= 1 and res.kept_unversioned >= 1
        for r in consumed:
            with pytest.raises(RolloutNotFoundError):
                c.stat(r)
        assert c.stat(newer).num_rows == 80 and c.stat(named).num_rows == 80
        part = c.drop_consumed(base + 2, max_rollouts=1, max_calls=1)
        assert part.examined >= 1  # one bounded call: the walk goes on from its cursor
        c.delete_many([newer, named])
    with RoutingClient(url_of(svc, transport), api_key=KEY_B) as b:
        assert b.stat(theirs).num_rows == 40  # tenant-scoped
        b.delete(theirs)
    assert _metric(svc, "r3_rollouts_dropped_total", "drop_version") - before >= 6


def test_unauthenticated_lifecycle_calls_are_refused_before_the_body(svc: Service) -> None:
    with httpx.Client(base_url=svc.http_url, timeout=10) as h:
        for path in ("/v1/batch/delete", "/v1/drop-consumed"):
            resp = h.post(path, content=b"{" * 10)  # not even JSON: auth answers first
            assert resp.status_code == 401
    code = _grpc_code(
        lambda s: s.DropConsumed(pb.DropConsumedRequest(upto="1"), metadata=grpc_md(None)), svc
    )
    assert code == grpc.StatusCode.UNAUTHENTICATED


async def test_a_writer_racing_drops_through_the_service(svc: Service) -> None:
    """Drops up to 5 through the service while a client appends version-6 segments:
    every rollout ends whole (both first segments, or gone)."""
    ids = [rid() for _ in range(16)]
    with RoutingClient(svc.http_url, api_key=KEY_A) as c:
        for r in ids:
            _put(c, r, ("4", "5"))

    async def writer(a: AsyncRoutingClient) -> None:
        for r in ids:
            with contextlib.suppress(InvalidRequestError, LimitExceededError, RolloutNotFoundError):
                await a.put(r, frame_for(TRAJ[80:120], 80, version="6"))

    async with (
        AsyncRoutingClient(svc.http_url, api_key=KEY_A) as w,
        AsyncRoutingClient(svc.grpc_url, api_key=KEY_A) as d,
    ):
        await asyncio.gather(writer(w), d.drop_consumed(5, max_rollouts=2))
    with RoutingClient(svc.http_url, api_key=KEY_A) as c:
        for r in ids:
            try:
                starts = [s.segment.start for s in c.stat(r).segments]
            except RolloutNotFoundError:
                continue
            assert starts in ([0, 40], [0, 40, 80], [80]), starts
        c.delete_many(ids)


async def test_release_step_after_a_step(svc: Service) -> None:
    """The glue's call after a step: the step's rollouts, and with a consumed version every
    rollout computed up to it (an aborted one never trained on included)."""
    step, aborted, next_step = [rid() for _ in range(3)], rid(), rid()
    with RoutingClient(svc.http_url, api_key=KEY_A) as c:
        for r in step:
            _put(c, r, ("800001",))
        _put(c, aborted, ("800001",))
        _put(c, next_step, ("800002",))
        got = release_step(c, step, consumed_version=800001)
        assert got.deleted == 3 and got.dropped >= 1  # the aborted one, by version
        assert got.freed_bytes and got.freed_bytes > 4 * 1000
        with pytest.raises(RolloutNotFoundError):
            c.stat(aborted)
        assert c.stat(next_step).num_rows == 40
    async with AsyncRoutingClient(svc.grpc_url, api_key=KEY_A) as a:
        done = await arelease_step(a, [next_step])
        assert (done.deleted, done.dropped) == (1, 0)


def test_the_integrations_recipe_runs_as_written(svc: Service) -> None:
    """docs/integrations.md's "After each step" block, executed against the service."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text()
    section = text.split("## After each step", 1)[1].split("\n## ", 1)[0]
    block = section.split("```python\n", 1)[1].split("```", 1)[0]
    step_ids, stale, fresh = [rid() for _ in range(2)], rid(), rid()
    with RoutingClient(svc.http_url, api_key=KEY_A) as r3:
        for r in step_ids:
            _put(r3, r, ("600010",))
        _put(r3, stale, ("600009",))  # aborted two versions ago, never trained on
        _put(r3, fresh, ("600011",))  # generated under the new weights: kept
        ns = {"r3": r3, "step_ids": step_ids, "new_version": 600011, "max_staleness": 1}
        exec(compile(block, "docs/integrations.md#after-each-step", "exec"), ns)
        assert ns["done"].deleted == 2 and ns["done"].dropped >= 1
        with pytest.raises(RolloutNotFoundError):
            r3.stat(stale)
        assert r3.stat(fresh).num_rows == 40
        r3.delete(fresh)


def test_the_operator_commands(
    svc: Service, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``r3 delete ids.txt`` and ``r3 drop --upto V`` against the service."""
    listed, old, kept = [rid() for _ in range(3)], rid(), rid()
    with RoutingClient(svc.http_url, api_key=KEY_A) as c:
        for r in [*listed, old]:
            _put(c, r, ("500001",))
        _put(c, kept, ("500002",))
    (tmp_path / "ids.txt").write_text("\n".join([*listed, rid()]) + "\n")
    common = ["--url", svc.grpc_url, "--api-key", KEY_A]
    assert cli_main(["delete", str(tmp_path / "ids.txt"), *common]) == 0
    assert capsys.readouterr().out.startswith("3 of 4 rollouts deleted; Redis freed ")
    assert cli_main(["drop", "--upto", "500001", *common]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["dropped"] >= 1 and res["cursor"] == "" and res["kept_newer"] >= 1
    assert cli_main(["drop", "--upto", "five", *common]) == 1
    assert "weight version 'five'" in capsys.readouterr().err
    with RoutingClient(svc.http_url, api_key=KEY_A) as c:
        with pytest.raises(RolloutNotFoundError):
            c.stat(old)
        assert c.stat(kept).num_rows == 40
        c.delete(kept)


def test_an_empty_batch_delete_is_refused_on_both_transports(svc: Service) -> None:
    with svc.http(KEY_A) as h:
        resp = h.post("/v1/batch/delete", json={"rollout_ids": []})
    assert resp.status_code == 422, resp.text
    assert resp.json()["error"]["code"] == "invalid_request"
    assert "rollout_ids" in resp.json()["error"]["message"]
    with pytest.raises(grpc.RpcError) as info:
        svc.stub().BatchDelete(pb.BatchDeleteRequest(rollout_ids=[]), metadata=grpc_md())
    err: Any = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "rollout_ids" in err.details() and "at least 1" in err.details()
    assert dict(err.trailing_metadata())["r3-error-code"] == "invalid_request"


@pytest.mark.parametrize("value", ["5", True, False, 5.0, "", None, [5], {"n": 5}])
def test_drop_max_rollouts_is_a_strict_integer(svc: Service, value: object) -> None:
    """``max_rollouts`` is a JSON integer or absent: ``"5"`` and ``true`` are not counts
    (``null`` is absent: the service's bound)."""
    r = rid()
    with RoutingClient(svc.http_url, api_key=KEY_A) as c:
        _put(c, r, ("1",))
        with svc.http(KEY_A) as h:
            resp = h.post("/v1/drop-consumed", json={"upto": 3, "max_rollouts": value})
        if value is None:
            assert resp.status_code == 200, resp.text
        else:
            assert resp.status_code == 422, (value, resp.text)
            assert resp.json()["error"]["code"] == "invalid_request"
            assert "max_rollouts" in resp.json()["error"]["message"]
            assert c.stat(r).num_rows == 40  # nothing read, nothing lost
        c.delete(r)


@pytest.mark.parametrize("value", [0, -1, -(1 << 63), 4097, 1 << 20, (1 << 63) - 1])
def test_drop_max_rollouts_out_of_range_is_refused_alike(svc: Service, value: int) -> None:
    """Past ``R3_CACHE_DROP_MAX_ROLLOUTS`` (4,096) or below 1: HTTP's 400 and gRPC's
    INVALID_ARGUMENT say the same, and nothing is dropped."""
    r = rid()
    with RoutingClient(svc.http_url, api_key=KEY_A) as c:
        _put(c, r, ("1",))
        with svc.http(KEY_A) as h:
            resp = h.post("/v1/drop-consumed", json={"upto": 3, "max_rollouts": value})
        assert resp.status_code == 400, resp.text
        http_msg = resp.json()["error"]["message"]
        assert "max_rollouts must be between 1 and" in http_msg
        req = pb.DropConsumedRequest(upto="3", max_rollouts=value)
        with pytest.raises(grpc.RpcError) as info:
            svc.stub().DropConsumed(req, metadata=grpc_md())
        err: Any = info.value
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details() == http_msg
        with pytest.raises(InvalidRequestError, match="max_rollouts"):
            c.drop_consumed(3, max_rollouts=value)
        assert c.stat(r).num_rows == 40
        c.delete(r)


@pytest.mark.parametrize(
    "cursor", ["0.12345", "9999.99", "0.18446744073709551615", "0.12345." + "0" * 32]
)
def test_a_made_up_cursor_is_refused_on_both_transports(svc: Service, cursor: str) -> None:
    """Well-formed positions the service never answered: a 400 / INVALID_ARGUMENT, and no
    SCAN resumes there (nothing is dropped, though every rollout is up to the version)."""
    r = rid()
    with RoutingClient(svc.http_url, api_key=KEY_A) as c:
        _put(c, r, ("1",))
        with svc.http(KEY_A) as h:
            resp = h.post("/v1/drop-consumed", json={"upto": 3, "cursor": cursor})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["code"] == "invalid_request"
        assert "cursor" in resp.json()["error"]["message"]
        req = pb.DropConsumedRequest(upto="3", cursor=cursor)
        with pytest.raises(grpc.RpcError) as info:
            svc.stub().DropConsumed(req, metadata=grpc_md())
        err: Any = info.value
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "cursor" in err.details()
        assert c.stat(r).num_rows == 40  # nothing dropped
        c.delete(r)


def test_a_cursor_is_good_only_for_its_namespace_and_version(svc: Service, transport: str) -> None:
    """A cursor tenant A was answered is refused to tenant B and to a drop up to another
    version, on both transports; A resumes with it and the walk ends."""
    mine, theirs = [rid() for _ in range(6)], rid()
    with RoutingClient(url_of(svc, transport), api_key=KEY_B) as b:
        _put(b, theirs, ("1",))
    with RoutingClient(url_of(svc, transport), api_key=KEY_A) as c:
        for r in mine:
            _put(c, r, ("1",))
        part = c.drop_consumed(3, max_rollouts=1, max_calls=1)
        assert part.cursor, part
    for key, upto in ((KEY_B, "3"), (KEY_A, "4")):
        with svc.http(key) as h:
            resp = h.post("/v1/drop-consumed", json={"upto": upto, "cursor": part.cursor})
        assert resp.status_code == 400, resp.text
        assert "not one this service answered" in resp.json()["error"]["message"]
        req = pb.DropConsumedRequest(upto=upto, cursor=part.cursor)
        with pytest.raises(grpc.RpcError) as info:
            svc.stub().DropConsumed(req, metadata=grpc_md(key))
        err: Any = info.value
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    with RoutingClient(url_of(svc, transport), api_key=KEY_B) as b:
        assert b.stat(theirs).num_rows == 40  # B's rollouts: untouched
        b.delete(theirs)
    cursor, dropped, calls = part.cursor, part.dropped, 0
    with svc.http(KEY_A) as h:
        while cursor:  # the answered cursor resumes, over HTTP whatever the first call was
            body = {"upto": 3, "cursor": cursor, "max_rollouts": 2}
            resp = h.post("/v1/drop-consumed", json=body)
            assert resp.status_code == 200, resp.text
            cursor, dropped = resp.json()["cursor"], dropped + resp.json()["dropped"]
            calls += 1
            assert calls < 1000
    assert dropped >= len(mine)
    with RoutingClient(url_of(svc, transport), api_key=KEY_A) as c:
        for r in mine:
            with pytest.raises(RolloutNotFoundError):
                c.stat(r)
