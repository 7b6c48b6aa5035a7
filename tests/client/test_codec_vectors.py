"""docs/format.md's test vectors decode (and, for raw/set, encode) exactly as the spec says.

Version 2 and 3 vectors (``"version": 2`` / ``3``) also carry the content digest, optionally
the chunk plan (``block_rows``, ``layer_groups``) and, for continuation frames, the context
frame they continue (``context_hex``); version 1 vectors (``"version": 1``) are the old
single-body format.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from r3_client import (
    Context,
    FrameError,
    Segment,
    content_digest,
    decode_frame,
    decode_rollout,
    encode_context,
    encode_frame,
    read_header,
    token_digest,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "format.md"
#: Codecs whose bytes are fully specified; set-zstd bytes depend on the zstd version.
EXACT_CODECS = {"raw", "set"}
CODECS = {"raw", "set", "set-zstd"}
REQUIRED_KEYS = {"name", "version", "codec", "num_experts", "layer_ids", "start", "segment"}
REQUIRED_KEYS |= {"input"}
REQUIRED_V2_KEYS = REQUIRED_KEYS | {"digest"}


def _vectors() -> list[dict[str, Any]]:
    blocks = re.findall(r"```json\n(.*?)```", DOC.read_text(), flags=re.S)
    return [v for v in map(json.loads, blocks) if isinstance(v, dict) and "frame_hex" in v]


VECTORS = _vectors()
IDS = [v["name"] for v in VECTORS]


def _as_sets(rows: Any) -> list[list[list[int]]]:
    return [[sorted(row) for row in layer] for layer in np.asarray(rows).tolist()]


def _segment(vec: dict[str, Any]) -> Segment | None:
    return None if vec["segment"] is None else Segment.from_dict(vec["segment"])


def _context(vec: dict[str, Any]) -> Context | None:
    """The context a continuation vector's frame continues (from its context frame)."""
    if "context_hex" not in vec:
        return None
    hdr = read_header(bytes.fromhex(vec["context_hex"]))
    assert hdr.codec == "context" and hdr.context is not None
    return Context.parse(hdr.context.raw)


def _hex_ok(text: str) -> bool:
    return re.fullmatch(r"(?:[0-9a-f]{2})+", text) is not None


def test_doc_has_vectors() -> None:
    by_version: dict[int, list[dict[str, Any]]] = {1: [], 2: [], 3: []}
    for vec in VECTORS:
        assert vec.get("version") in by_version, f"vector {vec.get('name')} needs version 1-3"
        by_version[vec["version"]].append(vec)
    assert len(by_version[1]) >= 4, f"{DOC} must keep at least 4 version 1 vectors"
    for version, vecs in by_version.items():
        have = {v["codec"] for v in vecs}
        assert have >= CODECS, f"version {version} vectors lack codecs {CODECS - have}"
    for version in (2, 3):
        vecs = by_version[version]
        assert any("context_hex" in v for v in vecs), f"need a version {version} continuation"
        assert any("block_rows" in v and "layer_groups" in v for v in vecs), (
            f"need a version {version} vector with several blocks and layer groups"
        )
    for vec in VECTORS:
        keys = REQUIRED_V2_KEYS if vec["version"] >= 2 else REQUIRED_KEYS
        assert set(vec) >= keys, f"vector {vec['name']} misses keys {keys - set(vec)}"
        assert len(vec["frame_hex"]) < 1024, f"vector {vec['name']} is not small"
        assert _hex_ok(vec["frame_hex"]), "frame_hex is lowercase hex"
        assert bytes.fromhex(vec["frame_hex"])[4] == vec["version"], "prefix byte 4 is the version"
        if "context_hex" in vec:
            assert vec["version"] >= 2 and _hex_ok(vec["context_hex"])


@pytest.mark.parametrize("vec", VECTORS, ids=IDS)
def test_vector_decodes_to_input(vec: dict[str, Any]) -> None:
    ctx = _context(vec)
    frame = decode_frame(bytes.fromhex(vec["frame_hex"]), context=ctx)
    hdr, routing = frame.header, frame.routing
    want = np.asarray(vec["input"])
    assert hdr.version == vec["version"]
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
    if vec["version"] >= 2:
        seg = _segment(vec)
        assert seg is not None
        assert hdr.digest == vec["digest"]
        digest = content_digest(
            vec["num_experts"], vec["layer_ids"], seg, want, version=vec["version"]
        )
        assert digest == vec["digest"]
        assert hdr.base == ("" if ctx is None else ctx.digest)
        if "block_rows" in vec:
            assert all(b == vec["block_rows"] for b in hdr.blocks[:-1])
            assert len(hdr.blocks) > 1 and len(hdr.groups) == vec["layer_groups"] > 1
            assert len(hdr.chunks) == len(hdr.blocks) * len(hdr.groups)


@pytest.mark.parametrize("vec", VECTORS, ids=IDS)
def test_vector_encodes(vec: dict[str, Any]) -> None:
    frame = encode_frame(
        np.asarray(vec["input"]),
        num_experts=vec["num_experts"],
        layer_ids=vec["layer_ids"],
        start=vec["start"],
        segment=_segment(vec),
        codec=vec["codec"],
        base=_context(vec),
        block_rows=vec.get("block_rows"),
        layer_groups=vec.get("layer_groups"),
        version=vec["version"],
    )
    if vec["codec"] in EXACT_CODECS:
        assert frame.hex() == vec["frame_hex"]
    else:  # zstd bytes are not normative: check the round trip instead
        again = decode_frame(frame, context=_context(vec))
        assert again.header.codec == vec["codec"]
        assert again.header.version == vec["version"]
        assert _as_sets(again.routing.indices) == _as_sets(vec["input"])


@pytest.mark.parametrize("vec", [v for v in VECTORS if "context_hex" in v], ids=lambda v: v["name"])
def test_continuation_vector_reads_back(vec: dict[str, Any]) -> None:
    """context_hex ‖ frame_hex is what a read returns; the context frame is reproducible."""
    ctx = _context(vec)
    assert ctx is not None
    if not ctx.has_table:  # a context without a zstd table is fully specified
        rebuilt = Context.build(ctx.num_experts, ctx.topk, ctx.layer_ids)
        assert encode_context(rebuilt).hex() == vec["context_hex"]
    data = bytes.fromhex(vec["context_hex"] + vec["frame_hex"])
    end = vec["start"] + len(vec["input"])
    got = decode_rollout(data, start=vec["start"], end=end)
    assert _as_sets(got.indices) == _as_sets(vec["input"])
    assert got.segments == (_segment(vec),)
    with pytest.raises(FrameError, match="context"):
        decode_frame(bytes.fromhex(vec["frame_hex"]))  # unresolved without its context


@pytest.mark.parametrize("vec", [v for v in VECTORS if "tokens" in v], ids=lambda v: str(v["name"]))
def test_vector_tokens_digest_covers_prefix(vec: dict[str, Any]) -> None:
    seg = vec["segment"]
    assert seg["tokens_digest"] == token_digest(vec["tokens"][: seg["end"]])
