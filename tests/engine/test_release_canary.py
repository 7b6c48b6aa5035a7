"""The canary (``tests/engine/test_canary.py``) in every other tested release's environment.

``.venv`` holds the newest tested SGLang; each other release in
:data:`sglang_r3.releases.TESTED` has its own ``.venv-sglang-<version>`` (made by
``scripts/bootstrap.sh``), where the canary runs again, against that release's row of
:mod:`sglang_r3.releases`.  Only the canary file runs there (``--noconftest``: the
suite's fixtures need packages that environment does not hold).
"""

from __future__ import annotations

import os
import subprocess
from importlib.metadata import version
from pathlib import Path

import pytest

from sglang_r3.cpu import prepare_env
from sglang_r3.releases import TESTED
from tests.support.engine_fixtures import release_python

ROOT = Path(__file__).resolve().parents[2]
OTHERS = [v for v in TESTED if v != version("sglang")]


def test_every_tested_release_has_a_run() -> None:
    """The installed release and the others together are every tested release."""
    assert sorted([version("sglang"), *OTHERS]) == sorted(TESTED)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("release", OTHERS)
def test_canary_passes_on_release(release: str) -> None:
    python = release_python(release)
    proc = subprocess.run(
        [
            python,
            "-m",
            "pytest",
            "--noconftest",
            "-p",
            "no:cacheprovider",
            "-q",
            "tests/engine/test_canary.py",
        ],
        cwd=ROOT,
        # sgl_kernel loads against the stub libcuda; the caller's PYTEST_ADDOPTS would
        # change what the canary runs and prints, so it is not passed on.
        env=prepare_env({k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}),
        capture_output=True,
        text=True,
        timeout=280,
    )
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, f"the canary failed on SGLang {release}:\n{tail}"
    assert " passed" in proc.stdout and " failed" not in proc.stdout, tail
