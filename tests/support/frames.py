"""Small builders shared by the tests and benchmarks: tiny-moe frames, rollout ids, hostile ids."""

from __future__ import annotations

import struct
import uuid
import zlib
from typing import Any

import msgpack
import numpy as np

from r3_client import Segment, encode_frame, read_header, token_digest
from r3_client.codec.frame import PREFIX, crc32c
from r3_client.synthetic import synthetic_routing

E, K, LAYERS = 64, 4, (1, 3, 5)
TRAJ = synthetic_routing(300, len(LAYERS), E, K, skew=1.0, rho=0.7, seed=7)


def rid() -> str:
    """A fresh rollout id."""
    return f"rollout-{uuid.uuid4().hex[:8]}"


def frame_for(
    idx: np.ndarray,
    start: int,
    *,
    codec: str = "auto",
    version: str = "v1",
    layers: tuple[int, ...] = LAYERS,
    e: int = E,
    digest: bool = True,
) -> bytes:
    """A segment frame for rows ``[start, start + len(idx))`` of a tiny-moe rollout."""
    end = start + idx.shape[0]
    seg = Segment(start, end, "tiny-moe", version, token_digest(range(end)) if digest else "")
    return encode_frame(idx, num_experts=e, layer_ids=layers, segment=seg, codec=codec)  # type: ignore[arg-type]


def forge_checksums(frame: bytes | bytearray) -> bytes:
    """``frame`` (possibly damaged) with every checksum made to match its bytes again, so
    a test reaches the checks behind them: v1/v2 the CRC-32 over the whole frame; v3 each
    chunk's CRC-32C (its header re-packed with them when it still parses as a map with a
    chunk list, keeping its damaged values) and the CRC-32C over prefix and header."""
    data = bytes(frame)
    if len(data) < PREFIX.size + 4 or data[4] != 3:
        return data[:-4] + struct.pack("<I", zlib.crc32(data[:-4]))
    magic, version, codec, reserved, hlen, blen = PREFIX.unpack_from(data)
    head, body = data[PREFIX.size : PREFIX.size + hlen], data[PREFIX.size + hlen : -4]
    try:
        hdr = msgpack.unpackb(head, raw=False, strict_map_key=False)
        chunks = hdr["chunks"]
        at, fixed = 0, []
        for length, _ in chunks:
            fixed.append([length, crc32c(body[at : at + length])])
            at += length
        hdr["chunks"] = fixed
        head = msgpack.packb(hdr, use_bin_type=True)
    except Exception:  # a header that no longer parses: the reader refuses it anyway
        pass
    prefix = PREFIX.pack(magic, version, codec, reserved, len(head), blen)
    return prefix + head + body + struct.pack("<I", crc32c(prefix + head))


def same_sets(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal as expert sets (row order ignored)."""
    return a.shape == b.shape and bool(np.array_equal(np.sort(a, -1), np.sort(b, -1)))


def hostile_ids(victim: str) -> list[str]:
    """Rollout ids the id rule refuses, each aimed at ``victim`` where it can be.

    Every reserved URL character around the name, dot segments, unicode, control
    characters (NUL, CRLF), and sizes; shared by the client/service and engine suites.
    """
    return [
        *(f"{victim}{c}junk" for c in "/?#%&;,[]{}|\\^`\"'<> "),
        f"{victim}#",
        f"{victim}?layers=3",
        f"../rollouts/{victim}",
        f"./{victim}",
        f"{victim}/..",
        f"{victim}%2F..",
        "%2e%2e",
        # dot segments: legal characters, but HTTP clients and proxies rewrite them
        ".",
        "..",
        "../x",
        # unicode, control characters, NUL, CRLF (header / log injection)
        f"{victim}\u00e9",
        f"{victim}\u202e",
        "\uff36\uff29\uff23\uff34\uff29\uff2d",  # fullwidth VICTIM
        f"{victim}\x00",
        f"{victim}\r\nX-Injected: 1",
        f"{victim}\n",
        "\t",
        # sizes
        "",
        "v" * 201,
        "v" * 10_000,
    ]


#: Ids that look like trouble in a URL but are legal by the rule: they must work everywhere.
TRICKY_LEGAL_IDS = ["...", ".a", "a.", "-", "=", "+", "@", ":", "a+b", "a=b", "a:b@c+d=e-f_g.h"]
#: Values that are not a rollout id string at all.
NOT_STRINGS: list[Any] = [None, 7, 7.5, True, b"victim", {"id": "victim"}, ["victim"], [7]]


def frame_parts(frame: bytes) -> tuple[dict[str, Any], list[bytes]]:
    """A v2 frame's header map and its chunk bodies, for tests that rebuild a frame with
    crafted parts (``r3_client.codec.frame.assemble_frame`` puts them back together)."""
    hdr = read_header(frame)
    raw_header = frame[20 : 20 + (hdr.frame_length - 24 - hdr.body_length)]
    at = hdr.frame_length - 4 - hdr.body_length
    chunks = []
    for length, _ in hdr.chunks:
        chunks.append(frame[at : at + length])
        at += length
    return msgpack.unpackb(raw_header, raw=False), chunks
