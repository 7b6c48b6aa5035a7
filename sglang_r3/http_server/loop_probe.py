"""A heartbeat on the HTTP process's event loop: how long it could not run.

SGLang's tokenizer manager streams every request's chunks from one asyncio loop, so
anything that holds that loop stalls every stream at once.  With
``SGLANG_R3_LOOP_PROBE_MS`` set (e.g. ``1``), a task sleeps that long in a loop and
records how late it wakes up; ``GET /r3/loop`` returns the count, maximum, p99 and
sum of those lags since the last call (and starts a new window).  The extension is
installed in every SGLang process of the environment, so the probe also works
under plain ``python -m sglang.launch_server`` (for baselines).  Off by default.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

ENV = "SGLANG_R3_LOOP_PROBE_MS"
_MAX_SAMPLES = 1 << 20


class LoopProbe:
    """Lags of a periodic task on one event loop, since the last :meth:`take`."""

    def __init__(self) -> None:
        self.interval = float(os.environ.get(ENV, "0") or 0) / 1000
        self._lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    def ensure_started(self) -> None:
        """Start the heartbeat on the running loop (once; no-op when disabled)."""
        if not self.enabled or (self._task is not None and not self._task.done()):
            return
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(self.interval)
            if len(self._lags) < _MAX_SAMPLES:
                self._lags.append(max(loop.time() - t - self.interval, 0.0))

    def take(self) -> dict[str, Any]:
        """Summary of the lags since the last call (seconds); starts a new window."""
        lags, self._lags = sorted(self._lags), []
        n = len(lags)
        return {
            "enabled": self.enabled,
            "interval_s": self.interval,
            "samples": n,
            "max_s": lags[-1] if n else 0.0,
            "p99_s": lags[min(n - 1, int(n * 0.99))] if n else 0.0,
            "sum_s": sum(lags),
            "over_5ms": sum(1 for x in lags if x > 0.005),
        }


LOOP_PROBE = LoopProbe()
