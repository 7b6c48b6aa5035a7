"""Frames decoded straight into a rank's int64 targets (``r3_client.codec.into`` and the
compiled ``decode_into``, issue 44): equal to the reference (``decode_rollout``) for every
codec, continuation frames, layer subsets and strided windows of a layer-major target;
every read it does not take is left to the reference (None); hostile job arguments are
refused before anything is read or written, and a damaged chunk is a failing code."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from r3_client import Context, Segment, decode_rollout, encode_frame, read_header
from r3_client._kernels import native
from r3_client.codec import encode_context, slice_context, slice_frame
from r3_client.codec.into import plan_into
from r3_client.synthetic import synthetic_routing

pytestmark = pytest.mark.skipif(
    not native.decodes_into(False), reason="the compiled codec is not built here"
)

L, E, K = 16, 64, 4
LAYERS = tuple(range(1, L + 1))
ROWS = synthetic_routing(3000, L, E, K, skew=1.0, rho=0.7, seed=3)
R3_CRC = 10


def _agent(codec: str, cut: int = 2000, end: int = 3000) -> tuple[bytes, bytes]:
    kw: dict[str, Any] = {} if codec == "auto" else {"codec": codec}
    seg = Segment(0, cut, "m", "r")
    first = encode_frame(ROWS[:cut], num_experts=E, layer_ids=LAYERS, segment=seg, **kw)
    ctx = Context.parse(read_header(first).context.raw)  # type: ignore[union-attr]
    seg2 = Segment(cut, end, "m", "r")
    cont = encode_frame(
        ROWS[cut:end], num_experts=E, layer_ids=LAYERS, segment=seg2, base=ctx, **kw
    )
    return first, cont


READS = [
    (0, 3000, None),
    (100, 2500, [3, 4, 9]),
    (1999, 2001, [16]),
    (2100, 2900, [1, 2]),
    (511, 1537, [5, 6, 7, 8]),
]


@pytest.mark.parametrize("codec", ["auto", "raw", "set", "set-zstd"])
def test_decoded_into_targets_equals_the_reference(codec: str) -> None:
    first, cont = _agent(codec)
    for data in (first + cont, [first, cont], [cont, first]):
        for a, b, layers in READS:
            ref = decode_rollout(data, start=a, end=b, layers=layers)
            plan = plan_into(data, start=a, end=b, layers=layers)
            assert plan is not None, (codec, a, b)
            assert plan.layer_ids == ref.layer_ids and plan.topk == K
            # a window of a layer-major target, as a rank's targets hold it
            big = np.full((len(plan.layer_ids), 4000, K), -9, np.int64)
            win = big[:, 700 : 700 + b - a].transpose(1, 0, 2)
            assert native.decode_into(plan.jobs(win)) == (0, 0)
            np.testing.assert_array_equal(win, ref.indices)
            assert (big[:, :700] == -9).all() and (big[:, 700 + b - a :] == -9).all()


def test_slices_as_the_service_cuts_them_decode_into_targets() -> None:
    """The service's answers: slices by rows and layers, their contexts trimmed."""
    first, cont = _agent("auto")
    for a, b, layers in READS[1:]:
        hdr = read_header(first)
        ctx = Context.parse(hdr.context.raw)  # type: ignore[union-attr]
        parts = []
        if a < 2000:
            parts.append(
                slice_frame(first, start=a, end=min(b, 2000), layers=layers, trim_context=True)
            )
        if b > 2000:
            parts.append(
                slice_frame(
                    cont, start=max(a, 2000), end=b, layers=layers, context=ctx,
                    trim_context=True,
                )
            )  # fmt: skip
        if a >= 2000:
            continue  # (a continuation alone needs its context frame: the service sends it)
        if b > 2000:  # the trimmed context the continuation's slice names, as the service sends it
            named = slice_context(read_header(cont, context=ctx), ctx, layers)  # type: ignore[arg-type]
            parts.insert(0, encode_context(named))
        data = b"".join(parts)
        ref = decode_rollout(data, start=a, end=b, layers=layers)
        plan = plan_into(data, start=a, end=b, layers=layers)
        assert plan is not None
        out = np.zeros((b - a, len(plan.layer_ids), K), np.int64)
        assert native.decode_into(plan.jobs(out))[0] == 0
        np.testing.assert_array_equal(out, ref.indices)


def test_reads_the_call_does_not_take_are_left_to_the_reference() -> None:
    first, cont = _agent("auto")
    assert plan_into(cont, start=2100, end=2200, layers=None) is None  # its context missing
    assert plan_into(first, start=1900, end=2100, layers=None) is None  # rows past the frame
    assert plan_into(first + cont, start=0, end=100, layers=[99]) is None  # an unknown layer
    assert plan_into(first + first, start=0, end=100, layers=None) is None  # overlapping
    v2 = encode_frame(ROWS[:600], num_experts=E, layer_ids=LAYERS, version=2)
    assert plan_into(v2, start=0, end=100, layers=None) is None  # v2's CRC-32: Python's
    assert plan_into(b"not a frame", start=0, end=1, layers=None) is None
    assert plan_into(first, start=5, end=5, layers=None) is None  # empty


def test_a_damaged_chunk_is_a_failing_code_and_nothing_past_it_runs() -> None:
    first, _ = _agent("auto")
    plan = plan_into(first, start=0, end=2000, layers=None)
    assert plan is not None
    hdr = read_header(first)
    at = hdr.frame_length - 4 - hdr.body_length + hdr.chunks[0][0] // 2  # inside chunk 0
    bad = bytearray(first)
    bad[at] ^= 0x40
    planned = plan_into(bytes(bad), start=0, end=2000, layers=None)
    assert planned is not None  # (headers intact: the chunk CRC finds it)
    out = np.full((2000, L, K), 5, np.int64)
    code, job = native.decode_into(planned.jobs(out))
    assert (code, job) == (R3_CRC, 0)
    # a chunk nobody asks for is neither checked nor decoded
    clean = plan_into(bytes(bad), start=1500, end=2000, layers=[16])
    assert clean is not None
    out2 = np.zeros((500, 1, K), np.int64)
    assert native.decode_into(clean.jobs(out2))[0] == 0
    want = decode_rollout(first, start=1500, end=2000, layers=[16]).indices
    np.testing.assert_array_equal(out2, want)


def test_hostile_jobs_are_refused_before_anything_is_read() -> None:
    first, _ = _agent("raw")
    plan = plan_into(first, start=0, end=600, layers=None)
    assert plan is not None
    out = np.zeros((600, L, K), np.int64)
    ((body, desc, win, e, codec, order, bits, row_lo, lmap),) = plan.jobs(out)[:1]
    lib = native._active
    assert lib is not None

    def job(**kw: Any) -> tuple[Any, ...]:
        base = dict(
            body=body, desc=desc, out=win, e=e, codec=codec, order=order, tables=None,
            bits=bits, row_lo=row_lo, lmap=lmap,
        )  # fmt: skip
        base.update(kw)
        return tuple(base.values())

    far = desc.copy()
    far[0, 0] = len(body)  # a chunk past the body
    wide = desc.copy()
    wide[0, 4] = L  # layers past the frame's
    huge = desc.copy()
    huge[0, 2] = 1 << 40  # rows no chunk holds
    for bad in (
        job(desc=far),
        job(desc=wide),
        job(desc=huge),
        job(desc=desc[:, :6].copy()),  # not 7 columns
        job(lmap=np.array([0, L], np.int32)),  # a target layer out lacks
        job(lmap=np.array([], np.int32)),
        job(out=np.zeros((600, L, K), np.int16)),  # not int64
        job(e=K - 1),
        job(codec=7),
        job(row_lo=-1),
    ):
        with pytest.raises((ValueError, TypeError)):
            lib.decode_into([bad])
    with pytest.raises(TypeError):
        lib.decode_into([("too", "short")])
    with pytest.raises(TypeError):
        lib.decode_into(7)
    assert (out == 0).all()  # nothing written by a refused call


@pytest.mark.parametrize("codec", ["raw", "set", "set-zstd"])
def test_hostile_chunk_bytes_never_write_past_their_window(codec: str) -> None:
    """Chunks of random bytes (their CRCs not checked: the decoders themselves fuzzed, as
    the AddressSanitizer run of this suite does): a failing code, or ids within
    ``[-1, E)`` written inside the window only."""
    first, _ = _agent(codec)
    plan = plan_into(first, start=0, end=2000, layers=[2, 9, 10])
    assert plan is not None
    rng = np.random.default_rng(7)
    for trial in range(60):
        big = np.full((3, 2600, K), -7, np.int64)
        win = big[:, 300:2300].transpose(1, 0, 2)
        jobs = []
        for body, desc, out, e, cid, order, bits, row_lo, lmap in plan.jobs(win):
            d = desc.copy()
            d[:, 6] = -1
            raw = bytearray(bytes(body))
            for at, length in d[:, :2].tolist():
                if length and rng.random() < 0.5:
                    cut = int(rng.integers(0, length))
                    noise = rng.integers(0, 256, length - cut, np.uint8).tobytes()
                    raw[at + cut : at + length] = noise
            jobs.append((bytes(raw), d, out, e, cid, order, bits, row_lo, lmap))
        code, _ = native.decode_into(jobs)
        assert (big[:, :300] == -7).all() and (big[:, 2300:] == -7).all(), trial
        if code == 0:
            assert ((win >= -1) & (win < E)).all(), trial
