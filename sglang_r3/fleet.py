"""Many engines behind sglang-router: the router settings R3 needs, in one place.

Measured against ``sglang-router==0.3.2`` (docs/engine.md, "A fleet behind
sglang-router"):

* the router rebuilds ``/generate`` and ``/v1/chat/completions`` bodies and drops
  ``custom_params``; of the request's headers it forwards only ``authorization``,
  ``x-request-id``, ``x-correlation-id``, ``traceparent``, ``tracestate`` and
  ``x-smg-routing-key``.  The engine therefore reads the rollout id from
  ``X-SMG-Routing-Key`` (:data:`sglang_r3.config.DEFAULT_TAG_HEADER`);
* ``--policy manual`` sends every request with the same ``X-SMG-Routing-Key`` to the
  same engine (requests without one go to a random engine), so the rollout id as the
  key keeps a rollout's turns on one engine: prefix-cache hits, no cross-engine races;
* its circuit breaker counts *every* non-2xx answer as an engine failure (400, 409,
  413 and 503 alike): a burst of stale turns or a cache outage would take healthy
  engines out of rotation.  It is off; health checks take dead engines out;
* it retries 429/5xx answers and timeouts (up to 5 attempts by default): a tagged
  request that already generated would generate again, to be refused again.
  Retries are off; the rollout driver retries with the same rollout id (conflicts
  are answered by the engine, docs/engine.md).
"""

from __future__ import annotations

from collections.abc import Sequence

#: The sglang-router release these settings were measured against (pinned in deploy/).
ROUTER_VERSION = "0.3.2"

#: Health checks: SGLang's ``/health`` (a 1-token generation when the engine is idle,
#: exempt from ``--routing-require-tag``).  Three misses 5 s apart take an engine out;
#: one success brings it back.  The timeout is generous: a busy CPU engine is slow.
ROUTER_ARGS: tuple[str, ...] = (
    "--policy",
    "manual",
    "--disable-circuit-breaker",
    "--disable-retries",
    "--health-check-endpoint",
    "/health",
    "--health-check-interval-secs",
    "5",
    "--health-check-timeout-secs",
    "20",
    "--health-failure-threshold",
    "3",
    "--health-success-threshold",
    "1",
    "--request-timeout-secs",
    "3600",
)


def router_argv(
    python: str, workers: Sequence[str], *, host: str, port: int, extra: Sequence[str] = ()
) -> list[str]:
    """The command line of an sglang-router in front of ``workers`` with R3's settings."""
    return [
        python,
        "-m",
        "sglang_router.launch_router",
        "--host",
        host,
        "--port",
        str(port),
        "--worker-urls",
        *workers,
        *ROUTER_ARGS,
        *extra,
    ]
