"""Speculative decoding (EAGLE/MTP chain) on a real CPU engine: one stored row per accepted
token, equal to a non-speculative engine's rows for the same tokens.

The speculative engine runs the tiny Qwen3-MoE with the MTP draft
:func:`sglang_r3.harness.build_tiny_mtp_draft` builds (a MoE layer of its own, which
SGLang must keep out of the target's rows), ``--speculative-algorithm NEXTN`` (SGLang
resolves it to EAGLE), one step, ``topk 1``, two draft tokens per verify: every verify
forward computes routing for the last accepted token and one draft; a rejected draft's
row must never be stored.  SGLang 0.5.23 cannot run speculation on this CPU by itself:
the test-only shims ``spec_ops``, ``torch_native_verify``, ``draft_torch_native`` and
``cuda_sync_noop`` (``tests/engine/cpu_shims``) stand in for its GPU-only pieces.

Rows are compared as sets per (token, layer).  Where the speculative engine's greedy
tokens equal the reference engine's (``qwen_engine``, no speculation), its stored rows
are compared with the reference's; where they diverge (batched verify can break an
exact bf16 logit tie the other way), with a ``transformers`` forward of the engine's own
tokens.  A difference is a *near-tie* when that forward puts the router's 2nd and 3rd
logits less than :data:`NEAR_TIE` apart (the two experts are interchangeable up to bf16
rounding); any other difference is *real*, and there must be none.

Tree speculation (``topk > 1``) and NGRAM are refused at start-up (test_launcher.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from _engine import as_sets, generate, inline_rows, rid, shim_env, sp
from _service import KEY_A, Service

from cache_service.redis_proc import free_port
from r3_client import RoutingClient
from sglang_r3.harness import EngineServer, build_tiny_mtp_draft, start_engine

pytestmark = pytest.mark.timeout(600)

LAYERS, TOPK = 3, 2
NEW_TOKENS = 24
NEAR_TIE = 0.01
SHIMS = ("spec_ops", "torch_native_verify", "draft_torch_native", "cuda_sync_noop")
SPEC_ARGS = (
    "--speculative-algorithm", "NEXTN",
    "--speculative-num-steps", "1",
    "--speculative-eagle-topk", "1",
    "--speculative-num-draft-tokens", "2",
)  # fmt: skip
# Prompts with repeated stretches, so that some drafts are accepted and some are not.
PROMPTS = [
    [5 + (7 * k + 13 * i) % 900 for k in range(20 + 3 * i)] + list(range(300, 306)) * 2
    for i in range(4)
]


@pytest.fixture(scope="module")
def spec_engine(
    tiny_models: dict[str, Path],
    engine_cache: Service,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineServer]:
    """The tiny Qwen3-MoE with its MTP draft, chain speculation, the plugin on."""
    root = tmp_path_factory.mktemp("spec")
    draft = build_tiny_mtp_draft(tiny_models["qwen3_moe"], root / "mtp")
    server = start_engine(
        tiny_models["qwen3_moe"],
        port=free_port(),
        log=root / "sglang.log",
        routing_cache=engine_cache.http_url,
        api_key=KEY_A,
        extra_args=(*SPEC_ARGS, "--speculative-draft-model-path", str(draft)),
        env={**os.environ, **shim_env(*SHIMS)},
    )
    yield server
    server.stop()


def _router_logits(model: Path, tokens: list[int]) -> npt.NDArray[np.float32]:
    """``[len(tokens) - 1, layers, experts]`` router logits of a ``transformers`` forward."""
    import torch
    import transformers

    tf: Any = transformers
    hf = tf.AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        out = hf(torch.tensor([tokens[:-1]]), output_router_logits=True)
    logits = torch.stack([x.float() for x in out.router_logits], 1)
    return logits.numpy().reshape(len(tokens) - 1, LAYERS, -1)


def _classify(
    got: npt.NDArray[Any], want: npt.NDArray[Any], logits: npt.NDArray[np.float32]
) -> tuple[int, int]:
    """(near-ties, real differences) among the (token, layer) routers where ``got`` and
    ``want`` differ as sets, judged by the 2nd-3rd router logit gap in ``logits``."""
    differ = (as_sets(got) != as_sets(want)).any(-1)
    ranked = -np.sort(-logits, axis=-1)
    gap = ranked[..., TOPK - 1] - ranked[..., TOPK]
    return int((differ & (gap < NEAR_TIE)).sum()), int((differ & (gap >= NEAR_TIE)).sum())


def _hf_rows(logits: npt.NDArray[np.float32]) -> npt.NDArray[np.int64]:
    return np.argsort(-logits, axis=-1, kind="stable")[..., :TOPK]


def test_chain_speculation_stores_one_exact_row_per_accepted_token(
    spec_engine: EngineServer,
    qwen_engine: EngineServer,
    cache_client: RoutingClient,
    tiny_models: dict[str, Path],
) -> None:
    # Reference: no speculation, one request at a time.
    reference = []
    for prompt in PROMPTS:
        body = {
            "input_ids": prompt,
            "sampling_params": sp(None, NEW_TOKENS),
            "return_routed_experts": True,
        }
        status, out = generate(qwen_engine.url, body)
        assert status == 200, out
        reference.append(out)
    # Speculative engine: all prompts at once (batched verify), each a tagged rollout.
    rollouts = [rid("spec") for _ in PROMPTS]

    def run(i: int) -> tuple[int, Any]:
        body = {"input_ids": PROMPTS[i], "sampling_params": sp(rollouts[i], NEW_TOKENS)}
        return generate(spec_engine.url, body)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(run, range(len(PROMPTS))))

    counts = dict(routers=0, same_tokens=0, near_ties=0, real=0)
    correct = proposed = verify_steps = completion = shipped_bytes = shipped_rows = 0
    for prompt, rollout, (status, out), ref in zip(
        PROMPTS, rollouts, results, reference, strict=True
    ):
        assert status == 200, out
        meta = out["meta_info"]
        tokens = prompt + out["output_ids"]
        rows = len(tokens) - 1  # P + N - 1: every accepted token but the last
        assert meta["completion_tokens"] == len(out["output_ids"]) == NEW_TOKENS
        assert (meta["r3"]["start"], meta["r3"]["end"]) == (0, rows) and meta["r3"]["stored"]
        stored = cache_client.get(rollout)
        # One row per accepted token: none for the rejected drafts that verify computed.
        assert stored.indices.shape == (rows, LAYERS, TOPK)
        assert cache_client.stat(rollout).num_rows == rows

        logits = _router_logits(tiny_models["qwen3_moe"], tokens)
        if out["output_ids"] == ref["output_ids"]:
            want: npt.NDArray[Any] = inline_rows(ref, LAYERS, TOPK)
            counts["same_tokens"] += 1
        else:  # an exact tie broken the other way: judge by the engine's own tokens
            want = _hf_rows(logits)
        assert want.shape == stored.indices.shape
        ties, real = _classify(stored.indices, want, logits)
        counts["routers"] += rows * LAYERS
        counts["near_ties"] += ties
        counts["real"] += real

        correct += meta["spec_num_correct_drafts"]
        proposed += meta["spec_num_proposed_drafts"]
        verify_steps += meta["spec_verify_ct"]
        completion += meta["completion_tokens"]
        shipped_bytes += meta["r3"]["nbytes"]
        shipped_rows += rows

    print(
        f"\nchain speculation: {counts}; drafts accepted {correct}/{proposed} "
        f"({correct / proposed:.2f}), {completion / verify_steps:.2f} tokens per verify; "
        f"{shipped_bytes / shipped_rows:.1f} bytes shipped per token "
        f"({shipped_bytes} B for {shipped_rows} rows)"
    )
    assert counts["real"] == 0, counts
    assert counts["same_tokens"] >= len(PROMPTS) // 2, counts  # the reference is used
    # Both kinds of draft happened, so the row counts above tested both.
    assert 0 < correct < proposed, (correct, proposed)
