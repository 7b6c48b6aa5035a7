"""The engine's per-rollout routing path at a real model's shape, on the real hook code.

SGLang on this CPU cannot run a 48-layer x 128-expert model over 16k-token prompts
fast enough for an interleaved engine benchmark, so this measures what the engine
does with the routing of one finished rollout, process by process, using the
extension's own functions (``sglang_r3.http_server.shipping``) and SGLang's own encoder
(``pybase64``), against the real cache service:

* **detokenizer process**: upstream base64-encodes the int32 ``[rows, L, K]`` tensor
  (``DetokenizerManager._b64_encode_per_request``, SGLang 0.5.23: configuration
  ``upstream``); upstream's main branch is moving to a narrow wire (``routed_experts_wire``:
  base64 of the ids as uint8, configuration ``upstream-u8``; uint16 above 256 experts;
  the tensor is handed over already narrow, so only the base64 is timed); r3 narrows it
  to the smallest unsigned dtype that holds it
  (``sglang_r3.scheduler.row_transport.compact_rows``);
* **IPC to the HTTP process**: the detokenizer's output is pickled and unpickled
  (SGLang's default ``SGLANG_USE_PICKLE_IPC``); the unpickling runs on the
  tokenizer manager's event loop;
* **HTTP process**: upstream puts the base64 string in the response, which is
  serialized with orjson on the event loop; r3 ships the rows (``Shipper.ship``:
  decode, checks, layer gather, digests, encoding, PUT) and serializes the
  response with its reference.  ``r3`` writes the default frame format (v3); ``r3-v2``
  the same Shipper writing format v2 (``--versions``), for the comparison.

The engine CPU per rollout is the detokenizer's plus the HTTP process's; the summary
gives r3's over each upstream wire, every configuration measured in the same run
(interleaved: each configuration twice, ``--reps`` rollouts each time).

A heartbeat task on the same event loop (sleeping 1 ms) measures the loop's stall:
the longest time it could not run while a rollout was handled.  CPU seconds are
this process's (``time.process_time``, all threads) and the cache service's (with
its Redis).  With ``--baseline-only-b64`` (implied when the installed extension
predates ``sglang_r3.scheduler.row_transport``), r3 is fed upstream's base64 as before.

    python bench/ship_path.py [--rows 16384] [--layers 48] [--experts 128] [--topk 8]
        [--reps 8] [--versions 3,2] [--json bench/out/ship_path.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import pickle
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pybase64
import torch

from r3_client.synthetic import synthetic_routing
from sglang_r3.config import EngineConfig
from sglang_r3.http_server import shipping
from sglang_r3.http_server.tagging import OutputTag
from sglang_r3.layers import MoeShape

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]  # ROOT: tests.support, before verl's ``tests``
from engine_bench import tree_cpu  # noqa: E402

from tests.support.service_process import KEY_A, start_service  # noqa: E402

try:  # the extension's engine-side row handling (absent before the hot-path rework)
    from sglang_r3.scheduler import row_transport as engine_rows
except ImportError:  # pragma: no cover - measuring the old code
    engine_rows = None  # type: ignore[assignment]

UPSTREAM = ("upstream", "upstream-u8")  # upstream's wires: base64 of int32 / of uint8 ids
R3 = {"r3": 3, "r3-v2": 2}  # configuration: the frame format its Shipper writes


class Heartbeat:
    """Sleeps ``interval`` on the loop and records how late it wakes up."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(self.interval)
            self.lags.append(loop.time() - t - self.interval)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    def take(self) -> list[float]:
        out, self.lags = self.lags, []
        return out


def detokenize(config: str, tensor: torch.Tensor, narrow: torch.Tensor, compact: bool) -> Any:
    """What the detokenizer hands to the HTTP process for one rollout."""
    if config == "upstream-u8":
        return pybase64.b64encode(narrow.numpy().tobytes()).decode("utf-8")
    if config == "upstream" or not compact:
        return pybase64.b64encode(tensor.numpy().tobytes()).decode("utf-8")
    return engine_rows.compact_rows(engine_rows.TaggedRows(tensor))


async def one(
    config: str,
    shipper: shipping.Shipper | None,
    blob: bytes,
    prompt: list[int],
    output: list[int],
    hb: Heartbeat,
) -> dict[str, float]:
    """Handle one finished rollout as the HTTP process does; stall and CPU."""
    hb.take()
    await asyncio.sleep(0.005)  # let the heartbeat settle
    hb.take()
    c0, w0 = time.process_time(), time.perf_counter()
    payload = pickle.loads(blob)  # SGLang's recv_pyobj, on the loop
    meta: dict[str, Any] = {"finish_reason": {"type": "length"}, "weight_version": "default"}
    if config in UPSTREAM:
        meta["routed_experts"] = payload
    else:
        assert shipper is not None
        tag = OutputTag(0, 0, f"ship-{uuid.uuid4().hex[:12]}", "", False, False)
        meta["r3"] = await shipper.ship(tag, 0, payload, prompt, output, meta)
        if meta["r3"].get("stored") is not True:
            raise RuntimeError(f"not stored: {meta['r3']}")
    body = orjson.dumps({"output_ids": output, "meta_info": meta})
    wall = time.perf_counter() - w0
    cpu = time.process_time() - c0
    await asyncio.sleep(0.003)  # the heartbeat's last wake-up after the work
    lags = hb.take()
    return {
        "wall_s": wall,
        "http_cpu_s": cpu,
        "loop_stall_max_s": max(lags) if lags else wall,
        "loop_stall_sum_s": sum(x for x in lags if x > 0.001),
        "response_bytes": len(body),
    }


async def run_config(
    config: str,
    shipper: shipping.Shipper | None,
    blob: bytes,
    prompt: list[int],
    output: list[int],
    reps: int,
    service_pid: int,
) -> list[dict[str, float]]:
    hb = Heartbeat()
    hb.start()
    out = []
    try:
        for _ in range(reps):
            s0 = sum(tree_cpu(service_pid).values())
            r = await one(config, shipper, blob, prompt, output, hb)
            r["service_cpu_s"] = sum(tree_cpu(service_pid).values()) - s0
            out.append(r)
    finally:
        await hb.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--new", type=int, default=8, help="generated tokens of each rollout")
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--versions", default="3,2", help="frame formats r3 writes (r3 = 3, r3-v2 = 2)")
    p.add_argument("--baseline-only-b64", action="store_true")
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "out" / "ship_path.json")
    args = p.parse_args(argv)
    compact = engine_rows is not None and not args.baseline_only_b64
    L, E, K = args.layers, args.experts, args.topk  # noqa: N806
    routing = synthetic_routing(args.rows, L, E, K, skew=1.0, rho=0.9, seed=3).astype(np.int32)
    tensor = torch.from_numpy(np.ascontiguousarray(routing))
    narrow = torch.from_numpy(routing.astype(np.uint8 if E <= 256 else np.uint16))
    versions = [int(v) for v in args.versions.split(",")]
    r3_configs = [name for name, v in R3.items() if v in versions]
    if not r3_configs or len(r3_configs) != len(versions):
        p.error(f"--versions takes 3 and/or 2, got {args.versions!r}")
    configs = [*UPSTREAM, *r3_configs]
    rng = np.random.default_rng(5)
    tokens = rng.integers(3, 1024, size=args.rows + 1).tolist()
    prompt, output = tokens[: -args.new], tokens[-args.new :]
    shape = MoeShape(E, K, L, tuple(range(L)))
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    results["engine_input"] = "compact rows" if compact else "base64 int32"
    with tempfile.TemporaryDirectory(prefix="ship-path-") as d:
        svc = start_service(
            Path(d),
            None,
            env={
                "R3_CACHE_MAX_BODY_BYTES": str(256 << 20),
                "R3_CACHE_MAX_TOKENS_PER_SEGMENT": str(max(args.rows, 20000)),
            },
        )
        try:
            config = EngineConfig(routing_cache=svc.http_url, api_key=KEY_A)
            # the engine's own setting (--routing-format-version) picks each Shipper's format
            versions = {n: dataclasses.replace(config, format_version=v) for n, v in R3.items()}
            for name in configs * 2:
                detok_cpu, blobs = [], []
                for _ in range(args.reps):
                    c0 = time.thread_time()
                    payload = detokenize(name, tensor, narrow, compact)
                    blob = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
                    detok_cpu.append(time.thread_time() - c0)
                    blobs.append(blob)

                async def go(name: str = name, blob: bytes = blobs[0]) -> list[dict[str, float]]:
                    shipper = (
                        shipping.Shipper(versions[name], shape, "bench") if name in R3 else None
                    )
                    try:
                        return await run_config(
                            name, shipper, blob, prompt, output, args.reps, svc.proc.pid
                        )
                    finally:
                        if shipper is not None:
                            await shipper.client.aclose()

                rows = asyncio.run(go())
                for r, c in zip(rows, detok_cpu, strict=True):
                    r["detokenizer_cpu_s"] = c
                    r["engine_cpu_s"] = c + r["http_cpu_s"]
                    r["ipc_bytes"] = len(blobs[0])
                results.setdefault(name, []).extend(rows)
        finally:
            svc.stop()
    summary = {}
    for name in configs:
        rs = results[name]
        summary[name] = {k: statistics.median([r[k] for r in rs]) for k in rs[0]}
        summary[name]["loop_stall_max_s_worst"] = max(r["loop_stall_max_s"] for r in rs)
    results["summary"] = summary
    print(
        f"{args.rows} rows x {L} layers x top-{K} of {E} experts, {results['engine_input']}, "
        f"{args.reps * 2} rollouts per configuration (medians); r3 writes format "
        + ", ".join(f"v{R3[n]} ({n})" for n in r3_configs)
    )
    cols = (
        "engine_cpu_s",
        "detokenizer_cpu_s",
        "ipc_bytes",
        "http_cpu_s",
        "loop_stall_max_s",
        "loop_stall_max_s_worst",
        "loop_stall_sum_s",
        "wall_s",
        "service_cpu_s",
        "response_bytes",
    )
    print("| configuration | " + " | ".join(cols) + " |")
    for name in configs:
        s = summary[name]
        print(
            f"| {name} | "
            + " | ".join(
                f"{s[c]:,.0f}" if c.endswith("bytes") else f"{s[c] * 1e3:.1f} ms" for c in cols
            )
            + " |"
        )
    ratios = {}
    for name in r3_configs:
        for base in UPSTREAM:
            ratio = summary[name]["engine_cpu_s"] / summary[base]["engine_cpu_s"]
            ratios[f"{name} / {base}"] = ratio
            print(
                f"- engine CPU per rollout (detokenizer + HTTP), {name} / {base}: "
                f"**{ratio:.2f}x** ({summary[name]['engine_cpu_s'] * 1e3:.1f} vs "
                f"{summary[base]['engine_cpu_s'] * 1e3:.1f} ms; target <= 0.5x, issue 37)"
            )
    results["engine_cpu_ratios"] = ratios
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
