"""The SGLang plugin: entry point ``r3`` in the ``sglang.srt.plugins`` group.

SGLang calls :func:`register` once in each of its processes (launcher, scheduler,
detokenizer, DP controller) before applying hooks.  SGLang only *logs* an exception
raised here or a hook that fails to apply, so the hooks verify themselves at start-up
(:func:`sglang_r3.launch.startup.check_startup`) and stop the server with a clear message.
"""

from __future__ import annotations

import os


def register() -> None:
    """Install the CPU allocator (on CPU) and register the hooks."""
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
        from sglang_r3.cpu.allocator import install_allocator

        install_allocator()
    from sglang_r3 import hooks

    hooks.register_hooks()  # idempotent: a hook already registered is skipped
