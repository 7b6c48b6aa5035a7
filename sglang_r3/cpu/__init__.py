"""Running the real SGLang on a machine without a GPU (``--device cpu``).

Three things are needed, all done here: ``SGLANG_USE_CPU_ENGINE=1`` (selects SGLang's
CPU platform), a stub ``libcuda.so.1`` on ``LD_LIBRARY_PATH`` (sgl_kernel's extension
links against it), and a host allocator for the routed-experts buffer (upstream's
default registers the buffer with CUDA).  The launcher calls :func:`prepare_env`
before SGLang is imported; the plugin calls
:func:`sglang_r3.cpu.allocator.install_allocator` in every process.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

STUB_SOURCE = "cuda_stub.c"


class CpuSetupError(RuntimeError):
    """The CPU recipe could not be prepared (no C compiler, build failure)."""


def cache_dir() -> Path:
    """Where the compiled stub lives: ``$SGLANG_R3_CACHE_DIR`` or ``~/.cache/sglang-r3``."""
    base = os.environ.get("SGLANG_R3_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sglang-r3"
    )
    return Path(base)


def build_cuda_stub(directory: Path | None = None) -> Path:
    """Compile ``libcuda.so.1`` from the packaged C file (once; keyed by its hash).

    Returns the directory holding the library, for ``LD_LIBRARY_PATH``.
    """
    source = resources.files(__package__).joinpath(STUB_SOURCE).read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:16]
    out_dir = (directory or cache_dir()) / f"cuda-stub-{digest}"
    lib = out_dir / "libcuda.so.1"
    if lib.exists():
        return out_dir
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise CpuSetupError(
            "--device cpu needs a C compiler to build the stub libcuda.so.1 "
            "(install gcc, e.g. `apt-get install gcc`)"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        src = Path(tmp) / STUB_SOURCE
        src.write_bytes(source)
        tmp_lib = Path(tmp) / "libcuda.so.1"
        proc = subprocess.run(
            [
                cc,
                "-shared",
                "-fPIC",
                "-O2",
                "-Wl,-soname,libcuda.so.1",
                "-o",
                str(tmp_lib),
                str(src),
            ],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise CpuSetupError(f"building the stub libcuda.so.1 failed:\n{proc.stderr}")
        os.replace(tmp_lib, lib)  # atomic: concurrent launchers never see half a file
    return out_dir


def prepare_env(env: dict[str, str]) -> dict[str, str]:
    """Return ``env`` plus what SGLang's CPU engine needs; build the stub if missing."""
    out = dict(env)
    out["SGLANG_USE_CPU_ENGINE"] = "1"
    stub = str(build_cuda_stub())
    paths = [p for p in out.get("LD_LIBRARY_PATH", "").split(":") if p]
    if stub not in paths:
        out["LD_LIBRARY_PATH"] = ":".join([stub, *paths])
    return out
