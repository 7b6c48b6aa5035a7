"""Installing this package into an environment that already holds a framework's SGLang
moves neither that SGLang nor its torch (issue 54).

verl 0.9.1 pins ``sglang==0.5.12`` with ``torch==2.11.0`` and runs SGLang inside its own
rollout workers, in the trainer's environment.  ``.venv-sglang-0.5.12`` is such an
environment: ``scripts/bootstrap.sh`` installs ``sglang==0.5.12`` (with its pins) first,
then ``pip install -e .[sglang]`` on top, as a verl user would.  Here pip is asked again
what that install would change (``--dry-run --report``), and the environment is read.
"""

from __future__ import annotations

import json
import subprocess
from importlib.metadata import version
from pathlib import Path

import pytest

from sglang_r3.releases import TESTED
from tests.support.engine_fixtures import release_python

ROOT = Path(__file__).resolve().parents[2]
OTHERS = [v for v in TESTED if v != version("sglang")]


def _installed(python: str, *names: str) -> dict[str, str]:
    code = (
        "import json, sys; from importlib.metadata import version; "
        "print(json.dumps({n: version(n) for n in sys.argv[1:]}))"
    )
    out = subprocess.run([python, "-c", code, *names], check=True, capture_output=True, text=True)
    return dict(json.loads(out.stdout))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("release", OTHERS)
def test_installing_sglang_r3_keeps_the_environments_sglang_and_torch(release: str) -> None:
    python = release_python(release)
    held = _installed(python, "sglang", "torch")
    assert held["sglang"] == release
    if release == "0.5.12":
        assert held["torch"] == "2.11.0"  # SGLang 0.5.12's own pin (its wheel's METADATA)
    proc = subprocess.run(
        [
            python,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--quiet",
            "--report",
            "-",
            "-e",
            f"{ROOT}[sglang]",
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    would = {
        item["metadata"]["name"].lower(): item["metadata"]["version"] for item in report["install"]
    }
    assert "sglang" not in would and "torch" not in would, would
    assert set(would) <= {"sglang-r3"}, f"installing sglang-r3 would also change {would}"
    assert _installed(python, "sglang", "torch") == held
