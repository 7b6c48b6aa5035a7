"""Speculative decoding (EAGLE/MTP chain) on a real CPU engine: one stored row per accepted
token, equal to a non-speculative engine's rows for the same tokens.

The speculative engine runs the tiny Qwen3-MoE with the MTP draft
:func:`sglang_r3.tools.local_stack.build_tiny_mtp_draft` builds (a MoE layer of its own, which
SGLang must keep out of the target's rows), ``--speculative-algorithm NEXTN`` (SGLang
resolves it to EAGLE), one step, ``topk 1``, two draft tokens per verify: every verify
forward computes routing for the last accepted token and one draft; a rejected draft's
row must never be stored.  SGLang 0.5.23 cannot run speculation on this CPU by itself:
the test-only shims ``spec_ops``, ``torch_native_verify``, ``draft_torch_native`` and
``cuda_sync_noop`` (``tests/engine/cpu_shims``) stand in for its GPU-only pieces.

Rows are compared as sets per (token, layer) with the non-speculative reference engine's
rows of the same tokens: its own greedy run where the tokens agree, its recomputation of
the speculative engine's tokens (one prefill, KV recomputed) where they diverge (batched
verify can break an exact bf16 logit tie the other way).  A ``transformers`` forward of
the tokens judges each difference (``rows_judge``): a *near-tie* when the router's 2nd
and 3rd logits are less than ``NEAR_TIE`` (0.01) apart (the two experts are
interchangeable up to bf16 rounding), *after a tie* in a deeper layer of a token that
already differed at a near-tie (its input differs from there on), *real* otherwise;
there must be no real one.

STANDALONE (a separate MoE draft model) and EAGLE3 (a dummy-weight draft head: every
draft rejected) are tested the same way behind ``R3_TEST_SPEC_EXTRA=1`` (more engines
than CI's time allows).
Tree speculation (``topk > 1``) and NGRAM are refused at start-up (test_launcher.py).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from cache_service.redis_proc import free_port
from r3_client import RoutingClient
from sglang_r3.tools.local_stack import (
    EngineServer,
    build_tiny_model,
    build_tiny_mtp_draft,
    start_engine,
)
from tests.support.engine_requests import generate, inline_rows, rid, shim_env, sp
from tests.support.rows_judge import judge_rows, reference_rows
from tests.support.service_process import KEY_A, Service

pytestmark = pytest.mark.timeout(600)

LAYERS, TOPK = 3, 2
NEW_TOKENS = 24
EXTRA_ENV = "R3_TEST_SPEC_EXTRA"
SHIMS = ("spec_ops", "torch_native_verify", "draft_torch_native", "cuda_sync_noop")
CHAIN_ARGS = (
    "--speculative-num-steps", "1",
    "--speculative-eagle-topk", "1",
    "--speculative-num-draft-tokens", "2",
)  # fmt: skip
# Prompts with repeated stretches, so that some drafts are accepted and some are not.
PROMPTS = [
    [5 + (7 * k + 13 * i) % 900 for k in range(20 + 3 * i)] + list(range(300, 306)) * 2
    for i in range(4)
]


def _start_speculative(
    target: Path, log: Path, cache: Service, algorithm: str, draft: Path, *extra: str
) -> EngineServer:
    """``target`` with the plugin on, speculating by ``algorithm`` as a chain
    (:data:`CHAIN_ARGS`) with the draft at ``draft``, on the CPU shims."""
    return start_engine(
        target,
        port=free_port(),
        log=log,
        routing_cache=cache.http_url,
        api_key=KEY_A,
        extra_args=(
            "--speculative-algorithm",
            algorithm,
            *CHAIN_ARGS,
            "--speculative-draft-model-path",
            str(draft),
            *extra,
        ),
        env={**os.environ, **shim_env(*SHIMS)},
    )


@pytest.fixture(scope="module")
def spec_engine(
    tiny_models: dict[str, Path],
    engine_cache: Service,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineServer]:
    """The tiny Qwen3-MoE with its MTP draft, chain speculation, the plugin on."""
    root = tmp_path_factory.mktemp("spec")
    draft = build_tiny_mtp_draft(tiny_models["qwen3_moe"], root / "mtp")
    server = _start_speculative(
        tiny_models["qwen3_moe"], root / "sglang.log", engine_cache, "NEXTN", draft
    )
    yield server
    server.stop()


def _reference(url: str, prompt_ids: list[list[int]]) -> list[dict[str, Any]]:
    """The non-speculative engine's greedy outputs with inline rows, one at a time."""
    out = []
    for prompt in prompt_ids:
        body = {
            "input_ids": prompt,
            "sampling_params": sp(None, NEW_TOKENS),
            "return_routed_experts": True,
        }
        status, answer = generate(url, body)
        assert status == 200, answer
        out.append(answer)
    return out


def _speculate(url: str, prompt_ids: list[list[int]]) -> list[tuple[str, dict[str, Any]]]:
    """All prompts at once (batched verify), each a tagged rollout; (rollout, output)."""
    rollouts = [rid("spec") for _ in prompt_ids]

    def run(i: int) -> dict[str, Any]:
        body = {"input_ids": prompt_ids[i], "sampling_params": sp(rollouts[i], NEW_TOKENS)}
        status, out = generate(url, body)
        assert status == 200, out
        return out  # type: ignore[no-any-return]

    with ThreadPoolExecutor(len(prompt_ids)) as pool:
        return list(zip(rollouts, pool.map(run, range(len(prompt_ids))), strict=True))


def _check_rows(
    model: Path,
    reference_url: str,
    prompt_ids: list[list[int]],
    client: RoutingClient,
    spec_url: str,
) -> dict[str, Any]:
    """Run the prompts on both engines; assert one stored row per accepted token; count
    the routers that differ from the reference engine's rows of the same tokens (its
    greedy run where the tokens agree, its recomputation of the speculative engine's own
    tokens where they diverge), judged by a ``transformers`` forward; the figures."""
    reference = _reference(reference_url, prompt_ids)
    results = _speculate(spec_url, prompt_ids)
    counts = dict(routers=0, same_tokens=0, near_ties=0, after_tie=0, real=0)
    correct = proposed = verify_steps = shipped_bytes = shipped_rows = 0
    for prompt, ref, (rollout, out) in zip(prompt_ids, reference, results, strict=True):
        meta = out["meta_info"]
        tokens = prompt + out["output_ids"]
        rows = len(tokens) - 1  # P + N - 1: every accepted token but the last
        assert meta["completion_tokens"] == len(out["output_ids"]) == NEW_TOKENS
        assert (meta["r3"]["start"], meta["r3"]["end"]) == (0, rows) and meta["r3"]["stored"]
        stored = client.get(rollout)
        # One row per accepted token: none for the rejected drafts that verify computed.
        assert stored.indices.shape == (rows, LAYERS, TOPK)
        assert client.stat(rollout).num_rows == rows

        if out["output_ids"] == ref["output_ids"]:
            want = inline_rows(ref, LAYERS, TOPK)
            counts["same_tokens"] += 1
        else:  # greedy broke an exact tie the other way under batched verify
            want = reference_rows(reference_url, tokens, LAYERS, TOPK)
        assert want.shape == stored.indices.shape
        judged = judge_rows(stored.indices, want, model, tokens, LAYERS, TOPK, after_tie_ok=True)
        counts["routers"] += rows * LAYERS
        counts["near_ties"] += judged.near_ties
        counts["after_tie"] += judged.after_tie
        counts["real"] += len(judged.real)

        correct += meta["spec_num_correct_drafts"]
        proposed += meta["spec_num_proposed_drafts"]
        verify_steps += meta["spec_verify_ct"]
        shipped_bytes += meta["r3"]["nbytes"]
        shipped_rows += rows
    print(
        f"\n{counts}; drafts accepted {correct}/{proposed} ({correct / proposed:.2f}), "
        f"{NEW_TOKENS * len(results) / verify_steps:.2f} tokens per verify; "
        f"{shipped_bytes / shipped_rows:.1f} bytes shipped per token "
        f"({shipped_bytes} B for {shipped_rows} rows)"
    )
    return {**counts, "accepted": correct, "proposed": proposed}


def test_chain_speculation_stores_one_exact_row_per_accepted_token(
    spec_engine: EngineServer,
    qwen_engine: EngineServer,
    cache_client: RoutingClient,
    tiny_models: dict[str, Path],
) -> None:
    got = _check_rows(
        tiny_models["qwen3_moe"], qwen_engine.url, PROMPTS, cache_client, spec_engine.url
    )
    assert got["real"] == 0, got
    assert got["same_tokens"] >= len(PROMPTS) // 2, got  # the reference engine is used
    # Both kinds of draft happened, so the row counts above tested both.
    assert 0 < got["accepted"] < got["proposed"], got


@pytest.mark.skipif(
    not os.environ.get(EXTRA_ENV),
    reason=f"two more engines (~1.5 min); set {EXTRA_ENV}=1 to run it",
)
def test_standalone_moe_draft_stores_one_exact_row_per_accepted_token(
    engine_cache: Service,
    cache_client: RoutingClient,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """STANDALONE: a separate draft model, here a MoE one (Mixtral: SGLang rewrites a
    Qwen3-MoE draft to its MTP class), the target with its last layer dropped, so the
    draft routes through experts too and must stay out of the target's rows.  The
    reference is a non-speculative engine of the same Mixtral target."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("standalone")
    target = build_tiny_model("mixtral", root / "mixtral")
    draft = root / "draft"
    draft.mkdir()
    weights = load_file(str(target / "model.safetensors"))
    last = f"model.layers.{LAYERS - 1}."
    save_file(
        {k: v for k, v in weights.items() if not k.startswith(last)},
        str(draft / "model.safetensors"),
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (target / name).exists():
            shutil.copy(target / name, draft / name)
    config = json.loads((target / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "num_hidden_layers": LAYERS - 1}))
    server = _start_speculative(target, root / "sglang.log", engine_cache, "STANDALONE", draft)
    try:
        reference = start_engine(
            target,
            port=free_port(),
            log=root / "reference.log",
            routing_cache=engine_cache.http_url,
            api_key=KEY_A,
        )
        try:
            got = _check_rows(target, reference.url, PROMPTS, cache_client, server.url)
        finally:
            reference.stop()
    finally:
        server.stop()
    assert got["real"] == 0, got
    assert got["accepted"] > 0, got


@pytest.mark.skipif(
    not os.environ.get(EXTRA_ENV),
    reason=f"one more engine (~1 min); set {EXTRA_ENV}=1 to run it",
)
def test_eagle3_rejected_drafts_store_no_rows(
    engine_cache: Service,
    qwen_engine: EngineServer,
    cache_client: RoutingClient,
    tiny_models: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """EAGLE3: the target also captures auxiliary hidden states for the draft head.  The
    head here has random (``dummy``) weights, so every draft is rejected: the rows are
    the target's only, one per token, none for the drafts verify computed."""
    import transformers

    tf: Any = transformers
    root = tmp_path_factory.mktemp("eagle3")
    head = tf.LlamaConfig(
        vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    ).to_dict()  # fmt: skip
    head.update(
        architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=1024, target_hidden_size=128
    )
    (root / "config.json").write_text(json.dumps(head))
    server = _start_speculative(
        tiny_models["qwen3_moe"],
        root / "sglang.log",
        engine_cache,
        "EAGLE3",
        root,
        "--speculative-draft-load-format",
        "dummy",
    )
    try:
        got = _check_rows(
            tiny_models["qwen3_moe"], qwen_engine.url, PROMPTS, cache_client, server.url
        )
    finally:
        server.stop()
    assert got["real"] == 0, got
    assert got["accepted"] == 0 < got["proposed"], got
