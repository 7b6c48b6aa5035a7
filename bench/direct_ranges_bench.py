"""``DirectReader.get_ranges`` memory at many reads of one rollout (issue 42, defect 7).

Stores one rollout (``--rows`` rows of the tiny-moe shape: 3 MoE layers, 64 experts,
top-4) in a real cache service with direct reads on, over a real passworded
``redis-server``, and reads it through :meth:`DirectReader.get_ranges` with ``N`` small
reads (``--span`` rows each, cycling over the rollout) for each ``N`` of ``--reads``.
Per ``N``, three passes against the same store:

* **held**: the first answer taken, then the generator left suspended; the growth of the
  Python heap (``tracemalloc`` current) is what the reader holds for the reads not yet
  consumed;
* **peak**: every answer consumed (and dropped), ``tracemalloc`` peak growth;
* **rss**: the same without ``tracemalloc``: peak RSS growth (``VmHWM`` reset before)
  and the wall time.

    python bench/direct_ranges_bench.py                       # 10^4 and 10^5 reads
    python bench/direct_ranges_bench.py --reads 1000 10000    # quick
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import secrets
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cache_service.redis_proc import RedisProcess, free_port  # noqa: E402
from r3_client import DirectReader, Routing  # noqa: E402
from r3_client.synthetic import synthetic_routing  # noqa: E402
from tests.support.frames import LAYERS, E, K, frame_for, rid  # noqa: E402
from tests.support.memory import reset_peak, rss_mib  # noqa: E402
from tests.support.service_process import DIRECT_READS, KEY_A, Service, start_service  # noqa: E402

MIB = 1 << 20


def reads_of(key: str, n: int, rows: int, span: int) -> list[tuple[str, int, int]]:
    starts = itertools.cycle(range(0, rows - span + 1, span))
    return [(key, a, a + span) for a in itertools.islice(starts, n)]


def held(reader: DirectReader, reads: list[tuple[str, int, int]]) -> float:
    """MiB the reader holds after its first answer, the rest not yet consumed."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        it = reader.get_ranges(reads)
        next(it)
        time.sleep(0.5)  # let the decode workers run ahead as far as they may
        grown = tracemalloc.get_traced_memory()[0] - base
        del it  # its last reference: the generator is closed
    finally:
        tracemalloc.stop()
    return grown / MIB


def peak(reader: DirectReader, reads: list[tuple[str, int, int]]) -> float:
    """``tracemalloc`` peak growth (MiB) over a call whose answers are all consumed."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        count = sum(1 for _ in reader.get_ranges(reads))
        top = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert count == len(reads)
    return top / MIB


def rss(reader: DirectReader, reads: list[tuple[str, int, int]]) -> tuple[float, float]:
    """(peak RSS growth MiB, seconds) over a call whose answers are all consumed."""
    gc.collect()
    before = reset_peak()
    t0 = time.perf_counter()
    count = 0
    for _, got in reader.get_ranges(reads):
        assert isinstance(got, Routing)
        count += 1
    secs = time.perf_counter() - t0
    assert count == len(reads)
    return rss_mib()[1] - before, secs


def run(svc: Service, args: argparse.Namespace) -> dict[str, Any]:
    key = rid()
    rows = synthetic_routing(args.rows, len(LAYERS), E, K, skew=1.0, seed=3)
    with svc.http() as c:
        resp = c.put(f"/v1/rollouts/{key}/segments", content=frame_for(rows, 0, digest=False))
        assert resp.status_code in (200, 201), resp.text
    out: dict[str, Any] = {}
    with DirectReader.from_service(svc.http_url, api_key=KEY_A) as reader:
        # warm up (connections, codec backend) and check a sample of answers
        for (_, a, b), (_, got) in zip(
            reads_of(key, 64, args.rows, args.span),
            reader.get_ranges(reads_of(key, 64, args.rows, args.span)),
            strict=True,
        ):
            assert isinstance(got, Routing) and got.start == a, got
            assert (np.sort(got.indices, -1) == np.sort(rows[a:b], -1)).all()
        for n in args.reads:
            reads = reads_of(key, n, args.rows, args.span)
            grown_rss, secs = rss(reader, reads)
            fig = {
                "held_mib": round(held(reader, reads), 2),
                "tracemalloc_peak_mib": round(peak(reader, reads), 2),
                "rss_peak_growth_mib": round(grown_rss, 1),
                "seconds": round(secs, 2),
                "reads_per_s": round(n / secs),
            }
            out[str(n)] = fig
            print(
                f"{n:>7} reads of one {args.rows}-row rollout ({args.span} rows each): "
                f"held after 1st answer {fig['held_mib']:.2f} MiB, tracemalloc peak "
                f"{fig['tracemalloc_peak_mib']:.2f} MiB, RSS peak +{fig['rss_peak_growth_mib']} "
                f"MiB, {secs:.2f} s ({fig['reads_per_s']} reads/s)",
                flush=True,
            )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reads", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--span", type=int, default=4)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="r3-direct-ranges-") as tmp_s:
        tmp = Path(tmp_s)
        rp = RedisProcess(
            free_port(), tmp / "redis", appendonly=False, password=secrets.token_urlsafe(24)
        )
        svc: Service | None = None
        try:
            rp.start()
            svc = start_service(tmp, rp.url, env=DIRECT_READS)
            report = run(svc, args)
        finally:
            if svc is not None:
                svc.stop()
            rp.stop()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
