"""Prometheus metrics of one service instance (own registry, so tests can run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["Metrics"]

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    """Counters, histograms and gauges named ``r3_*``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "r3_requests",
            "Requests by transport, operation and HTTP status (gRPC mapped to the same)",
            ["transport", "op", "code"],
            registry=r,
        )
        self.latency = Histogram(
            "r3_request_seconds",
            "Request latency",
            ["transport", "op"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.bytes_in = Counter("r3_bytes_in", "Frame bytes received", ["transport"], registry=r)
        self.bytes_out = Counter("r3_bytes_out", "Bytes sent", ["transport"], registry=r)
        self.dedupe_hits = Counter(
            "r3_dedupe_hits", "Segments stored by reference to an existing copy", registry=r
        )
        self.dedupe_bytes = Counter(
            "r3_dedupe_saved_bytes", "Frame bytes not stored thanks to dedupe", registry=r
        )
        self.store_memory = Gauge(
            "r3_store_used_memory_bytes", "Redis used_memory, summed over primaries", registry=r
        )
        self.store_keys = Gauge("r3_store_keys", "Keys in Redis (all primaries)", registry=r)
        self.store_maxmemory = Gauge(
            "r3_store_maxmemory_bytes",
            "Redis maxmemory, summed over primaries (0: no limit set)",
            registry=r,
        )
        self.store_fullest_ratio = Gauge(
            "r3_store_fullest_ratio",
            "used_memory / maxmemory of the fullest primary (a primary without a limit: 0)",
            registry=r,
        )
        self.store_up = Gauge(
            "r3_store_up",
            "1 when Redis answered this scrape's INFO, 0 when it did not (the other store "
            "gauges then keep their last value)",
            registry=r,
        )
        self.views_stored = Counter(
            "r3_views_stored", "Views stored (rows an engine recomputed)", registry=r
        )
        self.view_rows_stored = Counter(
            "r3_view_rows_stored", "Token rows in the views stored", registry=r
        )
        # how: delete (one rollout), batch_delete (many by id), drop_version (by weight version)
        self.rollouts_dropped = Counter(
            "r3_rollouts_dropped", "Rollouts dropped on request, by how", ["how"], registry=r
        )
        self.dropped_bytes = Counter(
            "r3_dropped_bytes", "Stored bytes of the rollouts dropped, by how", ["how"], registry=r
        )
        self.batch_items = Counter(
            "r3_batch_items", "Batch-get items by result", ["result"], registry=r
        )

    def record_request(self, transport: str, op: str, status: int, seconds: float) -> None:
        """Count and time one answered request, the same way for both transports.

        ``status`` is the HTTP status; a gRPC answer is labelled with the HTTP status
        of the same outcome (``cache_service.errors``' table, 200 for OK), so one
        query covers both transports.
        """
        self.requests.labels(transport, op, str(status)).inc()
        self.latency.labels(transport, op).observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
