"""Client benchmark: rollout ids -> a padded torch tensor in verl's layout, ours vs upstream.

Both paths start from 256 rollout ids and end with the same verl batch
``[256, prompt_len + response_len, 48, 8]`` int16 torch tensor (prompt left-padded,
response right-padded, 0 at padding and the last token, as verl fills them), measured
in the same run, best of ``--repeat``:

* **upstream**: what RL frameworks do with SGLang today — fetch each rollout's
  SGLang-shaped JSON response (``meta_info.routed_experts`` = base64 of int32
  ``[T-1, L, K]``) over HTTP, ``base64.b64decode`` + ``np.frombuffer``, and pad
  into the batch by hand.  Served by a minimal Starlette app on uvicorn in its
  own process (the same stack as our service), 8 requests in flight.
* **ours**: ``AsyncRoutingClient.get_many`` over HTTP from the real cache
  service (its own process, its own redis-server), then ``r3_client.layouts.verl_layout``
  and ``torch.from_numpy``.

Bytes transferred are the response bodies each server sent (upstream: JSON;
ours: the service's ``r3_bytes_out_total``).  Targets (issue 4): ours >= 3x faster
end to end and >= 5x fewer bytes.

    python bench/client_bench.py [--rollouts 256] [--prompt 1024] [--response 3072]
        [--repeat 3] [--distinct 8] [--json PATH]

Only ``--distinct`` routing arrays are generated and reused under different ids
(generation is slow and the bytes are what matter).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch

from r3_client import AsyncRoutingClient, Segment, encode_frame
from r3_client.layouts import verl_layout
from r3_client.synthetic import synthetic_routing

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support, before site-packages' ``tests`` (verl's)
from cache_service.redis_proc import RedisProcess, free_port  # noqa: E402
from tests.support.service_process import KEY_A, METRICS_KEY, Service, start_service  # noqa: E402

L, E, K = 48, 128, 8

UPSTREAM_APP = """
import sys
from pathlib import Path
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route
bodies = [p.read_bytes() for p in sorted(Path(sys.argv[1]).glob("*.json"))]
async def generate(request):
    i = int(request.path_params["i"])
    return Response(bodies[i % len(bodies)], media_type="application/json")
app = Starlette(routes=[Route("/rollout/{i:int}", generate)])
"""


def upstream_json(routing: np.ndarray, prompt: int, response: int) -> bytes:
    """An SGLang /generate response carrying routing the way upstream ships it."""
    return json.dumps(
        {
            "text": "",
            "output_ids": [],
            "meta_info": {
                "id": "0",
                "prompt_tokens": prompt,
                "completion_tokens": response,
                "finish_reason": {"type": "length", "length": response},
                "routed_experts": base64.b64encode(routing.astype("<i4").tobytes()).decode(),
            },
        }
    ).encode()


def start_upstream(data_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """uvicorn + Starlette serving the prebuilt JSON bodies; returns (process, url)."""
    app = data_dir / "upstream_app.py"
    app.write_text(UPSTREAM_APP)
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import sys; sys.argv=['x', {str(data_dir)!r}]; sys.path.insert(0, {str(data_dir)!r});"
            f"import uvicorn, upstream_app; uvicorn.run(upstream_app.app, port={port}, "
            "log_level='warning')",
        ],
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            httpx.get(f"{url}/rollout/0", timeout=1)
            return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("upstream stand-in did not start")


async def upstream_path(
    url: str, n: int, prompt: int, response: int, concurrency: int = 8
) -> tuple[torch.Tensor, int]:
    """Fetch JSON, base64-decode, frombuffer, pad by hand: what frameworks do today."""
    out = torch.zeros((n, prompt + response, L, K), dtype=torch.int16)
    nbytes = 0
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:

        async def one(i: int) -> None:
            nonlocal nbytes
            async with sem:
                resp = await http.get(f"/rollout/{i}")
            nbytes += len(resp.content)
            meta = resp.json()["meta_info"]
            rows = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype="<i4")
            rows = rows.reshape(-1, L, K)
            p = meta["prompt_tokens"]
            # prompt rows right-aligned at the prompt boundary, response rows after it
            out[i, prompt - p : prompt] = torch.from_numpy(rows[:p].astype(np.int16))
            out[i, prompt : prompt + rows.shape[0] - p] = torch.from_numpy(
                rows[p:].astype(np.int16)
            )

        await asyncio.gather(*(one(i) for i in range(n)))
    return out, nbytes


def bytes_out(svc: Service) -> float:
    headers = {"Authorization": f"Bearer {METRICS_KEY}"}
    text = httpx.get(f"{svc.http_url}/metrics", headers=headers, timeout=10).text
    for line in text.splitlines():
        if line.startswith('r3_bytes_out_total{transport="http"}'):
            return float(line.split()[-1])
    return 0.0


async def our_path(
    svc: Service, ids: list[str], prompt: int, response: int
) -> tuple[torch.Tensor, float]:
    """get_many from the cache service, then verl_layout: one call each."""
    before = bytes_out(svc)
    async with AsyncRoutingClient(svc.http_url, api_key=KEY_A) as c:
        got = dict([x async for x in c.get_many(ids, chunk_size=32, concurrency=4)])
    routings = [got[r] for r in ids]
    batch = verl_layout(routings, [prompt] * len(ids), [response] * len(ids))
    out = torch.from_numpy(batch)
    return out, bytes_out(svc) - before


def main() -> int:
    """Run both paths and print the comparison."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rollouts", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--response", type=int, default=3072)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--distinct", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args()
    n, p, r = args.rollouts, args.prompt, args.response
    rows = p + r - 1
    print(
        f"# client benchmark — python {platform.python_version()}, {os.cpu_count()} cores; "
        f"{n} rollouts x {p + r} tokens (prompt {p}, response {r}), {L}x{E}x{K}"
    )
    arrays = [
        synthetic_routing(rows, L, E, K, skew=1.0, rho=0.9, seed=s) for s in range(args.distinct)
    ]
    with tempfile.TemporaryDirectory(prefix="r3-client-bench-") as tmp_s:
        tmp = Path(tmp_s)
        bodies = tmp / "upstream"
        bodies.mkdir()
        for i, a in enumerate(arrays):
            (bodies / f"{i:03d}.json").write_bytes(upstream_json(a, p, r))
        redis = RedisProcess(free_port(), tmp / "redis", appendonly=False).start()
        svc = start_service(tmp, redis.url, env={"R3_CACHE_MAX_BATCH": "1024"})
        upstream, up_url = start_upstream(bodies)
        try:
            ids = [f"bench-{i}" for i in range(n)]
            with httpx.Client(
                base_url=svc.http_url, headers={"Authorization": f"Bearer {KEY_A}"}
            ) as http:
                for i, rid in enumerate(ids):
                    a = arrays[i % len(arrays)]
                    frame = encode_frame(
                        a,
                        num_experts=E,
                        layer_ids=range(L),
                        segment=Segment(0, rows, "bench", "v1"),
                    )
                    http.put(f"/v1/rollouts/{rid}/segments", content=frame).raise_for_status()
            t_up, t_ours = math.inf, math.inf
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                ref, up_bytes = asyncio.run(upstream_path(up_url, n, p, r))
                t_up = min(t_up, time.perf_counter() - t0)
                del ref
                t0 = time.perf_counter()
                ours, our_bytes = asyncio.run(our_path(svc, ids, p, r))
                t_ours = min(t_ours, time.perf_counter() - t0)
            ref, _ = asyncio.run(upstream_path(up_url, n, p, r))
            same = torch.equal(torch.sort(ref, -1).values, torch.sort(ours, -1).values)
            if not same:
                raise SystemExit("the two paths disagree")
        finally:
            upstream.kill()
            upstream.wait()
            svc.stop()
            redis.stop()
    speed, shrink = t_up / t_ours, up_bytes / our_bytes
    print(f"\n| path | bytes transferred | seconds (best of {args.repeat}) | tensor |")
    print("|---|---:|---:|---|")
    print(
        f"| upstream: JSON + base64 int32, decode + pad by hand | {up_bytes:,} | "
        f"{t_up:.2f} | {tuple(ours.shape)} {ours.dtype} |"
    )
    print(
        f"| ours: AsyncRoutingClient.get_many + verl_layout | {our_bytes:,.0f} | "
        f"{t_ours:.2f} | identical (as sets) |"
    )
    print(
        f"\nspeed-up {speed:.2f}x (target >= 3x: {'met' if speed >= 3 else 'NOT met'}); "
        f"bytes {shrink:.1f}x fewer (target >= 5x: {'met' if shrink >= 5 else 'NOT met'})"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "upstream_s": t_up,
                    "ours_s": t_ours,
                    "upstream_bytes": up_bytes,
                    "our_bytes": our_bytes,
                    "speedup": speed,
                    "byte_ratio": shrink,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
