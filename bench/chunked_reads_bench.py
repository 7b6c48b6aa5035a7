"""Bytes Redis sends for a training step's ranked reads: whole-segment layout vs chunked.

Issue 44: Redis cannot read part of a hash field, so before the chunked layout every
pipeline stage and CP rank reading a rollout made Redis send all of it.  This stores the
same rollouts (Qwen3-30B-A3B shape: 48 layers, 128 experts, top-8, skewed routing, one
segment each) in two namespaces-worth of services over one ``redis-server``: one service
writing ``R3_CACHE_STORE_LAYOUT=whole`` (the baseline, in the same run), one writing
``chunked`` (the default).  Then every (pp stage, CP rank) reads its rows (CP zigzag: two
of ``2 * cp`` equal chunks) of its stage's layers, through the service
(``RoutingClient.get_ranges``) and straight from Redis (``DirectReader.get_ranges``), and
Redis's ``total_net_output_bytes`` is read around each: Redis bytes sent / stored bytes,
summed over the ranks (the ideal is 1.0: every byte leaves Redis once), and each rank's
bytes over its share (its rows x its layers of the stored bytes; the worst rank reported),
per layout and reader.  Each figure includes the ``INFO`` reply it is read with (~1.6 KB
per rank).

    python bench/chunked_reads_bench.py --rollouts 4 --tokens 16384 --pp 4 --cp 2

Writes ``bench/out/chunked_reads_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


from cache_service.redis_proc import RedisProcess, free_port  # noqa: E402
from r3_client import DirectReader, RoutingClient, Segment, encode_frame  # noqa: E402
from r3_client.synthetic import synthetic_routing  # noqa: E402
from tests.support.service_process import DIRECT_READS, KEY_A, start_service  # noqa: E402
from tests.support.stored import redis_sent  # noqa: E402

LAYERS, E, K = 48, 128, 8


def rank_reads(ids: list[str], rows: int, cp: int, c: int) -> list[tuple[str, int, int]]:
    """CP rank ``c``'s zigzag rows of every rollout: chunks ``c`` and ``2 cp - 1 - c``."""
    n = 2 * cp
    cut = [rows * i // n for i in range(n + 1)]
    out = []
    for rid in ids:
        for j in (c, n - 1 - c):
            out.append((rid, cut[j], cut[j + 1]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rollouts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument(
        "--json", type=Path, default=ROOT / "bench" / "out" / "chunked_reads_bench.json"
    )
    args = ap.parse_args()
    rows = args.tokens - 1
    per = LAYERS // args.pp
    report: dict[str, Any] = {"rollouts": args.rollouts, "tokens": args.tokens, "pp": args.pp}
    report["cp"] = args.cp
    with tempfile.TemporaryDirectory() as tmp:
        redis_proc = RedisProcess(
            free_port(), Path(tmp) / "redis", appendonly=False, password=secrets.token_urlsafe(24)
        ).start()
        try:
            for layout in ("whole", "chunked"):
                env = {**DIRECT_READS, "R3_CACHE_STORE_LAYOUT": layout}
                (Path(tmp) / layout).mkdir()
                svc = start_service(Path(tmp) / layout, redis_proc.url, env=env)
                try:
                    ids, stored = [], 0
                    with RoutingClient(svc.http_url, api_key=KEY_A) as client:
                        for n in range(args.rollouts):
                            rid = f"{layout}-{n}"
                            idx = synthetic_routing(rows, LAYERS, E, K, skew=1.0, rho=0.9, seed=n)
                            seg = Segment(0, rows, "qwen3-30b-a3b-shape", layout)
                            client.put(
                                rid,
                                encode_frame(
                                    idx, num_experts=E, layer_ids=range(LAYERS), segment=seg
                                ),
                            )
                            stored += client.stat(rid).stored_bytes
                            ids.append(rid)
                        out: dict[str, float] = {}
                        for how in ("service", "direct"):
                            total, worst = 0, 0.0
                            reader = (
                                DirectReader.from_service(svc.http_url, api_key=KEY_A)
                                if how == "direct"
                                else None
                            )
                            try:
                                for s in range(args.pp):
                                    layers = list(range(s * per, (s + 1) * per))
                                    for c in range(args.cp):
                                        reads = rank_reads(ids, rows, args.cp, c)
                                        before = redis_sent(redis_proc.url)
                                        src: Any = reader if reader is not None else client
                                        for _ in src.get_ranges(
                                            reads, layers=layers, view="generated"
                                        ):
                                            pass
                                        sent = redis_sent(redis_proc.url) - before
                                        total += sent
                                        # its share: its rows x its layers of the stored bytes
                                        got_rows = sum(b - a for _, a, b in reads)
                                        share = stored * got_rows / (rows * len(ids)) / args.pp
                                        worst = max(worst, sent / share)
                            finally:
                                if reader is not None:
                                    reader.close()
                            out[f"{how}_redis_sent_over_stored"] = total / stored
                            out[f"{how}_worst_rank_sent_over_share"] = worst
                        out["stored_bytes"] = stored
                        report[layout] = out
                        print(f"[{layout}] {out}", flush=True)
                finally:
                    svc.stop()
        finally:
            redis_proc.stop()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
