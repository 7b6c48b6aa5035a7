"""Format v3 groundwork (issue 37): what each candidate digest, checksum and entropy stage
costs and saves at the issue's shapes, single-threaded, against v2 and base64 in one run.

Measurements only: nothing here is product code, and it imports packages the project does
not depend on (``blake3``, ``google-crc32c``, ``crc32c``, ``constriction``, ``xxhash``).
Run it from the repository root in a separate venv (never the project's ``.venv``)::

    python3 -m venv --system-site-packages /tmp/v3probe
    /tmp/v3probe/bin/pip install blake3 google-crc32c crc32c constriction \\
        numpy==2.3.5 zstandard==0.25.0 msgpack==1.2.4 xxhash==4.1.0   # the .venv's versions
    PYTHONPATH=clients /tmp/v3probe/bin/python docs/notes/format-v3-probe/probe.py \\
        [--tokens 16384] [--repeat 5] [--shapes qwen3,dsv3,e512] [--json out.json]

Every figure is process CPU (``time.process_time``) of one call on one thread (blake3 with
its default ``max_threads=1``; python-zstandard without worker threads), best and median
of ``--repeat`` calls after one warm-up call. Data as ``bench/native_codec_bench.py``:
``synthetic_routing`` skewed (skew 1.0, rho 0.9) and uniform (skew 0, rho 0), seed 0.

"B/row" is bytes per (token, layer) row, as issue 37 counts it.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import math
import resource
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from typing import Any

import blake3
import constriction
import crc32c as crc32c_pkg
import google_crc32c
import numpy as np
import numpy.typing as npt
import xxhash
import zstandard

from r3_client import Segment, _native, decode_frame, encode_frame, token_digest
from r3_client.codec import use_backend
from r3_client.codec.bodies import gap_dtype, gap_payload, popularity
from r3_client.codec.frame import BLOCK_ROWS, LAYER_GROUPS
from r3_client.codec.header import content_digest, inverse_order
from r3_client.synthetic import synthetic_routing

SHAPES = {  # name: (layers, experts, topk)
    "qwen3": (48, 128, 8),  # Qwen3-30B-A3B, the headline shape
    "dsv3": (58, 256, 8),  # DeepSeek-V3
    "e512": (40, 512, 22),  # NemotronH-like E=512/K=22 (layer count assumed: per-row figures)
}
DATA = {
    "skewed": {"skew": 1.0, "rho": 0.9},
    "uniform": {"skew": 0.0, "rho": 0.0},
    # not in the bench: skewed without the AR(1) time correlation (what zstd's matches use)
    "skewed-iid": {"skew": 1.0, "rho": 0.0},
}
ZSTD_LEVELS = (3, 2, 1, -1, -3, -5, -10)
#: One zstd parameter set found by a short sweep (docs/notes/format-v3-probe.md): the fast
#: strategy with the longest minimum match and a tiny hash table (few, long matches; the
#: window covers a whole chunk so each chunk is one block with its own Huffman table).
FAST7 = {
    "strategy": zstandard.STRATEGY_FAST,
    "min_match": 7,
    "hash_log": 6,
    "window_log": 17,
    "search_log": 1,
}


def cpu(fn: Callable[[], object], repeat: int) -> dict[str, float]:
    """Best and median process-CPU milliseconds of ``fn`` over ``repeat`` calls (one warm-up)."""
    fn()
    runs = []
    for _ in range(repeat):
        c0 = time.process_time()
        fn()
        runs.append((time.process_time() - c0) * 1e3)
    return {"best_ms": min(runs), "median_ms": statistics.median(runs)}


def chunk_plan(rows: int, nl: int) -> list[tuple[int, int, int, int]]:
    """v2's default chunks (block rows 2048, 8 balanced layer groups): (a, b, lo, hi)."""
    ng = min(nl, LAYER_GROUPS)
    per, extra = divmod(nl, ng)
    bounds = [0]
    for g in range(ng):
        bounds.append(bounds[-1] + per + (1 if g < extra else 0))
    return [
        (a, min(a + BLOCK_ROWS, rows), bounds[g], bounds[g + 1])
        for a in range(0, rows, BLOCK_ROWS)
        for g in range(ng)
    ]


def entropy_bits(counts: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """Per-layer order-0 entropy (bits per symbol) of ``[L, A]`` symbol counts."""
    p = counts / counts.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.where(p > 0, p * np.log2(p), 0.0)
    return h.sum(axis=1)


def table_bytes(counts: npt.NDArray[Any]) -> int:
    """Shipping cost of per-layer frequency tables: counts quantized to 2^15 per layer as
    uint16 (a nonzero count keeps at least 1), zstd-3. An estimate of a v3 context's table."""
    q = np.floor(counts / counts.sum(axis=1, keepdims=True) * 32768).astype(np.int64)
    q = np.where((counts > 0) & (q == 0), 1, q).astype("<u2")
    return len(zstandard.ZstdCompressor(level=3).compress(q.tobytes()))


class Rans:
    """Order-0 rANS (constriction's stack coder, 32-bit words, 24-bit precision) with one
    categorical model per layer built from frame-wide counts; one coder per v2 chunk,
    layers coded one after another within the chunk."""

    def __init__(self, counts: npt.NDArray[Any]) -> None:
        self.models = [
            constriction.stream.model.Categorical(c.astype(np.float64), perfect=False)
            for c in counts
        ]

    def encode(self, lm: npt.NDArray[np.int32], plan: list[tuple[int, int, int, int]]) -> list[Any]:
        """``lm``: layer-major symbols ``[L, R, K]`` int32 -> one uint32 array per chunk."""
        out = []
        for a, b, lo, hi in plan:
            coder = constriction.stream.stack.AnsCoder()
            for layer in range(hi - 1, lo - 1, -1):  # a stack: last in, first out
                coder.encode_reverse(lm[layer, a:b].reshape(-1), self.models[layer])
            out.append(coder.get_compressed())
        return out

    def decode(
        self,
        chunks: list[Any],
        plan: list[tuple[int, int, int, int]],
        k: int,
        out: npt.NDArray[np.int32],
    ) -> None:
        for data, (a, b, lo, hi) in zip(chunks, plan, strict=True):
            coder = constriction.stream.stack.AnsCoder(data)
            for layer in range(lo, hi):
                out[layer, a:b] = coder.decode(self.models[layer], (b - a) * k).reshape(b - a, k)


def measure(
    name: str, dist: str, idx: npt.NDArray[Any], e: int, args: argparse.Namespace
) -> dict[str, Any]:
    rows, nl, k = idx.shape
    rr = args.repeat
    nrows = rows * nl  # (token, layer) rows
    res: dict[str, Any] = {
        "shape": name,
        "dist": dist,
        "rows": rows,
        "layers": nl,
        "E": e,
        "K": k,
        "ids": idx.size,
    }
    stored = idx.astype(np.uint8 if e <= 256 else np.uint16)  # as the engine hands them over
    i32 = np.ascontiguousarray(idx, dtype="<i4")
    seg = Segment(0, rows, "probe", "v0", token_digest(np.arange(rows, dtype=np.uint32)))
    layers = tuple(range(nl))

    # ---- baselines: upstream's wires and v2 ------------------------------------------------
    def v2_encode() -> bytes:
        return encode_frame(stored, num_experts=e, layer_ids=layers, start=0, segment=seg)

    frame = v2_encode()
    res["v2_frame_bytes"] = len(frame)
    res["v2_B_per_row"] = len(frame) / nrows
    t: dict[str, Any] = {}
    t["b64(int32)"] = cpu(lambda: base64.b64encode(i32.data), rr)
    t["b64(stored)"] = cpu(lambda: base64.b64encode(stored.data), rr)
    # base64's CPU includes the page faults of its fresh output (33.5 MB at 16k x 48 x 8)
    # when the allocator maps new memory; split user / system time and count the faults.
    splits = []
    for _ in range(rr):
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        base64.b64encode(i32.data)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        splits.append(
            (
                (r1.ru_utime - r0.ru_utime) * 1e3,
                (r1.ru_stime - r0.ru_stime) * 1e3,
                r1.ru_minflt - r0.ru_minflt,
            )
        )
    res["b64_int32_user_sys_ms_minflt"] = splits
    t["v2 encode_frame (native)"] = cpu(v2_encode, rr)
    t["v2 decode_frame (native)"] = cpu(lambda: decode_frame(frame), rr)
    with use_backend("numpy"):
        t["v2 decode_frame (numpy reference)"] = cpu(lambda: decode_frame(frame), rr)
    res["baseline"] = t

    # ---- the encoder's stages that any v3 keeps (native kernels) ---------------------------
    srt = _native.canonical(stored, e, np.dtype(np.int16))  # the kernel writes int16/int32
    assert srt is not None
    srt_stored = srt.astype(stored.dtype)  # canonical ids in the stored (u8/u16) width
    table = popularity(srt, e)
    to_rank = inverse_order(table)
    plan = chunk_plan(rows, nl)
    st: dict[str, Any] = {}
    st["canonical sort (int16 out)"] = cpu(
        lambda: _native.canonical(stored, e, np.dtype(np.int16)), rr
    )
    st["popularity table"] = cpu(lambda: popularity(srt, e), rr)

    def payloads() -> list[Any]:
        return [gap_payload(srt[a:b, lo:hi], e, k, to_rank[lo:hi]) for a, b, lo, hi in plan]

    st["gap planes (relabelled, all chunks)"] = cpu(payloads, rr)
    pay = [bytes(p) for p in payloads()]
    order_u = np.ascontiguousarray(table)

    def post_decode() -> None:  # gaps -> ids, relabel back, token-major (the kernel v2 runs)
        out = np.empty((rows, nl, k), dtype=np.int16)
        for p, (a, b, lo, hi) in zip(pay, plan, strict=True):
            ok = _native.zset_decode(p, e, order_u[lo:hi], out[a:b, lo:hi])
            assert ok

    st["decode: gap planes -> ids (native kernel, all chunks)"] = cpu(post_decode, rr)
    res["stages"] = st

    # ---- 1. content digest candidates ------------------------------------------------------
    hlen = int.from_bytes(frame[8:12], "little")
    body = frame[20 + hlen : -4]  # the v2 frame's body as written (set-zstd, or set if chosen)
    zc3 = zstandard.ZstdCompressor(level=3)
    srt32 = np.ascontiguousarray(srt, dtype="<i4")
    srt16 = np.ascontiguousarray(srt, dtype="<i2")  # what the kernel hands over today
    inputs = {
        "int32 rows (today)": srt32.data.cast("B"),
        "ids as stored (u8)" if e <= 256 else "ids as stored (u16)": srt_stored.data.cast("B"),
        "ids as int16": srt16.data.cast("B"),
        "v2 body (as written)": memoryview(body),
    }
    hashes: dict[str, Callable[[Any], object]] = {
        "sha256": lambda d: hashlib.sha256(d).digest(),
        "blake2b-256": lambda d: hashlib.blake2b(d, digest_size=32).digest(),
        "blake3": lambda d: blake3.blake3(d).digest(),  # max_threads=1 (default)
    }
    dg: dict[str, Any] = {
        "content_digest() today (sha256, widening to int32 in 128k pieces)": {
            "bytes": srt.size * 4,
            **cpu(lambda: content_digest(e, layers, seg, srt, canonical=True), rr),
        },
    }
    for iname, data in inputs.items():
        for hname, h in hashes.items():
            m = cpu(lambda h=h, data=data: h(data), rr)
            dg[f"{hname} over {iname}"] = {
                "bytes": len(data),
                **m,
                "GB_per_s": len(data) / m["best_ms"] / 1e6,
            }
    res["digest"] = dg

    # ---- 2. checksums, one per chunk (64 calls at the headline shape) ----------------------
    zchunks = [zc3.compress(p) for p in pay]
    raw_chunks = [np.ascontiguousarray(stored[a:b, lo:hi]).tobytes() for a, b, lo, hi in plan]
    sums: dict[str, Callable[[bytes], object]] = {
        "zlib.crc32 (today)": zlib.crc32,
        "google_crc32c.value": google_crc32c.value,
        "crc32c.crc32c": crc32c_pkg.crc32c,
        "xxhash.xxh3_64 (non-CRC)": xxhash.xxh3_64_intdigest,
    }
    ck: dict[str, Any] = {
        "google_crc32c.implementation": google_crc32c.implementation,
        "crc32c.hardware_based": bool(crc32c_pkg.hardware_based),
    }
    for cname, chunks in (("v2 set-zstd chunks", zchunks), ("raw u8/u16 id chunks", raw_chunks)):
        n = sum(len(c) for c in chunks)
        for sname, f in sums.items():
            m = cpu(lambda f=f, chunks=chunks: [f(c) for c in chunks], rr)
            ck[f"{sname} over {cname}"] = {
                "bytes": n,
                "calls": len(chunks),
                **m,
                "GB_per_s": n / m["best_ms"] / 1e6,
            }
    res["checksum"] = ck

    # ---- 3a. zstd levels on the v2 gap payloads and on raw ids -----------------------------
    zs: dict[str, Any] = {}
    dz = zstandard.ZstdDecompressor()
    for lname, src in (("gap payload", pay), ("raw ids", raw_chunks)):
        variants: list[tuple[str, zstandard.ZstdCompressor]] = [
            (str(lvl), zstandard.ZstdCompressor(level=lvl)) for lvl in ZSTD_LEVELS
        ]
        variants.append(
            (
                "fast7 (fast, min_match 7, hash_log 6, window_log 17)",
                zstandard.ZstdCompressor(
                    compression_params=zstandard.ZstdCompressionParameters(**FAST7)
                ),
            )
        )
        for lvl, zc in variants:  # each compressor reused across chunks (v2 makes one per chunk)
            comp = [zc.compress(p) for p in src]
            size = sum(len(c) for c in comp)
            enc = cpu(lambda zc=zc, src=src: [zc.compress(p) for p in src], rr)
            dec = cpu(
                lambda comp=comp, src=src: [
                    dz.decompress(c, max_output_size=len(p)) for c, p in zip(comp, src, strict=True)
                ],
                rr,
            )
            zs[f"{lname} zstd {lvl}"] = {
                "bytes": size,
                "B_per_row": size / nrows,
                "encode": enc,
                "decode": dec,
            }
    res["zstd"] = zs

    # ---- 3b. order-0 rANS on expert ids, per-layer popularity ------------------------------
    counts = np.stack(
        [np.bincount(srt[:, layer].reshape(-1).astype(np.intp), minlength=e) for layer in range(nl)]
    ).astype(np.float64)
    h_ids = entropy_bits(counts)  # bits per id, per layer
    rans = Rans(counts)
    lm = np.ascontiguousarray(srt.transpose(1, 0, 2), dtype=np.int32)
    rchunks = rans.encode(lm, plan)
    rbytes = sum(c.nbytes for c in rchunks)
    back = np.empty_like(lm)
    rans.decode(rchunks, plan, k, back)
    assert np.array_equal(back, lm), "rANS round trip"
    tb = table_bytes(counts)

    def rans_encode() -> None:
        r = Rans(counts)  # the models are built per frame
        r.encode(np.ascontiguousarray(srt.transpose(1, 0, 2), dtype=np.int32), plan)

    def rans_decode() -> None:
        out = np.empty_like(lm)
        rans.decode(rchunks, plan, k, out)
        np.ascontiguousarray(out.transpose(1, 0, 2), dtype=np.int16)  # token-major output

    # ---- 3c. order-0 rANS on the relabelled gaps (per-layer gap histogram) -----------------
    gdt = gap_dtype(e, k)
    glm = np.empty((nl, rows, k), dtype=np.int32)
    for p, (a, b, lo, hi) in zip(pay, plan, strict=True):
        n = (hi - lo) * (b - a) * k
        v = np.frombuffer(p, dtype=np.uint8)
        g = (
            v[:n].astype(np.int32)
            if gdt.itemsize == 1
            else (v[:n].astype(np.int32) | (v[n:].astype(np.int32) << 8))
        )
        glm[lo:hi, a:b] = g.reshape(hi - lo, b - a, k)
    gcounts = np.stack(
        [np.bincount(glm[layer].reshape(-1), minlength=e - k + 2) for layer in range(nl)]
    ).astype(np.float64)
    h_gaps = entropy_bits(gcounts)
    # The same with one table per (chunk, layer): what a chunk-adaptive order-0 coder could
    # reach before paying for its tables (64 x 6 tables at the headline shape).
    local_bits = 0.0
    for a, b, lo, hi in plan:
        for layer in range(lo, hi):
            c = np.bincount(glm[layer, a:b].reshape(-1), minlength=e - k + 2)[None, :]
            local_bits += float(entropy_bits(c.astype(np.float64))[0]) * (b - a) * k
    grans = Rans(gcounts)
    gchunks = grans.encode(glm, plan)
    gbytes = sum(c.nbytes for c in gchunks)
    gback = np.empty_like(glm)
    grans.decode(gchunks, plan, k, gback)
    assert np.array_equal(gback, glm), "gap rANS round trip"

    set_bits = math.log2(math.comb(e, k))
    res["rans"] = {
        "ids: bytes": rbytes,
        "ids: B_per_row": rbytes / nrows,
        "ids: table bytes (est.)": tb,
        "ids: table B_per_row": tb / nrows,
        "ids: encode": cpu(rans_encode, rr),
        "ids: decode": cpu(rans_decode, rr),
        "gaps: bytes": gbytes,
        "gaps: B_per_row": gbytes / nrows,
        "gaps: table bytes (est.)": table_bytes(gcounts),
        "gaps: encode": cpu(lambda: Rans(gcounts).encode(glm, plan), rr),
        "gaps: decode": cpu(lambda: grans.decode(gchunks, plan, k, np.empty_like(glm)), rr),
    }
    res["bounds_B_per_row"] = {
        "set bound log2 C(E,K)": set_bits / 8,
        "per-layer empirical id entropy (sum over K ids of -log2 p)": float(h_ids.mean() * k / 8),
        "  same minus log2 K! (order within a row is free)": float(
            (h_ids.mean() * k - math.log2(math.factorial(k))) / 8
        ),
        "per-layer empirical gap entropy (order-0, K gaps)": float(h_gaps.mean() * k / 8),
        "per-(chunk, layer) empirical gap entropy (tables not counted)": local_bits / 8 / nrows,
        "raw stored ids": stored.itemsize * k,
    }
    return res


def fmt(m: dict[str, float]) -> str:
    return f"{m['best_ms']:.1f} / {m['median_ms']:.1f}"


def report(r: dict[str, Any]) -> None:
    """A plain-text summary of one (shape, distribution)."""
    p = print
    nr = r["rows"] * r["layers"]
    b = r["baseline"]
    b64 = b["b64(int32)"]["best_ms"]
    ref = b["v2 decode_frame (numpy reference)"]["best_ms"]
    p(
        f"\n=== {r['shape']} {r['dist']}: {r['rows']} x {r['layers']} x top-{r['K']} of {r['E']}"
        f"  (ms CPU best / median of {ARGS.repeat})"
    )
    p(
        f"v2 frame {r['v2_frame_bytes']:,} B = {r['v2_B_per_row']:.3f} B/row;"
        f" targets: encode <= {0.5 * b64:.1f} ms (0.5x b64 int32), decode <= {ref / 4:.1f} ms"
        f" (numpy ref / 4)"
    )
    p(
        "  b64(int32) per call, user ms / sys ms / minor faults: "
        + ", ".join(f"{u:.1f}/{s_:.1f}/{f}" for u, s_, f in r["b64_int32_user_sys_ms_minflt"])
    )
    for sect in ("baseline", "stages"):
        for k, v in r[sect].items():
            p(f"  {k:58s} {fmt(v)}")
    p("  -- digest")
    for k, v in r["digest"].items():
        gb = f"  {v['GB_per_s']:.2f} GB/s" if "GB_per_s" in v else ""
        p(f"  {k:66s} {v['bytes']:>10,} B  {fmt(v)}{gb}")
    p("  -- checksum, one call per chunk")
    for k, v in r["checksum"].items():
        if isinstance(v, dict):
            p(f"  {k:58s} {v['bytes']:>10,} B  {fmt(v)}  {v['GB_per_s']:.2f} GB/s")
        else:
            p(f"  {k}: {v}")
    p("  -- zstd (encode / decode ms CPU, best / median)")
    for k, v in r["zstd"].items():
        p(
            f"  {k[:28]:28s} {v['bytes']:>10,} B {v['B_per_row']:6.3f} B/row"
            f"  enc {fmt(v['encode'])}  dec {fmt(v['decode'])}"
        )
    rn = r["rans"]
    p("  -- order-0 rANS (constriction), one coder per v2 chunk")
    for what in ("ids", "gaps"):
        p(
            f"  {what:5s} {rn[what + ': bytes']:>10,} B {rn[what + ': B_per_row']:6.3f} B/row"
            f" (+ table ~{rn[what + ': table bytes (est.)']:,} B = "
            f"{rn[what + ': table bytes (est.)'] / nr:.3f} B/row)"
            f"  enc {fmt(rn[what + ': encode'])}  dec {fmt(rn[what + ': decode'])}"
        )
    p("  -- bounds (B/row)")
    for k, v in r["bounds_B_per_row"].items():
        p(f"  {k:62s} {v:.3f}")
    sys.stdout.flush()


def main() -> None:
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--shapes", default="qwen3")
    ap.add_argument("--dists", default="skewed,uniform")
    ap.add_argument("--json")
    ARGS = args = ap.parse_args()
    assert _native.backend() == "native", "the compiled codec did not load"
    out = []
    for name in args.shapes.split(","):
        nl, e, k = SHAPES[name]
        for dist in args.dists.split(","):
            idx = synthetic_routing(args.tokens, nl, e, k, seed=0, **DATA[dist])
            r = measure(name, dist, idx, e, args)
            report(r)
            out.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "argv": sys.argv,
                    "zstd": zstandard.ZSTD_VERSION,
                    "numpy": np.__version__,
                    "results": out,
                },
                f,
                indent=1,
            )


ARGS: argparse.Namespace
if __name__ == "__main__":
    main()
