"""Cache service for R3 routing: the Redis segment store and its HTTP/gRPC front."""

from cache_service.store import SegmentStore, StoreSettings

__all__ = ["SegmentStore", "StoreSettings"]
