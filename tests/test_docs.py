"""The README cannot rot: its snippets run, its commands are the ones CI and make use."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_readme_python_snippets_run() -> None:
    snippets = _blocks("python")
    assert snippets, "README has no python snippet"
    for code in snippets:
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})


def test_readme_commands_are_the_make_targets_ci_runs() -> None:
    commands = [
        line.split("#")[0].strip() for block in _blocks("bash") for line in block.splitlines()
    ]
    assert "make test" in commands
    assert "make demo" in commands
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, flags=re.M), ".ci/run must call the README test command"
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^test:", makefile, flags=re.M)
    assert re.search(r"^demo:", makefile, flags=re.M)


def test_foundation_demo_runs() -> None:
    """`make demo`'s script end to end on a small rollout (it starts its own redis-server)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "store_demo.py"), "--tokens", "300"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "round trip exact (as sets): True" in out
    assert "re-sending turn 3: duplicate" in out


@pytest.mark.parametrize("script", ["codec_bench.py"])
def test_benchmark_runs_small(script: str) -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / script),
            "--tokens",
            "300",
            "--repeat",
            "1",
            "--shapes",
            "Qwen3-30B-A3B",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    assert "### targets" in out
    assert "frame set-zstd" in out
