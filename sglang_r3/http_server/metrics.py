"""Prometheus metrics of the extension, served at ``GET /r3/metrics`` on the SGLang server.

Own registry: SGLang's ``/metrics`` may run in multiprocess mode; these counters
live in the HTTP (tokenizer-manager) process, where routing is shipped.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

OUTPUTS = Counter(
    "r3_engine_outputs_total",
    "Tagged outputs by outcome: stored, inline_fallback, failed, aborted.",
    ["outcome"],
    registry=REGISTRY,
)
CACHE_ERRORS = Counter(
    "r3_engine_cache_errors_total",
    "Failed writes to the routing cache after retries, by error class.",
    ["error"],
    registry=REGISTRY,
)
CONFLICTS = Counter(
    "r3_engine_conflicts_total",
    "Requests refused because they disagree with the stored trajectory.",
    registry=REGISTRY,
)
GUARD_TRIPS = Counter(
    "r3_engine_guard_trips_total",
    "Routing refused by a consistency guard (row count, invalid rows, retraction).",
    ["guard"],
    registry=REGISTRY,
)
RETRACTED = Counter(
    "r3_engine_retracted_outputs_total",
    "Outputs whose request the scheduler retracted at least once (rows may be re-prefilled).",
    registry=REGISTRY,
)
ROWS = Counter("r3_engine_rows_total", "Token rows shipped to the cache.", registry=REGISTRY)
BYTES_SHIPPED = Counter(
    "r3_engine_bytes_shipped_total", "Encoded frame bytes sent to the cache.", registry=REGISTRY
)
BYTES_UPSTREAM = Counter(
    "r3_engine_bytes_engine_total",
    "Routing the engine handed over for tagged outputs, counted as upstream's int32 "
    "(rows x all layers x K x 4 bytes), whatever form it came in.",
    registry=REGISTRY,
)
HANDOVER = Counter(
    "r3_engine_routing_handover_total",
    "Tagged outputs by the form their rows reached the HTTP process in: compact (the "
    "detokenizer's uint8/uint16 rows), tensor (--skip-tokenizer-init), base64 (msgpack IPC).",
    ["form"],
    registry=REGISTRY,
)
SHIP_SECONDS = Histogram(
    "r3_engine_ship_seconds",
    "Time from a finished output to its routing stored (encode + put).",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0),
    registry=REGISTRY,
)
VIEWS = Counter(
    "r3_engine_views_total",
    "Views shipped: rows a request recomputed that already had a computation (after a "
    "weight push, an eviction, a retraction or a resume), stored beside the first.",
    registry=REGISTRY,
)
VIEW_ROWS = Counter(
    "r3_engine_view_rows_total",
    "Token rows shipped in views (recomputed rows stored beside their first computation).",
    registry=REGISTRY,
)
ROWS_LOST = Counter(
    "r3_engine_rows_lost_total",
    "Token rows of outputs whose write to the routing cache failed after retries, by the "
    "error class of r3_engine_cache_errors_total: the cache does not hold them (under "
    "on_cache_error=inline the response carries them).",
    ["error"],
    registry=REGISTRY,
)
