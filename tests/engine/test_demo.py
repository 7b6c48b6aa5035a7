"""``r3 demo`` (the README's main job), shortened, and its clean-up on Ctrl-C / SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

# Up to 94 s on 2 cores with both test workers busy (make test runs pytest -n 2): a
# busy CI machine runs it twice as long, well inside this.
pytestmark = pytest.mark.timeout(600)

R3 = str(Path(sys.executable).parent / "r3")
T = TypeVar("T")


def _procs_mentioning(text: str) -> list[tuple[int, str]]:
    """Live processes whose command line contains ``text``."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd and int(d.name) != os.getpid():
            out.append((int(d.name), cmd))
    return out


def _procs_in_group(pgid: int) -> list[int]:
    """Live processes of process group ``pgid`` (zombies included until reaped)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may hold spaces, so split after ")".
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(d.name))
    return out


def _wait_gone(check: Callable[[], list[T]], timeout: float = 30.0) -> list[T]:
    """Poll ``check`` until it returns nothing or ``timeout`` passes; its last answer."""
    deadline = time.monotonic() + timeout
    left = check()
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = check()
    return left


def test_demo_quick(tmp_path: Path) -> None:
    work, out_json = tmp_path / "work", tmp_path / "demo.json"
    run = subprocess.run(
        [R3, "demo", "--quick", "--workdir", str(work), "--json", str(out_json)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = run.stdout
    assert run.returncode == 0, out[-4000:] + run.stderr[-4000:]
    for k in range(1, 8):
        assert f"[{k}/7]" in out, f"stage {k} missing"
    for label in (
        "rollouts stored",
        "bytes per token",
        "saved by dedupe",
        "saved by multi-turn deltas",
        "routing disagreement",
        "k3 KL(train || infer)",
    ):
        assert label in out, label
    # docs/demo.md's recorded run shows the same stages and summary lines.
    doc = (Path(__file__).resolve().parents[2] / "docs" / "demo.md").read_text()
    recorded = doc.split("sglang-r3 demo: summary", 1)[1].split("stopped every process")[0]
    for line in filter(None, map(str.strip, recorded.splitlines())):
        assert line.split("  ")[0] in out, (
            f"docs/demo.md shows a line the demo no longer prints: {line}"
        )
    assert len(re.findall(r"^\[\d/7\]", doc, flags=re.M)) == 7
    stats = json.loads(out_json.read_text())
    assert stats["rollouts"] == 4 + 1  # --quick: a group of 4 and one agent
    assert stats["dedupe_hits"] == 3 and stats["dedupe_saved_bytes"] > 0
    assert len(stats["turn_bytes"]) == 3
    assert sum(stats["turn_bytes"]) * 5 < sum(stats["turn_upstream_b64"])
    assert 0 < stats["stored_bytes"] < stats["rows"] * 8 * 4 * 4  # < int32 for 8 layers, top-4
    native, replay = stats["results"]["native"], stats["results"]["replay"]
    assert native["router_disagreement"] > 0 and replay["router_disagreement"] == 0
    assert replay["k3_kl"] < native["k3_kl"]
    # Everything it started is gone.
    pgid = int(re.search(r"process group (\d+)", out).group(1))  # type: ignore[union-attr]
    assert not _wait_gone(lambda: _procs_mentioning(str(work)))
    assert not _wait_gone(lambda: _procs_in_group(pgid))


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_demo_interrupted_stops_everything(tmp_path: Path, sig: signal.Signals) -> None:
    """Interrupted with SGLang up: the cache, Redis and SGLang (and its children) all go.

    The demo holds after stage 3 (``R3_DEMO_HOLD_AFTER_STAGE``) and says so; the signal
    is sent once it has, so the demo cannot finish first however slow the machine (it
    did, after a fixed sleep: exit 0, expected 130).
    """
    work = tmp_path / "work"
    proc = subprocess.Popen(
        [R3, "demo", "--quick", "--workdir", str(work)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a terminal's Ctrl-C reaches only the demo's own group
        env={**os.environ, "R3_DEMO_HOLD_AFTER_STAGE": "3"},
        # As from a terminal: SIGINT at its default.  A test run started in the background
        # by a non-interactive shell inherits SIGINT ignored, and Python keeps it ignored
        # (the demo then never saw the Ctrl-C and stopped only at the test's SIGTERM).
        preexec_fn=_sigint_default,
    )
    assert proc.stdout is not None
    watchdog = threading.Timer(600, proc.kill)  # a demo that never holds fails, not hangs
    watchdog.start()
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if "holding after stage 3" in line:
                break
        else:
            proc.wait()
            pytest.fail(
                f"the demo exited {proc.returncode} without holding after stage 3: "
                + "".join(seen)[-3000:]
            )
        engine = [p for p in _procs_mentioning(str(work)) if "sglang_r3.launch_server" in p[1]]
        assert engine, "".join(seen)
        engine_pgid = os.getpgid(engine[0][0])
        assert len(_procs_in_group(engine_pgid)) > 1, "SGLang's children run"
        assert _procs_mentioning(str(work / "cache")), "the cache and its redis-server run"
        proc.send_signal(sig)
        rest, _ = proc.communicate(timeout=120)
    finally:
        watchdog.cancel()
        if proc.poll() is None:  # a failed check above: still stop what the demo started
            proc.terminate()
            proc.communicate(timeout=120)
    output = "".join(seen) + rest
    assert proc.returncode == 130, output[-3000:]
    assert "interrupted" in output and "stopped every process" in output, output[-3000:]
    assert not _wait_gone(lambda: _procs_mentioning(str(work))), "cache / redis / SGLang left"
    assert not _wait_gone(lambda: _procs_in_group(engine_pgid)), "SGLang children left"
