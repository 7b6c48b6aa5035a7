"""docs/format.md's test vectors decode (and, for raw/set, encode) exactly as the spec says."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from r3_client import Segment, decode_frame, encode_frame, token_digest

DOC = Path(__file__).resolve().parents[2] / "docs" / "format.md"
#: Codecs whose bytes are fully specified; set-zstd bytes depend on the zstd version.
EXACT_CODECS = {"raw", "set"}
REQUIRED_KEYS = {"name", "codec", "num_experts", "layer_ids", "start", "segment", "input"}


def _vectors() -> list[dict[str, Any]]:
    blocks = re.findall(r"```json\n(.*?)```", DOC.read_text(), flags=re.S)
    return [v for v in map(json.loads, blocks) if isinstance(v, dict) and "frame_hex" in v]


VECTORS = _vectors()


def _as_sets(rows: Any) -> list[list[list[int]]]:
    return [[sorted(row) for row in layer] for layer in np.asarray(rows).tolist()]


def _segment(vec: dict[str, Any]) -> Segment | None:
    return None if vec["segment"] is None else Segment.from_dict(vec["segment"])


def test_doc_has_vectors() -> None:
    assert len(VECTORS) >= 4, f"{DOC} must hold at least 4 test vectors, found {len(VECTORS)}"
    assert {v["codec"] for v in VECTORS} >= {"raw", "set", "set-zstd"}
    for vec in VECTORS:
        assert set(vec) >= REQUIRED_KEYS, f"vector {vec.get('name')} misses keys"
        assert len(vec["frame_hex"]) < 1024, f"vector {vec['name']} is not small"
        assert re.fullmatch(r"(?:[0-9a-f]{2})+", vec["frame_hex"]), "frame_hex is lowercase hex"


@pytest.mark.parametrize("vec", VECTORS, ids=[v["name"] for v in VECTORS])
def test_vector_decodes_to_input(vec: dict[str, Any]) -> None:
    frame = decode_frame(bytes.fromhex(vec["frame_hex"]))
    hdr, routing = frame.header, frame.routing
    want = np.asarray(vec["input"])
    assert hdr.codec == vec["codec"]
    assert hdr.num_experts == routing.num_experts == vec["num_experts"]
    assert hdr.topk == want.shape[2]
    assert hdr.layer_ids == routing.layer_ids == tuple(vec["layer_ids"])
    assert (hdr.start, hdr.end) == (vec["start"], vec["start"] + want.shape[0])
    assert routing.start == vec["start"]
    assert hdr.segment == _segment(vec)
    assert routing.indices.shape == want.shape
    if vec["codec"] == "raw":
        assert routing.indices.tolist() == want.tolist()
    else:
        assert _as_sets(routing.indices) == _as_sets(want)


@pytest.mark.parametrize("vec", VECTORS, ids=[v["name"] for v in VECTORS])
def test_vector_encodes(vec: dict[str, Any]) -> None:
    frame = encode_frame(
        np.asarray(vec["input"]),
        num_experts=vec["num_experts"],
        layer_ids=vec["layer_ids"],
        start=vec["start"],
        segment=_segment(vec),
        codec=vec["codec"],
    )
    if vec["codec"] in EXACT_CODECS:
        assert frame.hex() == vec["frame_hex"]
    else:  # zstd bytes are not normative: check the round trip instead
        again = decode_frame(frame)
        assert again.header.codec == vec["codec"]
        assert _as_sets(again.routing.indices) == _as_sets(vec["input"])


@pytest.mark.parametrize("vec", [v for v in VECTORS if "tokens" in v], ids=lambda v: str(v["name"]))
def test_vector_tokens_digest_covers_prefix(vec: dict[str, Any]) -> None:
    seg = vec["segment"]
    assert seg["tokens_digest"] == token_digest(vec["tokens"][: seg["end"]])
