"""The committed gRPC stubs are what the committed .proto generates."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_up_to_date(tmp_path: Path) -> None:
    subprocess.run(
        [str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)],
        check=True,
        env={**os.environ, "PYTHON": sys.executable},
        cwd=ROOT,
    )
    for name in ("r3_cache_pb2.py", "r3_cache_pb2.pyi", "r3_cache_pb2_grpc.py"):
        fresh = (tmp_path / name).read_text()
        committed = (ROOT / "clients" / "r3_client" / "_proto" / name).read_text()
        assert fresh == committed, f"{name} is stale: run scripts/gen_proto.sh"


def test_the_proto_record_messages_are_generated_from_the_dataclasses() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT / "clients")},
    )
    assert done.returncode == 0, done.stderr
