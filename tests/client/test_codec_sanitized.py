"""The compiled codec under AddressSanitizer + UBSan, and the numpy codec on its own.

1. The extension is rebuilt from ``clients/r3_client/_kernels/_r3codec.c`` with
   ``-fsanitize=address,undefined -fno-sanitize-recover=all`` and the codec suites
   (differential, hostile bodies with more fuzz examples, format v2, the API, the
   vectors) run against it in a child process: any out-of-bounds access, overflow,
   misaligned load or other undefined behaviour aborts it.  Zero findings means exit 0
   and no sanitizer report.
2. The same suites run with ``R3_CODEC_BACKEND=numpy``: the fallback is a full codec.
3. A machine where the extension cannot load gets one warning line and a working codec.
4. The kernels built without their SSE2 paths (``-DR3_NO_SIMD``, what a non-x86 CPU
   compiles) pass the differential suite.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

# 158 s on 2 cores with both test workers busy (make test runs pytest -n 2): a
# busy CI machine runs it twice as long, well inside this.
pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "clients" / "r3_client" / "_kernels" / "_r3codec.c"
SUITES = [
    "tests/client/test_codec_native.py",
    "tests/client/test_codec_into.py",
    "tests/client/test_codec_v2.py",
    "tests/client/test_codec_v3.py",
    "tests/client/test_codec_api.py",
    "tests/client/test_codec_vectors.py",
    "tests/client/test_routing.py",
]


def _pytest(env: dict[str, str], *suites: str) -> subprocess.CompletedProcess[str]:
    # The child runs the suites whole, as written here: the caller's PYTEST_ADDOPTS (a
    # -q, --durations, -k of its own) would change what it runs and prints.
    inherited = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *suites],
        cwd=ROOT,
        env={**inherited, **env},
        capture_output=True,
        text=True,
        timeout=900,
    )


def _runtime(gcc: str, name: str) -> str:
    path = subprocess.run(
        [gcc, f"-print-file-name={name}"], capture_output=True, text=True, check=True
    ).stdout.strip()
    if not Path(path).is_file():
        pytest.fail(f"{gcc} has no {name}: install gcc's sanitizer runtimes (libasan8, libubsan1)")
    return path


def _build(lib: Path, *flags: str) -> str:
    """The extension built from SOURCE into ``lib`` with ``flags``; the gcc used."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.fail("gcc is required (scripts/bootstrap.sh installs it) to build the kernels")
    include = f"-I{sysconfig.get_paths()['include']}"
    # With libzstd where the installed build has it (setup.py decides; test_codec_native
    # checks that it did), so decode_chunks' inflation of hostile set-zstd chunks runs under
    # the sanitizers too.
    import r3_client._kernels._r3codec as installed

    define, link = (["-DR3_HAVE_ZSTD=1"], ["-lzstd"]) if installed.HAVE_ZSTD else ([], [])
    subprocess.run(
        [gcc, *flags, *define, "-shared", "-fPIC", include, str(SOURCE), "-o", str(lib), *link],
        check=True,
    )
    return gcc


def test_the_codec_suites_pass_under_address_and_undefined_sanitizers(tmp_path: Path) -> None:
    lib = tmp_path / "_r3codec_asan.so"
    gcc = _build(
        lib, "-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
        "-fno-sanitize-recover=all",
    )  # fmt: skip
    env = {
        "LD_PRELOAD": f"{_runtime(gcc, 'libasan.so')} {_runtime(gcc, 'libubsan.so')}",
        # CPython's own allocations are not ours to judge; every error is fatal.
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
        # Python's objects from malloc, not pymalloc's arenas: a body read past its end
        # meets ASan's red zone instead of the next object.
        "PYTHONMALLOC": "malloc",
        "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
        "R3_NATIVE_LIBRARY": str(lib),
        "R3_FUZZ_EXAMPLES": "600",
    }
    run = _pytest(env, *SUITES)
    out = run.stdout + run.stderr
    assert "AddressSanitizer" not in out and "runtime error" not in out, out[-6000:]
    assert run.returncode == 0, out[-6000:]
    assert " passed" in run.stdout and " skipped" not in run.stdout.splitlines()[-1], out[-3000:]


def test_the_portable_kernels_match_the_reference_where_sse2_is_absent(tmp_path: Path) -> None:
    """The encode kernels take SSE2 paths on x86-64; ``-DR3_NO_SIMD`` builds the plain C that
    other CPUs (ARM) compile, and the differential suite holds it to the reference too."""
    lib = tmp_path / "_r3codec_portable.so"
    _build(lib, "-O2", "-DR3_NO_SIMD")
    run = _pytest({"R3_NATIVE_LIBRARY": str(lib)}, SUITES[0], SUITES[-1])
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    assert " passed" in run.stdout, run.stdout[-3000:]


def test_the_codec_suites_pass_on_the_numpy_fallback() -> None:
    run = _pytest({"R3_CODEC_BACKEND": "numpy"}, *SUITES[1:])
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]


def test_an_extension_that_cannot_load_is_one_warning_line_and_a_working_codec(
    tmp_path: Path,
) -> None:
    code = (
        "import numpy as np\n"
        "from r3_client import decode_frame, encode_frame\n"
        "from r3_client.codec import backend\n"
        "f = encode_frame(np.array([[[1, 0]]]), num_experts=4, layer_ids=[0])\n"
        "assert decode_frame(f).routing.indices.tolist() == [[[0, 1]]]\n"
        "print(backend())\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={**os.environ, "R3_NATIVE_LIBRARY": str(tmp_path / "missing.so")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "numpy"
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "numpy codec" in lines[0], run.stderr
