"""A pause in the extension's worker-thread shipping step (test knob, not a CPU stand-in).

Lets a test tell by the order of events that shipping an output's routing does not
hold the HTTP process's event loop.  Seconds from ``R3_SHIM_SHIP_DELAY_S``; wraps
``sglang_r3.http_server.shipping.Shipper._plan`` (the step run in a worker thread), rows unchanged.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

DELAY_ENV = "R3_SHIM_SHIP_DELAY_S"


def apply() -> None:
    """Sleep the configured seconds before each ``Shipper._plan``."""
    from sglang_r3.http_server.shipping import Shipper

    delay = float(os.environ[DELAY_ENV])
    plan = Shipper._plan

    @functools.wraps(plan)
    def delayed(self: Any, *args: Any, **kwargs: Any) -> Any:
        time.sleep(delay)
        return plan(self, *args, **kwargs)

    Shipper._plan = delayed  # type: ignore[method-assign]
