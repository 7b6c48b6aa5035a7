"""A hook of ``sglang_r3`` on a target that does not exist (test knob, not a CPU stand-in).

Proves that the start-up check stops the server instead of running without a hook
SGLang could not apply.  The target is read from ``R3_SHIM_BOGUS_HOOK_TARGET``.  SGLang
runs plugins in entry-point order, which is not fixed: the hook goes into
``sglang_r3.hooks.HOOKS`` (what the start-up check verifies) and the HTTP process's
targets, then ``register_hooks`` registers it, whichever plugin ran first
(registering is idempotent, and SGLang applies hooks only after every plugin ran).
"""

from __future__ import annotations

import os

TARGET_ENV = "R3_SHIM_BOGUS_HOOK_TARGET"


def bogus_hook(*args: object, **kwargs: object) -> None:
    return None


def add_bogus_hook(target: str) -> None:
    """Add ``target`` with :func:`bogus_hook` to the extension's hooks and register them."""
    from sglang_r3 import hooks, targets

    if target not in targets.HTTP_TARGETS:
        hooks.HOOKS.append((target, bogus_hook, "BEFORE"))
        targets.HTTP_TARGETS.append(target)
    hooks.register_hooks()


def apply() -> None:
    """Add the hook on the target named in the environment."""
    add_bogus_hook(os.environ[TARGET_ENV])
