from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PutSegmentRequest(_message.Message):
    __slots__ = ("rollout_id", "frame", "view", "share")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    frame: bytes
    view: int
    share: bool
    def __init__(self, rollout_id: _Optional[str] = ..., frame: _Optional[bytes] = ..., view: _Optional[int] = ..., share: _Optional[bool] = ...) -> None: ...

class GetRolloutRequest(_message.Message):
    __slots__ = ("rollout_id", "start", "end", "layers", "view")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    start: int
    end: int
    layers: _containers.RepeatedScalarFieldContainer[int]
    view: int
    def __init__(self, rollout_id: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., layers: _Optional[_Iterable[int]] = ..., view: _Optional[int] = ...) -> None: ...

class RolloutFrame(_message.Message):
    __slots__ = ("frame",)
    FRAME_FIELD_NUMBER: _ClassVar[int]
    frame: bytes
    def __init__(self, frame: _Optional[bytes] = ...) -> None: ...

class RolloutRef(_message.Message):
    __slots__ = ("rollout_id",)
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    def __init__(self, rollout_id: _Optional[str] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class TouchRequest(_message.Message):
    __slots__ = ("rollout_id", "ttl_s")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    ttl_s: int
    def __init__(self, rollout_id: _Optional[str] = ..., ttl_s: _Optional[int] = ...) -> None: ...

class TouchResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RewindRequest(_message.Message):
    __slots__ = ("rollout_id", "rows")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    rows: int
    def __init__(self, rollout_id: _Optional[str] = ..., rows: _Optional[int] = ...) -> None: ...

class BatchGetRequest(_message.Message):
    __slots__ = ("rollout_ids", "start", "end", "layers", "ranges")
    ROLLOUT_IDS_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    rollout_ids: _containers.RepeatedScalarFieldContainer[str]
    start: int
    end: int
    layers: _containers.RepeatedScalarFieldContainer[int]
    ranges: _containers.RepeatedCompositeFieldContainer[RowRange]
    def __init__(self, rollout_ids: _Optional[_Iterable[str]] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., layers: _Optional[_Iterable[int]] = ..., ranges: _Optional[_Iterable[_Union[RowRange, _Mapping]]] = ...) -> None: ...

class RowRange(_message.Message):
    __slots__ = ("start", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message", "http_status")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    HTTP_STATUS_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    http_status: int
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ..., http_status: _Optional[int] = ...) -> None: ...

class BatchItem(_message.Message):
    __slots__ = ("rollout_id", "frame", "error")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    frame: bytes
    error: Error
    def __init__(self, rollout_id: _Optional[str] = ..., frame: _Optional[bytes] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class BatchStatRequest(_message.Message):
    __slots__ = ("rollout_ids",)
    ROLLOUT_IDS_FIELD_NUMBER: _ClassVar[int]
    rollout_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rollout_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class BatchStatItem(_message.Message):
    __slots__ = ("rollout_id", "stat", "error")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    STAT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    stat: RolloutStat
    error: Error
    def __init__(self, rollout_id: _Optional[str] = ..., stat: _Optional[_Union[RolloutStat, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class BatchStatResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[BatchStatItem]
    def __init__(self, items: _Optional[_Iterable[_Union[BatchStatItem, _Mapping]]] = ...) -> None: ...

class BatchDeleteRequest(_message.Message):
    __slots__ = ("rollout_ids",)
    ROLLOUT_IDS_FIELD_NUMBER: _ClassVar[int]
    rollout_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rollout_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class BatchDeleteItem(_message.Message):
    __slots__ = ("rollout_id", "deleted", "error")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    DELETED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    deleted: Deleted
    error: Error
    def __init__(self, rollout_id: _Optional[str] = ..., deleted: _Optional[_Union[Deleted, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class BatchDeleteResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[BatchDeleteItem]
    def __init__(self, items: _Optional[_Iterable[_Union[BatchDeleteItem, _Mapping]]] = ...) -> None: ...

class DropConsumedRequest(_message.Message):
    __slots__ = ("upto", "cursor", "max_rollouts")
    UPTO_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    MAX_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    upto: str
    cursor: str
    max_rollouts: int
    def __init__(self, upto: _Optional[str] = ..., cursor: _Optional[str] = ..., max_rollouts: _Optional[int] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("start", "end", "model_id", "weight_version", "tokens_digest")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    model_id: str
    weight_version: str
    tokens_digest: str
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ..., model_id: _Optional[str] = ..., weight_version: _Optional[str] = ..., tokens_digest: _Optional[str] = ...) -> None: ...

class SegmentInfo(_message.Message):
    __slots__ = ("segment", "codec", "nbytes", "shared")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    segment: Segment
    codec: str
    nbytes: int
    shared: bool
    def __init__(self, segment: _Optional[_Union[Segment, _Mapping]] = ..., codec: _Optional[str] = ..., nbytes: _Optional[int] = ..., shared: _Optional[bool] = ...) -> None: ...

class RolloutStat(_message.Message):
    __slots__ = ("rollout_id", "num_experts", "topk", "layer_ids", "num_rows", "stored_bytes", "shared_bytes", "memory_bytes", "ttl_s", "segments", "views")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    VIEWS_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    num_experts: int
    topk: int
    layer_ids: _containers.RepeatedScalarFieldContainer[int]
    num_rows: int
    stored_bytes: int
    shared_bytes: int
    memory_bytes: int
    ttl_s: float
    segments: _containers.RepeatedCompositeFieldContainer[SegmentInfo]
    views: _containers.RepeatedCompositeFieldContainer[ViewInfo]
    def __init__(self, rollout_id: _Optional[str] = ..., num_experts: _Optional[int] = ..., topk: _Optional[int] = ..., layer_ids: _Optional[_Iterable[int]] = ..., num_rows: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., shared_bytes: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., ttl_s: _Optional[float] = ..., segments: _Optional[_Iterable[_Union[SegmentInfo, _Mapping]]] = ..., views: _Optional[_Iterable[_Union[ViewInfo, _Mapping]]] = ...) -> None: ...

class ViewInfo(_message.Message):
    __slots__ = ("serves", "start", "end", "weight_version", "nbytes")
    SERVES_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    serves: int
    start: int
    end: int
    weight_version: str
    nbytes: int
    def __init__(self, serves: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., weight_version: _Optional[str] = ..., nbytes: _Optional[int] = ...) -> None: ...

class PutSegmentResponse(_message.Message):
    __slots__ = ("status", "rollout_id", "segment", "nbytes", "shared", "dedupe_hit")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    DEDUPE_HIT_FIELD_NUMBER: _ClassVar[int]
    status: str
    rollout_id: str
    segment: Segment
    nbytes: int
    shared: bool
    dedupe_hit: bool
    def __init__(self, status: _Optional[str] = ..., rollout_id: _Optional[str] = ..., segment: _Optional[_Union[Segment, _Mapping]] = ..., nbytes: _Optional[int] = ..., shared: _Optional[bool] = ..., dedupe_hit: _Optional[bool] = ...) -> None: ...

class Deleted(_message.Message):
    __slots__ = ("rollout_id", "existed", "freed_bytes")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    existed: bool
    freed_bytes: int
    def __init__(self, rollout_id: _Optional[str] = ..., existed: _Optional[bool] = ..., freed_bytes: _Optional[int] = ...) -> None: ...

class DropResult(_message.Message):
    __slots__ = ("dropped", "kept_newer", "kept_unversioned", "freed_bytes", "examined", "cursor")
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    KEPT_NEWER_FIELD_NUMBER: _ClassVar[int]
    KEPT_UNVERSIONED_FIELD_NUMBER: _ClassVar[int]
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXAMINED_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    dropped: int
    kept_newer: int
    kept_unversioned: int
    freed_bytes: int
    examined: int
    cursor: str
    def __init__(self, dropped: _Optional[int] = ..., kept_newer: _Optional[int] = ..., kept_unversioned: _Optional[int] = ..., freed_bytes: _Optional[int] = ..., examined: _Optional[int] = ..., cursor: _Optional[str] = ...) -> None: ...
