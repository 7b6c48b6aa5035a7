"""A local stack: tiny MoE models, the cache service and SGLang on loopback, managed.

For the demos (``r3 demo``, ``r3 rl-demo``, ``r3 mismatch-report``), the tests and
the benchmarks.  :class:`LocalStack` builds a model, starts the cache and the engine,
and stops what it started in reverse order on exit.

Nothing is downloaded: models are random, built from ``transformers`` configs with a
fixed seed, with a word-level tokenizer (``w3 w4 ...``) and a plain chat template.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cache_service.redis_proc import free_port
from cache_service.service_process import ServiceProcess, start_service_process, wait_ready
from r3_client.synthetic import tiny_moe_config

FAMILIES = ("qwen3_moe", "glm4_moe", "olmoe", "mixtral")
VOCAB = 1024
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w3 {% endif %}"
)


def _config(
    family: str, layers: int, experts: int, topk: int, hidden: int = 128, positions: int = 4096
) -> Any:
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")
    sizes: dict[str, Any] = dict(
        layers=layers, experts=experts, topk=topk, hidden=hidden, heads=4, kv_heads=2,
        head_dim=32, ffn=2 * hidden, moe_ffn=64, vocab=VOCAB, positions=positions,
    )  # fmt: skip
    tokens = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "glm4_moe":
        return tiny_moe_config(
            family, **sizes, **tokens, norm_topk_prob=True, partial_rotary_factor=0.5
        )
    if family == "olmoe":
        # SGLang 0.5.23 sizes OLMoE's q/k norms by the hidden size, so its key/value
        # heads must equal its query heads there (2 KV heads fail to load).
        sizes["kv_heads"] = sizes["heads"]
    return tiny_moe_config(family, **sizes, **tokens)


def build_tiny_model(
    family: str,
    out_dir: str | os.PathLike[str],
    *,
    layers: int = 3,
    experts: int = 8,
    topk: int = 2,
    hidden: int = 128,
    positions: int = 4096,
    init_std: float = 0.02,
    seed: int = 0,
) -> Path:
    """Write a random bf16 MoE checkpoint with tokenizer to ``out_dir`` (once).

    ``positions`` is the longest sequence the model takes (``max_position_embeddings``).
    ``init_std`` is the config's ``initializer_range``: larger values give peakier
    next-token distributions (0.2: the sampled token's probability is ~0.04 typically).
    """
    import torch
    import transformers

    tf: Any = transformers

    out = Path(out_dir)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = _config(family, layers, experts, topk, hidden, positions)
    cfg.initializer_range = init_std
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out)
    tiny_tokenizer().save_pretrained(out)
    return out


def build_tiny_mtp_draft(
    target_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str]
) -> Path:
    """Write an MTP draft for a tiny Qwen3-MoE target (:func:`build_tiny_model`) to
    ``out_dir`` (once), for ``--speculative-algorithm EAGLE|NEXTN
    --speculative-draft-model-path out_dir``.

    SGLang 0.5.23 loads any Qwen3-MoE draft as ``Qwen3MoeForCausalLMMTP``
    (``configs/model_config.py``), whose weights are ``mtp.fc`` (``[hidden, 2 * hidden]``
    over the concatenated normed token embedding and target hidden state),
    ``mtp.pre_fc_norm_{embedding,hidden}``, one decoder layer ``mtp.layers.0.*`` and
    ``mtp.norm``; embedding and LM head are shared from the target
    (``models/qwen3_moe.py``).  The draft's layer is a copy of the target's last layer
    (so it is a MoE layer: draft routing must stay out of the target's rows) and ``fc``
    is ``[0 | I]`` plus small noise, so the draft mostly continues the target's last hidden
    state and some of its guesses are accepted, some rejected.
    """
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    src, out = Path(target_dir), Path(out_dir)
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    if config.get("model_type") != "qwen3_moe":
        raise ValueError(
            f"{src}: an MTP draft is built for qwen3_moe, not {config.get('model_type')}"
        )
    target = load_file(str(src / "model.safetensors"))
    hidden = int(config["hidden_size"])
    generator = torch.Generator().manual_seed(0)
    fc = torch.zeros(hidden, 2 * hidden)
    fc[:, hidden:] = torch.eye(hidden)
    fc += 0.02 * torch.randn(hidden, 2 * hidden, generator=generator)
    weights = {
        "mtp.fc.weight": fc.to(torch.bfloat16),
        "mtp.pre_fc_norm_embedding.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "mtp.pre_fc_norm_hidden.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "mtp.norm.weight": target["model.norm.weight"].clone(),
    }
    last = f"model.layers.{int(config['num_hidden_layers']) - 1}."
    for name, tensor in target.items():
        if name.startswith(last):
            weights["mtp.layers.0." + name[len(last) :]] = tensor.clone()
    save_file(weights, str(out / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    if (src / "generation_config.json").exists():
        shutil.copy(src / "generation_config.json", out / "generation_config.json")
    config.update(num_hidden_layers=1, num_nextn_predict_layers=1)
    (out / "config.json").write_text(json.dumps(config, indent=1))  # last: marks it complete
    return out


def tiny_tokenizer(vocab_size: int = VOCAB) -> Any:
    """The tiny models' word-level tokenizer: token ``i`` is the word ``w{i}`` (ids 0-2 are
    ``<unk>``, ``<s>``, ``</s>``), with :data:`CHAT_TEMPLATE`; a ``PreTrainedTokenizerFast``."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tf: Any = transformers  # its tokenizer classes are untyped
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = tf.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<unk>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def words(token_ids: list[int]) -> str:
    """Text that the tiny tokenizer turns back into exactly ``token_ids``."""
    return " ".join(f"w{t}" for t in token_ids)


#: The cache service a local stack runs (``r3 serve``, embedded redis-server).
CacheServer = ServiceProcess


def start_cache(data_dir: Path, *, http_port: int, grpc_port: int) -> CacheServer:
    """Start the cache service with an embedded Redis under ``data_dir``, no auth; wait ready."""
    data_dir.mkdir(parents=True, exist_ok=True)
    return start_service_process(
        ["--data-dir", str(data_dir / "redis"), "--auth", "off", "--log-level", "WARNING"],
        log=data_dir / "cache.log",
        http_port=http_port,
        grpc_port=grpc_port,
    )


CPU_ARGS = (
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    # SGLang 0.5.23's spelling of the deprecated --disable-cuda-graph.
    "--cuda-graph-backend-decode",
    "disabled",
    "--cuda-graph-backend-prefill",
    "disabled",
    "--dtype",
    "bfloat16",
    # The KV pool is sized in tokens by --max-total-tokens, which must go with this
    # recipe (start_engine passes it).  SGLang 0.5.23 budgets the pool as the memory
    # free after loading minus (1 - fraction) x the memory free before loading, on CPU
    # too; with a small fraction, any other process taking more than that fraction
    # of free RAM during start-up leaves "no GPU memory for the KV cache".  A high
    # fraction makes the budget a loose upper bound and the token count the size.
    "--mem-fraction-static",
    "0.9",
    # An idle scheduler otherwise busy-polls a whole core; on a 2-core machine two
    # idle servers would starve everything else.
    "--sleep-on-idle",
)


def cpu_args(version: str) -> tuple[str, ...]:
    """:data:`CPU_ARGS` in SGLang ``version``'s spelling: before 0.5.14 (no
    ``--cuda-graph-backend-*``) CUDA graphs are switched off by ``--disable-cuda-graph``."""
    from sglang_r3.releases import Release

    if Release(version).has("cuda_graph_backend_args"):
        return CPU_ARGS
    out: list[str] = []
    skip = False
    for arg in CPU_ARGS:
        if skip:
            skip = False
            continue
        if arg.startswith("--cuda-graph-backend-"):
            skip = True
            if "--disable-cuda-graph" not in out:
                out.append("--disable-cuda-graph")
            continue
        out.append(arg)
    return tuple(out)


def engine_port() -> int:
    """A free port for an SGLang server: one whose ``port + 10000`` is a port too.

    SGLang 0.5.12 derives a gRPC port ``port + 10000`` at start-up whether or not gRPC
    is used, and refuses one above 65535 (``server_args.py:1147-1154``); a port from the
    kernel's ephemeral range (up to 60999) fails there one time in five."""
    return free_port(cluster_bus=True)


@functools.cache
def sglang_version_of(python: str) -> str:
    """The SGLang release installed for interpreter ``python`` (asked in a subprocess,
    nothing imported here)."""
    code = "from importlib.metadata import version; print(version('sglang'))"
    return subprocess.run(
        [python, "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()


@dataclass
class EngineServer:
    """A ``python -m sglang_r3.launch_server`` process in its own process group."""

    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    argv: list[str] = field(default_factory=list)

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL after 20 s; SGLang's children go with it."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def tail(self, n: int = 60) -> str:
        """The last ``n`` lines of the server log."""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def start_engine(
    model_path: str | os.PathLike[str],
    *,
    port: int,
    log: Path,
    routing_cache: str | None = None,
    api_key: str | None = None,
    extra_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    max_total_tokens: int = 4096,
    timeout_s: float = 240.0,
    launcher: str = "sglang_r3.launch_server",
    python: str | None = None,
) -> EngineServer:
    """Start SGLang on CPU (with the extension when ``routing_cache`` is given); wait healthy.

    The KV pool holds ``max_total_tokens`` tokens (see :data:`CPU_ARGS`).

    ``launcher="sglang.launch_server"`` starts upstream unchanged (the plugin is
    still installed, so the CPU allocator is there), for baselines.  ``python``: the
    interpreter of the environment whose SGLang to run (default: this one's).
    """
    python = python or sys.executable

    argv = [
        python,
        "-m",
        launcher,
        "--model-path",
        str(model_path),
        *cpu_args(sglang_version_of(python)),
        "--max-total-tokens",
        str(max_total_tokens),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        *extra_args,
    ]
    if routing_cache:
        argv += ["--return-routed-experts", "--routing-cache", routing_cache]
        if api_key:
            argv += ["--routing-api-key", api_key]
    run_env = dict(os.environ if env is None else env)
    if launcher != "sglang_r3.launch_server":
        from sglang_r3.cpu import prepare_env

        run_env = prepare_env(run_env)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            argv, stdout=fh, stderr=subprocess.STDOUT, env=run_env, start_new_session=True
        )
    server = EngineServer(f"http://127.0.0.1:{port}", proc, log, argv)
    wait_ready(f"{server.url}/health", server, "SGLang", timeout_s=timeout_s, poll_s=0.5)
    return server


def start_router(
    workers: list[str],
    *,
    port: int,
    metrics_port: int,
    log: Path,
    extra_args: tuple[str, ...] = (),
    timeout_s: float = 120.0,
) -> EngineServer:
    """Start ``sglang-router`` (:mod:`sglang_r3.launch.fleet` settings) in front of ``workers``.

    Waits until the router answers and lists every worker as healthy (it registers
    them in the background after it starts listening).  Stopped like an engine, by
    process group.
    """
    import httpx

    from sglang_r3.launch.fleet import router_argv

    # Its Prometheus exporter listens too (default 0.0.0.0:29000): on loopback.
    metrics = ("--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port))
    argv = router_argv(
        sys.executable, workers, host="127.0.0.1", port=port, extra=(*metrics, *extra_args)
    )
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    router = EngineServer(f"http://127.0.0.1:{port}", proc, log, argv)
    wait_ready(f"{router.url}/liveness", router, "sglang-router", timeout_s=timeout_s, poll_s=0.3)
    deadline = time.monotonic() + timeout_s
    while True:
        listed = httpx.get(f"{router.url}/workers", timeout=5).json().get("workers", [])
        if sorted(w["url"] for w in listed if w.get("is_healthy")) == sorted(workers):
            return router
        if time.monotonic() > deadline or proc.poll() is not None:
            router.stop()
            raise RuntimeError(f"sglang-router did not list {workers} as healthy: {listed}")
        time.sleep(0.3)


class LocalStack:
    """What a local run starts under ``work``, stopped in reverse order on exit.

    ``with LocalStack(work) as stack:`` then :meth:`build_model`, :meth:`start_cache`,
    :meth:`start_engine` in that order (a caller with its own model, cache or engine
    skips that step).  :meth:`stop` is the exit, for callers that must stop it at a
    point of their own.
    """

    def __init__(self, work: Path) -> None:
        self.work = work
        self.started: list[CacheServer | EngineServer] = []

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def build_model(self, family: str, name: str = "model", **kwargs: Any) -> Path:
        """:func:`build_tiny_model` into ``work/name``."""
        return build_tiny_model(family, self.work / name, **kwargs)

    def start_cache(self) -> CacheServer:
        """:func:`start_cache` under ``work/cache`` on free ports."""
        cache = start_cache(self.work / "cache", http_port=free_port(), grpc_port=free_port())
        self.started.append(cache)
        return cache

    def start_engine(self, model_path: str | os.PathLike[str], **kwargs: Any) -> EngineServer:
        """:func:`start_engine` on a free port, logging to ``work/sglang.log``."""
        engine = start_engine(
            model_path, port=engine_port(), log=self.work / "sglang.log", **kwargs
        )
        self.started.append(engine)
        return engine

    def stop(self) -> None:
        """Stop everything started, last first (the engine before the cache it ships to)."""
        while self.started:
            self.started.pop().stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m sglang_r3.tools.local_stack build-model OUT``: write a tiny MoE checkpoint.

    Used where a real checkpoint cannot be had: the dev Kubernetes overlay's init
    container, laptops without a model hub.
    """
    import argparse

    p = argparse.ArgumentParser(prog="python -m sglang_r3.tools.local_stack")
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build-model", help="write a random tiny MoE checkpoint + tokenizer")
    b.add_argument("out", type=Path)
    b.add_argument("--family", choices=FAMILIES, default="qwen3_moe")
    b.add_argument("--layers", type=int, default=3)
    b.add_argument("--experts", type=int, default=8)
    b.add_argument("--topk", type=int, default=2)
    b.add_argument("--hidden", type=int, default=128)
    b.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not 1 <= args.topk <= args.experts:
        p.error("--topk must be between 1 and --experts")
    out = build_tiny_model(
        args.family,
        args.out,
        layers=args.layers,
        experts=args.experts,
        topk=args.topk,
        hidden=args.hidden,
        seed=args.seed,
    )
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
