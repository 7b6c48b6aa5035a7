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

Each repeat times one native step and one replay step, alternating which goes first;
the report is the ratio of medians and the median of per-repeat ratios, plus the ops
dispatched per step (``TorchDispatchMode``: forward, backward and recompute), the
host-to-device copies per step and, on CUDA, the kernels launched per step
(``torch.profiler``).  Routing is the model's own (recorded first), so replay
computes the same function and only the replay machinery is measured.

    python bench/replay_bench.py                      # CPU: small shapes
    python bench/replay_bench.py --repeat 9           # CUDA: the issue-18 shapes
    python bench/replay_bench.py --only hf --layers 16 --experts 128 --topk 8 ...

Writes ``bench/out/replay_bench.json``.
"""

from __future__ import annotations

import argparse
import json
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

from r3_client import Routing  # noqa: E402
from r3_client.layouts import MegatronReplayBatch, hf_layout  # noqa: E402
from r3_client.replay import apply_routing_replay, record_routing, replay_routing  # noqa: E402
from r3_client.replay.megatron import RouterReplayDriver  # noqa: E402

SHAPE_KEYS = ("layers", "hidden", "experts", "topk", "batch", "seq", "dtype")
CPU_DEFAULTS = dict(zip(SHAPE_KEYS, (4, 256, 32, 4, 2, 256, "float32"), strict=True))
# The issue-18 configuration: 16 layers, 128 experts, top-8, hidden 768, bf16, 4 x 2048.
CUDA_DEFAULTS = dict(zip(SHAPE_KEYS, (16, 768, 128, 8, 4, 2048, "bfloat16"), strict=True))


class OpCounter(TorchDispatchMode):
    """Counts every op dispatched (forward, backward, recompute) and host->device copies."""

    def __init__(self) -> None:
        super().__init__()
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
    """Interleaved timings of ``steps`` (native first on even repeats), ops and kernels."""
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
    native, replay = times["native"], times["replay"]
    return {
        "median_s": {n: statistics.median(t) for n, t in times.items()},
        "times_s": times,
        "ratio_of_medians": statistics.median(replay) / statistics.median(native),
        "median_pair_ratio": statistics.median(r / n for r, n in zip(replay, native, strict=True)),
        "counts": counts,
        "extra_ops_per_step": counts["replay"]["ops"] - counts["native"]["ops"],
        "extra_kernels_per_step": (
            None
            if counts["native"]["kernels"] is None
            else counts["replay"]["kernels"] - counts["native"]["kernels"]
        ),
    }


# ---------------------------------------------------------------- HF


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
        head_dim=64,
        num_experts=args.experts,
        num_experts_per_tok=args.topk,
        norm_topk_prob=True,
        max_position_embeddings=max(4096, args.seq),
        tie_word_embeddings=False,
    )
    if args.experts_impl:
        config._experts_implementation = args.experts_impl
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    if args.checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    apply_routing_replay(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=g).to(device)
    mask = np.ones((args.batch, args.seq), dtype=np.int64)
    with torch.no_grad(), record_routing(model) as rec:
        model(input_ids=ids)
    layers = sorted(rec)
    own = torch.stack([rec[i] for i in layers], 1).reshape(args.batch, args.seq, len(layers), -1)
    own_np = own.cpu().numpy()
    routings = [
        Routing.from_array(own_np[b, :-1], num_experts=args.experts, layer_ids=tuple(layers))
        for b in range(args.batch)
    ]
    routing = hf_layout(routings, mask)  # host int16, -1 on each last token: what users hand over

    def loss_of(logits: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()
        )

    def native() -> None:
        model.zero_grad(set_to_none=True)
        loss_of(model(input_ids=ids).logits).backward()

    def replay() -> None:
        model.zero_grad(set_to_none=True)
        with replay_routing(model, routing):
            loss_of(model(input_ids=ids).logits).backward()

    out = measure({"native": native, "replay": replay}, device, args.repeat, args.warmup)
    out["shape"] = {**_shape(args), "checkpointing": args.checkpointing}
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
            loss_of(forward(model, tokens)).backward()

        def replay() -> None:
            model.zero_grad(set_to_none=True)
            driver.add_micro_batch(batch)
            with driver.forward():
                loss = loss_of(forward(model, tokens))
            with driver.backward():
                loss.backward()
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
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "replay_bench.json"))
    args = p.parse_args(argv)
    device = torch.device(args.device)
    defaults = CUDA_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(torch.get_num_threads())
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "repeat": args.repeat,
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
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
