"""Stored decompression bombs against every reader, under an address-space limit.

The service stores what a key holder writes without decoding it (format v2), so a
body whose zstd frames declare a legal size but inflate far past it reaches every
trainer reading that namespace.  Before issue 25 the readers inflated such a chunk
until its zstd frame ended (a 33 KB chunk declaring 4 MiB took each reader past
1 GiB); now each inflates into a buffer of the declared size and stops.  Each reader
runs in its own process (``tests/support/reader_probe.py``) with its address space capped, and its
peak RSS growth is asserted against what the header declares.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import zstandard

from r3_client import CodecError, Segment, decode_rollout, encode_frame, read_header, token_digest
from r3_client.codec.frame import MAX_TABLE_ENTRIES, assemble_frame, chunk_crc
from r3_client.synthetic import synthetic_routing
from tests.support.frames import frame_parts, rid
from tests.support.service_process import KEY_A, Service

PROBE = Path(__file__).parents[1] / "support" / "reader_probe.py"
MIB = 1 << 20
INFLATED = 2 << 30  # what each bomb inflates to: far more than any budget below
SLACK = 64 * MIB  # the bound: peak <= declared size + 64 MiB

# 2,048 rows x 128 layers x top-8 of 512 experts, one layer group: one set-zstd chunk
# whose gap payload (uint16) declares 4 MiB.
E, K, LAYERS, ROWS = 512, 8, tuple(range(128)), 2048


def _lying_zstd(declared: int, inflated: int = INFLATED) -> bytes:
    """A zstd frame whose header declares ``declared`` bytes and whose blocks inflate to
    ``inflated`` zero bytes (compressed in 16 MiB pieces; the header's size patched)."""
    cobj = zstandard.ZstdCompressor(level=1, write_checksum=False).compressobj(size=inflated)
    zero = bytes(16 * MIB)
    parts = [cobj.compress(zero) for _ in range(inflated // len(zero))]
    blob = b"".join([*parts, cobj.flush()])
    # Frame header: magic (4), descriptor (1), window (1), then a 4-byte content size
    # (descriptor 0x80: FCS field 4 bytes, not single-segment, no dict id).
    assert blob[4] == 0x80, hex(blob[4])
    out = blob[:6] + struct.pack("<I", declared) + blob[10:]
    assert zstandard.frame_content_size(out) == declared
    return out


def _frame() -> bytes:
    idx = synthetic_routing(ROWS, len(LAYERS), E, K, skew=1.0, seed=11)
    seg = Segment(0, ROWS, "bomb-chunk", "v1", token_digest(range(ROWS + 1)))
    frame = encode_frame(
        idx, num_experts=E, layer_ids=LAYERS, segment=seg, codec="set-zstd", layer_groups=1,
        block_rows=2048,  # one chunk (a block size the store takes; the default is 512)
    )  # fmt: skip
    hdr = read_header(frame)
    assert len(hdr.chunks) == 1
    return frame


def chunk_bomb(frame: bytes) -> tuple[bytes, int]:
    """``frame`` with its one chunk replaced by a lying zstd frame; its declared size."""
    header, chunks = frame_parts(frame)
    declared = zstandard.frame_content_size(chunks[0])
    chunks[0] = _lying_zstd(declared)
    header["chunks"] = [[len(c), chunk_crc(frame[4], c)] for c in chunks]
    return assemble_frame(frame[4], frame[5], header, chunks), declared


def table_bomb() -> tuple[bytes, int]:
    """A small frame whose context carries a relabel table of the largest legal size
    (1,024 layers x 4,096 experts of uint16: 8 MiB declared) as a lying zstd frame."""
    e, layers, rows = 4096, tuple(range(1024)), 2
    idx = synthetic_routing(rows, len(layers), e, K, seed=12)
    seg = Segment(0, rows, "bomb-table", "v1", token_digest(range(rows + 1)))
    frame = encode_frame(idx, num_experts=e, layer_ids=layers, segment=seg, codec="set-zstd")
    header, chunks = frame_parts(frame)
    ctx = msgpack.unpackb(header["ctx"], raw=False)  # type: ignore[arg-type]
    assert "table" not in ctx  # too few rows for one of its own
    declared = len(layers) * e * 2
    assert len(layers) * e == MAX_TABLE_ENTRIES
    ctx["table"] = _lying_zstd(declared)
    header["ctx"] = msgpack.packb(ctx, use_bin_type=True)
    return assemble_frame(2, frame[5], header, chunks), declared


@pytest.fixture(scope="module")
def bombs() -> dict[str, tuple[bytes, int]]:
    return {"chunk": chunk_bomb(_frame()), "table": table_bomb()}


def _probe(spec: dict[str, object]) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, str(PROBE), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_the_bombs_are_legal_frames_the_service_stores(
    service_single: Service, bombs: dict[str, tuple[bytes, int]]
) -> None:
    """The premise: declared sizes right, CRCs right, small — the service takes them."""
    for bomb, declared in bombs.values():
        assert len(bomb) < 2 * MIB and declared <= 8 * MIB
        with service_single.http() as c:
            resp = c.put(f"/v1/rollouts/{rid()}/segments", content=bomb)
        assert resp.status_code == 201, resp.text


@pytest.mark.parametrize("kind", ["chunk", "table"])
def test_decode_rollout_stops_at_the_declared_size(
    kind: str, bombs: dict[str, tuple[bytes, int]]
) -> None:
    with pytest.raises(CodecError, match="declared size"):
        decode_rollout(bombs[kind][0], rollout_id="bomb")


@pytest.mark.parametrize("how", ["decode", "http", "grpc", "direct"])
@pytest.mark.parametrize("kind", ["chunk", "table"])
def test_every_reader_refuses_a_stored_bomb_within_its_declared_size(
    how: str,
    kind: str,
    service_single: Service,
    bombs: dict[str, tuple[bytes, int]],
    tmp_path: Path,
) -> None:
    bomb, declared = bombs[kind]
    r = rid()
    with service_single.http() as c:
        assert c.put(f"/v1/rollouts/{r}/segments", content=bomb).status_code == 201
        stored = c.get(f"/v1/rollouts/{r}").content
    assert stored == bomb
    (tmp_path / "frame").write_bytes(stored)
    url = f"grpc://{service_single.grpc_target}" if how == "grpc" else service_single.http_url
    budget = declared + 512 * MIB  # room for threads' arenas; the bomb wants 2 GiB
    got = _probe(
        {
            "how": how,
            "url": url,
            "key": KEY_A,
            "rollout": r,
            "frame_file": str(tmp_path / "frame"),
            "budget": budget,
        }
    )
    print(f"{how} reader, {kind} bomb declaring {declared}: peak growth {got['peak_growth']}")
    assert got["error"] == "CodecError", got
    assert r in str(got["message"]) or how == "decode", got
    assert int(got["peak_growth"]) <= declared + SLACK, got  # type: ignore[call-overload]


def test_the_probe_sees_a_reader_that_inflates_without_bound(tmp_path: Path) -> None:
    """The apparatus is real: streaming a lying zstd frame open (what the readers did
    before) dies at the probe's cap or shows the growth."""
    declared = 4 * MIB
    (tmp_path / "z").write_bytes(_lying_zstd(declared))
    got = _probe(
        {"how": "stream", "frame_file": str(tmp_path / "z"), "budget": declared + 512 * MIB}
    )
    assert got["error"] == "MemoryError" or int(got["peak_growth"]) > declared + SLACK, got  # type: ignore[call-overload]
