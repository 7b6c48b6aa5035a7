"""One definition per answer record: JSON, protobuf and .proto all derive from the dataclass."""

from __future__ import annotations

import dataclasses

import pytest

from r3_client import ProtocolError, PutResult, RolloutInfo, Segment, SegmentInfo
from r3_client._answer_forms import from_message, from_plain, proto_messages, to_message, to_plain
from r3_client._proto import r3_cache_pb2 as pb

INFO = RolloutInfo(
    rollout_id="r-1",
    num_experts=128,
    topk=8,
    layer_ids=(0, 1, 47),
    num_rows=300,
    stored_bytes=1000,
    shared_bytes=200,
    memory_bytes=None,
    ttl_s=None,
    segments=(
        SegmentInfo(Segment(0, 100, "m", "v1", "a" * 64), "set", 600, True),
        SegmentInfo(Segment(100, 300, "m", "v2"), "set-zstd", 400, False),
    ),
)
PUT = PutResult("duplicate", "r-1", Segment(5, 9, "m", "v3", "b" * 64), 77, False, True)


@pytest.mark.parametrize(
    "record", [INFO, PUT, dataclasses.replace(INFO, ttl_s=3.5, memory_bytes=9)]
)
def test_plain_and_protobuf_forms_round_trip(record: object) -> None:
    cls = type(record)
    assert from_plain(cls, to_plain(record)) == record
    message_cls = pb.RolloutStat if cls is RolloutInfo else pb.PutSegmentResponse
    message = to_message(record, message_cls)
    assert from_message(message_cls.FromString(message.SerializeToString()), cls) == record


def test_unset_optionals_stay_unset_on_the_wire() -> None:
    message = to_message(INFO, pb.RolloutStat)
    assert not message.HasField("ttl_s") and not message.HasField("memory_bytes")
    assert "ttl_s" not in to_plain(INFO) or to_plain(INFO)["ttl_s"] is None


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"num_rows": "many"}, "num_rows|integer|invalid literal"),
        ({"layer_ids": None}, "null"),
        ({"segments": [{"codec": "set"}]}, "segment"),
    ],
)
def test_a_malformed_answer_is_a_protocol_error(change: dict[str, object], reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        from_plain(RolloutInfo, {**to_plain(INFO), **change})
    with pytest.raises(ProtocolError):
        from_plain(PutResult, {**to_plain(PUT), "status": "maybe"})


def test_a_new_field_is_one_line_in_the_dataclass() -> None:
    """What adding a field costs: the dataclass line; every form follows from it."""

    @dataclasses.dataclass(frozen=True)
    class Grown:
        rollout_id: str
        num_rows: int
        owner: str | None = None  # the new field

    assert proto_messages({Grown: "Grown"}).splitlines()[1:4] == [
        "  string rollout_id = 1;",
        "  int64 num_rows = 2;",
        "  optional string owner = 3;",
    ]
    grown = Grown("r", 3, "team-a")
    assert from_plain(Grown, to_plain(grown)) == grown
    assert from_plain(Grown, {"rollout_id": "r", "num_rows": 3}) == Grown("r", 3)
