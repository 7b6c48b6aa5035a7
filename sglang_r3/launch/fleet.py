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
  are answered by the engine, docs/engine.md);
* an engine that dies stays in rotation until its health checks fail
  ``--health-failure-threshold`` times in a row.  Until then the router answers its
  keys itself, ``500 {"error": {"type": "Internal Server Error", "code":
  "call_upstream_request_error", "message": "error sending request for url ..."}}``;
  :func:`classify_failure` tells that from the engine's own r3 500 (rows failed
  validation).  Afterwards the keys go to a live engine.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

#: The sglang-router release these settings were measured against (pinned in deploy/).
ROUTER_VERSION = "0.3.2"

#: Health checks are what takes a dead engine out (the circuit breaker is off, and the
#: router has no other way to mark a worker dead on connection refused): its keys are
#: answered ``call_upstream_request_error`` until ``--health-failure-threshold`` checks
#: in a row failed, at most about interval x threshold after the death (a refused
#: connection fails a check at once).  Measured with ``kill -9``: 14.1 s at 5 s x 3,
#: about 2 s at 1 s x 2 (``test_a_killed_engines_keys_move_to_a_live_engine``).
#:
#: * ``/health``: SGLang's 1-token generation when the engine is idle (so a hung
#:   scheduler fails it too), exempt from ``--routing-require-tag``.  It answers
#:   after at least 1 s (``http_server.py:780``), so a check every second costs one
#:   1-token prefill per engine per second when idle, none when busy.
#: * interval 1 s (the smallest the router takes: whole seconds), threshold 2: two
#:   refused connections in a row, one second apart; one failure alone never takes
#:   an engine out.
#: * timeout 20 s: a busy CPU engine answers slowly; only an engine that does not
#:   answer a check for 2 x 20 s is taken out for slowness.
#: * one success brings an engine back.
ROUTER_ARGS: tuple[str, ...] = (
    "--policy",
    "manual",
    "--disable-circuit-breaker",
    "--disable-retries",
    "--health-check-endpoint",
    "/health",
    "--health-check-interval-secs",
    "1",
    "--health-check-timeout-secs",
    "20",
    "--health-failure-threshold",
    "2",
    "--health-success-threshold",
    "1",
    "--request-timeout-secs",
    "3600",
)


def _router_arg(name: str) -> int:
    return int(ROUTER_ARGS[ROUTER_ARGS.index(name) + 1])


#: How long after an engine dies the router may still send its keys to it (and answer
#: ``call_upstream_*`` errors), per :data:`ROUTER_ARGS`: interval x threshold (s).
DEAD_ENGINE_WINDOW_S = _router_arg("--health-check-interval-secs") * _router_arg(
    "--health-failure-threshold"
)

FailureKind = Literal["engine_unreachable", "r3", "other"]


def classify_failure(status: int, body: str | bytes | Mapping[str, Any]) -> FailureKind:
    """What a rollout driver makes of a non-2xx answer through sglang-router.

    * ``"engine_unreachable"``: the router could not get an answer from the engine
      (``{"error": {"code": "call_upstream_..."}}``, e.g. ``call_upstream_request_error``
      with status 500 when the engine is dead).  Retry the same turn with the same
      rollout id after :data:`DEAD_ENGINE_WINDOW_S` (plus a margin): the router has then
      taken the dead engine out and the turn goes to a live one, which continues the
      stored trajectory.  If the engine died after storing the turn's rows, the retry
      is a 409 (docs/engine.md: ``RoutingClient.stat`` says what is stored).
    * ``"r3"``: the engine's own answer from this extension (its message starts with
      ``r3:``); the status means what docs/engine.md says: a 500 is rows that failed
      validation, nothing stored, not retryable.
    * ``"other"``: anything else (SGLang's own errors, the router's other refusals).

    ``body``: the response body (text, bytes or decoded JSON); a ``/generate``
    stream's error event (the JSON after ``data:``) is classified the same way.
    """
    del status  # the body decides: both kinds answer 500
    data: Any = body
    if isinstance(body, str | bytes):
        try:
            data = json.loads(body)
        except ValueError:
            return "other"
    if not isinstance(data, Mapping):
        return "other"
    error = data.get("error")
    if isinstance(error, Mapping):
        code, message = error.get("code"), error.get("message")
    else:  # SGLang's OpenAI error object: {"object": "error", "message": ..., "code": N}
        code, message = data.get("code"), data.get("message")
    if isinstance(message, str) and message.startswith("r3:"):
        return "r3"
    if (
        isinstance(code, str)
        and code.startswith("call_upstream_")
        and code != "call_upstream_status_error"
    ):
        return "engine_unreachable"
    return "other"


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
