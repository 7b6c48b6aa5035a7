"""PD disaggregation on a real SGLang pair: a prefill and a decode server (Mooncake over TCP).

Each request is POSTed to both with the same ``bootstrap_host/port/room``, as
sglang-router does in PD mode.  The prefill server ships rows ``[stored, P)`` and the
decode server ``[P, P+N-1)`` (``sglang_r3.http_server.pd``) under the one rollout id, in whichever
order their writes land.  Stored rows must equal those of the reference engine
(``qwen_engine``: tp=1, no PD) for the same greedy tokens, with no row left as the
decode server's never-computed prompt rows (all 0).

Needs the ``pd`` test extra (``scripts/bootstrap.sh``: the Mooncake wheel and three
Debian libraries) and the test-only CPU shim ``pd_host_indices``.
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from cache_service.redis_proc import free_port
from r3_client import RoutingClient
from sglang_r3.launch.fleet import ROUTER_ARGS
from sglang_r3.tools.local_stack import EngineServer, start_engine
from tests.support.engine_requests import as_sets, generate, inline_rows, rid, shim_env, sp
from tests.support.service_process import KEY_A, Service

pytestmark = pytest.mark.timeout(600)

QWEN_LAYERS = 3
#: Run the pair with a decode-side radix cache (later turns' prompt KV partly from the
#: decode server's own cache, not transferred); off in CI (another pair start, ~1.5 min).
DECODE_RADIX = os.environ.get("R3_TEST_PD_DECODE_RADIX") == "1"


def _missing() -> str | None:
    """Why Mooncake cannot run here (None: it can)."""
    if importlib.util.find_spec("mooncake") is None:
        return "mooncake-transfer-engine-non-cuda is not installed (the `pd` test extra)"
    for lib in ("ibverbs", "nl-3", "nl-route-3"):
        if ctypes.util.find_library(lib) is None:
            return f"lib{lib} is missing (Debian libibverbs1 / libnl-3-200 / libnl-route-3-200)"
    return None


@dataclass
class Pair:
    prefill: EngineServer
    decode: EngineServer
    bootstrap_port: int

    def generate(self, body: dict[str, Any]) -> tuple[tuple[int, Any], tuple[int, Any]]:
        """POST ``body`` to both servers at once with one bootstrap room: (prefill, decode)."""
        body = {
            **body,
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": self.bootstrap_port,
            "bootstrap_room": random.randrange(1 << 62),
        }
        with ThreadPoolExecutor(2) as pool:
            p = pool.submit(generate, self.prefill.url, body)
            d = pool.submit(generate, self.decode.url, body)
            return p.result(), d.result()


@pytest.fixture(scope="module")
def pd_pair(
    tiny_models: dict[str, Path], engine_cache: Service, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    """A prefill + decode pair on the tiny Qwen3-MoE with the extension, started together."""
    missing = _missing()
    if missing:
        pytest.skip(f"PD needs the Mooncake transfer engine: {missing}")
    bootstrap = free_port()
    env = {
        **os.environ,
        **shim_env(
            "pd_host_indices",
            MOONCAKE_PROTOCOL="tcp",
            # An optimisation that sends a radix-cached prefix's KV early; under overlap
            # scheduling it records a torch.cuda.Event (disaggregation/prefill.py:1492-1498),
            # which dies on CPU.  The final send carries the same KV.
            SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX="0",
        ),
    }
    common = ("--disaggregation-transfer-backend", "mooncake")
    roles = {
        "prefill": (*common, "--disaggregation-bootstrap-port", str(bootstrap)),
        # A host pool for retraction backups (the default here) is sized from the RAM
        # left over a 10 GiB reserve, which a busy 24 GiB machine may not have.
        "decode": (*common, "--disaggregation-decode-retraction-backup", "cpu_tensor"),
    }
    if DECODE_RADIX:
        roles["decode"] = (*roles["decode"], "--disaggregation-decode-enable-radix-cache")

    def start(role: str) -> EngineServer:
        return start_engine(
            tiny_models["qwen3_moe"],
            port=free_port(),
            log=tmp_path_factory.mktemp(f"pd-{role}") / "sglang.log",
            routing_cache=engine_cache.http_url,
            api_key=KEY_A,
            extra_args=("--disaggregation-mode", role, *roles[role]),
            env=env,
        )

    with ThreadPoolExecutor(2) as pool:
        futures = {role: pool.submit(start, role) for role in roles}
    servers = {role: f.result() for role, f in futures.items() if f.exception() is None}
    try:
        for f in futures.values():
            f.result()  # raises the first start-up failure (its server is stopped)
        yield Pair(servers["prefill"], servers["decode"], bootstrap)
    finally:
        for server in servers.values():
            server.stop()


def reference(engine: EngineServer, prompt: list[int], new: int) -> tuple[list[int], Any]:
    """Greedy output tokens and upstream's rows ``[P+N-1, L, K]`` of the tp=1 engine."""
    status, out = generate(
        engine.url,
        {"input_ids": prompt, "sampling_params": sp(None, new), "return_routed_experts": True},
    )
    assert status == 200, out
    return out["output_ids"], inline_rows(out, QWEN_LAYERS)


def check_no_uncomputed_rows(indices: Any) -> None:
    """No gap (-1) and no row with an expert twice in a layer (a never-written row is
    [0, 0] at top-2)."""
    assert (indices >= 0).all()
    s = np.sort(indices, axis=-1)
    assert (s[..., 1:] != s[..., :-1]).all(), "a stored row repeats an expert (never computed?)"


def test_pd_rollout_over_two_turns_equals_the_reference(
    pd_pair: Pair, qwen_engine: EngineServer, cache_client: RoutingClient
) -> None:
    rollout = rid("pd")
    prompt1 = [5 + (7 * k) % 900 for k in range(30)]
    (ps, pout), (ds, dout) = pd_pair.generate(
        {"input_ids": prompt1, "sampling_params": sp(rollout, 8)}
    )
    assert ps == 200, pout
    assert ds == 200, dout
    p1, e1 = len(prompt1), len(prompt1) + 8 - 1
    # The prefill server answers with the first token and ships the prompt's rows; the
    # decode server ships the rest.
    assert len(pout["output_ids"]) == 1
    assert (pout["meta_info"]["r3"]["start"], pout["meta_info"]["r3"]["end"]) == (0, p1)
    assert (dout["meta_info"]["r3"]["start"], dout["meta_info"]["r3"]["end"]) == (p1, e1)
    ref_ids, ref_rows = reference(qwen_engine, prompt1, 8)
    assert dout["output_ids"] == ref_ids
    assert pout["output_ids"] == ref_ids[:1]
    got = cache_client.get(rollout)
    assert (got.start, got.end) == (0, e1)
    check_no_uncomputed_rows(got.indices)
    np.testing.assert_array_equal(as_sets(got.indices), as_sets(ref_rows))

    # Turn 2: the conversation so far plus new tokens.  Prefill ships [e1, P2): turn
    # 1's output tokens are prompt there (computed by its forward), its prompt a radix
    # hit of rows computed there; decode ships [P2, P2+N-1).
    prompt2 = [*prompt1, *ref_ids, *[11 + 3 * k for k in range(6)]]
    (ps, pout), (ds, dout) = pd_pair.generate(
        {"input_ids": prompt2, "sampling_params": sp(rollout, 6)}
    )
    assert ps == 200, pout
    assert ds == 200, dout
    p2, e2 = len(prompt2), len(prompt2) + 6 - 1
    assert (pout["meta_info"]["r3"]["start"], pout["meta_info"]["r3"]["end"]) == (e1, p2)
    assert (dout["meta_info"]["r3"]["start"], dout["meta_info"]["r3"]["end"]) == (p2, e2)
    if DECODE_RADIX:  # turn 1's KV (transferred prompt, computed output) was a hit
        assert dout["meta_info"]["cached_tokens"] >= e1, dout["meta_info"]
    ref_ids2, ref_rows2 = reference(qwen_engine, prompt2, 6)
    assert dout["output_ids"] == ref_ids2
    got = cache_client.get(rollout)
    assert (got.start, got.end) == (0, e2)
    assert [(s.start, s.end) for s in got.segments] == [(0, p1), (p1, e1), (e1, p2), (p2, e2)]
    check_no_uncomputed_rows(got.indices)
    np.testing.assert_array_equal(as_sets(got.indices[:e1]), as_sets(ref_rows[:e1]))
    np.testing.assert_array_equal(as_sets(got.indices[e1:]), as_sets(ref_rows2[e1:]))
    if not DECODE_RADIX:
        # The prefill server recomputed turn 1's output positions (the decode server had
        # computed them): a view serving turn 2, what its KV transfer carried; turn 2's
        # tokens attended to it.  The first computation stays the generated answer.
        views = [(v.serves, v.start, v.end) for v in cache_client.stat(rollout).views]
        assert views == [(e1, p1, e1)], views
        assert [v["serves"] for v in pout["meta_info"]["r3"]["views"]] == [e1]
        latest = cache_client.get(rollout, view="latest").indices
        np.testing.assert_array_equal(as_sets(latest), as_sets(ref_rows2))

    # A turn that does not extend the stored trajectory is refused by both servers
    # before generation (the decode side too, which would otherwise wait for a KV
    # transfer that never comes).
    stale = [*prompt1, 3, 4, 5]
    (ps, pout), (ds, dout) = pd_pair.generate({"input_ids": stale, "sampling_params": sp(rollout)})
    assert (ps, ds) == (409, 409), (pout, dout)
    assert cache_client.get(rollout).end == e2


def start_pd_router(pair: Pair, log: Path) -> EngineServer:
    """sglang-router in PD mode in front of ``pair``, with R3's settings; wait until it
    lists both workers healthy."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--pd-disaggregation",
        "--prefill",
        pair.prefill.url,
        str(pair.bootstrap_port),
        "--decode",
        pair.decode.url,
        *ROUTER_ARGS,
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
    ]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    router = EngineServer(f"http://127.0.0.1:{port}", proc, log, argv)
    deadline = time.monotonic() + 60
    try:
        while True:
            assert proc.poll() is None, router.tail()
            try:
                listed = httpx.get(f"{router.url}/workers", timeout=5).json().get("workers", [])
                if sum(bool(w.get("is_healthy")) for w in listed) == 2:
                    return router
            except (httpx.HTTPError, ValueError):
                pass
            assert time.monotonic() < deadline, router.tail()
            time.sleep(0.3)
    except BaseException:
        router.stop()
        raise


def test_pd_behind_sglang_router_tags_both_sides_by_header(
    pd_pair: Pair,
    qwen_engine: EngineServer,
    cache_client: RoutingClient,
    tmp_path: Path,
) -> None:
    """sglang-router 0.3.2 in PD mode drops ``custom_params`` but forwards
    ``X-SMG-Routing-Key`` to both servers, and puts one bootstrap room in both bodies:
    both halves of the turn are stored under the header's rollout id."""
    router = start_pd_router(pd_pair, tmp_path / "router.log")
    try:
        rollout = rid("pd-router")
        prompt = [9 + (5 * k) % 700 for k in range(26)]
        r = httpx.post(
            f"{router.url}/generate",
            json={"input_ids": prompt, "sampling_params": sp(None, 7)},
            headers={"X-SMG-Routing-Key": rollout},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        out = r.json()  # the decode server's answer
        p, e = len(prompt), len(prompt) + 7 - 1
        assert (out["meta_info"]["r3"]["start"], out["meta_info"]["r3"]["end"]) == (p, e)
        ref_ids, ref_rows = reference(qwen_engine, prompt, 7)
        assert out["output_ids"] == ref_ids
        got = cache_client.get(rollout)
        assert [(s.start, s.end) for s in got.segments] == [(0, p), (p, e)]
        check_no_uncomputed_rows(got.indices)
        np.testing.assert_array_equal(as_sets(got.indices), as_sets(ref_rows))
    finally:
        router.stop()
