"""Training-step cost of routing replay: native vs replay, forward + backward, interleaved.

Two trainers, each at one shape:

- **hf**: a transformers Qwen3-MoE (``AutoModelForCausalLM.from_config``, fixed seed),
  ``r3_client.replay`` with the routing handed over exactly as
  ``r3_client.layouts.hf_layout`` returns it (host ``int16`` numpy, ``-1`` on each
  sequence's last token), optionally with gradient checkpointing;
- **megatron**: a Megatron-Core ``GPTModel`` (local layer spec, real ``TopKRouter``
  with ``moe_enable_routing_replay``, full recompute), driven by
  ``r3_client.replay.megatron.RouterReplayDriver`` with ``megatron_layout``-style host
  ``int64`` arrays.

Each repeat times one native step and one replay step, alternating which goes first
(with ``--fetch overlapped``, a third: replay with the routing fetched in the background);
the report is the ratio of medians and the median of per-repeat ratios, plus the ops
dispatched per step (``TorchDispatchMode``: forward, backward and recompute), the
host-to-device copies per step and, on CUDA, the kernels launched per step
(``torch.profiler``).  Routing is the model's own (recorded first), so replay
computes the same function and only the replay machinery is measured.

``--fetch overlapped`` (HF only, issue 36): the step a rank runs when it fetches the
routing of its *next* micro-batch while the current one computes.  The model's
recorded routing of each micro-batch is encoded once up front, one frame per sample at
the codec's defaults (``r3_client.encode_frame``): what the cache would send.  Each
``replay_fetch`` step hands the routing fetched during the step before to replay, and
submits to a background thread (``concurrent.futures``) the fetch of the next
micro-batch: ``r3_client.decode_rollout`` of its frames and ``hf_layout``.  The step
ends when both its forward + backward and that fetch are done, so no fetch work spills
into the next timed step.  The fetch is simulated by in-memory frames and their decode:
the decode and layout are the rank's CPU work; the network read is measured by the CPU
benches (``bench/client_bench.py``).  Reported besides the ratios: the fetch alone
(decode + layout per micro-batch, GPU idle), the time each step waited for it after its
own compute, and whether it was hidden.  ``--fetch-executor process`` runs the fetch in a
worker process instead of a thread (no GIL shared with the training loop);
``--switch-interval`` sets ``sys.setswitchinterval`` (the GIL hand-over) for the run.

    python bench/replay_bench.py                      # CPU: small shapes
    python bench/replay_bench.py --repeat 9           # CUDA: the issue-18 shapes
    python bench/replay_bench.py --only hf --layers 16 --experts 128 --topk 8 ...
    python bench/replay_bench.py --fetch overlapped   # + replay with the fetch overlapped

Writes ``bench/out/replay_bench.json``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support, before site-packages' ``tests`` (verl's)

from r3_client import Routing, decode_rollout, encode_frame, read_header  # noqa: E402
from r3_client.codec import backend as codec_backend  # noqa: E402
from r3_client.layouts import MegatronReplayBatch, hf_layout  # noqa: E402
from r3_client.replay import apply_routing_replay, record_routing, replay_routing  # noqa: E402
from r3_client.replay.megatron import RouterReplayDriver  # noqa: E402

SHAPE_KEYS = ("layers", "hidden", "experts", "topk", "batch", "seq", "dtype")
CPU_DEFAULTS = dict(zip(SHAPE_KEYS, (4, 256, 32, 4, 2, 256, "float32"), strict=True))
# The issue-18 configuration: 16 layers, 128 experts, top-8, hidden 768, bf16, 4 x 2048.
CUDA_DEFAULTS = dict(zip(SHAPE_KEYS, (16, 768, 128, 8, 4, 2048, "bfloat16"), strict=True))


class OpCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts every op dispatched (forward, backward, recompute) and host->device copies."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops = 0
        self.h2d = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.ops += 1
        name = str(func)
        if name.startswith(("aten._to_copy", "aten.copy_")) and args:
            src = args[1] if name.startswith("aten.copy_") else args[0]
            dst = args[0].device if name.startswith("aten.copy_") else kwargs.get("device")
            from_host = isinstance(src, torch.Tensor) and src.device.type == "cpu"
            if from_host and dst is not None and torch.device(dst).type == "cuda":
                self.h2d += 1
        return func(*args, **kwargs)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kernels_per_step(step: Callable[[], None], device: torch.device) -> int | None:
    """CUDA kernels one step launches (None off CUDA)."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        sync(device)
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def measure(
    steps: dict[str, Callable[[], None]], device: torch.device, repeat: int, warmup: int
) -> dict[str, Any]:
    """Interleaved timings of ``steps`` (native first on even repeats), ops and kernels.

    Every step other than ``native`` gets its ratios to ``native`` under ``ratios``; the
    top-level ratio keys are those of ``replay``.
    """
    names = list(steps)
    for _ in range(warmup):
        for name in names:
            steps[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeat):
        for name in names if r % 2 == 0 else names[::-1]:
            sync(device)
            t0 = time.perf_counter()
            steps[name]()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    counts: dict[str, Any] = {}
    for name in names:
        counter = OpCounter()
        with counter:
            steps[name]()
        counts[name] = {
            "ops": counter.ops,
            "h2d_copies": counter.h2d,
            "kernels": kernels_per_step(steps[name], device),
        }
    native = times["native"]
    ratios = {
        name: {
            "ratio_of_medians": statistics.median(times[name]) / statistics.median(native),
            "median_pair_ratio": statistics.median(
                r / n for r, n in zip(times[name], native, strict=True)
            ),
        }
        for name in names
        if name != "native"
    }
    return {
        "median_s": {n: statistics.median(t) for n, t in times.items()},
        "times_s": times,
        **ratios["replay"],
        "ratios": ratios,
        "counts": counts,
        "extra_ops_per_step": counts["replay"]["ops"] - counts["native"]["ops"],
        "extra_kernels_per_step": (
            None
            if counts["native"]["kernels"] is None
            else counts["replay"]["kernels"] - counts["native"]["kernels"]
        ),
    }


# ---------------------------------------------------------------- HF


def fetch_routing(frames: list[list[bytes]], mask: Any, i: int) -> Any:
    """A rank's CPU work for micro-batch ``i``: decode its frames, lay them out for HF."""
    return hf_layout([decode_rollout(f) for f in frames[i]], mask)


_WORKER: dict[str, Any] = {}  # a fetch worker process's frames and mask


def _worker_init(frames: list[list[bytes]], mask: Any) -> None:
    _WORKER.update(frames=frames, mask=mask)


def _worker_fetch(i: int) -> Any:
    return fetch_routing(_WORKER["frames"], _WORKER["mask"], i)


def hf_case(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=1024,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        moe_intermediate_size=args.hidden // 2,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 256),
        head_dim=64,  # type: ignore[call-arg]
        num_experts=args.experts,
        num_experts_per_tok=args.topk,
        norm_topk_prob=True,
        max_position_embeddings=max(4096, args.seq),
        tie_word_embeddings=False,
    )
    if args.experts_impl:
        config._experts_implementation = args.experts_impl
    torch.manual_seed(0)
    auto = transformers.AutoModelForCausalLM
    with torch.device(device):  # initialised where it runs: no host copy of a large model
        model = auto.from_config(config, dtype=dtype).to(device)  # type: ignore[no-untyped-call]
    if args.checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    apply_routing_replay(model)
    g = torch.Generator().manual_seed(1)
    fetching = args.fetch == "overlapped"
    # One micro-batch, or with the fetch overlapped several, each with its own tokens.
    mbs = args.micro_batches if fetching else 1
    batches = [
        torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=g).to(device)
        for _ in range(mbs)
    ]
    mask = np.ones((args.batch, args.seq), dtype=np.int64)
    per_mb: list[list[Routing]] = []
    e = args.experts
    for ids in batches:
        with torch.no_grad(), record_routing(model) as rec:
            model(input_ids=ids)
        layers = sorted(rec)
        own = torch.stack([rec[i] for i in layers], 1)
        own_np = own.reshape(args.batch, args.seq, len(layers), -1).cpu().numpy()
        per_mb.append(
            [
                Routing.from_array(own_np[b, :-1], num_experts=e, layer_ids=tuple(layers))
                for b in range(args.batch)
            ]
        )
    # host int16, -1 on each last token: what users hand over
    laid = [hf_layout(routings, mask) for routings in per_mb]
    routing = laid[0]

    def loss_of(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()
        )

    def train(i: int) -> None:
        """Forward, loss and backward on micro-batch ``i``."""
        ids = batches[i]
        model.zero_grad(set_to_none=True)
        loss = loss_of(model(input_ids=ids).logits, ids)
        loss.backward()  # type: ignore[no-untyped-call]

    at = {"native": 0, "replay": 0, "replay_fetch": 0}  # each step's next micro-batch

    def next_batch(step: str) -> int:
        at[step] += 1
        return (at[step] - 1) % mbs

    def native() -> None:
        train(next_batch("native"))

    def replay() -> None:
        i = next_batch("replay")
        with replay_routing(model, laid[i]):
            train(i)

    steps: dict[str, Callable[[], None]] = {"native": native, "replay": replay}
    fetch_report: dict[str, Any] | None = None
    pool: concurrent.futures.Executor | None = None
    if fetching:
        # What the cache would send: each sample's routing as one frame, default codec.
        frames = [[encode_frame(r) for r in routings] for routings in per_mb]

        def fetch(i: int) -> Any:
            return fetch_routing(frames, mask, i)

        for i, want in enumerate(laid):  # the codec returns each row's set, maybe reordered
            got = fetch(i)
            if not np.array_equal(np.sort(got, axis=-1), np.sort(want, axis=-1)):
                raise AssertionError(f"micro-batch {i}: decoded routing differs from recorded")
        if args.fetch_executor == "process":
            # spawn: the trainer has CUDA initialised, which a forked child must not inherit
            pool = concurrent.futures.ProcessPoolExecutor(
                1,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_worker_init,
                initargs=(frames, mask),
            )
            task: Callable[[int], Any] = _worker_fetch
        else:
            pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="r3-fetch")
            task = fetch
        # Fetched before the first step (also starts the worker); warm-up covers the rest.
        held = {"routing": pool.submit(task, 0).result()}
        waits: list[float] = []

        def replay_fetch() -> None:
            i = next_batch("replay_fetch")
            assert pool is not None
            pending = pool.submit(task, (i + 1) % mbs)  # the next micro-batch's routing
            with replay_routing(model, held["routing"]):
                train(i)
            t0 = time.perf_counter()
            held["routing"] = pending.result()
            waits.append(time.perf_counter() - t0)

        steps["replay_fetch"] = replay_fetch
        alone, round_trip = [], []
        for r in range(max(3, args.repeat)):
            t0 = time.perf_counter()
            fetch(r % mbs)
            alone.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            pool.submit(task, r % mbs).result()
            round_trip.append(time.perf_counter() - t0)
        frame_bytes = [sum(len(f) for f in fs) for fs in frames]
        fetch_report = {
            "micro_batches": mbs,
            "frames_per_micro_batch": args.batch,
            "frame_bytes_per_micro_batch": statistics.median(frame_bytes),
            "codec": sorted({read_header(f).codec for fs in frames for f in fs}),
            "codec_backend": codec_backend(),
            "alone_s": alone,
            "alone_median_s": statistics.median(alone),
            "executor": args.fetch_executor,
            # submit to result through the executor, GPU idle (a worker's pickling included)
            "round_trip_median_s": statistics.median(round_trip),
            "waits_s": waits,
        }

    try:
        out = measure(steps, device, args.repeat, args.warmup)
    finally:
        if pool is not None:
            pool.shutdown()
    if fetch_report is not None:
        med = out["median_s"]
        # The waits of the timed steps (after the warm-up's, before the counting runs').
        timed_waits = fetch_report["waits_s"][args.warmup : args.warmup + args.repeat]
        wait = statistics.median(timed_waits)
        fetch_report.update(
            wait_median_s=wait,
            # What the step with the fetch took over replay alone (medians; noise included).
            extra_over_replay_s=med["replay_fetch"] - med["replay"],
            # Hidden: a step waited for its fetch, after its own compute, under 1% of a step.
            hidden=wait <= 0.01 * med["native"],
        )
        del fetch_report["waits_s"]
        fetch_report["timed_waits_s"] = timed_waits
        out["fetch"] = fetch_report
    out["shape"] = {**_shape(args), "checkpointing": args.checkpointing}
    out["experts_implementation"] = getattr(model.config, "_experts_implementation", None)
    out["routing_handed_over"] = f"numpy {routing.dtype} {list(routing.shape)} (hf_layout)"
    return out


# ---------------------------------------------------------------- Megatron


def megatron_case(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> dict[str, Any]:
    from tests.support.megatron_model import Shape, build_gpt, forward, megatron_env

    shape = Shape(
        layers=args.layers,
        hidden=args.hidden,
        heads=max(1, args.hidden // 64),
        experts=args.experts,
        topk=args.topk,
        ffn=args.hidden // 2,
    )
    with megatron_env(device):
        model = build_gpt(shape, device, dtype=dtype)
        driver = RouterReplayDriver(model.config)
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, 256, (args.batch, args.seq), generator=g).to(device)
        with torch.no_grad(), driver.record():
            forward(model, tokens)
        per_layer = [r.cpu().numpy().astype(np.int64) for r in driver.recorded()]
        driver.finish_step()
        n = args.batch * args.seq
        batch = MegatronReplayBatch(
            per_layer=per_layer,  # host int64 arrays, as megatron_layout returns them
            layer_ids=tuple(range(args.layers)),
            cu_seqlens=np.arange(args.batch + 1, dtype=np.int32) * args.seq,
            seqlens=np.full(args.batch, args.seq, dtype=np.int32),
            positions=np.arange(n, dtype=np.int64),
        )

        def loss_of(logits: torch.Tensor) -> torch.Tensor:
            return logits.float().logsumexp(-1).mean()

        def native() -> None:
            model.zero_grad(set_to_none=True)
            loss_of(forward(model, tokens)).backward()  # type: ignore[no-untyped-call]

        def replay() -> None:
            model.zero_grad(set_to_none=True)
            driver.add_micro_batch(batch)
            with driver.forward():
                loss = loss_of(forward(model, tokens))
            with driver.backward():
                loss.backward()  # type: ignore[no-untyped-call]
            driver.finish_step()

        out = measure({"native": native, "replay": replay}, device, args.repeat, args.warmup)
    out["shape"] = {**_shape(args), "recompute": "full"}
    out["routing_handed_over"] = f"{len(per_layer)} x numpy int64 [{n}, {args.topk}]"
    return out


def _shape(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in SHAPE_KEYS}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--only", choices=["hf", "megatron"], default=None)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    for name in ("layers", "hidden", "experts", "topk", "batch", "seq"):
        p.add_argument(f"--{name}", type=int, default=None)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    p.add_argument("--checkpointing", action="store_true", help="HF gradient checkpointing")
    p.add_argument("--experts-impl", default=None, help="transformers experts_implementation")
    p.add_argument(
        "--fetch",
        choices=["none", "overlapped"],
        default="none",
        help="overlapped: also time replay with the next micro-batch's routing decoded and "
        "laid out in a background thread (HF only; issue 36)",
    )
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches cycled with --fetch")
    p.add_argument(
        "--fetch-executor",
        choices=["thread", "process"],
        default="thread",
        help="where --fetch runs: a thread of the trainer, or a worker process",
    )
    p.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="sys.setswitchinterval for the run, seconds (Python's default 0.005)",
    )
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "replay_bench.json"))
    args = p.parse_args(argv)
    if args.fetch == "overlapped":
        if args.only == "megatron":
            p.error("--fetch overlapped times the HF trainer only")
        args.only = "hf"
    device = torch.device(args.device)
    defaults = CUDA_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    dtype = getattr(torch, args.dtype)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    torch.set_num_threads(torch.get_num_threads())
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "repeat": args.repeat,
        "switch_interval_s": sys.getswitchinterval(),
        "argv": sys.argv[1:] if argv is None else argv,
    }
    cases = {"hf": hf_case, "megatron": megatron_case}
    for name, case in cases.items():
        if args.only not in (None, name):
            continue
        res = case(args, device, dtype)
        report[name] = res
        med = res["median_s"]
        print(
            f"{name:9s} native {med['native'] * 1e3:8.1f} ms  replay {med['replay'] * 1e3:8.1f} ms"
            f"  ratio {res['ratio_of_medians']:.3f} (pairs {res['median_pair_ratio']:.3f})"
            f"  extra ops/step {res['extra_ops_per_step']}"
            f"  h2d/step {res['counts']['replay']['h2d_copies']}"
            f"  extra kernels/step {res['extra_kernels_per_step']}",
            flush=True,
        )
        if "fetch" in res:
            f, r = res["fetch"], res["ratios"]["replay_fetch"]
            print(
                f"{name:9s} replay+fetch {med['replay_fetch'] * 1e3:8.1f} ms"
                f"  ratio {r['ratio_of_medians']:.3f} (pairs {r['median_pair_ratio']:.3f})"
                f"  fetch alone {f['alone_median_s'] * 1e3:.1f} ms"
                f" ({f['frame_bytes_per_micro_batch'] / 1e3:.0f} kB, {'/'.join(f['codec'])},"
                f" {f['codec_backend']}, {f['executor']}"
                f" round trip {f['round_trip_median_s'] * 1e3:.1f} ms)"
                f"  waited {f['wait_median_s'] * 1e3:.2f} ms"
                f"  over replay {f['extra_over_replay_s'] * 1e3:+.1f} ms  hidden {f['hidden']}",
                flush=True,
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
