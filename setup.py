"""The compiled codec kernels (``r3_client._kernels._r3codec``); everything else is in pyproject.toml.

Declared here rather than under ``[tool.setuptools]`` in pyproject.toml, where setuptools
still calls ``ext-modules`` experimental.  ``optional``: a machine without a C compiler
still installs, and runs the numpy codec (r3_client._kernels.native logs one line saying so).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "r3_client._kernels._r3codec",
            sources=["clients/r3_client/_kernels/_r3codec.c"],
            extra_compile_args=["-O3", "-Wall"],
            optional=True,
        )
    ]
)
