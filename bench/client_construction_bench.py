"""What a client costs to make: ``RoutingClient`` / ``AsyncRoutingClient`` against a bare
``httpx.Client`` / ``httpx.AsyncClient`` with httpx's default TLS settings (the baseline,
what each of our clients built before it shared one verifying context per CA bundle).

No server: a client connects on its first request, so this is construction and close
alone, interleaved, best of ``--repeat`` rounds of ``--clients`` each.

    python bench/client_construction_bench.py [--clients 50] [--repeat 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from r3_client import AsyncRoutingClient, RoutingClient

URL = "https://r3.example:8443"


def _sync_ours() -> None:
    RoutingClient(URL, api_key="k").close()


def _sync_httpx() -> None:
    httpx.Client(base_url=URL, headers={"Authorization": "Bearer k"}).close()


def _async_ours() -> None:
    asyncio.run(AsyncRoutingClient(URL, api_key="k").aclose())


def _async_httpx() -> None:
    asyncio.run(httpx.AsyncClient(base_url=URL, headers={"Authorization": "Bearer k"}).aclose())


def _ms_per_client(make: Callable[[], None], clients: int) -> float:
    t = time.perf_counter()
    for _ in range(clients):
        make()
    return (time.perf_counter() - t) / clients * 1e3


def main() -> None:
    """Print each kind's best time per client and the ratio; ``--json`` writes them."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    _sync_ours()  # the shared context built once, outside the timing
    _async_ours()
    pairs = {"sync": (_sync_httpx, _sync_ours), "async": (_async_httpx, _async_ours)}
    report: dict[str, dict[str, float]] = {}
    for kind, (base, ours) in pairs.items():
        best = {"httpx_default_ms": float("inf"), "ours_ms": float("inf")}
        for _ in range(args.repeat):  # interleaved: a noisy machine slows both alike
            for key, make in (("httpx_default_ms", base), ("ours_ms", ours)):
                best[key] = min(best[key], _ms_per_client(make, args.clients))
        best["ratio"] = best["httpx_default_ms"] / best["ours_ms"]
        report[kind] = best
        print(
            f"{kind}: httpx default {best['httpx_default_ms']:.2f} ms a client, ours "
            f"{best['ours_ms']:.2f} ms ({best['ratio']:.1f}x)"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
