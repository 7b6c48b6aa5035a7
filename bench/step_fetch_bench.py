"""A training step's routing: each rank fetching its own slice vs one process decoding the step.

Stores a GRPO step at the Qwen3-30B-A3B shape (48 MoE layers, 128 experts, top-8) in a
real cache service over a real ``redis-server``: ``--rollouts`` rollouts of
``--tokens`` tokens, each one segment as the engine ships a single-turn call, skewed
(Zipf-like expert popularity) and uniform routing.  Then, in one run, against the same
store:

* **whole step** (today's glue): one driver process fetches every rollout
  (``RoutingClient.get_many``) and lays out verl's ``routed_experts`` for the whole
  batch (``verl_layout``, int16 ``[bs, T, 48, 8]``), which verl then ships to the
  ranks through Ray.  Timed up to the laid-out tensor only: the dispatch is not
  counted, so this is a lower bound on that path.
* **rank-local**: the driver checks the step once (``check_step``: one ``stat`` per
  rollout) and hands each rank rollout ids and lengths; each of the ``dp x pp x cp x
  tp`` ranks, a separate process, fetches its micro-batches' slices
  (``fetch_verl_rank_slice`` through ``get_ranges``, the next micro-batch prefetched)
  and holds its replay targets (int64, as verl's ``RouterReplay`` takes them).  Ranks
  run ``--wave`` at a time (the machine's cores); each rank's own wall time is what a
  rank on its own host would take.

Reported per distribution: the driver's peak RSS growth in both paths (``VmHWM``
reset before the work), per-rank bytes received against the rank's share of the
stored bytes (its rows x its layers), the sum over ranks against the stored bytes,
per-rank peak RSS growth against the slice it holds, and the time until every rank
holds its targets (slowest rank + the driver's check) against the whole-step time.

**Straddled steps** (``--straddle``, issue 43): then, per fraction, the same step with
that fraction of its rollouts multi-turn agents straddling ``--pushes`` weight pushes,
stored as the engine's shipper writes them (``pushes + 1`` equal turns: turn 1 a
segment ``[0, a)``; after a push, turn 2 a view serving row ``a`` with rows ``[0, a)``
recomputed (other routing, same shape), then its segment ``[a, b)``; and so on).  The
driver expands the step (``expand_states``: one training sample per state; timed, peak
RSS growth), and every rank fetches its micro-batches of *expanded* samples (an
expanded sample of ``n`` tokens keeps the prompt's 1,024 tokens, its response is the
rest) with ``fetch_verl_rank_slice(view="exact", states=...)``.  Against fraction 0
(the same step without views, measured in the same run): extra samples and tokens
forwarded, extra bytes per rank, each rank's bytes against its share (the stored bytes
of the rows x layers its states read, a row's bytes those of the view it is read from
where its state applies one), and the time (expansion + slowest rank).

    python bench/step_fetch_bench.py                       # 256 x 16k, dp2 pp2 cp2 tp2
    python bench/step_fetch_bench.py --rollouts 16 --tokens 4096 --dist skewed   # quick
    python bench/step_fetch_bench.py --rollouts 16 --tokens 8192 --dist skewed \
        --straddle 0,0.1,0.5 --pushes 1,2                # straddled steps, quick

Writes ``bench/out/step_fetch_bench.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cache_service.redis_proc import RedisProcess, free_port  # noqa: E402
from r3_client import (  # noqa: E402
    DirectReader,
    RolloutInfo,
    Routing,
    RoutingClient,
    Segment,
    encode_frame,
    expand_states,
)
from r3_client.expansion import applicable_views  # noqa: E402
from r3_client.layouts import VerlRank, verl_layout, verl_rank_plan  # noqa: E402
from r3_client.rank_local import check_step, fetch_verl_rank_slice, prefetched  # noqa: E402
from r3_client.synthetic import synthetic_routing  # noqa: E402
from tests.support.counting import Counting  # noqa: E402
from tests.support.memory import reset_peak, rss_mib  # noqa: E402
from tests.support.service_process import DIRECT_READS, KEY_A, start_service  # noqa: E402
from tests.support.stored import redis_sent  # noqa: E402

LAYERS, E, K = 48, 128, 8  # Qwen3-30B-A3B
BASES = 8  # distinct synthetic rollouts per distribution; the others relabel their experts
PROMPT = 1024  # every sample's prompt tokens (an expanded sample shorter than that: all but one)
MODEL = "qwen3-30b-a3b-shape"

#: One sample a rank fetches: rollout id, prompt and response lengths, and the state it
#: replays (``None``: the step is not expanded, the read names none).
Sample = tuple[str, int, int, int | None]


def peak_growth(before: float) -> float:
    return rss_mib()[1] - before


def relabelled(rng: np.random.Generator, rows: np.ndarray) -> np.ndarray:
    """A per-layer relabelling of ``rows``' experts: the same entropy, different bytes (no
    two rollouts share a blob, as no two real ones do; a recompute's rows differ)."""
    perm = np.argsort(rng.random((LAYERS, E)), axis=1).astype(np.int16)
    out: np.ndarray = perm[np.arange(LAYERS)[None, :, None], rows]
    return out


def frame_of(rows: np.ndarray, start: int, version: str) -> bytes:
    seg = Segment(start, start + rows.shape[0], MODEL, version)
    return encode_frame(rows, num_experts=E, layer_ids=range(LAYERS), segment=seg)


def turn_rows(tokens: int, pushes: int) -> list[int]:
    """A straddling agent's turns: ``pushes + 1`` equal turns over rows ``[0, tokens - 1)``,
    as the row each starts at and the rows' end (``[0, a, ..., tokens - 1]``)."""
    rows = tokens - 1
    return [rows * t // (pushes + 1) for t in range(pushes + 2)]


def make_step(
    url: str,
    n: int,
    tokens: int,
    skew: float,
    seed: int,
    *,
    straddled: frozenset[int] = frozenset(),
    pushes: int = 1,
    tag: str = "",
) -> list[str]:
    """Store ``n`` rollouts of ``tokens`` tokens; their ids.  Each is one segment as the
    engine ships a single-turn call, except those in ``straddled``: agents of ``pushes +
    1`` turns with a weight push before each later turn, written as the shipper writes
    them (each later turn's call recomputed every earlier row: a view serving the turn's
    first row, then the turn's own segment)."""
    rng = np.random.default_rng(seed)
    bases = [
        synthetic_routing(tokens - 1, LAYERS, E, K, skew=skew, seed=seed + b).astype(np.int16)
        for b in range(min(BASES, n))
    ]
    cuts = turn_rows(tokens, pushes)
    ids = []
    with RoutingClient(url, api_key=KEY_A) as client:
        for i in range(n):
            base = bases[i % len(bases)]
            arr = relabelled(rng, base)
            rid = f"step-{seed}{tag}-{i:05d}"
            if i not in straddled:
                client.put(rid, frame_of(arr, 0, "v1"))
            else:
                for turn in range(pushes + 1):
                    a, b = cuts[turn], cuts[turn + 1]
                    version = f"v{turn + 1}"
                    if turn:  # the push flushed the radix cache: rows [0, a) recomputed
                        client.put(rid, frame_of(relabelled(rng, base[:a]), 0, version), view=a)
                    client.put(rid, frame_of(arr[a:b], a, version))
            ids.append(rid)
    return ids


def whole_step(url: str, ids: list[str], tokens: int, out: Any) -> None:
    """The driver's whole-step path, in a fresh process: fetch, decode, lay out."""
    with RoutingClient(url, api_key=KEY_A) as client:
        before = reset_peak()
        t0 = time.perf_counter()
        routings = [r for _, r in client.get_many(ids) if isinstance(r, Routing)]
        n = len(ids)
        p = np.full(n, PROMPT)
        layout = verl_layout(routings, p, np.full(n, tokens - PROMPT), num_layers=LAYERS)
        dt = time.perf_counter() - t0
        out.put(
            {"s": dt, "rss_growth_mib": peak_growth(before), "tensor_gib": layout.nbytes / 2**30}
        )


def driver_local(url: str, ids: list[str], tokens: int, out: Any) -> None:
    """The rank-local driver, in a fresh process: one check of the step, then only ids."""
    with RoutingClient(url, api_key=KEY_A) as client:
        before = reset_peak()
        t0 = time.perf_counter()
        check_step(client, ids, np.full(len(ids), tokens))
        dt = time.perf_counter() - t0
        out.put({"s": dt, "rss_growth_mib": peak_growth(before)})


def driver_expand(url: str, ids: list[str], tokens: int, out: Any) -> None:
    """The driver of a step with views, in a fresh process: expand it, one training sample
    per state (one batched stat), and hand the ranks ids, states and lengths."""
    with RoutingClient(url, api_key=KEY_A) as client:
        before = reset_peak()
        t0 = time.perf_counter()
        exp = expand_states(client, ids, np.full(len(ids), tokens))
        handed = [(s.rollout_id, s.state, s.num_tokens) for s in exp.states]
        dt = time.perf_counter() - t0
        out.put(
            {
                "s": dt,
                "rss_growth_mib": peak_growth(before),
                "samples": len(exp.states),
                "extra_samples": exp.extra_samples,
                "extra_tokens": exp.extra_tokens,
                "tokens_forwarded": int(exp.num_tokens.sum()),
                "states": handed,
            }
        )


def verl_rank(coords: dict[str, int]) -> VerlRank:
    per = LAYERS // coords["pp"]
    stage = coords["pp_rank"]
    return VerlRank(
        tp_size=coords["tp"], tp_rank=coords["tp_rank"], cp_size=coords["cp"],
        cp_rank=coords["cp_rank"], stage_layers=range(stage * per, (stage + 1) * per),
    )  # fmt: skip


def lens(mb: list[Sample]) -> tuple[list[int], list[int]]:
    return [s[1] for s in mb], [s[2] for s in mb]


def rank_proc(
    url: str, coords: dict[str, int], micro: list[list[Sample]], how: str, redis_url: str, out: Any
) -> None:
    """One rank: fetch every micro-batch's slice (next one prefetched), hold them all.

    ``how``: ``service`` (through the service over HTTP; the bytes counted are the frames
    received) or ``direct`` (a ``DirectReader`` from the service's read plan; the bytes
    counted are what Redis sent while this rank read, so the direct world runs one rank
    at a time)."""
    per = LAYERS // coords["pp"]
    rank = verl_rank(coords)
    expanded = any(s[3] is not None for mb in micro for s in mb)
    with contextlib.ExitStack() as stack:
        src: Any
        if how == "direct":
            src = stack.enter_context(DirectReader.from_service(url, api_key=KEY_A))
        else:
            src = Counting(stack.enter_context(RoutingClient(url, api_key=KEY_A)))
        sent0 = redis_sent(redis_url) if how == "direct" else 0

        def fetch(mb: list[Sample]) -> Any:
            p, r = lens(mb)
            states = [s[3] for s in mb] if expanded else None  # expanded: each its state
            ids = [s[0] for s in mb]
            return fetch_verl_rank_slice(src, ids, p, r, rank=rank, view="exact", states=states)

        before = reset_peak()
        t0 = time.perf_counter()
        held = []
        for _mb, got in prefetched(micro, fetch):
            held.append(got)
        dt = time.perf_counter() - t0
        growth = peak_growth(before)
        rows = sum(verl_rank_plan(*lens(mb), rank=rank).num_rows for mb in micro)
        direct = how == "direct"
        out.put(
            {
                **coords,
                "how": how,
                "s": dt,
                "bytes": redis_sent(redis_url) - sent0 if direct else src.bytes + src.view_bytes,
                "view_bytes": 0 if direct else src.view_bytes,
                "rows": rows,
                "layers": per,
                "slice_mib": sum(sum(a.nbytes for a in s.per_layer) for s in held) / 2**20,
                "rss_growth_mib": growth,
            }
        )


def run_proc(target: Any, *args: Any) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q))
    p.start()
    res = q.get()
    p.join()
    return dict(res)


Job = tuple[dict[str, int], list[list[Sample]]]


def rank_jobs(samples: list[Sample], args: argparse.Namespace) -> list[Job]:
    """Each rank's coordinates and micro-batches: the samples split in ``dp`` contiguous
    parts, each cut into micro-batches of ``args.micro`` in order."""
    dp, pp, cp, tp = args.dp, args.pp, args.cp, args.tp
    bounds = [len(samples) * d // dp for d in range(dp + 1)]
    jobs = []
    for d, s, c, t in np.ndindex(dp, pp, cp, tp):
        mine = samples[bounds[d] : bounds[d + 1]]
        micro = [mine[i : i + args.micro] for i in range(0, len(mine), args.micro)]
        coords = dict(dp=dp, dp_rank=d, pp=pp, pp_rank=s, cp=cp, cp_rank=c, tp=tp, tp_rank=t)
        jobs.append((coords, micro))
    return jobs


def rank_key(coords: dict[str, Any]) -> tuple[int, ...]:
    return tuple(int(coords[k]) for k in ("dp_rank", "pp_rank", "cp_rank", "tp_rank"))


def local_world(
    url: str, jobs: list[Job], args: argparse.Namespace, how: str = "service", redis_url: str = ""
) -> list[dict[str, Any]]:
    """Every rank as its own process, ``args.wave`` at a time (``direct``: one at a time,
    so that what Redis sent while a rank ran is that rank's)."""
    ctx = mp.get_context("spawn")
    results: list[dict[str, Any]] = []
    wave = 1 if how == "direct" else args.wave
    for w in range(0, len(jobs), wave):
        q = ctx.Queue()
        procs = [
            ctx.Process(target=rank_proc, args=(url, coords, micro, how, redis_url, q))
            for coords, micro in jobs[w : w + wave]
        ]
        for p in procs:
            p.start()
        results += [q.get() for _ in procs]
        for p in procs:
            p.join()
    return results


def share_stats(
    ranks: list[dict[str, Any]], stored_total: int, rows_total: int
) -> dict[str, float]:
    """Each rank's bytes over its share (its rows x its layers of the stored bytes; set on
    each rank's record), the worst and the sum over the ranks against the stored bytes."""
    per_row_layer = stored_total / rows_total / LAYERS
    for r in ranks:
        r["share_bytes"] = per_row_layer * r["rows"] * r["layers"]
        r["bytes_over_share"] = r["bytes"] / r["share_bytes"]
        r["rss_over_slice_mib"] = r["rss_growth_mib"] - r["slice_mib"]
    return {
        "max_bytes_over_share": max(r["bytes_over_share"] for r in ranks),
        "sum_bytes_over_stored": sum(r["bytes"] for r in ranks) / stored_total,
        "slowest_rank_s": max(r["s"] for r in ranks),
        "max_rss_over_slice_mib": max(r["rss_over_slice_mib"] for r in ranks),
    }


def direct_world(
    url: str, redis_url: str, ids: list[str], tokens: int, stored_total: int, args: Any
) -> dict[str, Any]:
    """The same ranks reading with ``DirectReader`` (one at a time): each rank's Redis bytes
    over its share."""
    plain: list[Sample] = [(rid, PROMPT, tokens - PROMPT, None) for rid in ids]
    ranks = local_world(url, rank_jobs(plain, args), args, how="direct", redis_url=redis_url)
    return {"ranks": ranks, **share_stats(ranks, stored_total, len(ids) * (tokens - 1))}


def short_step(
    url: str, redis_url: str, name: str, skew: float, args: argparse.Namespace
) -> dict[str, Any]:
    """``--short-tokens`` samples (4k, say), stored and read by the same world through the
    service and with ``DirectReader``: each rank's bytes over its share, and what Redis
    sent over the stored bytes through the service."""
    tokens = args.short_tokens
    ids = make_step(url, args.rollouts, tokens, skew, seed=41 if name == "skewed" else 43)
    with RoutingClient(url, api_key=KEY_A) as client:
        stored_total = sum(client.stat(r).stored_bytes for r in ids)
    plain: list[Sample] = [(rid, PROMPT, tokens - PROMPT, None) for rid in ids]
    r0 = redis_sent(redis_url)
    ranks = local_world(url, rank_jobs(plain, args), args)
    out: dict[str, Any] = {
        "tokens": tokens,
        "stored_bytes": stored_total,
        "redis_out_over_stored": (redis_sent(redis_url) - r0) / stored_total,
        "service": {"ranks": ranks, **share_stats(ranks, stored_total, len(ids) * (tokens - 1))},
    }
    if args.direct:
        out["direct"] = direct_world(url, redis_url, ids, tokens, stored_total, args)
    with RoutingClient(url, api_key=KEY_A) as client:
        for key in ids:
            client.delete(key)
    print(
        f"[{name}] {tokens}-token samples: bytes/share max service "
        f"{out['service']['max_bytes_over_share']:.3f}"
        + (f", direct {out['direct']['max_bytes_over_share']:.3f}" if "direct" in out else "")
        + f"; Redis sent {out['redis_out_over_stored']:.3f}x stored (service)",
        flush=True,
    )
    return out


def one_distribution(
    url: str, redis_url: str, name: str, skew: float, args: argparse.Namespace
) -> dict[str, Any]:
    t0 = time.perf_counter()
    ids = make_step(url, args.rollouts, args.tokens, skew, seed=17 if name == "skewed" else 29)
    print(f"[{name}] stored {len(ids)} rollouts in {time.perf_counter() - t0:.0f} s", flush=True)
    with RoutingClient(url, api_key=KEY_A) as client:
        stored = [client.stat(r).stored_bytes for r in ids]
    stored_total = sum(stored)
    r0 = redis_sent(redis_url)
    whole = run_proc(whole_step, url, ids, args.tokens)
    r1 = redis_sent(redis_url)
    whole["redis_out_over_stored"] = (r1 - r0) / stored_total
    print(f"[{name}] whole step: {whole}", flush=True)
    driver = run_proc(driver_local, url, ids, args.tokens)
    plain: list[Sample] = [(rid, PROMPT, args.tokens - PROMPT, None) for rid in ids]
    ranks = local_world(url, rank_jobs(plain, args), args)
    redis_local = (redis_sent(redis_url) - r1) / stored_total
    rows_total = args.rollouts * (args.tokens - 1)
    shares = share_stats(ranks, stored_total, rows_total)
    slowest = shares["slowest_rank_s"]
    local_s = driver["s"] + slowest
    out = {
        "rollouts": args.rollouts,
        "tokens": args.tokens,
        "stored_bytes": stored_total,
        "stored_bytes_per_token": stored_total / (args.rollouts * args.tokens),
        "whole_step": whole,
        "rank_local": {
            "driver": driver,
            "ranks": ranks,
            "slowest_rank_s": slowest,
            "sum_rank_s": sum(r["s"] for r in ranks),
            "time_to_all_ranks_s": local_s,
            "sum_bytes_over_stored": shares["sum_bytes_over_stored"],
            "max_bytes_over_share": shares["max_bytes_over_share"],
            "max_rss_over_slice_mib": shares["max_rss_over_slice_mib"],
            "redis_out_over_stored": redis_local,
        },
        "time_ratio_local_over_whole": local_s / whole["s"],
    }
    if args.direct:
        d = out["direct"] = direct_world(url, redis_url, ids, args.tokens, stored_total, args)
        print(
            f"[{name}] DirectReader ranks: bytes/share max {d['max_bytes_over_share']:.3f}, "
            f"sum/stored {d['sum_bytes_over_stored']:.3f}, "
            f"slowest rank {d['slowest_rank_s']:.2f} s",
            flush=True,
        )
    with RoutingClient(url, api_key=KEY_A) as client:
        for key in ids:
            client.delete(key)
    rl = out["rank_local"]
    print(
        f"[{name}] stored {out['stored_bytes_per_token']:.0f} B/token | whole step "
        f"{whole['s']:.2f} s, driver RSS +{whole['rss_growth_mib']:.0f} MiB | rank-local: "
        f"driver {driver['s']:.2f} s RSS +{driver['rss_growth_mib']:.0f} MiB, slowest rank "
        f"{slowest:.2f} s (sum {rl['sum_rank_s']:.1f} s over {len(ranks)} ranks), bytes/share max "
        f"{rl['max_bytes_over_share']:.3f}, sum/stored {rl['sum_bytes_over_stored']:.3f}, "
        f"rank RSS - slice max {rl['max_rss_over_slice_mib']:.0f} MiB, Redis sent "
        f"{redis_local:.3f}x stored (whole step {whole['redis_out_over_stored']:.3f}x) | "
        f"time ratio {out['time_ratio_local_over_whole']:.3f}",
        flush=True,
    )
    return out


Piece = tuple[int, int, float, bool]  # rows [a, b), stored bytes per row and layer, a view's


def state_pieces(info: RolloutInfo, state: int) -> tuple[list[Piece], list[Piece]]:
    """Where a read under ``state`` finds each row: the rollout's segments with the views
    that state applies written over them in order (later wins), each at its own stored
    bytes per row and layer; and what the client reads for it, at row granularity: since
    issue 43 each row once, from that same source (``RoutingClient.get_ranges`` reads
    ``read_pieces``), so the two are one list (before, it read every segment row of the
    range, then each applied view's rows in it: the rows a later view overwrites too)."""
    segs: list[Piece] = [
        (
            g.segment.start,
            g.segment.end,
            g.nbytes / (g.segment.end - g.segment.start) / LAYERS,
            False,
        )
        for g in info.segments
    ]
    out = list(segs)
    for v in applicable_views(info):
        if v.serves > state or v.end <= v.start:
            continue
        cut: list[Piece] = []
        for a, b, rate, is_view in out:
            if a < v.start:
                cut.append((a, min(b, v.start), rate, is_view))
            if b > v.end:
                cut.append((max(a, v.end), b, rate, is_view))
        piece = (v.start, v.end, v.nbytes / (v.end - v.start) / LAYERS, True)
        out = [*cut, piece]
    return out, out


def rank_share(job: Job, infos: dict[str, RolloutInfo]) -> tuple[float, float, float]:
    """The stored bytes of the rows x layers ``job``'s rank reads under its samples'
    states (each row at the bytes of the segment or view it is read from: its share), the
    part of them read from views, and the bytes of the rows x layers the client reads
    for them (:func:`state_pieces`: the share, each row read once since issue 43)."""
    coords, micro = job
    rank = verl_rank(coords)
    pieces: dict[tuple[str, int], tuple[list[Piece], list[Piece]]] = {}
    total = from_views = read = 0.0
    for mb in micro:
        for i, a, b, _ in verl_rank_plan(*lens(mb), rank=rank).runs:
            rid, _, _, state = mb[i]
            key = (rid, state or 0)
            if key not in pieces:
                pieces[key] = state_pieces(infos[rid], key[1])
            need, reads = pieces[key]
            for lo, hi, rate, is_view in need:
                got = max(0, min(b, hi) - max(a, lo)) * rate
                total += got
                from_views += got if is_view else 0.0
            read += sum(max(0, min(b, hi) - max(a, lo)) * rate for lo, hi, rate, _ in reads)
    per = LAYERS // coords["pp"]
    return total * per, from_views * per, read * per


def straddled_step(
    url: str, skew: float, seed: int, frac: float, pushes: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One fraction: store the step, expand it on the driver, fetch it rank by rank."""
    n = args.rollouts
    k = round(frac * n)
    straddled = frozenset(i * n // k for i in range(k)) if k else frozenset()
    t0 = time.perf_counter()
    tag = f"-p{pushes}-k{k}"
    ids = make_step(url, n, args.tokens, skew, seed, straddled=straddled, pushes=pushes, tag=tag)
    store_s = time.perf_counter() - t0
    with RoutingClient(url, api_key=KEY_A) as client:
        got = client.stat_many(ids)
    infos = {i.rollout_id: i for i in got if isinstance(i, RolloutInfo)}
    assert len(infos) == n, got
    stored = sum(i.stored_bytes for i in infos.values())
    view_bytes = sum(v.nbytes for i in infos.values() for v in i.views)
    driver = run_proc(driver_expand, url, ids, args.tokens)
    samples: list[Sample] = []
    for rid, state, nt in driver.pop("states"):
        prompt = min(PROMPT, nt - 1)
        samples.append((rid, prompt, nt - prompt, state))
    jobs = rank_jobs(samples, args)
    by_key = {rank_key(c): (c, m) for c, m in jobs}
    ranks = local_world(url, jobs, args)
    for r in ranks:
        share, share_views, read = rank_share(by_key[rank_key(r)], infos)
        r["share_bytes"] = share
        r["share_view_bytes"] = share_views
        r["bytes_over_share"] = r["bytes"] / share
        # bytes / share = (rows read / share: 1 since each row is read once) x (bytes / rows
        # read: whole blocks and layer groups around the rows)
        r["read_rows_bytes"] = read
        r["read_rows_over_share"] = read / share
        r["bytes_over_read_rows"] = r["bytes"] / read
        r["rss_over_slice_mib"] = r["rss_growth_mib"] - r["slice_mib"]
    ranks.sort(key=rank_key)
    with RoutingClient(url, api_key=KEY_A) as client:
        for key in ids:
            client.delete(key)
    slowest = max(r["s"] for r in ranks)
    return {
        "fraction": frac,
        "pushes": pushes,
        "straddled": k,
        "turn_rows": turn_rows(args.tokens, pushes),
        "store_s": store_s,
        "stored_bytes": stored,
        "view_bytes_stored": view_bytes,
        "driver": driver,
        "ranks": ranks,
        "slowest_rank_s": slowest,
        "time_s": driver["s"] + slowest,
        "max_bytes_over_share": max(r["bytes_over_share"] for r in ranks),
        "sum_bytes_over_share": sum(r["bytes"] for r in ranks)
        / sum(r["share_bytes"] for r in ranks),
        "max_read_rows_over_share": max(r["read_rows_over_share"] for r in ranks),
        "sum_read_rows_over_share": sum(r["read_rows_bytes"] for r in ranks)
        / sum(r["share_bytes"] for r in ranks),
        "max_bytes_over_read_rows": max(r["bytes_over_read_rows"] for r in ranks),
        "sum_bytes_over_read_rows": sum(r["bytes"] for r in ranks)
        / sum(r["read_rows_bytes"] for r in ranks),
        "sum_view_bytes_over_view_share": (
            sum(r["view_bytes"] for r in ranks) / sum(r["share_view_bytes"] for r in ranks)
            if view_bytes
            else None
        ),
        "max_rss_over_slice_mib": max(r["rss_over_slice_mib"] for r in ranks),
    }


def straddled_steps(url: str, name: str, skew: float, args: argparse.Namespace) -> dict[str, Any]:
    """Fraction 0 (the same step without views: the baseline), then each fraction > 0 for
    each number of pushes, compared with it."""
    seed = 41 if name == "skewed" else 53
    step_tokens = args.rollouts * args.tokens
    base = straddled_step(url, skew, seed, 0.0, 1, args)
    base_bytes = {rank_key(r): r["bytes"] for r in base["ranks"]}
    runs = [base]
    for pushes in args.pushes:
        for frac in args.straddle:
            if frac > 0:
                runs.append(straddled_step(url, skew, seed, frac, pushes, args))
    for run in runs:
        d = run["driver"]
        extra = [r["bytes"] - base_bytes[rank_key(r)] for r in run["ranks"]]
        run["extra_tokens_over_step"] = d["extra_tokens"] / step_tokens
        run["extra_bytes_per_rank"] = {
            "min": min(extra),
            "mean": sum(extra) / len(extra),
            "max": max(extra),
        }
        run["bytes_per_rank_over_fraction_0"] = max(
            r["bytes"] / base_bytes[rank_key(r)] for r in run["ranks"]
        )
        run["time_over_fraction_0"] = run["time_s"] / base["time_s"]
        print(
            f"[{name} straddle {run['fraction']:g} x {run['pushes']} push(es)] "
            f"{run['straddled']} of {args.rollouts} rollouts straddle | expand "
            f"{d['s'] * 1e3:.0f} ms, driver RSS +{d['rss_growth_mib']:.1f} MiB | "
            f"+{d['extra_samples']} samples, +{d['extra_tokens']} tokens "
            f"({run['extra_tokens_over_step']:.1%} of the step) | per rank +"
            f"{run['extra_bytes_per_rank']['mean'] / 1e6:.1f} MB mean, "
            f"+{run['extra_bytes_per_rank']['max'] / 1e6:.1f} MB max, "
            f"max {run['bytes_per_rank_over_fraction_0']:.2f}x fraction 0 | bytes/share "
            f"max {run['max_bytes_over_share']:.3f}, summed {run['sum_bytes_over_share']:.3f} "
            f"(rows read / share max {run['max_read_rows_over_share']:.3f}, bytes / rows "
            f"read max {run['max_bytes_over_read_rows']:.3f}) | "
            f"time {run['time_s']:.2f} s ({run['time_over_fraction_0']:.2f}x fraction 0), "
            f"rank RSS - slice max {run['max_rss_over_slice_mib']:.0f} MiB",
            flush=True,
        )
    return {"step_tokens": step_tokens, "runs": runs}


def fractions(text: str) -> list[float]:
    if text.strip().lower() in ("", "none", "off"):
        return []
    out = [float(x) for x in text.split(",")]
    if any(not 0 <= x <= 1 for x in out):
        raise argparse.ArgumentTypeError(f"fractions must lie in [0, 1], got {text!r}")
    return out


def push_counts(text: str) -> list[int]:
    out = [int(x) for x in text.split(",")]
    if any(x not in (1, 2) for x in out):
        raise argparse.ArgumentTypeError(f"pushes must be 1 or 2, got {text!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rollouts", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--micro", type=int, default=4, help="samples per micro-batch")
    ap.add_argument("--wave", type=int, default=2, help="ranks running at once")
    ap.add_argument("--dist", choices=["skewed", "uniform", "both"], default="both")
    ap.add_argument(
        "--straddle",
        type=fractions,
        default=fractions("0,0.1,0.5"),
        metavar="FRACTION[,FRACTION...]",
        help="fractions of the rollouts straddling weight pushes (fraction 0, the baseline, "
        'is always measured; "none": skip the straddled steps)',
    )
    ap.add_argument(
        "--pushes",
        type=push_counts,
        default=[1],
        metavar="1|2|1,2",
        help="weight pushes each straddling agent spans (turns: pushes + 1)",
    )
    ap.add_argument(
        "--direct",
        action="store_true",
        help="also read the step with DirectReader ranks (one at a time): Redis bytes per rank",
    )
    ap.add_argument(
        "--short-tokens",
        type=int,
        default=0,
        help="also a step of --rollouts samples of this many tokens (4096: issue 44's 4k "
        "samples at CP 2), read by the same world; 0: none",
    )
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "out" / "step_fetch_bench.json")
    args = ap.parse_args(argv)
    if LAYERS % args.pp or args.rollouts % args.dp:
        ap.error("pp must divide 48 layers and dp the rollouts")
    env = {
        "R3_CACHE_MAX_BATCH": str(max(1024, args.rollouts)),
        "R3_CACHE_MAX_BODY_BYTES": str(256 << 20),
        "R3_CACHE_MAX_TOKENS_PER_SEGMENT": str(1 << 20),
    }
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    dists = {"skewed": 1.0, "uniform": 0.0}
    chosen = list(dists) if args.dist == "both" else [args.dist]
    with tempfile.TemporaryDirectory(prefix="r3-step-fetch-") as tmp_s:
        tmp = Path(tmp_s)
        # (a password: a service with direct reads on refuses a Redis that admits anyone)
        redis = RedisProcess(
            free_port(), tmp / "redis", appendonly=False, password=secrets.token_urlsafe(24)
        )
        redis.start()
        svc = None
        try:
            svc = start_service(
                tmp, redis.url, env={**env, **(DIRECT_READS if args.direct else {})}
            )
            for name in chosen:
                report[name] = one_distribution(svc.http_url, redis.url, name, dists[name], args)
                if args.short_tokens:
                    report[name]["short"] = short_step(
                        svc.http_url, redis.url, name, dists[name], args
                    )
                if args.straddle:
                    report[name]["straddle"] = straddled_steps(
                        svc.http_url, name, dists[name], args
                    )
        finally:
            if svc is not None:
                svc.stop()
            redis.stop()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
