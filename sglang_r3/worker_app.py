"""The ASGI app SGLang's HTTP workers import under ``--tokenizer-worker-num > 1``.

With more than one tokenizer worker, SGLang 0.5.23 serves HTTP from
``uvicorn.run(app_path, workers=N)`` (``http_server.py:3052-3077``; granian under
``--enable-http2``, ``:2790``).  Each worker is a fresh process that imports
``SGLANG_HTTP_SERVER_APP_PATH`` (``environ.py:343``, read when the server starts)
and builds its own tokenizer manager in the app's lifespan (``init_multi_tokenizer``,
``http_server.py:242, 298-308``), and SGLang never calls ``load_plugins()`` there.
Without our hooks such a worker would serialise the compact rows the detokenizer
half of the plugin hands it as a JSON object and store nothing.

``python -m sglang_r3.launch_server`` therefore points the variable at
:data:`APP_PATH` (this module); importing it, in each worker:

1. loads SGLang's plugins, so our hooks are registered and applied in the worker;
2. verifies that the HTTP hooks took effect (:func:`sglang_r3.launch.startup.check_startup`).
   A worker whose hooks did not apply exits with uvicorn's start-up failure status
   (3), on which uvicorn's supervisor stops the whole server instead of restarting
   the worker: it never serves without them;
3. adds the ``/r3/*`` routes (in the single-process case the launcher's
   ``before_launch_server`` hook adds them, which runs in the main process only);
4. exposes SGLang's own ``app``.

Per-worker state (each worker is its own process):

- ``/r3/metrics``: when ``PROMETHEUS_MULTIPROC_DIR`` is set (the launcher sets it for
  ``--tokenizer-worker-num > 1`` unless the user did; SGLang's ``--enable-metrics``
  uses the same directory), every worker's counters are summed over all processes,
  so any worker answers the engine's totals and a scrape sees monotonic counters.
  Without it, each worker answers its own counters.  ``/r3/info`` answers the
  worker's ``pid`` and this worker's own outcome counts.
- ``--routing-lookup seen``: each worker remembers the rollouts *it* wrote or looked
  up.  A rollout's next turn may reach another worker, which then treats it as new
  and learns at write time that the cache holds it (the case of a turn another
  engine stored): only the rows past the stored trajectory are written.  Correct, at
  the price of recomputing rows the cache already has and one extra round trip.
- The continuation-frame contexts (:class:`sglang_r3.http_server.shipping.Shipper`) are per
  worker: a worker that did not write a rollout's first segment codes its rows with
  their own context (a little larger, same rows).
- ``/r3/loop`` measures the event loop of the worker that answers it.

At the package root, with the other entry points (``plugin``, ``launch_server``): it puts the
hooks and start-up together, so a process package (``http_server``) may not hold it.
"""

from __future__ import annotations

import logging
import os
import sys

from sglang.srt.plugins import load_plugins

from sglang_r3.errors import StartupError
from sglang_r3.hooks import check_process
from sglang_r3.launch.startup import APP_PATH, add_routes
from sglang_r3.targets import HTTP_TARGETS

log = logging.getLogger("sglang_r3")

# uvicorn.config.STARTUP_FAILURE: the supervisor stops the server, not restarts the worker.
_STARTUP_FAILURE = 3

load_plugins()
try:
    check_process(HTTP_TARGETS, None)
except StartupError as exc:
    message = f"sglang_r3: HTTP worker {os.getpid()} stops the server: {exc}"
    log.error("%s", message)
    print(message, file=sys.stderr, flush=True)
    sys.exit(_STARTUP_FAILURE)
add_routes(aggregate_metrics=bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR")))

from sglang.srt.entrypoints.http_server import app  # noqa: E402

__all__ = ["APP_PATH", "app"]
