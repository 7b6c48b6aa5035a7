"""The compiled codec kernels (``r3_client._kernels._r3codec``); everything else is in pyproject.toml.

Declared here rather than under ``[tool.setuptools]`` in pyproject.toml, where setuptools
still calls ``ext-modules`` experimental.  ``optional``: a machine without a C compiler
still installs, and runs the numpy codec (r3_client._kernels.native logs one line saying so).
"""

import os

from setuptools import Extension, setup

#: libzstd's header (Debian's libzstd-dev, which scripts/bootstrap.sh installs): with it the
#: kernels inflate set-zstd chunks themselves (decode_chunks, one call per frame, the GIL
#: released throughout); without it they leave set-zstd chunks to python-zstandard.
ZSTD = any(os.path.exists(f"{d}/zstd.h") for d in ("/usr/include", "/usr/local/include"))

setup(
    ext_modules=[
        Extension(
            "r3_client._kernels._r3codec",
            sources=["clients/r3_client/_kernels/_r3codec.c"],
            extra_compile_args=["-O3", "-Wall"],
            define_macros=[("R3_HAVE_ZSTD", "1")] if ZSTD else [],
            libraries=["zstd"] if ZSTD else [],
            optional=True,
        )
    ]
)
