"""``r3 rl-demo``, shortened: two GRPO steps per run, replay on and off, real SGLang.

The demo checks its own invariants and exits 1 when one fails (replayed routing
equal to the engine's, per-segment weight versions, no stale prefix rows after a
push, flat Redis memory); this test runs it as a user would and reads its JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)


def test_two_steps_of_grpo_with_weight_pushes(tmp_path: Path) -> None:
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
    records = result["records"]
    for mode in ("replay", "native"):
        steps = [r for r in records if r["mode"] == mode]
        assert [r["step"] for r in steps] == [0, 1]
        # Step 1 trains on the episode begun in step 0, its turns under two versions.
        assert [r["straddling_episodes"] for r in steps] == [0, 1]
        assert all(r["bytes_moved"] > 0 and r["bytes_stored"] > 0 for r in steps)
    replay = [r for r in records if r["mode"] == "replay"]
    assert all(r["router_disagreement"] == 0.0 for r in replay)
    native = [r for r in records if r["mode"] == "native"]
    assert any(r["router_disagreement"] > 0.0 for r in native)
    # The runs' k3 KL is reported, not compared. At 2 steps x 10 samples it is dominated
    # by the straddling episode's first turn (sampled under the previous weights, in both
    # runs alike) and by routing flips at near-ties, which change little; sampling is not
    # seeded (SGLang's seed needs its deterministic mode, which the CPU path lacks).  Over
    # five runs replay/native ranged 0.017-3.3 (one CI failure at 3.3), so "replay lower"
    # is not a property of this size.  The routing asserts above are; the full-size
    # comparison is the recorded run in docs/rl-demo.md.
    kl = result["mean_k3_kl"]
    assert all(0.0 <= kl[m] < 1.0 for m in ("replay", "native")), kl
    assert any("Redis memory" in c for c in result["checks"]["replay"])
    for name in ("k3_kl.png", "router_disagreement.png", "reward.png"):
        assert (out / name).stat().st_size > 1000
