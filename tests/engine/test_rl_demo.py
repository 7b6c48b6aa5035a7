"""``r3 rl-demo``, shortened: two GRPO steps, each step's samples scored paired, real SGLang.

The demo checks its own invariants and exits 1 when one fails (replayed routing equal
to the rows given, per-segment weight versions, a view of the prefix an episode's last
turn recomputed after the push, no stale prefix rows after a push, flat Redis memory);
this test runs it as a user would and reads its JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)

POLICIES = ["native", "generated", "latest", "exact"]


def test_two_steps_of_grpo_with_weight_pushes_scored_paired(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = [
        sys.executable, "-m", "r3_client.cli", "rl-demo",
        "--steps", "2", "--prompts", "2", "--samples", "4", "--episodes", "1",
        "--prompt-len", "12", "--new", "8", "--tool", "2",
        "--out", str(out), "--workdir", str(tmp_path / "work"),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "rl-demo.json").read_text())
    # One run, trained on the exact replay; every step scores the same samples with the
    # same weights under each policy.
    assert result["trained"] == "exact" and result["policies"] == POLICIES
    records = result["records"]
    assert [r["step"] for r in records] == [0, 1]
    # Step 1 trains on the episode begun in step 0, its turns under two versions.
    assert [r["straddling_episodes"] for r in records] == [0, 1]
    assert all(r["bytes_moved"] > 0 and r["bytes_stored"] > 0 for r in records)
    for r in records:
        for key in ("k3_kl", "logp_abs_diff", "f2", "f5", "straddle_k3_kl", "first_turn_k3_kl"):
            assert sorted(r[key]) == sorted(POLICIES), (key, r[key])
        assert r["replay_router_disagreement"] == 0.0
        # trained through state expansion (one batched forward over a row per state), its
        # loss and every token's log-prob equal to the per-state forwards'
        assert r["expansion_max_abs_dlogp"] < 1e-4, r["expansion_max_abs_dlogp"]
        assert r["loss"]["expansion"] == pytest.approx(r["loss"]["per_state"], abs=1e-5)
    step0, step1 = records
    assert all(v != v for v in step0["straddle_k3_kl"].values())  # NaN: no episode yet
    # The GRPO samples have no views here (one state): the three replay policies are the
    # same routing, replayed in the same forward.
    for r in records:
        if r["samples_with_views"] == r["straddling_episodes"]:
            kl = r["k3_kl"]
            assert kl["generated"] == pytest.approx(kl["exact"], rel=1e-6), kl
            assert kl["latest"] == pytest.approx(kl["exact"], rel=1e-6), kl
    # Replay removes the routing part of the mismatch: over the run, exact below native on
    # the GRPO samples (their native routing disagrees with the engine's at every step
    # measured; per step the margin at step 0 was as small as 1.2x, so the sum is asserted).
    assert sum(r["k3_kl"]["exact"] for r in records) < sum(r["k3_kl"]["native"] for r in records)
    # The straddling episode: its last turn recomputed the prefix after the push (a view),
    # so latest and exact replay what it attended to (the same forward for that turn);
    # generated replays the first computation, routed by the weights before the push.
    assert step1["samples_with_views"] >= 1
    last = step1["straddle_k3_kl"]
    assert last["latest"] == pytest.approx(last["exact"], rel=1e-6), last
    assert last["exact"] < last["generated"], last
    # exact at native's level or below. Not exact <= native on every run: replay matches the
    # routing, not the bf16-vs-float32 arithmetic, and on a few dozen tokens a native flip
    # moved the KL either way by up to +23% in the runs measured (docs/rl-demo.md; a CI run
    # saw +6%), so the test bounds it at 2x; generated, the wrong prefix, is orders above.
    assert last["exact"] <= 2 * last["native"] + 1e-9, last
    assert last["generated"] > 10 * last["exact"], last
    # Its first turn, at the weights that generated it: exact replays the first computation
    # (as generated, in a shorter forward), latest the recomputed prefix.
    first = step1["first_turn_k3_kl"]
    assert first["exact"] < first["latest"], first
    assert first["exact"] == pytest.approx(first["generated"], rel=1e-2, abs=1e-9), first
    assert any(r["router_disagreement"] > 0.0 for r in records)
    assert any("Redis memory" in c for c in result["checks"])
    for name in ("k3_kl.png", "router_disagreement.png", "reward.png"):
        assert (out / name).stat().st_size > 1000
