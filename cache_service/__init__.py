"""Cache service for R3 routing: the Redis segment store (and, later, its HTTP/gRPC front)."""

from cache_service.store import RolloutStat, SegmentStore, StoreSettings

__all__ = ["RolloutStat", "SegmentStore", "StoreSettings"]
