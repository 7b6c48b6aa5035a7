"""Routing recorded by the real SGLang, fetched through the service, replayed in HF.

Replay must give 0 % routing disagreement with the engine; without replay the
disagreement is measured and printed (run with ``-s`` to see it).  On each tested
SGLang release (:func:`tests.support.engine_fixtures.sglang_release`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from r3_client import RoutingClient
from r3_client.replay import apply_routing_replay
from sglang_r3.tools.local_stack import EngineServer
from sglang_r3.tools.mismatch_report import (
    MisalignedLogprobsError,
    generate_rollouts,
    measure,
    output_logprobs,
)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def qwen_engine(release_qwen_engine: EngineServer) -> EngineServer:
    """The session's Qwen engine on each tested release."""
    return release_qwen_engine


@pytest.fixture(scope="module")
def glm_engine(release_glm_engine: EngineServer) -> EngineServer:
    """The session's GLM engine on each tested release."""
    return release_glm_engine


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
def test_engine_routing_replays_with_zero_disagreement(
    family: str,
    request: pytest.FixtureRequest,
    sglang_release: str,  # (the engines below are this release's)
    tiny_models: dict[str, Path],
    cache_client: RoutingClient,
) -> None:
    engine: EngineServer = request.getfixturevalue(
        "qwen_engine" if family == "qwen3_moe" else "glm_engine"
    )
    rollouts = generate_rollouts(
        engine.url, count=4, prompt_len=24, new_tokens=12, temperature=1.0, vocab=1024, seed=5
    )
    for r in rollouts:
        r.routing = cache_client.get(r.rollout_id)
        assert r.routing.num_rows == len(r.tokens) - 1
    tf: Any = transformers
    model = tf.AutoModelForCausalLM.from_pretrained(tiny_models[family], dtype=torch.bfloat16)
    apply_routing_replay(model.eval())
    results = measure(model, rollouts)
    replay, native = results["replay"], results["native"]
    assert replay["n_routers"] == native["n_routers"] > 0
    assert replay["router_disagreement"] == 0.0
    assert replay["token_disagreement"] == 0.0
    # SGLang 0.5.12 returns log-probs that do not line up with the output tokens of a
    # request it retracted (the GLM engine forces retractions); 0.5.23 does not.  Those
    # rollouts count for routing above, not for the log-prob measures.
    if sglang_release != "0.5.12":
        assert results["n_without_logprobs"] == 0
    print(
        f"\n{family}: native routing disagrees on {native['router_disagreement']:.2%} of routers "
        f"({native['token_disagreement']:.2%} of tokens); replay 0 %. "
        f"k3 KL native {native['k3_kl']:.2e}, replay {replay['k3_kl']:.2e} "
        f"({results['n_without_logprobs']} of 4 rollouts without aligned log-probs)"
    )


def test_output_logprobs_refuses_logprobs_that_name_other_tokens() -> None:
    """Log-probs are paired with output tokens only when each names its token."""
    item = {"output_ids": [7, 8, 9], "meta_info": {"output_token_logprobs": []}}
    item["meta_info"]["output_token_logprobs"] = [[-0.5, 7, None], [-1.0, 8, None], [-2.0, 9, None]]
    assert output_logprobs(item) == [-0.5, -1.0, -2.0]
    item["meta_info"]["output_token_logprobs"] = [[-0.5, 7, None], [-1.0, 9, None]]
    with pytest.raises(
        MisalignedLogprobsError, match=r"2 log-probs for 3 output tokens.*differs at 1"
    ):
        output_logprobs(item)
    item["meta_info"]["output_token_logprobs"] = [[-0.5, 7, None], [-1.0, 8, None]]
    with pytest.raises(MisalignedLogprobsError, match=r"2 log-probs for 3 output tokens$"):
        output_logprobs(item)


def test_mismatch_report_command(
    qwen_engine: EngineServer, engine_cache: Any, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """`r3 mismatch-report` against running servers writes its table, JSON and plots."""
    import json
    import subprocess
    import sys

    from tests.support.service_process import KEY_A

    out = tmp_path / "report"
    proc = subprocess.run(
        [
            sys.executable, "-m", "sglang_r3.tools.mismatch_report",
            "--engine-url", qwen_engine.url, "--cache-url", engine_cache.http_url,
            "--api-key", KEY_A, "--model-path", str(tiny_models["qwen3_moe"]),
            "--rollouts", "3", "--prompt-len", "10", "--new-tokens", "8", "--out", str(out),
        ],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| router-level disagreement |" in proc.stdout
    summary = json.loads((out / "mismatch.json").read_text())
    assert summary["replay"]["router_disagreement"] == 0.0
    assert summary["native"]["n_tokens"] == 3 * 8
    for png in ("p_infer_vs_p_train.png", "f_tau.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
