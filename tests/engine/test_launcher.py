"""The launcher refuses unsafe or broken configurations before SGLang starts (exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cache_service.redis_proc import free_port
from sglang_r3.cpu import prepare_env
from sglang_r3.tools.local_stack import build_tiny_mtp_draft
from tests.support.engine_requests import shim_env
from tests.support.service_process import KEY_A, Service


def launch(
    model: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    argv = [
        sys.executable,
        "-m",
        "sglang_r3.launch_server",
        "--model-path",
        str(model),
        "--device",
        "cpu",
        "--port",
        str(free_port()),
        *args,
    ]
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=180, env={**os.environ, **(env or {})}
    )


def plugin(cache: Service, key: str = KEY_A) -> tuple[str, ...]:
    """The launcher's options that turn the plugin on, shipping to ``cache`` with ``key``."""
    return ("--return-routed-experts", "--routing-cache", cache.http_url, "--routing-api-key", key)


def test_return_routed_experts_needs_a_cache(tiny_models: dict[str, Path]) -> None:
    proc = launch(tiny_models["qwen3_moe"], "--return-routed-experts")
    assert proc.returncode == 2
    assert "--return-routed-experts needs --routing-cache" in proc.stderr


HICACHE_VERIFIED = (
    "--enable-hierarchical-cache",
    "--hicache-io-backend",
    "direct",
    "--hicache-mem-layout",
    "layer_first",
)


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        # SGLang's defaults (kernel io, page_first): rows would move the same way, but
        # sglang_r3 has verified only direct io into a layer-first host pool.
        (("--enable-hierarchical-cache",), "verified that only with --hicache-io-backend direct"),
        # L3: KV restored by content hash from storage, with no rows there.
        ((*HICACHE_VERIFIED, "--hicache-storage-backend", "file"), "HiCache L3"),
    ],
    ids=["hicache-kernel-io", "hicache-l3-storage"],
)
def test_refuses_hicache_where_rows_cannot_follow(
    tiny_models: dict[str, Path], engine_cache: Service, args: tuple[str, ...], reason: str
) -> None:
    proc = launch(tiny_models["qwen3_moe"], *plugin(engine_cache), *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert reason in proc.stderr and "sglang#26975" in proc.stderr, proc.stderr[-2000:]


def test_refuses_wrong_api_key(tiny_models: dict[str, Path], engine_cache: Service) -> None:
    proc = launch(tiny_models["qwen3_moe"], *plugin(engine_cache, "not-a-key"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "refused the API key" in proc.stderr


@pytest.mark.parametrize("target", ["sglang.srt.managers.scheduler.NoSuchThing.nope"])
def test_hook_that_did_not_apply_stops_the_launch(
    tiny_models: dict[str, Path], engine_cache: Service, target: str
) -> None:
    proc = launch(
        tiny_models["qwen3_moe"],
        *plugin(engine_cache),
        env=shim_env("bogus_hook", R3_SHIM_BOGUS_HOOK_TARGET=target),
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"{target}: SGLang did not apply the hook" in proc.stderr


def test_plugin_excluded_by_sglang_plugins(tiny_models: dict[str, Path]) -> None:
    proc = launch(tiny_models["qwen3_moe"], env={"SGLANG_PLUGINS": "smg-zmq"})
    assert proc.returncode == 2 and "excludes this extension's plugin" in proc.stderr


def test_help_lists_our_options_in_their_own_group_with_sglangs() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_r3.launch_server", "--help"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert out.startswith("usage: python -m sglang_r3.launch_server")
    title = "R3 routing capture (sglang_r3):"
    assert title in out and "\noptions:" in out
    ours = out[out.index(title) : out.index("\noptions:")]
    for flag in (
        "--return-routed-experts",
        "--routing-cache URL",
        "--routing-api-key KEY",
        "--routing-on-cache-error {fail,inline}",
        "--routing-on-retraction {mark,fail}",
        "--routing-put-attempts N",
        "--routing-put-timeout S",
    ):
        assert flag in ours, flag
    sglangs = out[out.index("\noptions:") :]
    for flag in ("--model-path", "--device", "--enable-return-routed-experts", "--config"):
        assert flag in sglangs, flag
    assert "--routing-cache" not in sglangs


# ---------------------------------------------------------------- speculative decoding

TREE = (
    "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "1",
    "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "3",
)  # fmt: skip


@pytest.fixture(scope="module")
def mtp_draft(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_mtp_draft(tiny_models["qwen3_moe"], tmp_path_factory.mktemp("mtp"))


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (TREE, "--speculative-eagle-topk 2 (a draft tree)"),
        (("--speculative-algorithm", "NGRAM"), "speculative/ngram_worker.py:567-577"),
    ],
    ids=["eagle-tree", "ngram"],
)
def test_refuses_speculation_that_moves_kv_without_rows(
    tiny_models: dict[str, Path],
    engine_cache: Service,
    mtp_draft: Path,
    spec: tuple[str, ...],
    reason: str,
) -> None:
    proc = launch(
        tiny_models["qwen3_moe"],
        *plugin(engine_cache),
        "--attention-backend",
        "torch_native",
        *spec,
        "--speculative-draft-model-path",
        str(mtp_draft),
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert reason in proc.stderr
    assert "spec_utils.py:859-910" in proc.stderr  # the KV move that leaves rows behind
    assert "--speculative-eagle-topk 1" in proc.stderr  # what to do instead


_DECIDE = """
import json, sys
from sglang.srt.server_args import prepare_server_args
from sglang_r3.launch.startup import speculation_problem
base = ["--model-path", sys.argv[1], "--device", "cpu", "--attention-backend", "torch_native",
        "--speculative-draft-model-path", sys.argv[2]]
out = {}
for name, spec in json.loads(sys.argv[3]).items():
    server_args = prepare_server_args(base + spec)
    before = speculation_problem(server_args)  # what the launcher sees: the raw record
    server_args.resolve_once()  # what run_server, the HTTP hook and the scheduler see
    out[name] = [before is None, speculation_problem(server_args) is None]
print("DECIDED " + json.dumps(out))
"""


def test_speculation_is_judged_on_the_record_sglang_resolves(
    tiny_models: dict[str, Path], mtp_draft: Path
) -> None:
    """SGLang 0.5.23 resolves server_args into a stash (raw fields keep ``NEXTN``, topk
    None); the check decides on what resolution makes of them, before and after it runs."""
    specs = {
        # No topk: SGLang picks steps 3, topk 1, 4 draft tokens for this model: a chain.
        "nextn-default": ["--speculative-algorithm", "NEXTN"],
        "eagle3-chain": ["--speculative-algorithm", "EAGLE3", "--speculative-eagle-topk", "1",
                         "--speculative-num-steps", "2", "--speculative-num-draft-tokens", "3"],
        "eagle-tree": list(TREE),
        # NGRAM is refused whatever its breadth (its overlap path drops the rows).
        "ngram-chain": ["--speculative-algorithm", "NGRAM",
                        "--speculative-ngram-max-bfs-breadth", "1"],
    }  # fmt: skip
    env = prepare_env(dict(os.environ))
    proc = subprocess.run(
        [
            sys.executable, "-c", _DECIDE, str(tiny_models["qwen3_moe"]), str(mtp_draft),
            json.dumps(specs),
        ],
        capture_output=True, text=True, timeout=180, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("DECIDED "))
    assert json.loads(line.removeprefix("DECIDED ")) == {
        "nextn-default": [True, True],
        "eagle3-chain": [True, True],
        "eagle-tree": [False, False],
        "ngram-chain": [False, False],
    }


def test_refuses_tokenizer_workers_with_a_foreign_app(
    tiny_models: dict[str, Path], engine_cache: Service
) -> None:
    """Under --tokenizer-worker-num > 1 SGLang's HTTP workers import the app named by
    SGLANG_HTTP_SERVER_APP_PATH; the launcher sets it to sglang_r3.worker_app, and
    refuses a value of the user's that would run the workers without the plugin."""
    proc = launch(
        tiny_models["qwen3_moe"],
        *plugin(engine_cache),
        "--tokenizer-worker-num",
        "2",
        env={"SGLANG_HTTP_SERVER_APP_PATH": "sglang.srt.entrypoints.http_server:app"},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "SGLANG_HTTP_SERVER_APP_PATH=sglang_r3.worker_app:app" in proc.stderr
    assert "'sglang.srt.entrypoints.http_server:app'" in proc.stderr
