"""Test-only SGLang plugin: CPU stand-ins for code paths SGLang 0.5.23 runs only on a GPU.

Never part of the product.  SGLang finds it through the ``.dist-info`` next to this
package when ``tests/engine/cpu_shims`` is on ``PYTHONPATH`` (:func:`shim_env` in
``tests/support/engine_requests.py`` does that) and loads it in every process it loads plugins in,
like ``sglang_r3``.  Each shim is a module here with an ``apply()`` that patches one
upstream gap, switched on by name in ``R3_CPU_SHIMS`` (comma-separated); nothing is
patched unless named.  A shim makes SGLang *run* on CPU; it never changes which routing
rows SGLang records (that is the product's job, in ``sglang_r3``).

Two shims are test knobs instead, so that the product carries none: ``bogus_hook`` (a
hook that cannot apply, for the start-up check) and ``ship_delay`` (a slow shipping
step, for the event loop); each reads its setting from an ``R3_SHIM_*`` variable.
"""

from __future__ import annotations

import importlib
import logging
import os

log = logging.getLogger("r3_cpu_shims")

ENV = "R3_CPU_SHIMS"


def requested() -> list[str]:
    """The shim names switched on in this process's environment."""
    return [n.strip() for n in os.environ.get(ENV, "").split(",") if n.strip()]


def register() -> None:
    """SGLang's plugin entry point: apply every requested shim (once per process)."""
    for name in requested():
        module = importlib.import_module(f"r3_cpu_shims.{name}")
        if not getattr(module, "_applied", False):
            module.apply()
            setattr(module, "_applied", True)  # noqa: B010  (a module attribute)
            log.info("r3_cpu_shims: %s applied in pid %d", name, os.getpid())
