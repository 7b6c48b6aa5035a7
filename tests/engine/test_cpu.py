"""sglang_r3.cpu: the CUDA driver stub SGLang loads on CPU."""

from __future__ import annotations

import subprocess
from pathlib import Path

from sglang_r3.cpu import build_cuda_stub


def test_cuda_stub_builds_and_exports_the_symbol(tmp_path: Path) -> None:
    lib = build_cuda_stub(tmp_path) / "libcuda.so.1"
    assert lib.exists()
    assert build_cuda_stub(tmp_path) == lib.parent  # cached
    syms = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True)
    assert "cuPointerGetAttribute" in syms.stdout
